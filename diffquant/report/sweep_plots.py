"""Sweep figures: metric vs bit-width (the paper's Figure 8 layout), W × A heatmaps, layer sensitivity."""

from __future__ import annotations

from pathlib import Path

from diffquant.report.plots import pyplot, save_figure
from diffquant.report.style import color, integer_ticks

MIN_SPAN = {"next_token_acc": 0.05, "needle_choice": 0.2, "needle_exact": 0.2}  # accuracy axes: never zoom into noise

METRIC_LABEL = {"ppl": "perplexity", "loss": "loss (nats)", "next_token_acc": "next-token accuracy",
                "needle_choice": "needle retrieval accuracy (choice)", "needle_exact": "needle retrieval (exact)"}


def _metrics(rows: list[dict]) -> list[str]:
    keys = [k for k in ("ppl", "next_token_acc", "needle_choice") if any(k in r for r in rows)]
    keys += sorted({k for r in rows for k in r if k.endswith("_acc") and k != "next_token_acc"})  # the accuracy
    return keys  # figure's metric (lm-eval's acc: the summed log-likelihood's choice)


def plot_bits(rows: list[dict], out: Path) -> list[Path]:
    act = [r for r in rows if r["kind"] == "act"]
    metrics = _metrics(act)
    if not act or not metrics:
        return []
    plt = pyplot()
    panels = sorted({(r["site"], r["granularity"]) for r in act})
    fig, axes = plt.subplots(len(metrics), len(panels), figsize=(4.2 * len(panels), 3.4 * len(metrics)),
                             squeeze=False, layout="constrained")
    bits = sorted({r["bits"] for r in act}, reverse=True)
    fp = {r["model"]: r for r in act if r["bits"] == 16 and r.get("mitigate", "none") == "none"}
    for i, metric in enumerate(metrics):
        for j, (site, gran) in enumerate(panels):
            ax = axes[i][j]
            fixes = sorted({r.get("mitigate", "none") for r in act}, key=lambda f: (f != "none", f))
            for label in sorted({r["model"] for r in act}):
                for n, fix in enumerate(fixes):
                    pts = {r["bits"]: r for r in act if r["model"] == label and r["site"] == site
                           and r["granularity"] == gran and r.get("mitigate", "none") == fix}
                    if label in fp:
                        pts.setdefault(16, fp[label])
                    xs = [k for k, b in enumerate(bits) if b in pts and pts[b].get(metric) is not None]
                    ys = [pts[bits[k]][metric] for k in xs]
                    ax.errorbar(xs, ys, yerr=_errors([pts[bits[k]] for k in xs], metric), marker="o", capsize=3,
                                label=label if fix == "none" else f"{label} + {fix}", color=color(label),
                                ls=("-", "--", ":", "-.")[n % 4])
            ax.set_xticks(range(len(bits)), [f"{b}" + (" (fp)" if b == 16 else "") for b in bits])
            n = next((r.get(metric.replace("_acc", "_examples")) if metric.endswith("_acc") else r.get("tokens")
                      for r in act if metric in r), None)
            unit = "examples" if metric.endswith("_acc") else "tokens"
            ax.set(xlabel="bits", ylabel=METRIC_LABEL.get(metric, f"{metric.removesuffix('_acc')}: accuracy"),
                   title=f"{site}, per {gran}" + (f" ({n:,} {unit})" if n else ""))
            values = [r.get(metric) for r in act if r.get(metric)]
            if metric == "ppl" and values and max(values) / min(values) > 3:
                ax.set_yscale("log")
            _min_span(ax, MIN_SPAN.get(metric) or (0.05 if metric.endswith("_acc") else None))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("Only this site quantized; 16 = the model's own precision (cf. paper Fig. 8). Bars: 95% intervals "
                 "(perplexity: over sequences; accuracy: Wilson), each panel's sample in its title.", fontsize=9)
    return save_figure(fig, out, "metric_vs_bits")


