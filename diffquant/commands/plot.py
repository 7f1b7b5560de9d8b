"""`diffquant plot DIR`: redraw every figure from saved results, without running a model."""

from __future__ import annotations

import json
from pathlib import Path

from diffquant.errors import DiffquantError


def redraw(folder: Path) -> list[Path]:
    written = []
    if (folder / "stats.json").is_file():
        from diffquant.report.plots import plot_histograms, plot_layer_series, plot_sinks

        models = json.loads((folder / "stats.json").read_text())["models"]
        written += plot_layer_series({m["label"]: m["layers"] for m in models}, folder)
        written += plot_histograms(models, folder)
        written += plot_sinks(models, folder)
    if (folder / "emergence.json").is_file():
        from diffquant.report.emergence_plots import plot_emergence

        written += plot_emergence(json.loads((folder / "emergence.json").read_text()), folder)
    if (folder / "results.json").is_file():
        from diffquant.report.sweep_plots import plot_sweep

        written += plot_sweep(json.loads((folder / "results.json").read_text())["rows"], folder)
    return written


def run_cli(args) -> None:
    folder = Path(args.folder)
    if not folder.is_dir():
        raise DiffquantError(f"{folder} is not a folder")
    written = []
    for sub in [folder, *sorted(p for p in folder.iterdir() if p.is_dir())]:
        written += redraw(sub)
    if not written:
        raise DiffquantError(f"{folder} holds no stats.json, emergence.json or results.json to plot")
    print("\n".join(str(p) for p in written))
