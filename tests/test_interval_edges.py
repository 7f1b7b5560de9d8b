"""stats/intervals.py at its edges, against scipy and numbers written out: two values (the fewest a t-interval takes),
a value of zero, an adjusted p exactly at α, a difference between 0 and 1, a proportion of 0 or 1 whose Wilson bound
rounds past [0, 1], and a loss past the overflow cap (issue 50's mutants of the module)."""

import math
from statistics import stdev

import pytest
from scipy import stats as sps

from diffquant.stats.intervals import (ALPHA, fmt_interval, half95, ppl_interval, standard_error, t95, t_interval,
                                       verdict, wilson)


def test_two_values_are_enough_for_a_t_interval_and_one_is_not():
    assert t95(2) == pytest.approx(sps.t.ppf(0.975, 1), rel=1e-9)
    assert half95(0.5, 2) == pytest.approx(0.5 * sps.t.ppf(0.975, 1), rel=1e-9)
    assert standard_error([1.0, 4.0]) == pytest.approx(stdev([1.0, 4.0]) / math.sqrt(2)) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="at least two values, got 1"):
        t95(1)
    assert half95(0.5, 1) is None and half95(None, 5) is None and standard_error([3.0]) is None


def test_a_zero_value_and_a_missing_interval_format():
    assert fmt_interval(0.0, [-0.125, 0.25]) == "0.0000 [-0.1250, 0.2500]"
    assert fmt_interval(3.0, None) == "3.000" and fmt_interval(None, None) == "-"
    assert fmt_interval(84.0812, [78.0612, 90.5688]) == "84.08 [78.06, 90.57]"


def test_perplexity_interval_is_capped_at_exp_700():
    """A loss interval reaching past 700 nats is capped there (exp(709.8) overflows a float)."""
    ci = ppl_interval(700.5, 0.01, 10)
    assert ci == [math.exp(700.0), math.exp(700.0)]
    assert ppl_interval(800.0, 1.0, 10) == [math.exp(700.0), math.exp(700.0)]
    low = 2.0 - sps.t.ppf(0.975, 9) * 0.1
    assert ppl_interval(2.0, 0.1, 10)[0] == pytest.approx(math.exp(low), rel=1e-9)


def test_an_empty_t_interval_has_every_field():
    for values in ([], [None, float("nan")]):
        assert t_interval(values) == {"mean": None, "half": None, "n": 0, "values": values}
    one = t_interval([2.5])
    assert one == {"mean": 2.5, "half": None, "n": 1, "values": [2.5]}


def test_verdict_at_alpha_and_for_a_difference_below_one():
    """p exactly α is not a difference (p < α is); a difference of 0.5 is higher, −0.5 lower; the detectable effect
    is said with its SD and units."""
    assert verdict(0.5, ALPHA, 4) == f"no difference detected (n = 4, p {ALPHA:.2g})"
    assert verdict(0.5, 0.01, 4) == "higher (p 0.01)" and verdict(-0.5, 0.01, 4) == "lower (p 0.01)"
    assert verdict(0.0, 0.01, 4) == "no difference detected (n = 4, p 0.01)"
    assert verdict(0.5, 0.2, 3, detectable={"sd": 7.24, "units": 0.3125}) == \
        "no difference detected (n = 3, detectable 7.2 SD = 0.312, p 0.2)"


def test_wilson_bounds_stay_in_the_unit_interval_where_rounding_would_leave_it():
    """k = n = 9 and k = 0, n = 9: the closed form gives 1 + 2e-16 and −1e-17 in floats; the bounds are 1 and 0.
    Elsewhere the interval is the closed form, computed here from scipy's normal quantile."""
    z = sps.norm.ppf(0.975)
    for k, n in ((9, 9), (0, 9), (3, 9), (1, 2)):
        p = k / n
        centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        lo, hi = (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)
        got = wilson(k, n)
        assert got == pytest.approx([max(0.0, lo), min(1.0, hi)], rel=1e-9, abs=1e-15)
        assert 0.0 <= got[0] <= got[1] <= 1.0
    assert wilson(9, 9)[1] == 1.0 and wilson(0, 9)[0] == 0.0
    for k, n in ((0, 0), (4, 3), (-1, 3)):
        with pytest.raises(ValueError, match="0 <= k <= n and n > 0"):
            wilson(k, n)


