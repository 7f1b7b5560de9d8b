"""Matplotlib figures (Agg backend, PNG + SVG), drawn from saved numbers only."""

from __future__ import annotations

import struct
from pathlib import Path

from diffquant.report.style import color, integer_ticks


def pyplot():
    """matplotlib.pyplot on the Agg backend (files only, no display), imported on first use so that importing the
    report modules stays cheap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fit_texts(fig) -> None:
    """Wrap every axes title and axis label to its axes' size and the figure's title to the figure's width, so a
    long model or task label takes more lines instead of running into its neighbour (constrained layout then makes
    room)."""
    import textwrap

    renderer = fig.canvas.get_renderer()
    boxes = []
    for ax in fig.axes:
        box = ax.get_window_extent(renderer)
        boxes += [(ax.title, box.width, "width"), (ax.xaxis.label, box.width, "width"),
                  (ax.yaxis.label, box.height, "height")]
    if fig._suptitle is not None:
        boxes.append((fig._suptitle, fig.bbox.width * 0.98, "width"))
    engine = fig.get_layout_engine()
    if engine is not None:  # the axes where the layout puts them (a full draw would also render every line)
        engine.execute(fig)
    for ax in fig.axes:  # a log axis labels some minor ticks too (4×10⁻³, 6×10⁻³): where they crowd, major ones only
        for axis in (ax.xaxis, ax.yaxis):
            labels = [t.label1.get_window_extent(renderer) for t in axis._update_ticks()
                      if t.label1.get_visible() and t.label1.get_text()]
            if any(_overlap(a, b) for i, a in enumerate(labels) for b in labels[i + 1:]):
                from matplotlib.ticker import NullFormatter

                axis.set_minor_formatter(NullFormatter())
    for text, room, side in boxes:
        words = " ".join(text.get_text().split())
        width = len(words)
        while width > 10 and getattr(text.get_window_extent(renderer), side) > room:
            width = int(width * 0.9)
            text.set_text(textwrap.fill(words, width))


def drawn_texts(fig) -> list:
    """The texts a drawn figure shows: its titles, every axes' title, axis labels, the tick labels inside the view,
    legend entries and annotations."""
    fig.canvas.draw()
    texts = [t for t in (fig._suptitle, *fig.texts) if t is not None]
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
        for axis in (ax.xaxis, ax.yaxis):
            texts += [t.label1 for t in axis._update_ticks() if t.label1.get_visible()]
        if ax.get_legend() is not None:
            texts += ax.get_legend().get_texts()
    return list({id(t): t for t in texts if t.get_visible() and t.get_text().strip()}.values())


def overlapping_texts(fig) -> list[tuple[str, str]]:
    """Pairs of texts a figure shows whose boxes intersect by more than a pixel each way (a test's check that no
    label prints over another)."""
    renderer = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in drawn_texts(fig)]
    return [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:] if _overlap(ba, bb)]


def _overlap(a, b) -> bool:
    """Two boxes intersect by more than a pixel each way."""
    return min(a.x1, b.x1) - max(a.x0, b.x0) > 1 and min(a.y1, b.y1) - max(a.y0, b.y0) > 1


def save_figure(fig, out: Path, stem: str) -> list[Path]:
    """Write `fig` as out/stem.png and out/stem.svg after the layout pass (fit_texts), atomically and reproducibly
    (the same numbers give the same files), then close it; returns the two paths."""
    fit_texts(fig)
    # The layout (constrained, with the wrapped texts) and the tight box are computed once, here: savefig's
    # bbox_inches="tight" would draw each file twice, and the layout engine solve again on every draw.
    engine = fig.get_layout_engine()
    if engine is not None:
        engine.execute(fig)
        fig.set_layout_engine("none")
    bbox = fig.get_tightbbox(fig.canvas.get_renderer()).padded(pyplot().rcParams["savefig.pad_inches"])
    paths = []
    for ext in ("png", "svg"):
        path = out / f"{stem}.{ext}"
        tmp = out / f".{stem}.tmp.{ext}"
        # no date in the SVG and its element ids salted by the stem: redrawing the same numbers writes the same file
        plt = pyplot()
        with plt.rc_context({"svg.hashsalt": stem}):
            fig.savefig(tmp, dpi=130, bbox_inches=bbox, metadata={"Date": None} if ext == "svg" else None)
        tmp.replace(path)
        paths.append(path)
    pyplot().close(fig)
    return paths


def plot_layer_series(series_by_model: dict[str, dict[str, list[dict]]], out: Path) -> list[Path]:
    """Kurtosis vs layer, and top-1 and median |x| vs layer (log scale), one line per model."""
    plt = pyplot()
    kinds = sorted({k for s in series_by_model.values() for k in s})
    written = []
    if not kinds:
        return written
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.6), squeeze=False, layout="constrained")
    for ax, kind in zip(axes[0], kinds):
        for label, series in series_by_model.items():
            rows = series.get(kind, [])
            ax.plot([r["layer"] for r in rows], [r["kurtosis"] for r in rows], marker="o", label=label,
                    color=color(label))
        ax.axhline(3.0, color="gray", lw=0.8, ls=":", label="Gaussian (3)")
        ax.set(title=f"{kind}: kurtosis", xlabel="layer", ylabel="Pearson kurtosis (log)", yscale="log")
        integer_ticks(ax)
        ax.legend(fontsize=8)
    written += save_figure(fig, out, "kurtosis_vs_layer")
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.6), squeeze=False, layout="constrained")
    for ax, kind in zip(axes[0], kinds):
        for label, series in series_by_model.items():
            rows = series.get(kind, [])
            c = color(label)
            ax.plot([r["layer"] for r in rows], [r["absmax"] for r in rows], marker="o", color=c, label=f"{label} top-1")
            ax.plot([r["layer"] for r in rows], [r["median"] for r in rows], marker="x", ls="--", color=c,
                    label=f"{label} median")
        ax.set(title=f"{kind}: |x| top-1 and median", xlabel="layer", ylabel="|x| (log)", yscale="log")
        integer_ticks(ax)
        ax.legend(fontsize=8)
    written += save_figure(fig, out, "absmax_vs_layer")
    return written


def plot_histograms(models: list[dict], out: Path) -> list[Path]:
    """Density of |x| (log-log) for attention logits and hidden states, pooled over layers, per model."""
    plt = pyplot()
    kinds = [k for k in ("attn_logits", "hidden") if any(k in m.get("histograms", {}) for m in models)]
    if not kinds:
        return []
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 3.6), squeeze=False, layout="constrained")
    for ax, kind in zip(axes[0], kinds):
        for m in models:
            h = m.get("histograms", {}).get(kind)
            if not h:
                continue
            bins = sorted((int(i), c) for i, c in h["bins"].items() if int(i) > 0 and c >= 10)  # drop sparse tails
            if not bins:
                continue
            lo, hi = _bin_edges(h, [i for i, _ in bins])
            total = sum(h["bins"].values())
            ys = [c / total / (b - a) for (_, c), a, b in zip(bins, lo, hi)]
            ax.plot([(a * b) ** 0.5 for a, b in zip(lo, hi)], ys, label=m["label"], lw=1, color=color(m["label"]))
        ax.set(xscale="log", yscale="log", xlabel="|x|", ylabel="density", title=f"{kind}: distribution of |x|")
        ax.legend(fontsize=8)
    return save_figure(fig, out, "histograms")


def _bin_edges(h: dict, idx: list[int]) -> tuple[list[float], list[float]]:
    """Edges of histogram bins as profile reports store them: float32 magnitude bins rounded to 16 bits
    (stats/histogram.py), the truncated ones of earlier reports, or the log-spaced bins ({"lo", "ratio"}) of
    reports written before those."""
    import torch

    from diffquant.stats.histogram import FORMAT, bin_edges

    if h.get("format") == FORMAT:
        lo, hi = bin_edges(torch.tensor(idx, dtype=torch.int64))
        return lo.tolist(), hi.tolist()
    if h.get("format") == "float32-high16":  # bin i: floats whose bit pattern starts with the 16 bits i
        edge = lambda i: struct.unpack("<f", struct.pack("<I", i << 16))[0]  # noqa: E731
        return [edge(i) for i in idx], [edge(i + 1) for i in idx]
    return [h["lo"] * h["ratio"] ** (i - 1) for i in idx], [h["lo"] * h["ratio"] ** i for i in idx]


def plot_sinks(models: list[dict], out: Path, epsilon: float = 0.3) -> list[Path]:
    """Per layer: the fraction of sink heads, the mean first-token share, and the massive-activation ratio
    max‖h_t‖ / median‖h_t‖; one colour per model. DIFF counts differential heads by their share of
    A1 − λ·A2 on token 0; its A1 and A2 maps' first-key masses are drawn dashed and dotted."""
    with_sinks = [m for m in models if m.get("sinks", {}).get("layers")]
    if not with_sinks:
        return []
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6), layout="constrained")
    nan = float("nan")
    mean = lambda xs: sum(xs) / len(xs) if xs else nan  # noqa: E731
    for m in with_sinks:
        layers = sorted(m["sinks"]["layers"].items(), key=lambda kv: int(kv[0]))
        xs = [int(k) for k, _ in layers]
        c = color(m["label"])
        if all("sink" in v for _, v in layers):
            counted = [v["sink"]["heads"] - v["sink"].get("undefined", 0) for _, v in layers]
            axes[0].plot(xs, [v["sink"]["sinks"] / n if n else nan for (_, v), n in zip(layers, counted)],
                         marker="o", color=c, label=m["label"])
            axes[1].plot(xs, [mean([x for x in v["share"] if x is not None]) for _, v in layers], marker="o",
                         color=c, label=m["label"])
        for key, ls in (("A1", "--"), ("A2", ":")):
            if all(f"first_mass_{key}" in v for _, v in layers):
                axes[1].plot(xs, [mean(v[f"first_mass_{key}"]) for _, v in layers], ls=ls, color=c,
                             label=f"{m['label']} {key} map mass")
        ratios = [v.get("massive_ratio") for _, v in layers]
        axes[2].plot(xs, ratios, marker="o", color=c, label=m["label"])
    axes[0].set(title=f"sink heads (first-token share > {epsilon})", xlabel="layer", ylabel="fraction of heads",
                ylim=(-0.05, 1.05))
    axes[1].set(title="first-token share (DIFF: of A1 − λ·A2)", xlabel="layer", ylabel="mean share (queries ≥ 1)")
    axes[2].set(title="massive activations: max‖h‖ / median‖h‖", xlabel="layer", ylabel="ratio (log)", yscale="log")
    for ax in axes:
        integer_ticks(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, out, "sinks_vs_layer")
