"""What diffquant measures that a TransformerLens or nnsight workflow does not give out of the box, each in a few
lines, on a random-weight tiny DIFF model (runs in seconds on a CPU; swap in your own checkpoint):

    python -m benchmarks.peers_examples

1. DIFF's two softmax maps and the differential map A1 − λ·A2, each as its own site.
2. Attention sinks per differential head: first-token mass per map and per differential map.
3. Statistics under fake quantization: the same profile with a scheme attached.
4. Streaming merge: statistics of two disjoint shards merged equal those of the whole (what torchrun ranks do:
   `torchrun --nproc-per-node 2 -m diffquant.cli profile --model M --data kjv --tokens 65536 --out runs/p`).
"""

from __future__ import annotations

import torch

from diffquant.models.load import load_model
from diffquant.profiler import profile_model
from diffquant.quant.numerics.scheme import get_scheme, attach_scheme

model, _ = load_model("tiny:diff")
ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))

# 1. DIFF's maps: attn_logits holds both softmax maps' logits (map j pairs with head j + H/2), attn_map the
#    differential map per differential head
prof = profile_model(model, ids, ["layers.0.attn_logits", "layers.0.attn_map"], progress=False, sinks=True)
for site in ("layers.0.attn_logits", "layers.0.attn_map"):
    s = prof.sites[site].summary(full=False)
    print(f"1. {site}: top-1 |x| {s['absmax']:.4f}, kurtosis {s['kurtosis']:.2f}, {s['count']:,} values")

# 2. sinks per differential head: first-token attention mass of A1, A2 and A1 − λ·A2, per head
layer0 = prof.sink_summary()["layers"][0]
print("2. first-token mass per head, A1 and A2 (softmax maps):", [round(m, 3) for m in layer0["first_mass"]])
print("   per differential head (A1 − λ·A2):", [round(m, 3) for m in layer0["first_mass_map"]])

# 3. the same statistics with 4-bit attention logits simulated in place (handle.remove() restores the float model)
handle = attach_scheme(model, get_scheme("logits-int4"))
quantized = profile_model(model, ids, ["layers.0.attn_logits"], progress=False)
handle.remove()
a, b = prof.sites["layers.0.attn_logits"], quantized.sites["layers.0.attn_logits"]
print(f"3. layers.0.attn_logits kurtosis float {a.summary(False)['kurtosis']:.3f}, "
      f"under logits-int4 {b.summary(False)['kurtosis']:.3f}")

# 4. two shards profiled apart and merged: the statistics of all the tokens (top-k exactly; kurtosis to ~1e-8,
#    the float32 rounding of each batch's deviations)
whole = profile_model(model, ids, ["*.hidden"], progress=False)
first = profile_model(model, ids[:2], ["*.hidden"], progress=False)
second = profile_model(model, ids[2:], ["*.hidden"], progress=False)
merged = first.sites["layers.1.hidden"].merge(second.sites["layers.1.hidden"]).summary(False)
print(f"4. layers.1.hidden top-100 whole {whole.sites['layers.1.hidden'].summary(False)['top']['top100']:.6f}, "
      f"merged {merged['top']['top100']:.6f}; kurtosis whole "
      f"{whole.sites['layers.1.hidden'].summary(False)['kurtosis']:.9f}, merged {merged['kurtosis']:.9f}")
