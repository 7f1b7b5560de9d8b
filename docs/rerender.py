"""Rewrite the committed reports from the committed result files, without training or evaluating anything.

    python -m docs.rerender          # then: python -m docs.readme_results

What it recomputes, and why each step is exact:
- sweep folders (docs/demo/sweep, docs/mitigations/cells/*): every interval from the per-sequence losses that
  cells.jsonl keeps: perplexity's interval (exp of the loss's t-interval over sequences) and the paired change
  from float (t-interval), as a sweep writes them today; results.json/csv, the demo's summary.json and the
  figures follow.
- three-seed results (docs/emergence, docs/rivals/*): per seed, the attention-logit top-1/median (a ratio of two
  saved numbers) and, for files whose intervals were normal (z) intervals, each paired quantization-cost interval
  recomputed with t: the paired SE is recovered from the saved z-interval in loss space, log1p(ci/100), exactly
  (up to float rounding); then the mean ± t-interval over seeds of every metric.
- the demo's sink tables (docs/demo/profile, docs/demo/smollm2 and the summary's `sinks` rows): stats.json files
  written before DIFF's sinks were counted per differential head hold, per layer, each softmax map's mean
  first-key mass (A1 maps, then A2 maps) and each differential map's mean first-key entry, but no λ. The
  differential map's mean is A1's mean minus λ times A2's (one λ per layer, the same queries counted), so each
  head gives λ = (A1 − map) / A2; the heads of a layer must agree (the sums were float32: they do to < 1e-7 in
  the committed files, and more than LAMBDA_SPREAD refuses), and the layer's λ is their least-squares fit. The
  shares, sink counts and rates then follow from stats/sinks.py as a profile computes them today. The demo's
  emergence figure is redrawn from its emergence.json so that its sink panel says which definition it holds
  (those snapshots keep per-layer pooled masses only: their DIFF rate cannot be recomputed, only labelled).
- results.md of each experiment and docs/demo/report.md, by the same renderers the experiments use.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAMBDA_SPREAD = 1e-6  # the most a DIFF layer's λ may differ between its heads' recoveries


def refresh_sweep(folder: Path) -> dict[str, dict]:
    """Recompute the intervals of every cell of a sweep folder from its per-sequence losses; rewrite cells.jsonl,
    results.json/csv in place. Returns {key: flat row}."""
    from diffquant.paths import atomic_write_text
    from diffquant.stats.intervals import ppl_interval
    from diffquant.sweeps import NATIVE, _flat, load_done, versus_float, write_results

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


def recover_lambda(a1: list[float], a2: list[float], mapped: list[float]) -> tuple[float, float]:
    """(λ of one DIFF layer, the spread of its heads' recoveries) from each differential head's mean first-key
    mass of A1 and A2 and mean first-key entry of A1 − λ·A2 (see the module docstring)."""
    from diffquant.errors import DiffquantError

    per_head = [(x - m) / y for x, y, m in zip(a1, a2, mapped)]
    spread = max(per_head) - min(per_head)
    if spread > LAMBDA_SPREAD:
        raise DiffquantError(f"the heads of a DIFF layer give λ from {min(per_head):.9g} to {max(per_head):.9g}: "
                             "these masses are not of one differential map per layer")
    return sum(y * (x - m) for x, y, m in zip(a1, a2, mapped)) / sum(y * y for y in a2), spread


def upgrade_sinks(sinks: dict) -> dict:
    """A stats.json model's `sinks`, written before DIFF's sinks were counted per differential head, in today's
    layout (stats/sinks.py `LayerSinks.summary`, `model_sink_rates`); files already in it come back unchanged.
    DIFF layers get λ recovered from their stored masses; softmax heads' shares are their first-key masses."""
    import torch

    from diffquant.stats.sinks import LayerSinks, model_sink_rates

    layers = sinks.get("layers") or {}
    if not layers or all("share" in v for v in layers.values()):
        return sinks
    diff = any("first_mass_map" in v for v in layers.values())
    fresh, spreads = {}, []
    for i, v in layers.items():
        acc = LayerSinks()  # the stored means as sums over one query: summary() divides by 1, exactly
        acc.mass["probs"], acc.queries["probs"] = torch.tensor(v["first_mass"], dtype=torch.float64), torch.tensor(1.0)
        if diff:
            half = len(v["first_mass"]) // 2
            acc.lam, spread = recover_lambda(v["first_mass"][:half], v["first_mass"][half:], v["first_mass_map"])
            spreads.append(spread)
            acc.mass["map"], acc.queries["map"] = torch.tensor(v["first_mass_map"], dtype=torch.float64), torch.tensor(1.0)
        new = acc.summary(diff, sinks["epsilon"])
        fresh[int(i)] = {**new, **{k: v[k] for k in ("value_ratio", "massive_ratio", "massive_max")}}
    out = {"epsilon": sinks["epsilon"], "layers": fresh, "model": model_sink_rates(fresh)}
    if diff:
        out["lambda_recovered"] = (f"λ per layer recovered by docs/rerender.py as (A1 − map) / A2 from the stored "
                                   f"first-key masses; its heads agreed to {max(spreads):.2g}")
    return out


def refresh_demo_sinks(s: dict) -> None:
    """docs/demo/profile and docs/demo/smollm2: stats.json's sinks in today's layout (see `upgrade_sinks`),
    table5.md/csv and the sink figure redrawn from them, and the summary's sink rows."""
    from diffquant.commands.demo import named_rows
    from diffquant.paths import atomic_write_json, atomic_write_text
    from diffquant.report.plots import plot_sinks
    from diffquant.report.profile_report import TABLE5_HEADER, sink_rows, sink_sections, table5_markdown
    from diffquant.report.style import display
    from diffquant.report.tables import to_csv

    for folder, table5, sinks in (("profile", "table5", "sinks"), ("smollm2", "smollm2_table5", "smollm2_sinks")):
        path = ROOT / "docs/demo" / folder / "stats.json"
        doc = json.loads(path.read_text())
        for m in doc["models"]:
            m["sinks"] = upgrade_sinks(m["sinks"])
        atomic_write_json(path, doc)
        shown = [{**m, "label": display(m["label"])} for m in doc["models"]]
        rows = named_rows(s[table5])
        tokens = ", ".join(f"{m['label']}: {m['provenance'].get('tokens')} tokens" for m in shown)
        atomic_write_text(path.parent / "table5.md", table5_markdown(rows, tokens) + sink_sections(shown))
        atomic_write_text(path.parent / "table5.csv", to_csv(TABLE5_HEADER, rows))
        plot_sinks(shown, path.parent)
        s[sinks] = sink_rows(doc["models"])


def refresh_seeds(doc: dict) -> dict:
    """Per-seed logit ratio, t-based paired cost intervals, and the aggregate over seeds (see the docstring)."""
    from scipy.stats import norm

    from diffquant.stats.intervals import t95
    from experiments.measure import aggregate

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
    from diffquant.commands.demo import render_report
    from diffquant.paths import atomic_write_json, atomic_write_text
    from diffquant.report.emergence_plots import plot_emergence
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
    refresh_demo_sinks(s)
    plot_emergence(json.loads((ROOT / "docs/demo/emergence/emergence.json").read_text()), ROOT / "docs/demo/emergence")
    atomic_write_json(summary_path, s)
    from docs import readme_results

    rivals = readme_results._load("docs/rivals/demo/results.json")
    atomic_write_text(ROOT / "docs/demo/report.md", render_report(s, readme_results.one_seed_note(s, rivals, "../rivals/demo/results.md")))

    # the post-training fixes
    from experiments import mitigations

    mit = ROOT / "docs/mitigations"
    doc = json.loads((mit / "results.json").read_text())
    fresh = {}
    for folder in sorted((mit / "cells").iterdir()):
        fresh.update(refresh_sweep(folder))
    # The cells label the search's pair "(regime)", as they were measured; since commit 8c48e4b the report names it
    # by the setting the search chose (mitigations.models_to_run), since the search reached no outlier regime.
    from experiments.emergence import regime_setting

    setting = f"({regime_setting(ROOT / 'docs/emergence/search.json')[0]})"
    for row in fresh.values():
        row.update(key=row["key"].replace("(regime)", setting), model=row["model"].replace("(regime)", setting))
    fresh = {row["key"]: row for row in fresh.values()}
    doc["rows"] = [fresh[r["key"]] for r in doc["rows"]]
    atomic_write_json(mit / "results.json", doc)
    atomic_write_text(mit / "results.md", mitigations.render(doc))
    mitigations._plot(doc["rows"], mit)

    # three seeds: emergence regime and rivals
    from experiments.emergence import render_regime

    # (the fair comparison, docs/rivals/fair-guo, is another format: `python -m experiments.fair_rivals --render`)
    for path in (ROOT / "docs/emergence/results.json", ROOT / "docs/rivals/demo/results.json"):
        doc = refresh_seeds(json.loads(path.read_text()))
        atomic_write_json(path, doc)
        atomic_write_text(path.parent / "results.md", render_regime(doc))
    print("rewrote the demo, mitigation, emergence and rivals reports; now run python -m docs.readme_results")


if __name__ == "__main__":
    main()
