"""Outlier emergence: profile a model on a fixed held-out batch at log-spaced points of its training.

Each snapshot reuses `profile_model` (no second profiler) on the same batch: per layer the top-1, median,
top-1/median and kurtosis of the hidden states and attention logits, the sink metrics of stats/sinks.py,
and the held-out loss of the batch (DIFF: sinks counted over differential heads by their share on token 0,
with λ per layer), and any of the papers' metric sets named (stats/metric_sets.py, `train --track-metrics`).
`train --track` takes snapshots at step 0 (the initialisation),
log-spaced steps, and the last step; they are saved with every checkpoint, so a resumed run keeps them.
"""

from __future__ import annotations

import math

import torch

TRACK_SITES = ("*.hidden", "*.attn_logits")


def track_steps(total: int, points: int) -> list[int]:
    """Steps (updates done) at which to take snapshots: 0, `points` log-spaced ones in [1, total], total."""
    if total <= 0:
        return [0]
    steps = {0, total}
    for i in range(points):
        steps.add(max(1, min(total, round(math.exp(math.log(total) * i / max(1, points - 1))))))
    return sorted(steps)


def snapshot(model, batch: torch.Tensor, step: int, tokens: int, metrics: tuple[str, ...] = ()) -> dict:
    """One emergence point: the model's statistics on `batch` ([n, seq_len]) after `step` updates."""
    from diffquant.evaluate import language_modeling
    from diffquant.profiler import profile_model
    from diffquant.taps import site_table

    was_training = model.training
    model.eval()
    sites = [s for s in TRACK_SITES if any(x.kind == s[2:] for x in site_table(model))]
    prof = profile_model(model, batch, sites, batch_size=len(batch), k=1, progress=False, sinks=True,
                         metrics=metrics)
    loss = language_modeling(model, batch, batch_size=len(batch))["loss"]
    model.train(was_training)
    layers: dict[int, dict] = {}
    for name, stats in prof.sites.items():
        s = stats.summary(full=False)
        top, median = s["absmax"], s["quantiles"]["median"]
        layers.setdefault(prof.layer_of[name], {})[prof.kind_of[name]] = {
            "top1": top, "median": median, "ratio": top / median if median else None, "kurtosis": s["kurtosis"]}
    sinks = prof.sink_summary()
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    for layer, v in sinks.get("layers", {}).items():
        entry = layers.setdefault(layer, {})
        if "sink" in v:
            counted = v["sink"]["heads"] - v["sink"].get("undefined", 0)
            entry["sink_fraction"] = v["sink"]["sinks"] / counted if counted else None
            entry["first_mass"] = mean(v["first_mass"])
            entry["first_share"] = mean([x for x in v["share"] if x is not None])
        if "lambda" in v:
            entry["lambda"] = v["lambda"]
            entry["first_mass_A1"], entry["first_mass_A2"] = mean(v["first_mass_A1"]), mean(v["first_mass_A2"])
        entry["massive_ratio"] = v.get("massive_ratio")
    point = {"step": step, "tokens": tokens, "loss": loss, "layers": {str(k): v for k, v in sorted(layers.items())},
             "model": {**sinks.get("model", {}), **_extremes(layers)}}
    if metrics:
        point["metric_sets"] = prof.metric_results()
    return point


def _extremes(layers: dict[int, dict]) -> dict:
    """The largest per-layer figure of each kind (the layer where outliers are worst)."""
    out = {}
    for kind in ("hidden", "attn_logits"):
        for key in ("top1", "ratio", "kurtosis"):
            values = [v[kind][key] for v in layers.values() if kind in v and v[kind][key] is not None]
            out[f"{kind}_{key}_max"] = max(values) if values else None
    return out


def loglog_fit(tokens: list[int], values: list) -> dict | None:
    """The least-squares line log(value) = a + b·log(tokens) through the second half of the (tokens > 0,
    value > 0) points of a tracked curve: {"slope", "intercept", "r2", "points"}; None with fewer than 3."""
    pts = [(t, v) for t, v in zip(tokens, values) if t > 0 and v]
    pts = pts[len(pts) // 2:]
    if len(pts) < 3:
        return None
    xs, ys = [math.log(t) for t, _ in pts], [math.log(v) for _, v in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    syy = sum((y - my) ** 2 for y in ys)
    r2 = slope * slope * sxx / syy if syy else 1.0
    return {"slope": slope, "intercept": my - slope * mx, "r2": r2, "points": len(pts)}


def tokens_to_reach(tokens: list[int], values: list, target: float) -> float | None:
    """Tokens where `loglog_fit`'s line reaches `target`: the budget extrapolation of a metric that has not got
    there yet. None with fewer than 3 points or a line that does not rise."""
    fit = loglog_fit(tokens, values)
    if fit is None or fit["slope"] <= 0:
        return None
    return math.exp((math.log(target) - fit["intercept"]) / fit["slope"])
