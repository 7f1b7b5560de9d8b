"""Emergence figures from emergence.json: metrics against tokens seen (log x, one line per model) and
per-layer heat maps (layer × snapshot)."""

from __future__ import annotations

from pathlib import Path

from diffquant.report.plots import pyplot, save_figure
from diffquant.report.style import color, integer_ticks

PANELS = (  # (key in a snapshot's "model" figures, or "loss"; title; log y)
    ("hidden_ratio_max", "hidden states: top-1 / median (worst layer)", True),
    ("attn_logits_top1_max", "attention logits: top-1 (worst layer)", True),
    ("hidden_kurtosis_max", "hidden states: kurtosis (worst layer)", True),
    ("sink_rate", "sink rate (first-token share > 0.3; DIFF: differential heads)", False),
    ("massive_ratio_max", "max‖h‖ / median‖h‖ (worst layer)", True),
    ("loss", "held-out loss of the tracked batch", False),
)
HEATMAPS = (("hidden", "ratio", "hidden top-1 / median"), (None, "first_share", "first-token share (DIFF: of A1 − λ·A2)"))


OLD_SINK_TITLE = "sink rate (first-token mass > 0.3)\nDIFF: A1/A2 maps pooled, old definition"


def _title(key: str, title: str, models: dict) -> str:
    """The panel's title; the sink panel says so when a DIFF curve was tracked before DIFF's sinks were counted
    per differential head (its snapshots have the A1/A2 maps' rates but no λ: the rate pooled the two maps)."""
    old = any("sink_rate_A1" in p["model"] and "lambda" not in p["model"] for pts in models.values() for p in pts)
    return OLD_SINK_TITLE if key == "sink_rate" and old else title


def _old_share(pts: list[dict], key: str, title: str) -> tuple[str, str]:
    """Snapshots tracked before shares were recorded hold each layer's mean first-token mass over every softmax
    map (DIFF: A1 and A2 pooled): draw that, and say so."""
    has = lambda k: any(k in v for p in pts for v in p["layers"].values())  # noqa: E731
    if key == "first_share" and not has("first_share") and has("first_mass"):
        return "first_mass", "first-token mass\n(DIFF: A1/A2 pooled, old definition)"
    return key, title


def _value(point: dict, key: str):
    return point["loss"] if key == "loss" else point["model"].get(key)


def plot_emergence(doc: dict, out: Path) -> list[Path]:
    models = {label: pts for label, pts in doc["models"].items() if pts}
    if not models:
        return []
    plt = pyplot()
    scale = "; ".join(f"{label} {s['parameters'] / 1e6:.2f}M parameters, {s['tokens']:,} tokens"
                      for label, s in doc.get("scale", {}).items() if s.get("parameters"))
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), layout="constrained")
    for ax, (key, title, log) in zip(axes.flat, PANELS):
        for label, pts in models.items():
            xs = [max(p["tokens"], 1) for p in pts]  # the initialisation (0 tokens) sits at x = 1 on the log axis
            ys = [_value(p, key) for p in pts]
            ax.plot(xs, ys, marker="o", ms=3, color=color(label), label=label)
        ax.set(title=_title(key, title, models), xlabel="tokens seen (log; 1 = initialisation)", xscale="log")
        if log:
            ax.set_yscale("log")
        if key == "sink_rate":
            ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Outlier emergence during training ({scale}; {doc.get('track_sequences')} held-out sequences)",
                 fontsize=9)
    written = save_figure(fig, out, "emergence")
    fig, axes = plt.subplots(len(HEATMAPS), len(models), figsize=(4.2 * len(models), 3.2 * len(HEATMAPS)),
                             squeeze=False, layout="constrained")
    for j, (label, pts) in enumerate(models.items()):
        layers = sorted({int(k) for p in pts for k in p["layers"]})
        for i, (kind, key, title) in enumerate(HEATMAPS):
            key, title = _old_share(pts, key, title)
            grid = [[_layer_value(p, layer, kind, key) for p in pts] for layer in layers]
            ax = axes[i][j]
            im = ax.imshow(grid, aspect="auto", origin="lower", cmap="magma")
            ticks = list(range(0, len(pts), max(1, len(pts) // 6)))
            ax.set_xticks(ticks, [f"{pts[t]['tokens']:.0e}" for t in ticks], fontsize=7)
            ax.set_yticks(range(len(layers)), [str(x) for x in layers])
            ax.set(title=f"{label}: {title}", xlabel="tokens seen", ylabel="layer")
            integer_ticks(ax, "y")
            fig.colorbar(im, ax=ax)
    return written + save_figure(fig, out, "emergence_layers")


def _layer_value(point: dict, layer: int, kind: str | None, key: str):
    entry = point["layers"].get(str(layer), {})
    value = (entry.get(kind) or {}).get(key) if kind else entry.get(key)
    return float("nan") if value is None else value
