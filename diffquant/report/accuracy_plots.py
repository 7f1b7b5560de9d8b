"""The paper's Figure 8 on a real task: multiple-choice accuracy against the bit-width of one quantized
site, one line per granularity, 95% Wilson intervals as bands, chance marked, whole-model schemes (W8A8,
W4A16) beside the bit axis; and, beside it, the kurtosis per layer of the same model's attention logits and
hidden states (out/layer_kurtosis.json), so where the outliers are and what accuracy is lost share a page.
"""

from __future__ import annotations

import json
from pathlib import Path

from diffquant.report.plots import pyplot, save_figure
from diffquant.report.style import integer_ticks

LINESTYLES = ("-", "--", ":", "-.")
GRAN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")


def tasks_of(rows: list[dict]) -> list[str]:
    """Task prefixes with an accuracy and its Wilson interval (`{task}_acc`, `{task}_acc_ci95`)."""
    return sorted({k[:-4] for r in rows for k in r if k.endswith("_acc") and f"{k}_ci95" in r})


def plot_accuracy(rows: list[dict], out: Path) -> list[Path]:
    tasks = tasks_of(rows)
    if not tasks:
        return []
    kurtosis_path = Path(out) / "layer_kurtosis.json"
    kurtosis = json.loads(kurtosis_path.read_text()) if kurtosis_path.is_file() else None
    plt = pyplot()
    models = sorted({r["model"] for r in rows})
    width = len(tasks) + (1 if kurtosis else 0)
    fig, axes = plt.subplots(len(models), width, figsize=(5.2 * width, 3.9 * len(models)), squeeze=False,
                             layout="constrained")
    for i, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        for j, task in enumerate(tasks):
            _accuracy_panel(axes[i][j], mine, task, model)
        if kurtosis and model in kurtosis["models"]:
            _kurtosis_panel(axes[i][-1], kurtosis["models"][model], model, kurtosis["tokens"])
    fig.suptitle("Zero-shot multiple-choice accuracy (summed log-likelihood, lm-eval's acc) with only the named "
                 "site quantized (dynamic absmax); 16 = the model's own precision (cf. the paper's Fig. 8). "
                 "Bands and bars: 95% Wilson intervals; * : paired change from float with exact McNemar p < 0.05.",
                 fontsize=8.5)
    return save_figure(fig, out, "accuracy_vs_bits")


def _accuracy_panel(ax, rows: list[dict], task: str, model: str) -> None:
    acc = f"{task}_acc"
    act = [r for r in rows if r["kind"] == "act" and r.get("mitigate", "none") == "none" and acc in r]
    fp = next((r for r in act if r["scheme"] == "fp"), None)
    bits = sorted({r["bits"] for r in act}, reverse=True)
    lines = sorted({(r["site"], r["granularity"]) for r in act if r["scheme"] != "fp"})
    for n, (site, gran) in enumerate(lines):
        pts = {r["bits"]: r for r in act if r["site"] == site and r["granularity"] == gran and r["scheme"] != "fp"}
        if fp is not None:
            pts.setdefault(16, fp)
        xs = [k for k, b in enumerate(bits) if b in pts]
        got = [pts[bits[k]] for k in xs]
        c = GRAN_COLORS[n % len(GRAN_COLORS)]
        ax.plot(xs, [100 * r[acc] for r in got], marker="o", color=c, ls=LINESTYLES[n % 4],
                label=f"{site} per {gran}")
        ax.fill_between(xs, [100 * r[f"{acc}_ci95"][0] for r in got], [100 * r[f"{acc}_ci95"][1] for r in got],
                        color=c, alpha=0.15, lw=0)
        _stars(ax, xs, got, acc, c)
    schemes = [r for r in rows if r["kind"] in ("scheme", "wa") and r.get("mitigate", "none") == "none" and acc in r]
    x0 = len(bits) + 0.5
    for k, r in enumerate(schemes):
        y, (lo, hi) = 100 * r[acc], r[f"{acc}_ci95"]
        ax.errorbar([x0 + k], [y], yerr=[[y - 100 * lo], [100 * hi - y]], marker="s", color="k", capsize=3)
        _stars(ax, [x0 + k], [r], acc, "k")
    ticks = [f"{b}" + (" (fp)" if b == 16 else "") for b in bits] + [r["scheme"] for r in schemes]
    ax.set_xticks(list(range(len(bits))) + [x0 + k for k in range(len(schemes))], ticks,
                  rotation=30 if schemes else 0, fontsize=8)
    chance = next((r[f"{task}_chance"] for r in act if f"{task}_chance" in r), None)
    if chance is not None:
        ax.axhline(100 * chance, color="gray", ls=":", lw=1.2, label=f"chance ({100 * chance:.1f}%)")
    n = next((r.get(f"{task}_examples") for r in act), None)
    ax.set(xlabel="bits of the quantized site  |  whole-model schemes", ylabel="accuracy (%)",
           title=f"{model}:\n{task} ({n} examples)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5)


def _stars(ax, xs, rows, acc, c) -> None:
    for x, r in zip(xs, rows):
        p = r.get(f"{acc}_mcnemar_p")
        if p is not None and p < 0.05:
            ax.annotate("*", (x, 100 * r[f"{acc}_ci95"][1]), ha="center", va="bottom", color=c, fontsize=12)


def _kurtosis_panel(ax, series: dict, model: str, tokens: int) -> None:
    for kind, ls in (("attn_logits", "-"), ("hidden", "--")):
        rows = series.get(kind, [])
        if rows:
            ax.plot([r["layer"] for r in rows], [r["kurtosis"] for r in rows], marker="o", ms=3, ls=ls,
                    label={"attn_logits": "attention logits", "hidden": "hidden states"}[kind])
    ax.axhline(3.0, color="gray", lw=0.8, ls=":", label="Gaussian (3)")
    ax.set(title=f"{model}:\nkurtosis per layer (float, {tokens:,} tokens)", xlabel="layer",
           ylabel="Pearson kurtosis (log)", yscale="log")
    integer_ticks(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5)
