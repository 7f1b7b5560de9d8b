"""docs/rerender.py's recomputation of old stats.json sink figures per differential head, checked against a plain
computation on hand-built fragments; the committed demo's sink rows against the table header; the sink
definition that experiments/emergence.py (and its `--setting demo` run, docs/rivals/demo) writes into results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffquant.errors import DiffquantError

from conftest import load_script_module as _module  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EPS = 0.3




@pytest.fixture(scope="module")
def rerender():
    return _module("docs/rerender.py", "rerender_under_test")


# (λ, A1 masses, A2 masses) per layer: the issue's example head (share −0.4) beside a sink (share 1.2), a layer
# with λ < 0 (its maps add), and one with |1 − λ| ≤ 0.05 (share undefined)
LAYERS = [(0.5, [0.1, 0.7], [0.6, 0.2]), (-0.25, [0.2, 0.05], [0.4, 0.1]), (0.97, [0.9, 0.8], [0.5, 0.4])]


def _old_diff() -> dict:
    """A DIFF model's `sinks` as stats.json held them before λ was recorded: per layer, every softmax map's
    first-key mass (A1 maps, then A2 maps) and each differential map's mean first-key entry."""
    layers = {}
    for i, (lam, a1, a2) in enumerate(LAYERS):
        layers[str(i)] = {"first_mass": a1 + a2, "sink": {"heads": 4, "sinks": 0},
                          "first_mass_map": [x - lam * y for x, y in zip(a1, a2)], "sink_map": {"heads": 2, "sinks": 0},
                          "value_ratio": 1.0 + i, "massive_ratio": 2.0 + i,
                          "massive_max": {"ratio": 3.0 + i, "row": i, "position": 1, "channel": 7, "norm": 1.0}}
    return {"epsilon": EPS, "layers": layers, "model": {"sink_rate": 0.0, "sink_rate_map": 0.0}}


def test_old_diff_sinks_recomputed_per_differential_head(rerender):
    from diffquant.report.profile_report import SINK_HEADER, sink_rows

    new = rerender.upgrade_sinks(_old_diff())
    # plain computation from the layers' true λ
    shares, sinks, counted = [], 0, 0
    for i, (lam, a1, a2) in enumerate(LAYERS):
        layer = new["layers"][i]
        assert layer["lambda"] == pytest.approx(lam, abs=1e-12)
        assert layer["first_mass_A1"] == a1 and layer["first_mass_A2"] == a2
        if abs(1 - lam) <= 0.05:
            assert layer["share"] == [None, None] and "share_undefined" in layer
            assert layer["sink"] == {"heads": 2, "sinks": 0, "undefined": 2}
            continue
        share = [(x - lam * y) / (1 - lam) for x, y in zip(a1, a2)]
        assert layer["share"] == pytest.approx(share, abs=1e-12)
        assert layer["sink"] == {"heads": 2, "sinks": sum(s > EPS for s in share), "undefined": 0}
        shares += share
        sinks += sum(s > EPS for s in share)
        counted += 2
    assert new["layers"][0]["share"] == pytest.approx([-0.4, 1.2])  # the issue's head is no sink; its pair is
    assert new["layers"][1]["share"] == pytest.approx([0.24, 0.06])  # λ < 0: (0.2 + 0.25·0.4) / 1.25
    model = new["model"]
    assert model["sink_rate"] == pytest.approx(sinks / counted) == pytest.approx(1 / 4)
    assert model["sink_heads"] == counted == 4 and model["sink_heads_undefined"] == 2
    assert model["first_share_mean"] == pytest.approx(sum(shares) / len(shares))
    assert model["sink_rate_A1"] == pytest.approx(3 / 6)  # A1 masses above 0.3: 0.7, 0.9, 0.8
    assert model["sink_rate_A2"] == pytest.approx(4 / 6)  # A2 masses above 0.3: 0.6, 0.4, 0.5, 0.4
    assert model["lambda"] == pytest.approx([lam for lam, _, _ in LAYERS], abs=1e-12)
    assert model["massive_ratio_max"] == 4.0 and model["value_ratio_min"] == 1.0 and "sink_rate_map" not in model
    assert "agreed to" in new["lambda_recovered"]
    [row] = sink_rows([{"label": "DIFF", "sinks": new, "provenance": {"tokens": 99}}])
    assert len(row) == len(SINK_HEADER)
    assert dict(zip(SINK_HEADER, row)) == {
        "model": "DIFF", "sink rate": model["sink_rate"],
        "counted over": "differential head (share of A1 − λ·A2 on token 0); 2 heads with |1 − λ| ≤ 0.05 not counted",
        "heads counted": 4, "mean first-token share": model["first_share_mean"], "λ (min … max)": "-0.25 … 0.97",
        "A1 map sink rate": 0.5, "A2 map sink rate": pytest.approx(4 / 6), "max ‖h‖ ratio": 4.0,
        "where (layer, row, pos, channel)": "2, 2, 1, 7", "min ‖v₀‖ ratio": 1.0, "tokens": 99}


