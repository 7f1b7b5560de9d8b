"""How much of round-to-nearest's 4-bit cost do the weight solvers practitioners use recover? W4A16 with
int4 groups of 128 (the `w4a16` preset) on SmolLM2-135M-Instruct, weights by RTN, GPTQ and AWQ.

    python -m experiments.weight_solvers [--quick] [--calibration 128] [--out docs/weights]
    python -m experiments.weight_solvers --wa [--quick] [--scheme w4a8] [--out docs/weights/wa]   # the W×A table

The held-out tokens are the mitigations experiment's (experiments/mitigations.py): KJV's validation split,
32 windows of 256 (8,160 predicted tokens). Calibration: `--calibration` windows of 256 from the start of
the training split, never the evaluation text (the mitigations experiment's 16 are the first 16 of them). Per solver: perplexity with its 95% interval over sequences,
the paired change from float and from RTN (95% paired intervals over the same sequences), the share of
RTN's loss increase it recovers, and the solver's wall time. SmolLM2's published weights here are a Q4_1
GGUF dequantized to fp32: every weight-quantization result on it is on weights that were 4-bit once.
`--quick` runs the same on a random micro Llama and a byte tokenizer in seconds (a test of the script).

`--wa`, the W×A table: weight solvers (RTN, GPTQ, AWQ) × activation fixes (none, SmoothQuant with α searched per
model, QuaRot's rotation) at W4A8 on the same model and tokens; the rotation with GPTQ weights is `quarot`.
SmoothQuant's α search scores its candidates on the first 16 calibration windows. Each cell: the fix applied, the
weights solved, the scheme attached (static scales calibrated on the calibration windows), perplexity with its 95%
interval over sequences; paired Δloss (95% t-interval over the same sequences) against float, against RTN with the
same fix (what the solver buys) and against no fix with the same solver (what the fix buys). Intervals are per
comparison, not adjusted for the table's multiplicity. Cells are written as they finish (a stopped run keeps them
and resumes).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import diffquant as dq
from diffquant.lab import atomic_write_json, atomic_write_text

SCHEME = "w4a16"  # int4 symmetric, groups of 128, activations in float: the setting GPTQ/AWQ papers quote
SOLVERS = ("rtn", "gptq", "gptq:act-order", "awq", "awq+gptq")
# The reference GPTQ calibrates on 128 sequences (of 2,048 tokens; here of 256, this model's evaluation
# windows): 32,768 tokens, 21x down_proj's 1,536 inputs. 16 windows (4,096 tokens, the mitigations
# experiment's) overfit: on SmolLM2 the solved down_proj's held-out output error was 2-5x its calibration
# error, and GPTQ recovered 23% of RTN's cost (31% on 128 windows: see docs/weights).
CALIBRATION_WINDOWS = 128
CALIBRATION_CHARS = 1_000_000  # of the training split: 246,746 tokens (963 windows)
WA_SCHEME = "w4a8"  # `--wa`: activations quantized too, where the fixes matter
WA_FIXES = ("none", "smoothquant:search", "rotate")
WA_SOLVERS = ("rtn", "gptq", "awq")
WA_ORDER = [(f, w) for w in ("rtn", "gptq") for f in WA_FIXES] + [(f, "awq") for f in WA_FIXES]  # AWQ, the slowest, last


def _data(quick: bool, windows: int):
    """(model, tokenizer, evaluation windows, `windows` calibration windows, model label)."""
    if quick:
        import torch

        from diffquant.lab import PRESETS, build_pair, byte_tokenizer

        torch.manual_seed(0)
        model = build_pair(PRESETS["micro"], seed=0)[0]
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 256, (12, 64), generator=g)
        return model, byte_tokenizer(), ids[:8], ids[8:], "micro Llama (random weights)"
    from experiments.mitigations import EVAL_TOKENS, SEQ, held_out_and_calibration

    from diffquant.lab import encode, load_text, sequences, split_corpus

    model, tok = dq.load("smollm2-135m", device="cpu")
    seqs = held_out_and_calibration(tok, None, EVAL_TOKENS)[0]
    calib = sequences(encode(tok, split_corpus(load_text("kjv")[0])[0][:CALIBRATION_CHARS]), SEQ, windows * SEQ)
    if len(calib) < windows:
        raise dq.DiffquantError(f"the training split gives {len(calib)} calibration windows, fewer than {windows}")
    return model, tok, seqs, calib, "SmolLM2-135M-Instruct, dequantized from Q4_1"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--wa", action="store_true", help="the W×A table: solvers × activation fixes (see above)")
    p.add_argument("--scheme", default=None, help=f"with --wa: the scheme (default {WA_SCHEME})")
    p.add_argument("--solvers", nargs="+", default=list(SOLVERS), help="without --wa: the solvers compared")
    p.add_argument("--calibration", type=int, default=CALIBRATION_WINDOWS,
                   help="calibration windows of 256 tokens from the training split (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a loaded 2-core machine two threads oversubscribe)")
    p.add_argument("--out", default=None, help="default docs/weights (--wa: docs/weights/wa)")
    a = p.parse_args(argv)
    import torch

    if a.scheme and not a.wa:
        raise dq.DiffquantError(f"--scheme {a.scheme}: the solver table is {SCHEME}; --scheme goes with --wa")
    torch.set_num_threads(a.threads)
    if a.wa:
        return wa_table(a.quick, a.scheme or WA_SCHEME, a.calibration, Path(a.out or "docs/weights/wa"))
    a.out = a.out or "docs/weights"
    from diffquant.lab import parse_solver, start_run, versus_float

    out = start_run(a.out, vars(a), "cpu")
    model, _, seqs, calib, label = _data(a.quick, a.calibration)
    scheme = dq.scheme(SCHEME)
    fp = dq.perplexity(model, seqs)
    rows = []
    for name in a.solvers:
        t0 = time.perf_counter()
        with dq.quantize_(model, dq.Recipe(scheme, solver=parse_solver(name)), calib, progress=not a.quick) as q:
            seconds = time.perf_counter() - t0  # the solve (w4a16 has no activation scales to calibrate)
            r = dq.perplexity(model, seqs)
        rows.append({"weights": name, "solve_seconds": seconds, "loss": r["loss"], "loss_se": r["loss_se"],
                     "ppl": r["ppl"], "ppl_ci95": r["ppl_ci95"], "per_sequence_loss": r["per_sequence_loss"],
                     "record": {k: v for k, v in q.record["weights"].items() if k != "weights"},
                     **versus_float(fp, r)})
        result = {"model": label, "scheme": scheme.to_dict(),
                  "float": {k: fp[k] for k in ("loss", "loss_se", "ppl", "ppl_ci95", "tokens")},
                  "evaluation": {"sequences": len(seqs), "seq_len": seqs.shape[1], "predicted_tokens": fp["tokens"],
                                 "corpus": "random ids" if a.quick else "kjv (validation split)"},
                  "calibration": {"sequences": len(calib), "tokens": int(calib.numel()),
                                  "corpus": "random ids" if a.quick else "kjv (training split)"},
                  "rows": versus_rtn(rows)}
        atomic_write_json(out / "results.json", result)  # after each solver: a partial run keeps its rows
        atomic_write_text(out / "results.md", report(result))
    print(report(result))


def versus_rtn(rows: list[dict]) -> list[dict]:
    """Rows without per-sequence losses, each with its paired change from RTN and the share of RTN's loss
    increase it recovers."""
    from diffquant.lab import paired

    rtn = next((r for r in rows if r["weights"] == "rtn"), None)
    out = []
    for r in rows:
        row = {k: v for k, v in r.items() if k != "per_sequence_loss"}
        if rtn is not None and r is not rtn:
            d = paired(rtn["per_sequence_loss"], r["per_sequence_loss"])
            row["delta_loss_vs_rtn"], row["delta_loss_vs_rtn_ci95"] = d["mean"], d["ci95"]
            row["rtn_cost_recovered"] = 1 - r["delta_loss"] / rtn["delta_loss"] if rtn["delta_loss"] > 0 else None
        out.append(row)
    return out


def data_text(r: dict) -> str:
    """The held-out and calibration tokens of a result, in one sentence (no final stop)."""
    e, c = r["evaluation"], r["calibration"]
    return (f"Held-out: {e['corpus']}, {e['predicted_tokens']:,} predicted tokens ({e['sequences']} × {e['seq_len']}); "
            f"calibration: {c['corpus']}, {c['sequences']} windows ({c['tokens']:,} tokens)")


def report(r: dict) -> str:
    from diffquant.lab import markdown

    def ci(x):
        return f"[{x[0]:+.4f}, {x[1]:+.4f}]" if x else ""

    fp = r["float"]
    lines = [["float", f"{fp['ppl']:.3f} [{fp['ppl_ci95'][0]:.3f}, {fp['ppl_ci95'][1]:.3f}]", "", "", "", ""]]
    rtn = next((row for row in r["rows"] if row["weights"] == "rtn"), None)
    for row in r["rows"]:
        rec, band = row.get("rtn_cost_recovered"), row.get("delta_loss_vs_rtn_ci95")
        if rec is not None and band and rtn and rtn["delta_loss"] > 0:  # RTN's own uncertainty not carried
            rec_text = f"{100 * rec:.0f}% [{-100 * band[1] / rtn['delta_loss']:.0f}, {-100 * band[0] / rtn['delta_loss']:.0f}]"
        else:
            rec_text = f"{100 * rec:.0f}%" if rec is not None else "-"
        lines.append([row["weights"], f"{row['ppl']:.3f} [{row['ppl_ci95'][0]:.3f}, {row['ppl_ci95'][1]:.3f}]",
                      f"{row['delta_loss']:+.4f} {ci(row.get('delta_loss_ci95'))}",
                      f"{row['delta_loss_vs_rtn']:+.4f} {ci(row['delta_loss_vs_rtn_ci95'])}"
                      if "delta_loss_vs_rtn" in row else "-",
                      rec_text, f"{row['solve_seconds']:.0f} s"])
    head = (f"{r['model']}, scheme {r['scheme']['name']} (int4 symmetric, groups of 128, activations in float). "
            f"{data_text(r)}. Brackets: 95% intervals "
            "(perplexity: over sequences; Δloss: paired over the same sequences). Recovered: 1 − Δloss(solver) / "
            "Δloss(RTN), in brackets the paired Δloss-vs-RTN interval over Δloss(RTN) (RTN's own uncertainty not "
            "carried), so solvers whose brackets overlap are not told apart. Solve time: wall clock, one thread on a "
            "2-core CPU shared with other jobs (a benchmark note, not a controlled timing).\n\n")
    return head + markdown(["weights", "perplexity [95%]", "Δloss vs float", "Δloss vs RTN", "RTN cost recovered",
                            "solve time"], lines) + "\n"


def wa_table(quick: bool, scheme: str, calibration: int, out: Path) -> None:
    """`--wa`: every (fix, solver) cell of WA_ORDER at `scheme`, resumed from OUT/results.json (see above)."""
    from diffquant.lab import recipe_from_cli

    out.mkdir(parents=True, exist_ok=True)
    model, _, seqs, calib, label = _data(quick, calibration)
    path = out / "results.json"
    result = json.loads(path.read_text()) if path.exists() else None
    if result is None or result["scheme"] != scheme or result["model"] != label:
        fp = dq.perplexity(model, seqs)
        result = {"model": label, "scheme": scheme, "description": dq.scheme(scheme).description,
                  "float": {k: fp[k] for k in ("loss", "loss_se", "ppl", "ppl_ci95", "tokens", "per_sequence_loss")},
                  "evaluation": {"sequences": len(seqs), "seq_len": seqs.shape[1], "predicted_tokens": fp["tokens"],
                                 "corpus": "random ids" if quick else "kjv (validation split)"},
                  "calibration": {"sequences": len(calib), "tokens": int(calib.numel()),
                                  "corpus": "random ids" if quick else "kjv (training split)"},
                  "cells": []}
    done = {(c["fix"], c["weights"]) for c in result["cells"]}
    for fix_text, weights in WA_ORDER:
        if (fix_text, weights) in done:
            continue
        t0 = time.perf_counter()
        with dq.quantize_(model, recipe_from_cli(fix_text, weights, scheme), calib, progress=not quick) as q:
            seconds = time.perf_counter() - t0
            r = dq.perplexity(model, seqs)
        record = q.record["fixes"][0] if q.record["fixes"] else {"mitigation": None}
        solved_record = q.record["weights"]
        result["cells"].append({"fix": fix_text, "weights": weights, "seconds": seconds, "mitigation_record": record,
                                "weights_record": {k: v for k, v in solved_record.items() if k != "super_weights"},
                                **{k: r[k] for k in ("loss", "loss_se", "ppl", "ppl_ci95", "per_sequence_loss")}})
        atomic_write_json(path, result)
        atomic_write_text(out / "results.md", wa_report(result))
        print(f"{fix_text} × {weights}: ppl {r['ppl']:.3f} ({seconds:.0f} s)", flush=True)
    print(wa_report(result))


def wa_comparisons(result: dict) -> dict:
    """{(fix, weights): {"float"/"solver"/"fix": paired Δloss}} for every finished cell."""
    from diffquant.lab import paired

    cells = {(c["fix"], c["weights"]): c for c in result["cells"]}
    out = {}
    for (fix, w), c in cells.items():
        d = {"float": paired(result["float"]["per_sequence_loss"], c["per_sequence_loss"])}
        if w != "rtn" and (fix, "rtn") in cells:
            d["solver"] = paired(cells[(fix, "rtn")]["per_sequence_loss"], c["per_sequence_loss"])
        if fix != "none" and ("none", w) in cells:
            d["fix"] = paired(cells[("none", w)]["per_sequence_loss"], c["per_sequence_loss"])
        out[(fix, w)] = d
    return out


def wa_report(result: dict) -> str:
    from diffquant.lab import markdown

    def delta(d):
        return f"{d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]" if d and d.get("ci95") else "-"

    comp = wa_comparisons(result)
    cells = {(c["fix"], c["weights"]): c for c in result["cells"]}
    rows = []
    for fix, w in WA_ORDER:
        c = cells.get((fix, w))
        if c is None:
            continue
        d = comp[(fix, w)]
        name = "quarot" if (fix, w) == ("rotate", "gptq") else f"{fix} + {w}"
        alpha = c["mitigation_record"].get("alpha")
        rows.append([name + (f" (α {alpha:g})" if fix == "smoothquant:search" else ""),
                     f"{c['ppl']:.3f} [{c['ppl_ci95'][0]:.3f}, {c['ppl_ci95'][1]:.3f}]", delta(d["float"]),
                     delta(d.get("solver")), delta(d.get("fix")), f"{c['seconds']:.0f} s"])
    fp = result["float"]
    head = (f"{result['model']}, scheme {result['scheme']} ({result['description']}). {data_text(result)}. "
            f"Float perplexity {fp['ppl']:.3f} "
            f"[{fp['ppl_ci95'][0]:.3f}, {fp['ppl_ci95'][1]:.3f}]. Δloss: paired over the same sequences, 95% "
            "t-intervals per comparison (not adjusted for the table's multiplicity); vs RTN: the same fix with "
            "round-to-nearest weights; vs no fix: the same solver without the fix. quarot = rotate + GPTQ (without "
            "act-order; QuaRot's online Hadamard across heads before o_proj is not applied). smoothquant:search "
            "chooses α on the first 16 calibration windows with RTN weights (each row searches again and finds the "
            "same α); after rotate, AWQ applies no scales to down_proj's input (they would not commute with the "
            "online Hadamard). Time: fix, solve and calibration, wall clock, one thread on a shared 2-core CPU "
            "(not a cost comparison).\n\n")
    return head + markdown(["fix + weights", "perplexity [95%]", "Δloss vs float", "Δloss vs RTN", "Δloss vs no fix",
                            "time"], rows) + "\n"


if __name__ == "__main__":
    try:
        main()
    except dq.DiffquantError as err:  # one line, not a traceback
        raise SystemExit(f"weight_solvers: {err}") from None
