"""Super-weights (Yu et al. 2024, arXiv 2411.07191): the few down_proj weights that create the massive
activations; clipping or zeroing one of them destroys the model, so a range search must never clip them.

Found as the paper does, from the spikes of down_proj's output: per layer, the largest |output| over the
calibration tokens sits at one (token t, output channel r); the super-weight candidate is the weight W[r, c]
whose product with its input, x_t[c]·W[r, c], contributes most to that output. A layer holds a super-weight
when its largest |output| is at least FACTOR times the median of the layers' largest |output| (a spike
against the model's own scale, so a model without massive activations has none). On SmolLM2-135M-Instruct
the massive-activation channel is 507 (see docs/weights).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

from diffquant.errors import DiffquantError

if TYPE_CHECKING:
    import torch

FACTOR = 5.0  # a spike: a layer's largest down_proj |output| over the median of all layers'
CHUNK = 8


def find(model, calibration: torch.Tensor) -> list[dict]:
    """Every layer's down_proj spike {layer, row, col, weight, output, input, share, super}; `super` marks
    the super-weights. `share` is x_t[c]·W[r, c] / y_t[r], the weight's part of the spike."""
    import torch

    from diffquant.taps.sites import _decoder_layers

    layers = _decoder_layers(model)[1]
    downs = [getattr(getattr(layer, "mlp", None), "down_proj", None) for layer in layers]
    if any(not isinstance(d, torch.nn.Linear) for d in downs):
        raise DiffquantError(f"super-weights are found in each layer's mlp.down_proj Linear; "
                             f"{type(model).__name__} has none")
    best: dict[int, tuple] = {}

    def hook_for(i):
        def hook(module, args, out):
            x = args[0].reshape(-1, args[0].shape[-1])
            y = out.reshape(-1, out.shape[-1]).abs()
            flat = int(y.argmax())
            t, r = divmod(flat, y.shape[-1])
            if i not in best or float(y[t, r]) > best[i][0]:
                best[i] = (float(y[t, r]), t, r, x[t].detach().double().clone(), float(out.reshape(-1, out.shape[-1])[t, r]))

        return hook

    handles = [d.register_forward_hook(hook_for(i)) for i, d in enumerate(downs)]
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for ids in calibration.split(CHUNK):
                model(ids.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    out = []
    for i, d in enumerate(downs):
        peak, _, r, x, y = best[i]
        contrib = x * d.weight.detach()[r].double()
        c = int(contrib.abs().argmax())
        out.append({"layer": i, "row": r, "col": c, "weight": float(d.weight.detach()[r, c]), "output": y,
                    "input": float(x[c]), "share": float(contrib[c]) / y if y else 0.0, "peak": peak})
    median = statistics.median_low([o["peak"] for o in out])  # the lower middle value, as torch.median
    for o in out:
        o["super"] = median > 0 and o["peak"] >= FACTOR * median
    return out


def text(found: list[dict]) -> str:
    """The super-weights as report lines."""
    rows = [o for o in found if o["super"]]
    if not rows:
        return "super-weights: none (no layer's down_proj output spikes ≥ 5× the median layer's)"
    lines = [f"super-weights (Yu et al. 2024; down_proj output spike ≥ {FACTOR:g}× the median layer's):"]
    lines += [f"  layer {o['layer']} down_proj [{o['row']}, {o['col']}] = {o['weight']:+.4g}: input {o['input']:+.4g} "
              f"→ output {o['output']:+.4g} ({100 * o['share']:.0f}% of it)" for o in rows]
    return "\n".join(lines)


def profile_entry(model, sequences: torch.Tensor, label: str) -> list[dict]:
    """What `diffquant profile` records and prints: the spikes found on the first 8 profiled sequences
    (none for a model without down_proj Linears)."""
    try:
        found = find(model, sequences[:CHUNK])
    except DiffquantError as e:
        print(f"{label}: {e}")
        return []
    print(f"{label}: {text(found)}")
    return found