def test_old_softmax_sinks_and_new_files_recompute_plainly(rerender):
    old = {"epsilon": EPS, "model": {"sink_rate": 0.25},
           "layers": {"0": {"first_mass": [0.5, 0.1], "sink": {"heads": 2, "sinks": 1}, "value_ratio": 0.5,
                            "massive_ratio": 2.0, "massive_max": None},
                      "1": {"first_mass": [0.2, 0.1], "sink": {"heads": 2, "sinks": 0}, "value_ratio": 0.7,
                            "massive_ratio": 3.0, "massive_max": None}}}
    new = rerender.upgrade_sinks(old)
    assert [new["layers"][i]["share"] for i in (0, 1)] == [[0.5, 0.1], [0.2, 0.1]]
    assert new["model"]["sink_rate"] == 0.25 and new["model"]["sink_heads"] == 4
    assert new["model"]["first_share_mean"] == pytest.approx((0.5 + 0.1 + 0.2 + 0.1) / 4)
    assert new["model"]["sink_unit"] == "attention head" and "lambda" not in new["model"]
    again = json.loads(json.dumps(new))  # as stats.json stores it: a file in today's layout is left as it is
    assert rerender.upgrade_sinks(again) == again
    diff = json.loads(json.dumps(rerender.upgrade_sinks(_old_diff())))
    assert rerender.upgrade_sinks(diff) == diff


def test_lambda_that_differs_between_heads_is_refused(rerender):
    old = _old_diff()
    old["layers"]["0"]["first_mass_map"][1] += 1e-4  # no single λ makes this head's map
    with pytest.raises(DiffquantError, match="not of one differential map per layer"):
        rerender.upgrade_sinks(old)


def test_committed_demo_sink_rows_match_header_and_stats():
    from diffquant.report.profile_report import SINK_HEADER, sink_rows

    s = json.loads((ROOT / "docs/demo/summary.json").read_text())
    for folder, key in (("profile", "sinks"), ("smollm2", "smollm2_sinks")):
        stats = json.loads((ROOT / "docs/demo" / folder / "stats.json").read_text())["models"]
        assert all(len(r) == len(SINK_HEADER) for r in s[key])
        assert s[key] == json.loads(json.dumps(sink_rows(stats)))


def test_regime_results_name_their_sink_definition(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    emergence = _module("experiments/emergence.py", "emergence_under_test")

    def fake(name, overrides, seed, archs, runs, n_eval, schemes=()):
        return {a: {"parameters": 10, "train_tokens": 100, "tokens": 50, "loss": 2.0 + seed, "sink_rate": 0.1 * seed,
                    "hidden_ratio": 5.0 + seed, "emergence": []} for a in archs}

    monkeypatch.setattr(emergence, "train_and_measure", fake)
    doc = emergence.regime("s", {}, ("baseline", "diff"), [0, 1], tmp_path, tmp_path, 4)
    assert json.loads((tmp_path / "results.json").read_text())["sink_definition"] == "share"
    text = (tmp_path / "results.md").read_text()
    assert "| sink rate |" in text and "old definition" not in text
    del doc["sink_definition"]  # results written before: DIFF's rate pooled A1 and A2, dropped from the table
    old = emergence.render_regime(doc)
    assert f"| {emergence.OLD_SINK_LABEL} |" in old and "DIFF's sink rate is not shown" in old
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in old.splitlines()
            if r.startswith("| ") and not r.startswith("| model")}
    column = [h.strip() for h in old.splitlines()[2].split("|")[2:-1]].index(emergence.OLD_SINK_LABEL)
    assert rows["DIFF"][column] == "-" and rows["Transformer"][column] == "0.05 ± 0.64"  # the softmax design's stays


def test_emergence_figures_say_when_diff_curves_pool_a1_and_a2():
    from diffquant.report.emergence_plots import OLD_SINK_TITLE, _old_share, _title

    old = {"DIFF": [{"model": {"sink_rate": 0.0, "sink_rate_A1": 0.0}, "layers": {"0": {"first_mass": 0.1}}}]}
    new = {"DIFF": [{"model": {"sink_rate": 0.0, "sink_rate_A1": 0.0, "lambda": [0.5]},
                     "layers": {"0": {"first_mass": 0.1, "first_share": 0.05}}}]}
    assert _title("sink_rate", "sink rate", old) == OLD_SINK_TITLE and _title("sink_rate", "sink rate", new) == "sink rate"
    assert _title("loss", "loss", old) == "loss"
    assert _old_share(old["DIFF"], "first_share", "share")[0] == "first_mass"
    assert _old_share(new["DIFF"], "first_share", "share") == ("first_share", "share")
