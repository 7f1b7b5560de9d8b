"""Exported compressed-tensors checkpoints beside diffquant's simulation of the same recipe (issue 40's done-when).

    python -m benchmarks.export_parity [--model smollm2-135m] [--tokens 8192] [--recipes ...] [--out docs/export]

Each recipe runs `diffquant quantize ... --export compressed-tensors`, which prints the simulated held-out loss
and perplexity; the folder is then loaded by transformers' `AutoModelForCausalLM.from_pretrained` in a fresh
interpreter that never imports diffquant (compressed-tensors installed; the designs excepted, whose model_type
is diffquant's), and evaluated on the same windows the same way (`diffquant.evaluate.language_modeling`'s mean of
per-sequence mean cross-entropy, batches of 8). Weight-only recipes should agree to float rounding (the weights
are bit-identical); W8A8 int8 differs by the loader's activation grid (−128..127, dynamic scale max|x|/127.5,
where diffquant's is ±127, max|x|/127). Sizes: the exported safetensors beside the float model's state dict.
Results: OUT/parity-MODEL.json and .md (the checkpoints stay in --work).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {
    "w4a16+gptq": ["--scheme", "w4a16", "--solver", "gptq"],
    "w8a8-static+smoothquant": ["--scheme", "w8a8-static", "--fix", "smoothquant:0.5"],
    "w8a8-dynamic+smoothquant": ["--scheme", "w8a8", "--fix", "smoothquant:0.5"],
    "fp8+smoothquant": ["--scheme", "fp8", "--fix", "smoothquant:0.5"],
}

CHILD = r'''
import json, math, sys, torch
from transformers import AutoModelForCausalLM
if sys.argv[3] == "1":
    import diffquant  # noqa: F401 - a design's model_type
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.load(sys.argv[2])
losses = []
with torch.inference_mode():
    for start in range(0, len(ids), 8):
        batch = ids[start:start + 8]
        logits = model(batch, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
        losses += nll.double().mean(dim=1).tolist()
loss = math.fsum(losses) / len(losses)
print("RESULT " + json.dumps({"loss": loss, "ppl": math.exp(loss), "per_sequence_loss": losses,
                              "diffquant_imported": "diffquant" in sys.modules and sys.argv[3] != "1"}))
'''


def fresh_loss(folder: Path, ids_path: Path, design: bool) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(ids_path), "1" if design else "0"],
                         capture_output=True, text=True)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if run.returncode or line is None:
        raise SystemExit(f"loading {folder} failed: {run.stderr.strip()[-2000:]}")
    out = json.loads(line[len("RESULT "):])
    assert not out.pop("diffquant_imported"), "the fresh interpreter imported diffquant"
    return out


def main(argv=None) -> None:
    import torch

    from diffquant.cli import main as cli
    from diffquant.data.windows import corpus_windows
    from diffquant.paths import atomic_write_json, atomic_write_text
    from diffquant.stats.intervals import fmt_interval

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="any --model of diffquant quantize")
    p.add_argument("--data", default="kjv")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    p.add_argument("--out", default=str(ROOT / "docs" / "export"), help="where parity.json and parity.md go")
    p.add_argument("--work", default=str(ROOT / "benchmarks" / ".peers" / "export"),
                   help="where the exported checkpoints go (not committed)")
    p.add_argument("--cache-dir", default=None)
    a = p.parse_args(argv)
    out = Path(a.out)
    label = Path(a.model).name
    path = out / f"parity-{label}.json"
    old = json.loads(path.read_text()) if path.is_file() else {}
    kept = [r for r in old.get("rows", []) if r["recipe"] not in a.recipes]  # recipes not rerun stay
    rows = []
    for recipe in a.recipes:
        folder = Path(a.work) / f"{label}-{recipe}"
        code = cli(["quantize", "--model", a.model, *RECIPES[recipe], "--data", a.data, "--eval-tokens", str(a.tokens),
                    "--seq-len", str(a.seq_len), "--export", "compressed-tensors", "--out", str(folder), "--force"]
                   + (["--cache-dir", a.cache_dir] if a.cache_dir else []))
        if code:
            raise SystemExit(f"diffquant quantize failed for {recipe}")
        result = json.loads((folder / "quantize.json").read_text())
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
        ids = corpus_windows(a.data, tokenizer, "validation", a.seq_len, a.tokens, a.cache_dir)
        torch.save(ids, folder / "eval_ids.pt")
        design = json.loads((folder / "config.json").read_text())["model_type"].startswith("diffquant_")
        loaded = fresh_loss(folder, folder / "eval_ids.pt", design)
        (folder / "eval_ids.pt").unlink()
        sim = result["simulated"]
        rows.append({"recipe": recipe, "scheme": result["scheme"]["name"], "tokens": sim["tokens"],
                     "float": {k: result["fp"][k] for k in ("loss", "ppl")},
                     "simulated": {k: sim[k] for k in ("loss", "ppl")},
                     "loaded": {k: loaded[k] for k in ("loss", "ppl")},
                     "loaded_minus_simulated_loss": loaded["loss"] - sim["loss"],
                     "float_bytes": result["fp_bytes"], "export_bytes": result["export"]["safetensors_bytes"],
                     "format": result["export"]["quantization_config"]["format"]})
    import compressed_tensors
    import transformers

    order = list(RECIPES)
    rows = sorted(kept + rows, key=lambda r: order.index(r["recipe"]) if r["recipe"] in order else len(order))
    doc = {"model": a.model, "data": a.data, "seq_len": a.seq_len, "rows": rows,
           "versions": {"transformers": transformers.__version__, "compressed_tensors": compressed_tensors.__version__,
                        "torch": torch.__version__}}
    atomic_write_json(path, doc)
    lines = [f"{a.model}, held-out {a.data} ({rows[0]['tokens']:,} predicted tokens, windows of {a.seq_len}); "
             "perplexity as `diffquant quantize` prints it (4 significant digits); loaded: transformers' "
             "from_pretrained in an interpreter without diffquant.", "",
             "| recipe | format | float ppl | simulated ppl | loaded ppl | loaded − simulated loss | size (export / float) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['recipe']} | {r['format']} | {fmt_interval(r['float']['ppl'], None)} | "
                     f"{fmt_interval(r['simulated']['ppl'], None)} | {fmt_interval(r['loaded']['ppl'], None)} | "
                     f"{r['loaded_minus_simulated_loss']:+.2e} | {r['export_bytes'] / 1e6:.1f} MB / "
                     f"{r['float_bytes'] / 1e6:.1f} MB |")
    atomic_write_text(out / f"parity-{label}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
