"""Every figure the command line writes lays out whatever its labels (issue 51): drawn with the longest model label
in the zoo and long task names, no two of its texts (titles, axis labels, tick labels, legends, annotations)
overlap. The figures come from the committed result files and a real micro profile; the check runs on each figure
as it is saved (after the layout pass `save_figure` applies)."""

import json
from pathlib import Path

import pytest

from diffquant.report import plots

ROOT = Path(__file__).resolve().parent.parent
LONG = "SmolLM2-135M-Instruct (Q4_1 → fp32)"  # the zoo's display name, the longest model label there is


@pytest.fixture
def checked(monkeypatch):
    """{figure stem: overlapping text pairs} of every figure saved while the fixture is active."""
    seen = {}
    real_fit, real_save = plots.fit_texts, plots.save_figure

    def spy_save(fig, out, stem):
        seen[stem] = None
        spy_save.stem = stem
        return real_save(fig, out, stem)

    def spy_fit(fig):
        real_fit(fig)
        seen[spy_save.stem] = plots.overlapping_texts(fig)

    monkeypatch.setattr(plots, "fit_texts", spy_fit)
    monkeypatch.setattr(plots, "save_figure", spy_save)
    return seen


def _relabel(rows, label=LONG):
    return [{**r, "model": label if i % 2 == 0 else label.replace("SmolLM2", "DIFF-SmolLM2")}
            for i, r in enumerate(rows)]


@pytest.mark.slow
def test_sweep_figures_with_long_labels(tmp_path, checked, monkeypatch):
    from diffquant.report import accuracy_plots, sweep_plots

    monkeypatch.setattr(accuracy_plots, "save_figure", plots.save_figure)
    monkeypatch.setattr(sweep_plots, "save_figure", plots.save_figure)
    rows = [{**r, "model": LONG} for r in json.loads((ROOT / "docs/fig8_real/sweep/results.json").read_text())["rows"]]
    kurtosis = json.loads((ROOT / "docs/fig8_real/sweep/layer_kurtosis.json").read_text())
    kurtosis["models"] = {LONG: next(iter(kurtosis["models"].values()))}
    (tmp_path / "layer_kurtosis.json").write_text(json.dumps(kurtosis))
    accuracy_plots.plot_accuracy(rows, tmp_path)
    sweep_plots.plot_bits(rows, tmp_path)
    demo = json.loads((ROOT / "docs/demo/sweep/results.json").read_text())["rows"]
    sweep_plots.plot_wa(_relabel(demo), tmp_path)
    layer = [{**r, "kind": "layer", "layer": i % 4, "model": LONG} for i, r in enumerate(demo) if r["kind"] == "act"]
    sweep_plots.plot_sensitivity(layer, tmp_path)
    assert set(checked) >= {"accuracy_vs_bits", "metric_vs_bits", "wa_grid"}
    bad = {stem: pairs for stem, pairs in checked.items() if pairs}
    assert not bad, "\n".join(f"{stem}: {a!r} over {b!r}" for stem, pairs in bad.items() for a, b in pairs)


@pytest.mark.slow
def test_profile_and_emergence_figures_with_long_labels(tmp_path, checked, monkeypatch):
    import torch

    from diffquant.models.presets import PRESETS, build
    from diffquant.profiler import profile_model
    from diffquant.report import emergence_plots

    monkeypatch.setattr(emergence_plots, "save_figure", plots.save_figure)
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    profiles = [profile_model(build(PRESETS["micro"], arch), ids, ["*.hidden", "*.attn_logits"], progress=False,
                              sinks=True, label=label)
                for arch, label in (("baseline", LONG), ("diff", "DIFF " + LONG))]
    from diffquant.report.profile_report import write_report

    write_report(profiles, tmp_path)
    doc = json.loads((ROOT / "docs/demo/emergence/emergence.json").read_text())
    doc["models"] = {(LONG if i == 0 else "DIFF " + LONG): v for i, v in enumerate(doc["models"].values())}
    emergence_plots.plot_emergence(doc, tmp_path)
    assert set(checked) >= {"kurtosis_vs_layer", "absmax_vs_layer", "histograms", "emergence"}
    bad = {stem: pairs for stem, pairs in checked.items() if pairs}
    assert not bad, "\n".join(f"{stem}: {a!r} over {b!r}" for stem, pairs in bad.items() for a, b in pairs)
