"""experiments/regime.py: the outlier regime (the one definition) and issue 27's criteria with their
extrapolation, on hand-made tracked curves."""

import math

import pytest

from diffquant.track import tokens_to_reach
from experiments import regime


def point(tokens, shares, peak, loss=1.0, hidden_ratio=10.0, sink_rate=0.0):
    return {"tokens": tokens, "loss": loss, "layers": {str(i): {"first_share": s} for i, s in enumerate(shares)},
            "model": {"massive_ratio_max": peak, "value_ratio_min": 0.5, "hidden_ratio_max": hidden_ratio,
                      "sink_rate": sink_rate}}


def test_share_criterion_takes_the_largest_layer_and_its_first_snapshot():
    curve = [point(0, [0.1, 0.2], 2.0), point(100, [0.1, 0.49], 2.0), point(200, [0.55, 0.3], 2.0),
             point(400, [0.7, 0.3], 2.0)]
    v = regime.verdict(regime.series(curve))
    assert v["issue27"] and v["share_max"]["reached_at"] == 200 and v["share_max"]["final"] == 0.7
    assert not v["regime"]  # issue 27's sink criterion is not the outlier regime
    assert v["peak_growth"]["reached_at"] is None and v["peak_growth"]["final"] == pytest.approx(1.0)


def test_peak_growth_is_relative_to_initialisation():
    curve = [point(0, [0.0], 1.5), point(10, [0.0], 29.0), point(20, [0.0], 30.0)]
    v = regime.verdict(regime.series(curve))
    assert v["peak_growth"]["reached_at"] == 20 and v["issue27"]  # 30 / 1.5 = 20 ≥ 20; 29 / 1.5 is not


def test_extrapolation_of_an_exact_power_law():
    # share = 0.01 · (t / 1000)^0.5 reaches 0.5 at t = 1000 · 50² = 2.5M tokens
    tokens = [0, 1000, 2000, 4000, 8000, 16000, 32000]
    shares = [0.01 * math.sqrt(t / 1000) if t else 0.01 for t in tokens]
    assert tokens_to_reach(tokens, shares, 0.5) == pytest.approx(2.5e6, rel=1e-9)
    v = regime.verdict(regime.series([point(t, [s], 1.0) for t, s in zip(tokens, shares)]))
    assert not v["issue27"] and v["share_max"]["extrapolated_tokens"] == pytest.approx(2.5e6, rel=1e-9)
    assert v["peak_growth"]["extrapolated_tokens"] is None  # flat: nothing to extrapolate
    assert tokens_to_reach(tokens, list(reversed(shares)), 0.5) is None  # falling: no extrapolation


def test_missing_recipe_cell_is_one_clear_line(tmp_path):
    with pytest.raises(SystemExit, match="no finished baseline cell at lr 0.0003"):
        regime.main(["--cells", str(tmp_path), "--out", str(tmp_path / "out")])


def test_a_poor_fit_is_not_reported_as_a_number():
    from diffquant.track import loglog_fit

    tokens = [0, 1000, 2000, 4000, 8000, 16000, 32000]
    exact = [0.01 * math.sqrt(t / 1000) if t else 0.01 for t in tokens]
    assert loglog_fit(tokens, exact)["r2"] == pytest.approx(1.0)
    # flat, then one jump at the end: the line rises, but explains little
    noisy = [0.02, 0.02, 0.03, 0.035, 0.033, 0.024, 0.051]
    fit = loglog_fit(tokens, noisy)
    xs = [math.log(t) for t in tokens[4:]]  # the second half of the 6 points after initialisation
    ys = [math.log(v) for v in noisy[4:]]
    mx, my = sum(xs) / 3, sum(ys) / 3
    r = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / math.sqrt(
        sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))
    assert fit["r2"] == pytest.approx(r * r) and fit["points"] == 3
    v = regime.verdict(regime.series([point(t, [s], 1.0, loss=3.0 - i / 10) for i, (t, s) in
                                      enumerate(zip(tokens, noisy))]))
    assert v["share_max"]["fit_r2"] < regime.MIN_R2
    assert "no usable extrapolation" in regime.sentence(v, 838_848, [2.9, 2.8])


def test_the_outlier_regime_is_the_one_definition_on_each_snapshot():
    """The verdict reads diffquant.stats.outlier_regime on every snapshot: hidden top-1/median ≥ 100 (worst layer)
    or sink rate ≥ 0.5, the first snapshot that meets either; the sentence names the definition."""
    from diffquant.stats.outlier_regime import HIDDEN_RATIO, NAME, SINK_RATE

    assert (HIDDEN_RATIO, SINK_RATE) == (100.0, 0.5)
    curve = [point(0, [0.0], 1.0, hidden_ratio=5.0), point(10, [0.0], 1.0, hidden_ratio=99.9),
             point(20, [0.0], 1.0, hidden_ratio=100.0), point(30, [0.0], 1.0, hidden_ratio=40.0)]
    v = regime.verdict(regime.series(curve))
    assert v["regime"] and v["regime_at"] == 20 and v["hidden_ratio_max"] == 100.0 and not v["issue27"]
    sinks = [point(0, [0.0], 1.0, sink_rate=0.0), point(10, [0.0], 1.0, sink_rate=0.5)]
    assert regime.verdict(regime.series(sinks))["regime_at"] == 10
    flat = regime.verdict(regime.series([point(t, [0.0], 1.0, loss=3 - t / 100, hidden_ratio=12.0)
                                         for t in (0, 10, 20, 40)]))
    text = regime.sentence(flat, 40, [2.9, 2.8])
    assert not flat["regime"] and f"did not reach {NAME} within 40 tokens" in text
    assert "hidden top-1/median peaked at 12.0 and its sink rate at 0.00" in text
