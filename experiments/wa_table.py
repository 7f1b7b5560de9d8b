"""The W×A table: weight solvers (RTN, GPTQ, AWQ) × activation fixes (none, SmoothQuant with α searched per
model, QuaRot's rotation) at W4A8 on SmolLM2-135M-Instruct. The rotation with GPTQ weights is `quarot`.

    python experiments/wa_table.py [--quick] [--scheme w4a8] [--calibration 128] [--out docs/weights/wa]

Data as experiments/weight_solvers.py: 32 held-out KJV windows of 256 (8,160 predicted tokens), calibration
windows from the start of the training split (128 by default; SmoothQuant's α search scores its candidates on
the first 16 of them). Each cell: the fix applied, the weights solved, the scheme attached (static scales
calibrated on the calibration windows), perplexity with its 95% interval over sequences; paired Δloss (95%
t-interval over the same sequences) against float, against RTN with the same fix (what the solver buys) and
against no fix with the same solver (what the fix buys). Intervals are per comparison, not adjusted for the
table's multiplicity. Cells are written as they finish (a stopped run keeps them and resumes).
`--quick` runs the table on a random micro Llama in seconds (a test of the script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from diffquant.paths import atomic_write_json, atomic_write_text  # noqa: E402

FIXES = ("none", "smoothquant:search", "rotate")
SOLVERS = ("rtn", "gptq", "awq")
ORDER = [(f, w) for w in ("rtn", "gptq") for f in FIXES] + [(f, "awq") for f in FIXES]  # AWQ, the slowest, last


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--scheme", default="w4a8")
    p.add_argument("--calibration", type=int, default=None, help="calibration windows (default: weight_solvers')")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="docs/weights/wa")
    a = p.parse_args(argv)
    import torch

    from weight_solvers import CALIBRATION_WINDOWS, _data

    from diffquant.evaluate import language_modeling
    from diffquant.quant.recipe import from_cli, quantize_
    from diffquant.quant.scheme import get_scheme

    torch.set_num_threads(a.threads)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model, _, seqs, calib, label = _data(a.quick, a.calibration or (4 if a.quick else CALIBRATION_WINDOWS))
    path = out / "results.json"
    result = json.loads(path.read_text()) if path.exists() else None
    if result is None or result["scheme"] != a.scheme or result["model"] != label:
        fp = language_modeling(model, seqs)
        result = {"model": label, "scheme": a.scheme, "description": get_scheme(a.scheme).description,
                  "float": {k: fp[k] for k in ("loss", "loss_se", "ppl", "ppl_ci95", "tokens", "per_sequence_loss")},
                  "evaluation": {"sequences": len(seqs), "seq_len": seqs.shape[1], "predicted_tokens": fp["tokens"],
                                 "corpus": "random ids" if a.quick else "kjv (validation split)"},
                  "calibration": {"sequences": len(calib), "tokens": int(calib.numel()),
                                  "corpus": "random ids" if a.quick else "kjv (training split)"},
                  "cells": []}
    done = {(c["fix"], c["weights"]) for c in result["cells"]}
    for fix_text, weights in ORDER:
        if (fix_text, weights) in done:
            continue
        t0 = time.perf_counter()
        with quantize_(model, from_cli(fix_text, weights, a.scheme), calib, progress=not a.quick) as q:
            seconds = time.perf_counter() - t0
            r = language_modeling(model, seqs)
        record = q.record["fixes"][0] if q.record["fixes"] else {"mitigation": None}
        solved_record = q.record["weights"]
        result["cells"].append({"fix": fix_text, "weights": weights, "seconds": seconds, "mitigation_record": record,
                                "weights_record": {k: v for k, v in solved_record.items() if k != "super_weights"},
                                **{k: r[k] for k in ("loss", "loss_se", "ppl", "ppl_ci95", "per_sequence_loss")}})
        atomic_write_json(path, result)
        atomic_write_text(out / "results.md", report(result))
        print(f"{fix_text} × {weights}: ppl {r['ppl']:.3f} ({seconds:.0f} s)", flush=True)
    print(report(result))


def comparisons(result: dict) -> dict:
    """{(fix, weights): {"float"/"solver"/"fix": paired Δloss}} for every finished cell."""
    from diffquant.stats.intervals import paired

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


def report(result: dict) -> str:
    from diffquant.report.tables import markdown

    def delta(d):
        return f"{d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]" if d and d.get("ci95") else "-"

    comp = comparisons(result)
    cells = {(c["fix"], c["weights"]): c for c in result["cells"]}
    rows = []
    for fix, w in ORDER:
        c = cells.get((fix, w))
        if c is None:
            continue
        d = comp[(fix, w)]
        name = "quarot" if (fix, w) == ("rotate", "gptq") else f"{fix} + {w}"
        alpha = c["mitigation_record"].get("alpha")
        rows.append([name + (f" (α {alpha:g})" if fix == "smoothquant:search" else ""),
                     f"{c['ppl']:.3f} [{c['ppl_ci95'][0]:.3f}, {c['ppl_ci95'][1]:.3f}]", delta(d["float"]),
                     delta(d.get("solver")), delta(d.get("fix")), f"{c['seconds']:.0f} s"])
    from weight_solvers import data_text

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
    main()
