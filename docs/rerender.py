"""Rewrite the committed reports from the committed result files, without training or evaluating anything.

    python docs/rerender.py          # then: python docs/readme_results.py

What it recomputes, and why each step is exact:
- sweep folders (docs/demo/sweep, docs/mitigations/cells/*): every interval from the per-sequence losses that
  cells.jsonl keeps: perplexity's interval (exp of the loss's t-interval over sequences) and the paired change
  from float (t-interval), as a sweep writes them today; results.json/csv, the demo's summary.json and the
  figures follow.
- three-seed results (docs/emergence, docs/rivals/*): per seed, the attention-logit top-1/median (a ratio of two
  saved numbers) and, for files whose intervals were normal (z) intervals, each paired quantization-cost interval
  recomputed with t: the paired SE is recovered from the saved z-interval in loss space, log1p(ci/100), exactly
  (up to float rounding); then the mean ± t-interval over seeds of every metric.
- results.md of each experiment and docs/demo/report.md, by the same renderers the experiments use.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "experiments"))
sys.path.insert(0, str(ROOT / "docs"))


def refresh_sweep(folder: Path) -> dict[str, dict]:
    """Recompute the intervals of every cell of a sweep folder from its per-sequence losses; rewrite cells.jsonl,
    results.json/csv in place. Returns {key: flat row}."""
    from diffquant.paths import atomic_write_text
    from diffquant.stats.intervals import ppl_interval
    from diffquant.sweep import NATIVE, _flat, load_done, versus_float, write_results

    done = load_done(folder)
    fp = {r["model"]: r["metrics"] for r in done.values()
          if r["kind"] == "act" and r["bits"] == NATIVE and r.get("mitigate", "none") == "none"}
    for row in done.values():
        m = row["metrics"]
        n = len(m["per_sequence_loss"])
        m.update(sequences=n, ppl_ci95=ppl_interval(m["loss"], m["loss_se"], n))
        if "delta_loss" in m:
            m.update(versus_float(fp[row["model"]], m))
    atomic_write_text(folder / "cells.jsonl", "".join(json.dumps(r) + "\n" for r in done.values()))
    order = [r["key"] for r in json.loads((folder / "results.json").read_text())["rows"]]
    flat = {k: _flat(done[k]) for k in order}
    write_results(folder, list(flat.values()))
    return flat


def refresh_seeds(doc: dict) -> dict:
    """Per-seed logit ratio, t-based paired cost intervals, and the aggregate over seeds (see the docstring)."""
    from scipy.stats import norm

    from diffquant.stats.intervals import t95
    from measure import aggregate

    z = float(norm.ppf(0.975))
    for runs in doc["per_seed"].values():
        for m in runs:
            m["logit_ratio"] = m["logit_top1"] / m["logit_median"]
            if doc.get("intervals") == "t":
                continue
            for key in [k for k in m if k.endswith("_cost_ci95") and m[k]]:
                lo, hi = (math.log1p(x / 100) for x in m[key])
                mean, se = math.log1p(m[key.removesuffix("_ci95")] / 100), (hi - lo) / (2 * z)
                half = t95(m["sequences"]) * se
                m[key] = [100 * math.expm1(mean - half), 100 * math.expm1(mean + half)]
    doc["intervals"] = "t"
    doc["aggregate"] = {d: aggregate(runs) for d, runs in doc["per_seed"].items()}
    return doc


def main() -> None:
    from diffquant.demo import render_report
    from diffquant.paths import atomic_write_json, atomic_write_text
    from diffquant.report.sweep_plots import plot_sweep
    from diffquant.stats.intervals import ppl_interval

    # the demo: its sweep, its summary, its report and figures
    rows = refresh_sweep(ROOT / "docs/demo/sweep")
    plot_sweep(list(rows.values()), ROOT / "docs/demo/sweep")
    summary_path = ROOT / "docs/demo/summary.json"
    s = json.loads(summary_path.read_text())
    s["sweep"] = [rows[r["key"]] for r in s["sweep"]]
    for m in s["train"].values():
        m["ppl_ci95"] = ppl_interval(m["loss"], m["loss_se"], s["eval"]["sequences"])
    atomic_write_json(summary_path, s)
    import readme_results

    rivals = readme_results._load("docs/rivals/demo/results.json")
    atomic_write_text(ROOT / "docs/demo/report.md", render_report(s, readme_results.one_seed_note(s, rivals, "../rivals/demo/results.md")))

    # the post-training fixes
    import mitigations

    mit = ROOT / "docs/mitigations"
    doc = json.loads((mit / "results.json").read_text())
    fresh = {}
    for folder in sorted((mit / "cells").iterdir()):
        fresh.update(refresh_sweep(folder))
    doc["rows"] = [fresh[r["key"]] for r in doc["rows"]]
    atomic_write_json(mit / "results.json", doc)
    atomic_write_text(mit / "results.md", mitigations.render(doc))
    mitigations._plot(doc["rows"], mit)

    # three seeds: emergence regime and rivals
    from emergence import render_regime

    for path in [ROOT / "docs/emergence/results.json", *sorted((ROOT / "docs/rivals").glob("*/results.json"))]:
        doc = refresh_seeds(json.loads(path.read_text()))
        atomic_write_json(path, doc)
        atomic_write_text(path.parent / "results.md", render_regime(doc))
    print("rewrote the demo, mitigation, emergence and rivals reports; now run python docs/readme_results.py")


if __name__ == "__main__":
    main()
