"""diffquant's GPTQ beside llm-compressor's, on the same model, calibration and evaluation tokens.

    python -m benchmarks.llmcompressor_check [--calibration 128] [--group 64]

llm-compressor 0.14 pins transformers 5.17, so it runs in its own virtual environment,
benchmarks/.peers/llmcompressor-venv (created on first use; the project's dependencies do not change), as
a subprocess that loads the same SmolLM2-135M-Instruct folder benchmarks/peers.py exports (the zoo's Q4_1
GGUF dequantized to fp32), calibrates on the same KJV training windows diffquant's weight solvers use, and
returns (a) its own per-sequence losses on the evaluation windows, computed by its quantized model's
forward, and (b) every quantized Linear's dequantized weight (compressed-tensors' `fake_quantize` with its
scales). Both sides quantize every Linear but lm_head to int4 symmetric in groups of `--group` (64: llm-
compressor needs the group to divide the input width, and SmolLM2's 576 = 4.5 × 128 does not, where diffquant's
w4a16 ends each row with a ragged group of 64), with GPTQ without act-order (`actorder=None`), dampening 1%
of the mean diagonal and blocks of 128; llm-compressor's default (static act-order) is another row. The two
libraries' int4 grids differ: diffquant's symmetric int4 has 15 levels (±7, scale absmax/7), compressed-
tensors' 16 (−8..7, scale 2·absmax/15), so RTN and GPTQ differ by the grid as well as by the solver.

In this environment: diffquant's RTN and GPTQ on the same weights, each evaluated by
`diffquant.evaluate.language_modeling`; llm-compressor's dequantized weights loaded into the float model and
evaluated by the same function (so the two GPTQs differ only in their weights); per-Linear relative output
error ‖X·Ŵᵀ − X·Wᵀ‖² / ‖X·Wᵀ‖² on float inputs X from the calibration windows. Results:
docs/weights/llmcompressor.json and .md.

`--methods export` compares the two checkpoints a user would ship: llm-compressor's GPTQ output as it saves it
(compressed-tensors, `save_compressed=True`) beside `diffquant quantize --solver gptq --export compressed-tensors`
of the same recipe (int4 symmetric groups of `--group`, every Linear but lm_head), both read back the way a user
reads them, as `--model DIR` (`diffquant.models.load.load_model`: dequantized on load): safetensors size,
held-out perplexity, and per-Linear weight error ‖Ŵ − W‖² / ‖W‖² against the float weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PINS = ("torch==2.13.0", "llmcompressor==0.14.0.1")  # llm-compressor brings its transformers (5.17)
OUT = ROOT / "docs" / "weights"

CHILD = r'''
import json, sys, time
import numpy as np
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQModifier
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from safetensors.torch import save_file
from llmcompressor.pipelines.cache import IntermediatesCache

# llm-compressor 0.14's AWQ pins its cached activations (pin_memory), which raises on a machine without an
# accelerator; pinning only speeds host-to-device copies, so here it is skipped (the numbers are unchanged).
if not torch.accelerator.is_available():
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(ARGS["model_dir"], dtype=torch.float32)
calib, evals = np.load(ARGS["calib"]), np.load(ARGS["eval"])
ds = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": np.ones_like(calib).tolist()})
weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": ARGS["group"]}
groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
if ARGS["method"] == "gptq":
    kwargs = {} if ARGS["actorder"] == "default" else {"actorder": None}
    recipe = GPTQModifier(config_groups=groups, ignore=["lm_head"], dampening_frac=0.01, block_size=128, **kwargs)
else:  # AWQ's scales, then round to nearest on the scaled weights (llm-compressor's AWQ has no clip search)
    recipe = [AWQModifier(duo_scaling=ARGS["duo_scaling"]), QuantizationModifier(config_groups=groups,
                                                                                  ignore=["lm_head"])]
t, cpu = time.perf_counter(), time.process_time()
oneshot(model=model, tokenizer=AutoTokenizer.from_pretrained(ARGS["model_dir"]), dataset=ds, recipe=recipe, num_calibration_samples=len(calib), max_seq_length=calib.shape[1],
        shuffle_calibration_samples=False)
seconds, cpu_seconds = time.perf_counter() - t, time.process_time() - cpu
weights, grid = {}, {}
with torch.no_grad():
    for name, m in model.named_modules():
        if hasattr(m, "weight_scale") and getattr(m, "quantization_scheme", None) is not None:
            args = m.quantization_scheme.weights
            w = fake_quantize(m.weight, m.weight_scale, m.weight_zero_point, args)
            weights[name + ".weight"] = w.float().contiguous()
            grid[name] = {"num_bits": args.num_bits, "symmetric": args.symmetric, "strategy": str(args.strategy),
                          "group_size": args.group_size, "actorder": str(args.actorder),
                          "observer": str(args.observer)}
    for name, p in model.named_parameters():  # norms: AWQ folds 1/s into them
        if p.dim() == 1:
            weights[name] = p.detach().float().contiguous()
    losses = []
    for row in evals:
        ids = torch.tensor(row[None], dtype=torch.long)
        logits = model(ids).logits[0, :-1].float()
        losses.append(float(torch.nn.functional.cross_entropy(logits, ids[0, 1:])))
save_file(weights, ARGS["weights"])
if ARGS.get("save_dir"):  # the checkpoint as llm-compressor ships it (compressed-tensors)
    model.save_pretrained(ARGS["save_dir"], save_compressed=True)
    AutoTokenizer.from_pretrained(ARGS["model_dir"]).save_pretrained(ARGS["save_dir"])
import compressed_tensors, llmcompressor, transformers
print("RESULT " + json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds, "per_sequence_loss": losses, "grid": grid,
                              "versions": {"llmcompressor": llmcompressor.__version__,
                                           "compressed_tensors": compressed_tensors.__version__,
                                           "transformers": transformers.__version__, "torch": torch.__version__}}))
'''


def venv_python() -> Path:
    """The scratch venv's interpreter, created with PINS on first use."""
    from benchmarks.peers import SCRATCH

    venv = SCRATCH / "llmcompressor-venv"
    python, stamp = venv / "bin" / "python", venv / "diffquant-pins.txt"
    if python.is_file() and stamp.is_file() and stamp.read_text() == "\n".join(PINS):
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PINS], check=True)
    stamp.write_text("\n".join(PINS))
    return python