def _errors(rows: list[dict], metric: str):
    """[[below], [above]] of each point's 95% interval: its own where the row holds one (perplexity: exp(loss ± t SE);
    a multiple-choice accuracy: Wilson), else the t-interval of its standard error."""
    from diffquant.stats.intervals import half95
    from diffquant.report.tables import sample_size

    lo, hi = [], []
    for r in rows:
        v = r[metric]
        if r.get(f"{metric}_ci95"):  # perplexity's exp of the loss interval, an accuracy's Wilson interval
            lo.append(max(0.0, v - r[f"{metric}_ci95"][0]))  # a Wilson bound at 0 or 1 can round past the value
            hi.append(max(0.0, r[f"{metric}_ci95"][1] - v))
        else:
            half = half95(r.get(f"{metric}_se"), sample_size(r, metric)) or 0.0
            lo.append(half)
            hi.append(half)
    return [lo, hi]


def _min_span(ax, span: float | None) -> None:
    if span is None:
        return
    lo, hi = ax.get_ylim()
    if hi - lo < span:
        mid = (lo + hi) / 2
        ax.set_ylim(mid - span / 2, mid + span / 2)


def plot_wa(rows: list[dict], out: Path) -> list[Path]:
    wa = [r for r in rows if r["kind"] == "wa" and "ppl" in r and r.get("mitigate", "none") == "none"]
    if not wa:
        return []
    plt = pyplot()
    labels = sorted({r["model"] for r in wa})
    ws = sorted({r["wbits"] for r in wa}, reverse=True)
    acts = sorted({r["bits"] for r in wa}, reverse=True)
    fig, axes = plt.subplots(1, len(labels), figsize=(4.2 * len(labels), 3.6), squeeze=False, layout="constrained")
    for ax, label in zip(axes[0], labels):
        grid = [[next((r["ppl"] for r in wa if r["model"] == label and r["wbits"] == w and r["bits"] == a), None)
                 for a in acts] for w in ws]
        import numpy as np

        arr = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)
        im = ax.imshow(np.log10(arr), cmap="viridis")
        for y in range(len(ws)):
            for x in range(len(acts)):
                ax.text(x, y, f"{arr[y, x]:.3g}", ha="center", va="center", color="w", fontsize=8)
        ax.set_xticks(range(len(acts)), [f"A{a}" for a in acts])
        ax.set_yticks(range(len(ws)), [f"W{w}" for w in ws])
        ax.set_title(f"{label}: perplexity", color=color(label))
        fig.colorbar(im, ax=ax, label="log10 perplexity")
    return save_figure(fig, out, "wa_grid")


def plot_sensitivity(rows: list[dict], out: Path) -> list[Path]:
    layer = [r for r in rows if r["kind"] == "layer" and "ppl" in r and r.get("mitigate", "none") == "none"]
    fp = {r["model"]: r["ppl"] for r in rows if r["scheme"] == "fp" and "ppl" in r}
    if not layer:
        return []
    plt = pyplot()
    labels = sorted({r["model"] for r in layer})
    fig, axes = plt.subplots(1, len(labels), figsize=(4.5 * len(labels), 3.4), squeeze=False, layout="constrained")
    for ax, label in zip(axes[0], labels):
        rs = sorted((r for r in layer if r["model"] == label), key=lambda r: r["layer"])
        base = fp.get(label)
        ys = [r["ppl"] - base if base else r["ppl"] for r in rs]
        ax.bar([r["layer"] for r in rs], ys, color=color(label),
               yerr=[[r["ppl"] - r["ppl_ci95"][0] for r in rs], [r["ppl_ci95"][1] - r["ppl"] for r in rs]]
               if all(r.get("ppl_ci95") for r in rs) else None, capsize=2)
        integer_ticks(ax)
        bits = rs[0]["bits"] if rs else ""
        ax.set(xlabel="layer quantized alone", ylabel="perplexity increase" if base else "perplexity",
               title=f"{label}: {rs[0]['site'] if rs else ''} int{bits}")
    return save_figure(fig, out, "layer_sensitivity")


def plot_sweep(rows: list[dict], out: Path) -> list[Path]:
    from diffquant.report.accuracy_plots import plot_accuracy

    out = Path(out)
    return plot_bits(rows, out) + plot_wa(rows, out) + plot_sensitivity(rows, out) + plot_accuracy(rows, out)