def test_tost_against_two_one_sided_welch_tests_from_scipy():
    """Schuirmann's TOST from scipy's one-sided Welch tests of a against b shifted by ∓margin; the 90% interval from
    scipy's Welch interval; unequal sizes and spreads, a difference off zero, values left out (None, NaN)."""
    from diffquant.stats.intervals import tost

    a, b, margin = [1.0, 1.4, 0.7, 1.2], [0.5, 0.9, 0.2, 1.1, 0.8, 0.3], 0.9
    got = tost(a + [None, float("nan")], b, margin)
    lower = sps.ttest_ind(a, [x - margin for x in b], equal_var=False, alternative="greater").pvalue
    upper = sps.ttest_ind(a, [x + margin for x in b], equal_var=False, alternative="less").pvalue
    assert lower != pytest.approx(upper, rel=0.1)  # the two sides differ: a swap would show
    assert got["p"] == pytest.approx(max(lower, upper), rel=1e-9)
    ci = sps.ttest_ind(a, b, equal_var=False).confidence_interval(0.90)
    assert got["ci90"] == pytest.approx([ci.low, ci.high], rel=1e-9)
    assert got["diff"] == pytest.approx(sum(a) / 4 - sum(b) / 6) and got["margin"] == margin
    far = tost(a, [x - 2.0 for x in b], margin)  # 2 apart: not equivalent within 0.9
    assert far["p"] == pytest.approx(sps.ttest_ind(a, [x - 2.0 + margin for x in b], equal_var=False,
                                                   alternative="less").pvalue, rel=1e-9) and far["p"] > 0.5


def test_tost_edges():
    from diffquant.stats.intervals import tost

    assert tost([1.0], [1.0, 2.0], 0.5) is None and tost([1.0, 2.0], [None, 3.0], 0.5) is None
    assert tost([2.0, 2.0], [1.75, 1.75], 0.5) == {"diff": 0.25, "p": 0.0, "ci90": [0.25, 0.25], "margin": 0.5}
    assert tost([2.0, 2.0], [1.5, 1.5], 0.5)["p"] == 1.0  # no spread, a difference at the margin: not inside it
    for margin in (0.0, -1.0):
        with pytest.raises(ValueError, match="an equivalence margin must be positive"):
            tost([1.0, 2.0], [1.0, 2.0], margin)


@pytest.mark.filterwarnings("ignore:Precision loss occurred")  # scipy's, on the reference's constant arms
def test_welch_against_scipy_with_values_left_out_and_constant_arms():
    """None and NaN are left out before the test; an arm that is constant (spread 0, or exactly 1 on the other side)
    is still a Welch test unless both are; two constants give the exact difference with p 0 (or 1 when equal)."""
    from diffquant.stats.intervals import welch

    a, b = [1.0, 2.0, None, float("nan"), 3.5], [0.5, None, 1.5, 0.2]
    got = welch(a, b)
    ref = sps.ttest_ind([1.0, 2.0, 3.5], [0.5, 1.5, 0.2], equal_var=False)
    assert got["p"] == pytest.approx(ref.pvalue, rel=1e-12) and got["diff"] == pytest.approx(2.1667 - 0.7333, abs=1e-3)
    assert got["n"] == 3
    for x, y in (([2.0, 2.0, 2.0], [1.0, 1.5, 2.0]), ([1.0, 1.5, 2.0], [2.0, 2.0, 2.0]),
                 ([0.0, 1.0, 2.0], [5.0, 5.0, 5.0]), ([5.0, 5.0, 5.0], [0.0, 1.0, 2.0])):
        assert welch(x, y)["p"] == pytest.approx(sps.ttest_ind(x, y, equal_var=False).pvalue, rel=1e-12), (x, y)
    assert welch([2.0, 2.0], [1.25, 1.25]) == {"diff": 0.75, "p": 0.0, "sign": 1, "n": 2}
    assert welch([2.0, 2.0, 2.0], [2.0, 2.0]) == {"diff": 0.0, "p": 1.0, "sign": 0, "n": 2}


def test_pooled_sd_leaves_out_missing_values():
    import numpy as np

    from diffquant.stats.intervals import pooled_sd

    a, b = [1.0, 2.0, 4.0], [3.0, 5.0]
    ref = math.sqrt((2 * np.var(a, ddof=1) + 1 * np.var(b, ddof=1)) / 3)
    assert pooled_sd([1.0, None, 2.0, float("nan"), 4.0], [3.0, float("nan"), 5.0, None]) == pytest.approx(ref)


def test_a_t_interval_of_two_values_and_pm_formatting():
    from diffquant.stats.intervals import fmt_pm

    got = t_interval([1.0, 3.0])
    assert got["half"] == pytest.approx(sps.t.ppf(0.975, 1) * stdev([1.0, 3.0]) / math.sqrt(2)) and got["mean"] == 2.0
    assert fmt_pm(None, 1.0) == "-" and fmt_pm(2.5, None) == "2.5"
    assert fmt_pm(12345.6, 10.0) == "12346 ± 10" and fmt_pm(-0.0003, 0.0165) == "-0.0003 ± 0.0165"
