"""Did Guo et al.'s recipe give the baseline an outlier regime at the budget this machine allows?

Reads the tracked curves of the fair comparison's learning-rate sweep (experiments/fair_rivals.py, seed 0):
the baseline at Guo et al.'s own rate (3e-4) is their recipe as run here; the other rates and DIFF are shown
beside it. The verdict is the outlier regime as every report defines it (diffquant.stats.outlier_regime: hidden
top-1/median ≥ 100 or sink rate ≥ 0.5), read on each tracked snapshot (the worst layer's hidden ratio). Issue 27's
own criteria, fixed before this run, are reported beside it under that name: some layer's mean first-token attention
share ≥ 0.5 (an attention sink), or max‖h‖/median‖h‖ ≥ 20× its value at initialisation (a residual peak); where
neither is met, each is extrapolated: a log-log line through the second half of the snapshots, to the token count
where it would be met (none where the curve does not grow).

    python -m experiments.regime [--cells docs/rivals/fair-guo/cells] [--out docs/regime]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from pathlib import Path

SHARE, PEAK_GROWTH = 0.5, 20.0
MIN_R2 = 0.5  # an extrapolation from a worse log-log fit is not reported as a number
THEIR_TOKENS = 10_000 * 512 * 256  # Guo et al.: 10k steps of 512 sequences of 256 predicted tokens
RECIPE = ("baseline", 3e-4)  # Guo et al.'s design and rate


def layer_share_max(point: dict) -> float | None:
    """The largest per-layer mean first-token share of one snapshot (the sink criterion's statistic)."""
    shares = [v["first_share"] for v in point["layers"].values() if v.get("first_share") is not None]
    return max(shares) if shares else None


def series(curve: list[dict]) -> dict[str, list]:
    """Per snapshot: tokens, loss, the sink statistic, max‖h‖/median‖h‖ and its growth over initialisation."""
    peak0 = next((p["model"].get("massive_ratio_max") for p in curve if p["tokens"] == 0), None)
    rows = {"tokens": [], "loss": [], "share_max": [], "peak": [], "peak_growth": [], "value_ratio_min": [],
            "hidden_ratio_max": [], "sink_rate": []}
    for p in curve:
        peak = p["model"].get("massive_ratio_max")
        rows["hidden_ratio_max"].append(p["model"].get("hidden_ratio_max"))
        rows["sink_rate"].append(p["model"].get("sink_rate"))
        rows["tokens"].append(p["tokens"])
        rows["loss"].append(p["loss"])
        rows["share_max"].append(layer_share_max(p))
        rows["peak"].append(peak)
        rows["peak_growth"].append(peak / peak0 if peak is not None and peak0 else None)
        rows["value_ratio_min"].append(p["model"].get("value_ratio_min"))
    return rows


def verdict(s: dict) -> dict:
    """"regime": whether a snapshot is in the outlier regime (diffquant.stats.outlier_regime), "regime_at" the
    first such snapshot's tokens; then issue 27's criteria: whether and when (first snapshot) each was met, else its
    extrapolated token count, and "issue27": whether either was met."""
    from diffquant.lab import loglog_fit, regime_reached, tokens_to_reach

    at = next((t for t, h, r in zip(s["tokens"], s["hidden_ratio_max"], s["sink_rate"])
               if regime_reached({"hidden_ratio": h, "sink_rate": r})), None)
    out = {"regime": at is not None, "regime_at": at,
           "hidden_ratio_max": max((v for v in s["hidden_ratio_max"] if v is not None), default=None),
           "sink_rate_max": max((v for v in s["sink_rate"] if v is not None), default=None)}
    for key, target in (("share_max", SHARE), ("peak_growth", PEAK_GROWTH)):
        hit = next((t for t, v in zip(s["tokens"], s[key]) if v is not None and v >= target), None)
        fit = loglog_fit(s["tokens"], s[key])
        out[key] = {"target": target, "reached_at": hit, "final": s[key][-1], "fit_r2": fit and fit["r2"],
                    "extrapolated_tokens": None if hit is not None else tokens_to_reach(s["tokens"], s[key], target)}
    out["issue27"] = any(out[k]["reached_at"] is not None for k in ("share_max", "peak_growth"))
    return out


def sentence(v: dict, tokens: int, losses: list[float]) -> str:
    """The verdict, with what was reduced from Guo et al.'s setting next to it."""
    from experiments.fair_rivals import GUO_TRAIN

    from diffquant.lab import REGIME_NAME

    step = GUO_TRAIN["batch_size"] * GUO_TRAIN["seq_len"]
    where = (f"In a reduced version of Guo et al.'s recipe (Llama layout, a synthetic bigram chain, batch "
             f"{GUO_TRAIN['batch_size']}, {tokens // step} AdamW steps against their 10,000, {tokens / THEIR_TOKENS:.3%} "
             f"of their tokens; seed 0), the baseline")
    share, peak = v["share_max"], v["peak_growth"]
    ratio = "-" if v["hidden_ratio_max"] is None else f"{v['hidden_ratio_max']:.1f}"
    sinks = "-" if v["sink_rate_max"] is None else f"{v['sink_rate_max']:.2f}"
    head = (f"{where} reached {REGIME_NAME} at {v['regime_at']:,} tokens" if v["regime"] else
            f"{where} did not reach {REGIME_NAME} within {tokens:,} tokens: its worst layer's hidden top-1/median "
            f"peaked at {ratio} and its sink rate at {sinks} over the tracked snapshots")
    if v["issue27"]:
        parts = [f"{name} at {c['reached_at']:,} tokens" for name, c in
                 (("a sink (layer share ≥ 0.5)", share), ("a residual peak (≥ 20× initial)", peak)) if c["reached_at"]]
        return f"{head}. Issue 27's criteria, fixed before the run, were met: " + "; ".join(parts) + "."

    def ext(c):
        if c["extrapolated_tokens"] is None:
            return "no rise over the second half of the run to extrapolate"
        if c["fit_r2"] < MIN_R2:
            return (f"no usable extrapolation: the log-log line through the second half of the snapshots fits with "
                    f"R² = {c['fit_r2']:.2f}")
        return f"~{c['extrapolated_tokens']:.1e} tokens by extrapolation (R² = {c['fit_r2']:.2f})"

    return (f"{head}. Issue 27's criteria, fixed before the run, were not met either: the largest layer's first-token "
            f"share ended at {share['final']:.3f} (criterion 0.5; {ext(share)}) and max‖h‖/median‖h‖ at "
            f"{peak['final']:.2f}× its initial value (criterion 20×; {ext(peak)}). The loss on the tracked held-out "
            f"sequences was still falling ({losses[-2]:.3f} → {losses[-1]:.3f} over the last interval): the task was "
            "not learned to its end.")


def load_cells(cells: Path) -> dict[tuple[str, float], dict]:
    """{(design, lr): cell} of the sweep's seed-0 cells found under `cells`."""
    found = {}
    for path in sorted(cells.glob("*/lr*/s0.json")):
        cell = json.loads(path.read_text())
        found[(cell["design"], cell["lr"])] = cell
    return found


def report(cells: dict, out: Path) -> dict | None:
    import diffquant as dq
    from diffquant.lab import (HIDDEN_RATIO, REGIME_NAME, SINK_RATE, TrainConfig, atomic_write_json, atomic_write_text,
                               display, markdown, plot_emergence)

    recipe = next((c for (d, lr), c in cells.items() if d == RECIPE[0] and math.isclose(lr, RECIPE[1])), None)
    if recipe is None:
        raise dq.DiffquantError(f"no finished {RECIPE[0]} cell at lr {RECIPE[1]:g}, seed 0: run python -m "
                                "experiments.fair_rivals")
    s = series(recipe["curve"])
    v = verdict(s)
    tracked = next(f.default for f in fields(TrainConfig) if f.name == "track_sequences")  # fair_rivals keeps it
    shown = {(d, lr): c for (d, lr), c in cells.items() if d in ("baseline", "diff")}
    rows = []
    for (d, lr), c in sorted(shown.items()):
        cs, cv = series(c["curve"]), verdict(series(c["curve"]))
        rows.append([display(d), f"{lr:g}", f"{c['train_tokens']:,}", f"{cs['loss'][-1]:.4f}",
                     f"{cs['share_max'][-1]:.3f}", f"{cs['peak'][-1]:.2f}", f"{cs['peak_growth'][-1]:.2f}×",
                     "-" if cs["value_ratio_min"][-1] is None else f"{cs['value_ratio_min'][-1]:.3f}",
                     "-" if cv["hidden_ratio_max"] is None else f"{cv['hidden_ratio_max']:.1f}",
                     "yes" if cv["regime"] else "no",
                     ("yes" if cv["issue27"] else "no") if d == RECIPE[0] else "-"])
    doc = {"criterion": {"share_max": SHARE, "peak_growth": PEAK_GROWTH},
           "outlier_regime": {"hidden_ratio": HIDDEN_RATIO, "sink_rate": SINK_RATE},
           "recipe": {"design": RECIPE[0], "lr": RECIPE[1]},
           "tokens": recipe["train_tokens"], "parameters": recipe["parameters"], "verdict": v, "sentence":
           sentence(v, recipe["train_tokens"], s["loss"]), "series": s}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", doc)
    md = ["# Guo et al.'s recipe on this machine: is there an outlier regime?\n", f"**Verdict.** {doc['sentence']}\n",
          f"Setting: experiments/fair_rivals.py's `guo` experiment (its GUO_NOTES list what is reproduced and what "
          f"differs), {recipe['parameters'] / 1e6:.2f}M parameters, {recipe['train_tokens']:,} tokens per model, "
          f"seed 0, tracked at {len(s['tokens'])} snapshots on {tracked} held-out sequences. Verdict: "
          f"{REGIME_NAME}, on each snapshot (the worst layer's hidden ratio). Issue 27's criteria, fixed before the "
          f"run: some layer's mean first-token share ≥ {SHARE} or max‖h‖/median‖h‖ ≥ {PEAK_GROWTH:g}× its value at "
          "initialisation; extrapolation: a log-log line through the second half of the snapshots.\n",
          "Final snapshot of each sweep run (the hidden ratio: its largest over the snapshots). Issue 27's criteria "
          "are the baseline's (softmax heads); DIFF's share is its differential map's mass on token 0 divided by the "
          "map's row sum 1 − λ, which exceeds 1 where λ·A2 puts more mass on the other tokens than A1 does "
          "(0 < λ < 1), so it is shown, not judged:\n",
          markdown(["design", "lr", "tokens", f"loss ({tracked} tracked sequences)", "largest layer first-token share",
                    "max‖h‖/median‖h‖", "growth over init", "value-norm ratio (min)",
                    "hidden top-1/median (worst layer, largest)", "outlier regime", "issue 27's criteria"], rows),
          f"\nCurves of the baseline and DIFF at Guo et al.'s rate ({RECIPE[1]:g}):\n\n![curves](curves.png)\n"]
    atomic_write_text(out / "results.md", "\n".join(md))
    at_recipe = {f"{display(d)}, lr {lr:g}": c for (d, lr), c in sorted(shown.items()) if math.isclose(lr, RECIPE[1])}
    plot_emergence({"models": {label: c["curve"] for label, c in at_recipe.items()}, "track_sequences": tracked,
                    "scale": {label: {"parameters": c["parameters"], "tokens": c["train_tokens"]}
                              for label, c in at_recipe.items()}}, out)
    for suffix in (".png", ".svg"):
        made = out / f"emergence{suffix}"
        if made.is_file():
            made.replace(out / f"curves{suffix}")
    for extra in out.glob("emergence_layers.*"):
        extra.replace(out / extra.name.replace("emergence_layers", "curves_layers"))
    return doc


def main(argv=None) -> dict | None:
    import diffquant as dq

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cells", default="docs/rivals/fair-guo/cells")
    p.add_argument("--out", default="docs/regime")
    a = p.parse_args(argv)
    try:
        doc = report(load_cells(Path(a.cells)), Path(a.out))
    except dq.DiffquantError as err:
        sys.exit(f"regime: {err}")
    print(doc["sentence"])
    return doc


if __name__ == "__main__":
    main()
