"""The figures draw the numbers they were given: each figure read back from its matplotlib artists (titles, axis
labels, the plotted x and y data, the interval bars) against the rows or series it was drawn from."""

import numpy as np
import pytest

from diffquant.report.plots import plot_layer_series, plot_sinks
from diffquant.report.sweep_plots import plot_bits


def _lines(ax) -> dict:
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}


def test_layer_series_figures_draw_each_models_series(tmp_path, drawn):
    series = {"base": {"hidden": [{"layer": 0, "kurtosis": 3.5, "absmax": 12.0, "median": 0.7},
                                  {"layer": 1, "kurtosis": 40.0, "absmax": 300.0, "median": 0.9}],
                       "attn_logits": [{"layer": 0, "kurtosis": 5.0, "absmax": 20.0, "median": 1.5},
                                       {"layer": 1, "kurtosis": 8.0, "absmax": 25.0, "median": 1.25}]},
              "diff": {"hidden": [{"layer": 0, "kurtosis": 3.1, "absmax": 6.0, "median": 0.6},
                                  {"layer": 1, "kurtosis": 4.0, "absmax": 9.0, "median": 0.8}]}}
    written = plot_layer_series(series, tmp_path)
    assert {p.name for p in written} == {f"{s}.{e}" for s in ("kurtosis_vs_layer", "absmax_vs_layer")
                                         for e in ("png", "svg")}
    kurt, absmax = drawn["kurtosis_vs_layer"], drawn["absmax_vs_layer"]
    for ax, kind in zip(kurt.axes, ("attn_logits", "hidden")):
        assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel(), ax.get_yscale()) == \
            (f"{kind}: kurtosis", "layer", "Pearson kurtosis (log)", "log")
        lines = _lines(ax)
        for model, kinds in series.items():
            rows = kinds.get(kind, [])
            assert lines[model] == ([r["layer"] for r in rows], [r["kurtosis"] for r in rows])
        assert lines["Gaussian (3)"][1] == [3.0, 3.0]
    for ax, kind in zip(absmax.axes, ("attn_logits", "hidden")):
        assert ax.get_title() == f"{kind}: |x| top-1 and median" and ax.get_ylabel() == "|x| (log)"
        lines = _lines(ax)
        for model, kinds in series.items():
            rows = kinds.get(kind, [])
            assert lines[f"{model} top-1"] == ([r["layer"] for r in rows], [r["absmax"] for r in rows])
            assert lines[f"{model} median"] == ([r["layer"] for r in rows], [r["median"] for r in rows])


def test_sinks_figure_draws_rates_shares_and_ratios(tmp_path, drawn):
    """Sink fraction = sinks / (heads − undefined), the mean of the defined shares, the massive ratio; DIFF's A1 and
    A2 masses as their own lines; all computed here from the summaries drawn."""
    softmax = {"0": {"sink": {"heads": 4, "sinks": 1}, "share": [0.5, 0.1, 0.2, 0.0], "massive_ratio": 3.0},
               "1": {"sink": {"heads": 4, "sinks": 3}, "share": [0.6, 0.7, 0.9, 0.1], "massive_ratio": 30.0}}
    diff = {"0": {"sink": {"heads": 2, "sinks": 0, "undefined": 0}, "share": [0.1, 0.2], "massive_ratio": 2.0,
                  "first_mass_A1": [0.3, 0.5], "first_mass_A2": [0.2, 0.4]},
            "1": {"sink": {"heads": 2, "sinks": 1, "undefined": 1}, "share": [0.8, None], "massive_ratio": 5.0,
                  "first_mass_A1": [0.6, 0.2], "first_mass_A2": [0.1, 0.1]}}
    plot_sinks([{"label": "base", "sinks": {"layers": softmax}}, {"label": "DIFF", "sinks": {"layers": diff}}],
               tmp_path)
    rate, share, massive = drawn["sinks_vs_layer"].axes
    assert rate.get_title() == "sink heads (first-token share > 0.3)" and rate.get_ylabel() == "fraction of heads"
    assert massive.get_yscale() == "log" and massive.get_ylabel() == "ratio (log)"
    assert _lines(rate)["base"] == ([0, 1], [0.25, 0.75]) and _lines(rate)["DIFF"] == ([0, 1], [0.0, 1.0])
    assert _lines(share)["base"][1] == pytest.approx([0.2, 0.575])
    assert _lines(share)["DIFF"][1] == pytest.approx([0.15, 0.8])
    assert _lines(share)["DIFF A1 map mass"][1] == pytest.approx([0.4, 0.4])
    assert _lines(share)["DIFF A2 map mass"][1] == pytest.approx([0.3, 0.1])
    assert _lines(massive)["base"] == ([0, 1], [3.0, 30.0]) and _lines(massive)["DIFF"] == ([0, 1], [2.0, 5.0])


