"""diffquant's KV-cache simulation against transformers' QuantizedCache (optimum-quanto backend).

transformers' quantized cache attends the prompt in full precision and stores it quantized (quanto's
MaxOptimizer: min-max with a float offset, groups of `q_group_size` along the flattened head dim, axis 0);
decode tokens wait in a full-precision residual of `residual_length`, and when it fills the whole cache is
quantized again. diffquant simulates the same rule with its own quantizers (`ResidualRequantLayer`, int
min-max format, PerGroup(q_group_size) at the k_cache / v_cache sites). Both decode the same tokens one at a
time (teacher forcing: perplexity of the continuation) and generate greedily from the same prompt; the table
shows both, and the tolerance they must meet.

    python -m experiments.kv_cache_parity [--quick]      # --quick: the micro models only
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

OUT = ROOT / "docs" / "kv_cache"
TOLERANCE = {"max_abs_logit": 1e-4, "nll": 1e-5}  # fp32 on both sides: the same arithmetic, in another order


def models(quick: bool, checkpoints: list[str] = ()):
    """(label, model, token ids [1, prompt + continuation], prompt length) to compare on: the micro pair, then
    (unless quick) SmolLM2-135M-Instruct, then each trained checkpoint folder asked for, on 96 KJV held-out
    tokens through its own tokenizer."""
    import diffquant as dq
    from diffquant.lab import PRESETS, build_pair, fuse

    base, diff = build_pair(PRESETS["micro"], seed=0)
    fuse(diff)
    ids = torch.randint(3, base.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    out = [("micro Transformer (random init, seed 0)", base, ids, 48),
           ("micro DIFF (random init, seed 0)", diff, ids, 48)]
    if not quick:
        model, tok = dq.load("smollm2-135m", device="cpu")[:2]
        out.append(("SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)", model, kjv_stream(tok), 48))
    for folder in checkpoints:
        model, tok = dq.load(folder, device="cpu")[:2]
        out.append((f"{type(model).__name__} `{folder}` (trained, KJV held-out)", model, kjv_stream(tok), 48))
    return out


def kjv_stream(tokenizer) -> torch.Tensor:
    """The first 96 tokens of KJV's validation split through `tokenizer`, as [1, 96] ids."""
    from diffquant.lab import encode, load_text, split_corpus

    _, val = split_corpus(load_text("kjv")[0])
    return torch.from_numpy(encode(tokenizer, val)[:96].astype("int64"))[None]


def nll(logits: torch.Tensor, ids: torch.Tensor, prompt: int) -> float:
    """Mean negative log-likelihood of the continuation ids[prompt:] given everything before."""
    lp = torch.log_softmax(logits[0, prompt - 1:-1].float(), -1)
    return float(-lp.gather(-1, ids[0, prompt:, None]).mean())


def run(quick: bool, checkpoints: list[str] = ()) -> dict:
    from transformers.cache_utils import QuantizedCache

    import diffquant as dq
    from diffquant.lab import Format, PerGroup, QuantConfig, decode_greedy, decode_logits, residual_requant_cache

    rows = []
    for label, model, ids, prompt in models(quick, checkpoints):
        head_dim = model.config.head_dim
        with torch.inference_mode():
            fp_logits = model(ids).logits
        for bits in (4, 2):
            for residual in (16,):
                group = head_dim
                cfg = QuantConfig(Format("int", bits, False, minmax=True), PerGroup(group))
                scheme = dq.QuantScheme(f"quanto-int{bits}", (("*.k_cache", cfg), ("*.v_cache", cfg)))
                real_cache = lambda: QuantizedCache("quanto", model.config, nbits=bits, axis_key=0,  # noqa: E731
                                                    axis_value=0, q_group_size=group, residual_length=residual)
                t0 = time.perf_counter()
                real = decode_logits(model, ids, None, prompt, real_cache())
                sim = decode_logits(model, ids, scheme, prompt, residual_requant_cache(model, scheme, residual))
                gen_real = decode_greedy(model, ids[:, :prompt], None, 24, real_cache())
                gen_sim = decode_greedy(model, ids[:, :prompt], scheme, 24, residual_requant_cache(model, scheme,
                                                                                                   residual))
                row = {"model": label, "bits": bits, "q_group_size": group, "residual_length": residual,
                       "prompt": prompt, "continuation": ids.shape[1] - prompt,
                       "nll_fp": nll(fp_logits, ids, prompt), "nll_quanto": nll(real, ids, prompt),
                       "nll_diffquant": nll(sim, ids, prompt),
                       "max_abs_logit": float((real - sim).abs().max()),
                       "greedy_tokens": int(gen_real.numel()),
                       "greedy_equal": int((gen_real == gen_sim).sum()),
                       "seconds": round(time.perf_counter() - t0, 1)}
                row["within_tolerance"] = (row["max_abs_logit"] <= TOLERANCE["max_abs_logit"]
                                           and abs(row["nll_quanto"] - row["nll_diffquant"]) <= TOLERANCE["nll"]
                                           and row["greedy_equal"] == row["greedy_tokens"])
                rows.append(row)
                print(row, flush=True)
    return {"tolerance": TOLERANCE, "rows": rows, "quick": quick,
            "quanto": _version("optimum-quanto"), "transformers": _version("transformers"),
            "torch": torch.__version__}


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def table(doc: dict) -> str:
    from diffquant.lab import markdown

    body = [[r["model"], r["bits"], r["q_group_size"], r["residual_length"], f"{r['prompt']} + {r['continuation']}",
             f"{math.exp(r['nll_fp']):.4f}", f"{math.exp(r['nll_quanto']):.4f}", f"{math.exp(r['nll_diffquant']):.4f}",
             f"{r['max_abs_logit']:.1e}", f"{r['greedy_equal']}/{r['greedy_tokens']}",
             "yes" if r["within_tolerance"] else "NO"] for r in doc["rows"]]
    header = ["model", "bits", "group", "residual", "prompt + decoded", "ppl fp", "ppl quanto cache",
              "ppl diffquant sim.", "max abs Δ logit", "greedy tokens equal", "within tolerance"]
    return (f"transformers {doc['transformers']} QuantizedCache (optimum-quanto {doc['quanto']}, axis 0) against "
            "diffquant's simulation of the same rule; perplexity of the decoded continuation (teacher forcing, one "
            "token per step through the cache), and 24 greedy tokens from the prompt. Tolerance: max |Δ logit| ≤ "
            f"{doc['tolerance']['max_abs_logit']:g}, |Δ mean NLL| ≤ {doc['tolerance']['nll']:g}, every greedy "
            "token equal. Micro models are random-init (their perplexities only show the caches agree); SmolLM2 "
            "and trained checkpoints read KJV held-out tokens.\n\n" + markdown(header, body))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="micro models only (seconds)")
    p.add_argument("--model", action="append", default=[], metavar="FOLDER",
                   help="a trained checkpoint folder to add (repeatable), e.g. runs/rivals/demo/s0/baseline")
    a = p.parse_args(argv)
    from diffquant.lab import atomic_write_json, atomic_write_text

    torch.manual_seed(0)
    for folder in a.model:
        if not (Path(folder) / "config.json").is_file():
            raise SystemExit(f"--model {folder}: not a checkpoint folder (no config.json)")
    doc = run(a.quick, a.model)
    name = "parity-quick" if a.quick else "parity"
    atomic_write_json(OUT / f"{name}.json", doc)
    atomic_write_text(OUT / f"{name}.md", table(doc) + "\n")
    print(table(doc))


if __name__ == "__main__":
    main()