# llm-compressor configurations: (method, option) → row label. AWQ's duo_scaling off is the paper's s = mean|x|^α
# (diffquant's `awq`), on (llm-compressor's default) divides by mean|W|^(1−α).
PEERS = {"gptq": {("gptq", "none"): "llm-compressor gptq", ("gptq", "default"): "llm-compressor gptq (static act-order)"},
         "awq": {("awq", False): "llm-compressor awq (scales mean|x|^α, as the paper)",
                 ("awq", True): "llm-compressor awq (default duo scaling)"}}
OURS = {"gptq": ("rtn", "gptq"), "awq": ("awq:no-clip", "awq")}
REFERENCE = {"gptq": "diffquant gptq", "awq": "diffquant awq:no-clip"}  # the paired column's counterpart


def run_peer(model_dir: Path, calib_path: Path, eval_path: Path, weights: Path, method: str, option, group: int,
             save_dir: Path | None = None) -> dict:
    """llm-compressor's run of one configuration, cached beside its weights (a rerun reads the cache);
    `save_dir`: also its compressed-tensors checkpoint."""
    cached = weights.with_suffix(".json")
    if cached.is_file() and weights.is_file() and (save_dir is None or (save_dir / "config.json").is_file()):
        return json.loads(cached.read_text())
    args = {"model_dir": str(model_dir), "calib": str(calib_path), "eval": str(eval_path), "weights": str(weights),
            "method": method, "actorder": option, "duo_scaling": option, "group": group,
            "save_dir": str(save_dir) if save_dir else None}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    code = f"ARGS = {json.dumps(args)!r}\nimport json\nARGS = json.loads(ARGS)\n" + CHILD
    load = os.getloadavg()[0]
    out = subprocess.run([str(venv_python()), "-c", code], capture_output=True, text=True, env=env)
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if out.returncode or line is None:
        tail = [ln for ln in out.stderr.strip().splitlines() if ln.strip()][-3:]
        raise SystemExit(f"llm-compressor run failed (exit {out.returncode}): {' | '.join(tail)}")
    result = {**json.loads(line[len("RESULT "):]), "load": [load, os.getloadavg()[0]]}
    cached.write_text(json.dumps(result))
    return result