def test_metric_vs_bits_draws_each_point_and_its_interval(tmp_path, drawn):
    """One panel per (site, granularity), a line per model over the bit widths (16 = the float row), each point's
    bar spanning the perplexity interval of its row."""
    def row(model, bits, gran, ppl, lo, hi, scheme="q"):
        return {"model": model, "kind": "act", "site": "attn_logits", "granularity": gran, "bits": bits,
                "scheme": "fp" if bits == 16 else scheme, "mitigate": "none", "ppl": ppl, "ppl_ci95": [lo, hi]}

    rows = [row("T", 16, "tensor", 20.0, 19.0, 21.5), row("T", 8, "tensor", 20.5, 19.4, 22.0),
            row("T", 4, "tensor", 35.0, 31.0, 40.0), row("D", 16, "tensor", 18.0, 17.0, 19.0),
            row("D", 8, "tensor", 18.2, 17.1, 19.4), row("D", 4, "tensor", 19.0, 17.5, 21.0),
            row("T", 4, "head", 30.0, 27.0, 33.0), row("D", 4, "head", 18.5, 17.4, 19.9)]
    plot_bits(rows, tmp_path)
    fig = drawn["metric_vs_bits"]
    head, tensor = fig.axes  # panels sorted by (site, granularity)
    for ax, gran in ((head, "head"), (tensor, "tensor")):
        assert ax.get_title() == f"attn_logits, per {gran}" and ax.get_xlabel() == "bits"
        assert [t.get_text() for t in ax.get_xticklabels()] == ["16 (fp)", "8", "4"]
        for container in ax.containers:
            model = container.get_label()
            mine = {r["bits"]: r for r in rows if r["model"] == model and (r["granularity"] == gran or r["bits"] == 16)}
            want = [(k, mine[b]) for k, b in enumerate((16, 8, 4)) if b in mine]
            line, _, (bars,) = container.lines
            assert list(line.get_xdata()) == [k for k, _ in want]
            assert list(line.get_ydata()) == [r["ppl"] for _, r in want]
            ends = [end for seg in bars.get_segments() for end in (seg[0][1], seg[1][1])]
            assert ends == pytest.approx([end for _, r in want for end in r["ppl_ci95"]])
        assert sorted(c.get_label() for c in ax.containers) == ["D", "T"]


def _emergence_check(doc, drawn):
    """The emergence figures against the document drawn (test_emergence's tracked run: saving them takes seconds, so
    no second run here): a panel per metric with one line per model over tokens
    seen (initialisation at x = 1), and per model the layer × snapshot heat maps."""
    from diffquant.report.emergence_plots import HEATMAPS, PANELS

    models = {label: pts for label, pts in doc["models"].items() if pts}
    for ax, (key, _, log) in zip(drawn["emergence"].axes, PANELS):
        assert ax.get_xscale() == "log" and ax.get_yscale() == ("log" if log else "linear")
        lines = _lines(ax)
        for label, pts in models.items():
            want = [p["loss"] if key == "loss" else p["model"].get(key) for p in pts]
            assert lines[label][0] == [max(p["tokens"], 1) for p in pts]
            assert lines[label][1] == pytest.approx(want, nan_ok=True), (key, label)
    maps = [ax for ax in drawn["emergence_layers"].axes if ax.get_images()]
    assert len(maps) == len(HEATMAPS) * len(models)
    for j, (label, pts) in enumerate(models.items()):
        layers = sorted({int(k) for p in pts for k in p["layers"]})
        for i, (kind, key, _) in enumerate(HEATMAPS):
            ax = maps[i * len(models) + j]
            assert ax.get_title().startswith(f"{label}: ")
            entry = lambda p, layer: p["layers"].get(str(layer), {})  # noqa: E731
            want = [[(entry(p, layer).get(kind) or {}).get(key) if kind else entry(p, layer).get(key) for p in pts]
                    for layer in layers]
            got = np.ma.filled(ax.get_images()[0].get_array().astype(float), np.nan)
            np.testing.assert_allclose(got, [[np.nan if v is None else v for v in row] for row in want])



def test_wa_grid_and_layer_sensitivity_draw_the_rows(tmp_path, drawn):
    """W×A grid: log10 perplexity per (weight bits, activation bits), each cell's text the value; per-layer
    sensitivity: a bar per layer of the perplexity increase over the float row, its error bar the row's interval."""
    from matplotlib.container import ErrorbarContainer

    from diffquant.report.sweep_plots import plot_sensitivity, plot_wa

    wa = [{"model": "T", "kind": "wa", "scheme": "w", "wbits": w, "bits": a, "ppl": p}
          for (w, a), p in {(8, 8): 20.5, (8, 4): 31.0, (4, 8): 24.0, (4, 4): 52.0}.items()]
    plot_wa(wa, tmp_path)
    (ax,) = [a for a in drawn["wa_grid"].axes if a.get_images()]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["A8", "A4"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["W8", "W4"]
    np.testing.assert_allclose(ax.get_images()[0].get_array(), np.log10([[20.5, 31.0], [24.0, 52.0]]))
    assert sorted(t.get_text() for t in ax.texts) == sorted(f"{p:.3g}" for p in (20.5, 31.0, 24.0, 52.0))
    layer = [{"model": "T", "kind": "layer", "scheme": "q", "site": "hidden", "bits": 4, "layer": i, "ppl": p,
              "ppl_ci95": [p - 0.5, p + 1.0]} for i, p in enumerate([22.0, 20.5, 21.0])]
    plot_sensitivity(layer + [{"model": "T", "kind": "act", "scheme": "fp", "ppl": 20.0}], tmp_path)
    (ax,) = drawn["layer_sensitivity"].axes
    assert ax.get_title() == "T: hidden int4" and ax.get_ylabel() == "perplexity increase"
    assert [b.get_x() + b.get_width() / 2 for b in ax.patches] == pytest.approx([0, 1, 2])
    assert [b.get_height() for b in ax.patches] == pytest.approx([2.0, 0.5, 1.0])
    (errorbar,) = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    (bars,) = errorbar.lines[2]  # the error bars: the row's interval, moved down by the float perplexity
    ends = [end for seg in bars.get_segments() for end in (seg[0][1], seg[1][1])]
    assert ends == pytest.approx([end for r in layer for end in (r["ppl_ci95"][0] - 20.0, r["ppl_ci95"][1] - 20.0)])