def layer_errors(model, weights: dict, calib, limit: int = 4) -> dict[str, float]:
    """{linear: ‖X·Ŵᵀ − X·Wᵀ‖² / ‖X·Wᵀ‖²} with X the float model's inputs to that Linear on `limit` calibration
    windows, Ŵ = weights[linear]."""
    import torch

    inputs, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and f"{name}.weight" in weights:
            hooks.append(m.register_forward_pre_hook(
                lambda mod, a, name=name: inputs.setdefault(name, []).append(a[0].reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        try:
            model(calib[:limit])
        finally:
            for h in hooks:
                h.remove()
        out = {}
        for name, xs in inputs.items():
            x, w = torch.cat(xs).double(), model.get_submodule(name).weight.double()
            ref = x @ w.T
            out[name] = float(((x @ weights[f"{name}.weight"].double().T - ref) ** 2).sum() / (ref ** 2).sum())
    return out


FIXTURE = ROOT / "tests" / "data" / "llmcompressor-micro-llama-gptq-w4g32"


def write_fixture(out: Path = FIXTURE) -> None:
    """A checkpoint llm-compressor itself wrote, small enough to commit (tests/test_export.py reads it): its GPTQ
    (int4 symmetric, groups of 32, no act-order, every Linear but lm_head) of the matrix's micro Llama (random
    weights, seed 0; a byte-level BPE tokenizer trained on a few lines), calibrated on 8 random windows of 32
    tokens, saved with `save_compressed=True`; beside it llm-compressor's own dequantized weights
    (`fake_quantize`, reference.safetensors) and its per-sequence losses on 4 evaluation windows
    (fixture.json), each computed in llm-compressor's process."""
    import shutil
    import tempfile

    import numpy as np
    import torch

    from diffquant.data.tokens import train_tokenizer
    from diffquant.models.matrix import FAMILIES, VOCAB
    from diffquant.paths import atomic_write_json

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    calib, evals = (torch.randint(3, VOCAB, shape, generator=g).numpy() for shape in ((8, 32), (4, 32)))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        FAMILIES["llama"].build().save_pretrained(tmp / "float")
        text = "\n".join(f"and {w} went unto the {v}." for w in ("he", "she", "they") * 50 for v in ("house", "city"))
        train_tokenizer(text, 300).save_pretrained(tmp / "float")
        np.save(tmp / "calib.npy", calib)
        np.save(tmp / "eval.npy", evals)
        shutil.rmtree(out, ignore_errors=True)
        result = run_peer(tmp / "float", tmp / "calib.npy", tmp / "eval.npy", tmp / "reference.safetensors", "gptq",
                          "none", 32, save_dir=out)
        shutil.copy(tmp / "reference.safetensors", out / "reference.safetensors")
    atomic_write_json(out / "fixture.json", {
        "what": write_fixture.__doc__.split("\n\n")[0], "command": "python -m benchmarks.llmcompressor_check --fixture",
        "versions": result["versions"], "eval_ids": evals.tolist(), "per_sequence_loss": result["per_sequence_loss"],
        "grid": result["grid"]})
    print(f"wrote {out}")


def main(argv=None) -> None:
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from diffquant.evaluate import language_modeling
    from diffquant.quant.algorithms import solvers
    from diffquant.paths import atomic_write_json, atomic_write_text
    from diffquant.quant.numerics import granularity as G
    from diffquant.quant.numerics.config import int_config
    from diffquant.quant.recipe import Recipe, quantize_
    from diffquant.quant.numerics.scheme import LAYER_WEIGHTS, QuantScheme
    from diffquant.sweeps import versus_float
    from benchmarks.peers import SCRATCH, export_model
    from experiments.weight_solvers import CALIBRATION_WINDOWS, _data

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibration", type=int, default=CALIBRATION_WINDOWS,
                   help="calibration windows of 256 tokens from the training split (weight_solvers.py's)")
    p.add_argument("--group", type=int, default=64, help="int4 group size (must divide 576 and 1536)")
    p.add_argument("--methods", nargs="+", choices=("gptq", "awq", "export"), default=["gptq", "awq"],
                   help="sections to (re)compute; the others are kept from OUT/llmcompressor.json")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--fixture", action="store_true", help="write the small llm-compressor checkpoint the tests read "
                                                               "(tests/data/), and nothing else")
    a = p.parse_args(argv)
    if a.fixture:
        return write_fixture()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model_dir, _ = export_model()
    model, _, seqs, calib, label = _data(False, a.calibration)
    model.eval()
    calib_path, eval_path = SCRATCH / f"calib-{a.calibration}.npy", SCRATCH / "eval.npy"
    np.save(calib_path, calib.numpy())
    np.save(eval_path, seqs.numpy())
    fp = language_modeling(model, seqs)
    scheme = QuantScheme(f"w4a16-g{a.group}", (), ((LAYER_WEIGHTS, int_config(4, G.PerGroup(a.group))),),
                         f"int4 weights in groups of {a.group}, activations in full precision")
    out = Path(a.out)
    old = json.loads((out / "llmcompressor.json").read_text()) if (out / "llmcompressor.json").is_file() else {}
    sections = {m: old[m] for m in ("gptq", "awq", "export") if m in old and m not in a.methods}
    if "gptq" not in a.methods and "rows" in old:  # written before sections existed: the GPTQ section
        sections["gptq"] = {"rows": old["rows"], "layer_errors": old["layer_errors"]}
    for sec in sections.values():  # written when one calibration held for the whole file
        sec.setdefault("calibration", old.get("calibration"))
    calibration = {"windows": len(calib), "tokens": int(calib.numel()), "corpus": "kjv (training split)"}
    for method in a.methods:
        if method == "export":
            sections["export"] = {**export_section(model, model_dir, calib, calib_path, eval_path, seqs, scheme,
                                                   a.group), "calibration": calibration}
            continue
        rows, errors = [], {}
        for name in OURS[method]:
            t0, cpu, load = time.perf_counter(), time.process_time(), os.getloadavg()[0]
            with quantize_(model, Recipe(scheme, solver=solvers.parse(name)), calib):
                seconds, cpu, load = time.perf_counter() - t0, time.process_time() - cpu, [load, os.getloadavg()[0]]
                r = language_modeling(model, seqs)
                dequant = {f"{n}.weight": m.weight.detach().clone() for n, m in model.named_modules()
                           if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
            rows.append({"weights": f"diffquant {name}", "seconds": seconds, "cpu_seconds": cpu, "load": load,
                         **_eval_row(r, fp, versus_float)})
            if method == "gptq":  # AWQ rescales each Linear's input: float inputs would misread its weights
                errors[f"diffquant {name}"] = layer_errors(model, dequant, calib)
        for (kind, option), row_label in PEERS[method].items():
            weights_path = SCRATCH / f"llmc-{kind}-{option}-{a.calibration}-g{a.group}.safetensors"
            peer = run_peer(model_dir, calib_path, eval_path, weights_path, kind, option, a.group)
            theirs = load_file(weights_path)
            if method == "gptq":
                errors[row_label] = layer_errors(model, theirs, calib)
            saved = {k: v.detach().clone() for k, v in model.state_dict().items() if k in theirs}
            with torch.no_grad():
                for k, v in theirs.items():
                    model.get_parameter(k).copy_(v)
                r = language_modeling(model, seqs)
                for k, v in saved.items():
                    model.get_parameter(k).copy_(v)
            own = sum(peer["per_sequence_loss"]) / len(peer["per_sequence_loss"])
            rows.append({"weights": row_label, "seconds": peer["seconds"], "cpu_seconds": peer.get("cpu_seconds"),
                         "load": peer.get("load"),
                         "own_forward_loss": own,
                         "grid": peer["grid"], "versions": peer["versions"], **_eval_row(r, fp, versus_float)})
        sections[method] = {"rows": _paired(rows, REFERENCE[method]), "layer_errors": errors,
                            "calibration": calibration}
    result = {"model": label, "scheme": f"int4 symmetric weights in groups of {a.group} (every Linear but lm_head), "
              "activations in float",
              "evaluation": {"sequences": len(seqs), "predicted_tokens": fp["tokens"], "corpus": "kjv (validation split)"},
              "float": {k: fp[k] for k in ("loss", "ppl", "ppl_ci95")}, **sections}
    out = Path(a.out)
    atomic_write_json(out / "llmcompressor.json", result)
    atomic_write_text(out / "llmcompressor.md", report(result))
    print(report(result))


def _eval_row(r: dict, fp: dict, versus_float) -> dict:
    return {"loss": r["loss"], "ppl": r["ppl"], "ppl_ci95": r["ppl_ci95"], "per_sequence_loss": r["per_sequence_loss"],
            **versus_float(fp, r)}


def _paired(rows: list[dict], reference: str) -> list[dict]:
    """Each row's paired change from `reference` (95% t over the same sequences), per-sequence losses dropped."""
    from diffquant.stats.intervals import paired

    ref = next(r for r in rows if r["weights"] == reference)
    out = []
    for r in rows:
        row = {k: v for k, v in r.items() if k != "per_sequence_loss"}
        if r is not ref:
            d = paired(ref["per_sequence_loss"], r["per_sequence_loss"])
            row["delta_vs_reference"], row["delta_vs_reference_ci95"] = d["mean"], d["ci95"]
        out.append(row)
    return out


def report(r: dict) -> str:
    e = r["evaluation"]
    rows = [row for m in ("gptq", "awq") if m in r for row in r[m]["rows"]]
    versions = next((row["versions"] for row in rows if "versions" in row), {})
    text = (f"{r['model']}, {r['scheme']}. Calibration: per section (below), windows of 256 tokens from the "
            f"training split, the same windows for both libraries; held-out: {e['corpus']}, {e['predicted_tokens']:,} "
            f"predicted tokens ({e['sequences']} sequences). llm-compressor {versions.get('llmcompressor', '?')} (compressed-tensors "
            f"{versions.get('compressed_tensors', '?')}, transformers {versions.get('transformers', '?')}) in its own "
            "venv; every row evaluated by diffquant's `language_modeling` on the same windows. Δloss: paired over the "
            "same sequences, [95% t]. Layer error: ‖X·Ŵᵀ − X·Wᵀ‖² / ‖X·Wᵀ‖² per Linear on float inputs from 4 "
            "calibration windows (median and worst over the model's Linears). Last column: the mean loss of "
            "llm-compressor's own quantized forward next to ours on its dequantized weights.\n")
    for method, reading in (("gptq", gptq_reading), ("awq", awq_reading)):
        if method in r:
            text += "\n" + section_table(r, method) + reading(r[method])
    if "export" in r:
        text += "\n" + export_table(r["export"], r["float"])
    return text


def section_table(r: dict, method: str) -> str:
    import statistics

    from diffquant.report.tables import markdown

    sec = r[method]
    c = sec.get("calibration") or r["calibration"]
    fci = r["float"]["ppl_ci95"]
    body = [["float", f"{r['float']['ppl']:.3f} [{fci[0]:.3f}, {fci[1]:.3f}]", "", "", "", "", "", ""]]
    for row in sec["rows"]:
        err = sec["layer_errors"].get(row["weights"])
        key = "delta_vs_reference" if "delta_vs_reference" in row or method == "awq" else "delta_vs_diffquant_gptq"
        ci = row.get(key + "_ci95")
        body.append([row["weights"], f"{row['ppl']:.3f} [{row['ppl_ci95'][0]:.3f}, {row['ppl_ci95'][1]:.3f}]",
                     f"{row['delta_loss']:+.4f} [{row['delta_loss_ci95'][0]:+.4f}, {row['delta_loss_ci95'][1]:+.4f}]",
                     "-" if ci is None else f"{row[key]:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}]",
                     f"{statistics.median(err.values()):.2e}" if err else "-", f"{max(err.values()):.2e}" if err else "-",
                     "-" if "own_forward_loss" not in row else f"{row['own_forward_loss']:.4f} (ours {row['loss']:.4f})",
                     _seconds(row)])
    return f"{method.upper()}: calibration {c['corpus']}, {c['windows']} windows ({c['tokens']:,} tokens).\n\n" + markdown(
        ["weights", "perplexity [95%]", "Δloss vs float", f"Δloss vs {REFERENCE[method]} [95%]",
                     "layer error (median)", "layer error (worst)", "llm-compressor's own forward",
                     "wall seconds, CPU (load)"], body) + "\n"


def _seconds(row: dict) -> str:
    """The row's wall seconds to quantize (one thread), its CPU seconds, and the machine's 1-minute load average at
    its start and end (rows measured before CPU time and loads were recorded show neither)."""
    if row.get("seconds") is None:
        return "-"
    cpu, load = row.get("cpu_seconds"), row.get("load")
    return (f"{row['seconds']:.0f}" + (f", CPU {cpu:.0f}" if cpu else "") +
            (f" (load {load[0]:.1f}–{load[1]:.1f})" if load else ""))


def _delta(row: dict) -> tuple[float, list[float]]:
    key = "delta_vs_reference" if "delta_vs_reference" in row else "delta_vs_diffquant_gptq"
    return row[key], row[key + "_ci95"]


def _side(lo: float, hi: float) -> str:
    return "no difference detected" if lo <= 0 <= hi else ("llm-compressor's is worse" if lo > 0 else
                                                           "llm-compressor's is better")


def _own_gap(sec: dict) -> float:
    return max(abs(row["own_forward_loss"] - row["loss"]) for row in sec["rows"] if "own_forward_loss" in row)


def gptq_reading(sec: dict) -> str:
    """What the table says about the two plain GPTQs, from its numbers; the cause of a gap is not claimed."""
    import statistics

    rows = {row["weights"]: row for row in sec["rows"]}
    ours, theirs = rows.get("diffquant gptq"), rows.get("llm-compressor gptq")
    if not ours or not theirs:
        return ""
    mean, (lo, hi) = _delta(theirs)
    med = {k: statistics.median(sec["layer_errors"][k].values()) for k in ("diffquant gptq", "llm-compressor gptq")}
    return (f"\nThe two plain GPTQs: llm-compressor's minus diffquant's held-out loss {mean:+.4f} "
            f"nats [{lo:+.4f}, {hi:+.4f}] ({_side(lo, hi)}, one calibration set, one run), while llm-compressor's median "
            f"per-Linear output error on float inputs is {med['llm-compressor gptq']:.2e} against diffquant's "
            f"{med['diffquant gptq']:.2e}. The implementations differ at least in the int4 grid (diffquant: −7..7 with "
            "scale absmax/7, 15 levels; compressed-tensors: −8..7 with scale absmax/7.5, 16 levels) and in when group "
            "scales are set (llm-compressor from the original weights, a check by hand on layer 5's q_proj: every group "
            "sits on its original absmax/7.5; diffquant from the weights as GPTQ has updated them, as the reference "
            "does); which of these makes the gap was not isolated. The act-order row is compared with diffquant's GPTQ "
            "without act-order: diffquant's gptq:act-order was not run in this check. "
            f"llm-compressor's own quantized forward and ours on its "
            f"dequantized weights differ by at most {_own_gap(sec):.1e} nats in mean loss (last column but one), so "
            "the comparison reads its weights as it uses them." + speed_reading(ours, theirs) + "\n")


def speed_reading(ours: dict, theirs: dict) -> str:
    """The two plain GPTQs' wall (and CPU) seconds and their ratio, where both rows carry them: wall seconds on a
    shared machine depend on its load, CPU seconds less so."""
    if not ours.get("seconds") or not theirs.get("seconds"):
        return ""
    loads = "" if not (ours.get("load") and theirs.get("load")) else (
        f" (1-minute load averages {ours['load'][0]:.1f}–{ours['load'][1]:.1f} and "
        f"{theirs['load'][0]:.1f}–{theirs['load'][1]:.1f} on {os.cpu_count()} cores)")
    cpu = "" if not (ours.get("cpu_seconds") and theirs.get("cpu_seconds")) else (
        f"; in CPU seconds {ours['cpu_seconds']:.0f} and {theirs['cpu_seconds']:.0f}, "
        f"{theirs['cpu_seconds'] / ours['cpu_seconds']:.2f}×")
    return (f" Speed, one thread each: diffquant's GPTQ took {ours['seconds']:.0f} s and llm-compressor's "
            f"{theirs['seconds']:.0f} s{loads}, {theirs['seconds'] / ours['seconds']:.2f}× llm-compressor's speed{cpu}. "
            "Both "
            "run each layer twice over the calibration windows (to measure its inputs' Hessians, then to pass the solved "
            "layer's outputs on); where diffquant's time goes: benchmarks/gptq_breakdown.md.")


def awq_reading(sec: dict) -> str:
    """The AWQ rows, read from their numbers: llm-compressor's AWQ searches scales only, so its counterpart is
    diffquant's awq:no-clip; the clip search is diffquant's `awq` row."""
    rows = {row["weights"]: row for row in sec["rows"]}
    paper = rows.get(PEERS["awq"][("awq", False)])
    if paper is None or "diffquant awq:no-clip" not in rows:
        return ""
    mean, (lo, hi) = _delta(paper)
    text = (f"\nAWQ: llm-compressor's scale search in the paper's form (s = mean|x|^α, then round to nearest) minus "
            f"diffquant's awq:no-clip: {mean:+.4f} nats [{lo:+.4f}, {hi:+.4f}] ({_side(lo, hi)}, one calibration set, "
            "one run). Layer errors are not shown: AWQ divides each Linear's input by its scales, so the float "
            "model's inputs would misread the scaled weights. The two search the same family of scales on different objectives: llm-compressor on the "
            "output of the module that reads the scaled tensor (the attention block, the MLP, down_proj), diffquant on "
            "the summed output error of the Linears that read it (their Hessians, no forward per candidate). "
            "llm-compressor's AWQ has no clip search; diffquant's `awq` row adds it. "
            f"Own-forward agreement: {_own_gap(sec):.1e} nats.\n")
    duo = rows.get(PEERS["awq"][("awq", True)])
    if duo is not None:
        mean, (lo, hi) = _delta(duo)
        text += (f"With its default duo scaling (s = mean|x|^α / mean|W|^(1−α)) llm-compressor's AWQ minus diffquant's "
                 f"awq:no-clip is {mean:+.4f} nats [{lo:+.4f}, {hi:+.4f}] ({_side(lo, hi)}).\n")
    return text


def weight_errors(float_weights: dict, weights: dict) -> dict[str, float]:
    """{weight: ‖Ŵ − W‖² / ‖W‖²} (float64) over the weights both hold, Ŵ from `weights`, W from `float_weights`."""
    out = {}
    for name, w in float_weights.items():
        if name in weights:
            w, q = w.double(), weights[name].double()
            out[name] = float(((q - w) ** 2).sum() / (w ** 2).sum())
    return out


def checkpoint_side(folder: Path, float_weights: dict, seqs) -> dict:
    """One shipped checkpoint read back as `--model DIR`: its safetensors bytes, what it says it holds, held-out
    loss and perplexity (`language_modeling`), and per-Linear weight error against `float_weights`."""
    from diffquant.evaluate import language_modeling
    from diffquant.models.load import load_model

    model, _ = load_model(str(folder))
    weights = {f"{n}.weight": m.weight.detach() for n, m in model.named_modules()
               if f"{n}.weight" in float_weights}
    r = language_modeling(model, seqs)
    return {"bytes": sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")),
            "holds": getattr(model, "_diffquant_source_quantization", None), "loss": r["loss"], "ppl": r["ppl"],
            "ppl_ci95": r["ppl_ci95"], "per_sequence_loss": r["per_sequence_loss"],
            "weight_error": weight_errors(float_weights, weights)}


def export_section(model, model_dir: Path, calib, calib_path: Path, eval_path: Path, seqs, scheme, group: int) -> dict:
    """llm-compressor's shipped GPTQ checkpoint beside diffquant's export of the same recipe (see the doc)."""
    import torch

    from transformers import AutoTokenizer

    from diffquant.quant.algorithms.gptq_config import GPTQ
    from diffquant.quant.recipe import Recipe, quantize_
    from benchmarks.peers import SCRATCH

    float_weights = {f"{n}.weight": m.weight.detach().clone() for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and "lm_head" not in n}
    theirs = SCRATCH / f"llmc-gptq-export-{len(calib)}-g{group}"
    run_peer(model_dir, calib_path, eval_path, SCRATCH / f"llmc-gptq-none-{len(calib)}-g{group}-saved.safetensors",
             "gptq", "none", group, save_dir=theirs)
    ours = SCRATCH / f"diffquant-gptq-export-{len(calib)}-g{group}"
    with quantize_(model, Recipe(scheme, solver=GPTQ()), calib) as q:
        q.export(ours, AutoTokenizer.from_pretrained(model_dir))
    float_bytes = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    return compare_sides({"diffquant gptq (export)": checkpoint_side(ours, float_weights, seqs),
                          "llm-compressor gptq (save_compressed)": checkpoint_side(theirs, float_weights, seqs)},
                         float_bytes)


def compare_sides(sides: dict[str, dict], float_bytes: int) -> dict:
    """The side-by-side rows: size (and its share of the float model's), perplexity, the paired loss change of
    each side from the first (95% t over the same sequences), and the median and worst per-Linear weight error."""
    import statistics

    from diffquant.stats.intervals import paired

    first = next(iter(sides.values()))
    rows = []
    for label, side in sides.items():
        errors = side["weight_error"]
        row = {"checkpoint": label, "bytes": side["bytes"], "share_of_float": side["bytes"] / float_bytes,
               "holds": side["holds"], "loss": side["loss"], "ppl": side["ppl"], "ppl_ci95": side["ppl_ci95"],
               "weight_error_median": statistics.median(errors.values()) if errors else None,
               "weight_error_worst": max(errors.values()) if errors else None, "weight_error": errors}
        if side is not first:
            d = paired(first["per_sequence_loss"], side["per_sequence_loss"])
            row["delta_vs_first"], row["delta_vs_first_ci95"] = d["mean"], d["ci95"]
        rows.append(row)
    return {"float_bytes": float_bytes, "rows": rows}


def export_table(sec: dict, fp: dict) -> str:
    from diffquant.report.tables import markdown

    body = [["float", f"{sec['float_bytes'] / 1e6:.1f} MB", f"{fp['ppl']:.3f}", "", "", ""]]
    for row in sec["rows"]:
        ci = row.get("delta_vs_first_ci95")
        body.append([row["checkpoint"], f"{row['bytes'] / 1e6:.1f} MB ({row['share_of_float']:.0%})",
                     f"{row['ppl']:.3f} [{row['ppl_ci95'][0]:.3f}, {row['ppl_ci95'][1]:.3f}]",
                     "-" if ci is None else f"{row['delta_vs_first']:+.4f} [{ci[0]:+.4f}, {ci[1]:+.4f}]",
                     f"{row['weight_error_median']:.2e}", f"{row['weight_error_worst']:.2e}"])
    first = sec["rows"][0]["checkpoint"]
    return ("Shipped checkpoints (compressed-tensors), each read back as `--model DIR` (dequantized on load); weight "
            "error ‖Ŵ − W‖² / ‖W‖² per Linear against the float weights.\n\n" + markdown(
                ["checkpoint", "safetensors", "perplexity [95%]", f"Δloss vs {first} [95%]", "weight error (median)",
                 "weight error (worst)"], body) + "\n")


if __name__ == "__main__":
    main()
