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


def test_welch_sign_for_a_difference_between_zero_and_one_and_for_constants_below():
    """A significant difference of 0.01 is +1 and −0.01 is −1 (not 0: the sign is not d > 1); two constant arms
    with a below b are −1."""
    from diffquant.stats.intervals import welch

    a, b = [0.10, 0.11, 0.12, 0.105], [0.09, 0.10, 0.11, 0.095]
    up, down = welch(a, [x - 0.01 for x in a]), welch([x - 0.01 for x in a], a)
    assert sps.ttest_ind(a, b, equal_var=False).pvalue > ALPHA  # these overlap: no sign
    assert welch(a, b)["sign"] == 0
    a, b = [0.10, 0.101, 0.102], [0.090, 0.0905, 0.0912]
    ref = sps.ttest_ind(a, b, equal_var=False).pvalue
    assert ref < ALPHA and welch(a, b) == pytest.approx({"diff": 0.0104333, "p": ref, "sign": 1, "n": 3}, rel=1e-4)
    assert welch(b, a)["sign"] == -1 and welch(b, a)["p"] == pytest.approx(ref, rel=1e-12)
    assert up["diff"] == pytest.approx(0.01) and down["diff"] == pytest.approx(-0.01)
    assert welch([1.25, 1.25], [2.0, 2.0, 2.0]) == {"diff": -0.75, "p": 0.0, "sign": -1, "n": 2}


def test_welch_at_p_exactly_alpha_has_no_sign(monkeypatch):
    """p = α is not a difference (p < α is). scipy's t-test is made to answer exactly α (no data gives it in floats);
    welch itself runs as it is."""
    import scipy.stats

    from diffquant.stats.intervals import welch

    class Exactly:
        pvalue = ALPHA

    monkeypatch.setattr(scipy.stats, "ttest_ind", lambda *args, **kwargs: Exactly())
    assert welch([1.0, 2.0, 3.0], [0.0, 0.5, 1.0])["sign"] == 0
    Exactly.pvalue = math.nextafter(ALPHA, 0.0)
    assert welch([1.0, 2.0, 3.0], [0.0, 0.5, 1.0])["sign"] == 1


def test_tost_with_equal_spreads_on_both_sides():
    """Both arms with the same variance and size (Welch's df is then 2n − 2, not infinite): against scipy."""
    from diffquant.stats.intervals import tost

    a, b, margin = [1.0, 2.0, 3.5], [1.25, 2.25, 3.75], 2.0
    assert stdev(a) == stdev(b)
    lower = sps.ttest_ind(a, [x - margin for x in b], equal_var=False, alternative="greater").pvalue
    upper = sps.ttest_ind(a, [x + margin for x in b], equal_var=False, alternative="less").pvalue
    got = tost(a, b, margin)
    assert got["p"] == pytest.approx(max(lower, upper), rel=1e-9)
    ci = sps.ttest_ind(a, b, equal_var=False).confidence_interval(0.90)
    assert got["ci90"] == pytest.approx([ci.low, ci.high], rel=1e-9)


def _mde_by_bisection(n: int, tests: int, power: float = 0.8) -> float:
    """The power of the pooled two-sided t-test at α / tests, from the noncentral t, solved for d by plain
    bisection on a bracket found by doubling (not brentq)."""
    df = 2 * n - 2
    crit = sps.t.ppf(1 - ALPHA / tests / 2, df)

    def power_at(d):  # both tails, as a two-sided test rejects on either
        nc = d * math.sqrt(n / 2)
        lower = sps.nct.cdf(-crit, df, nc)  # below 1e-5 wherever it matters; scipy gives NaN for some far tails
        return sps.nct.sf(crit, df, nc) + (0.0 if math.isnan(lower) else lower)

    lo, hi = 0.0, 1.0
    while power_at(hi) < power:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if power_at(mid) < power else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize("n, tests, power", [(60, 1, 0.8), (5, 1, 0.9), (5, 24, 0.8), (2, 1, 0.8), (2, 2000, 0.8)])
def test_minimum_detectable_effect_by_bisection(n, tests, power):
    """Below 1 SD (n = 60, one test), a single test, a power other than 0.8, and two runs with 2,000 tests, whose
    answer lies past 100 SD. The lower tail's power (about 1e-6 here) is left out by the library: the reference keeps
    it, so the two agree to 1e-5."""
    from diffquant.stats.intervals import minimum_detectable_effect

    assert minimum_detectable_effect(n, tests, power=power) == pytest.approx(_mde_by_bisection(n, tests, power),
                                                                            rel=1e-5)


def test_minimum_detectable_effect_refuses_what_has_no_answer():
    from diffquant.stats.intervals import minimum_detectable_effect

    for n, tests in ((1, 3), (5, 0), (1, 0)):
        with pytest.raises(ValueError, match="needs n >= 2 runs per group and at least one test"):
            minimum_detectable_effect(n, tests)
    for power, alpha in ((1.0, 0.05), (0.0, 0.05), (0.8, 0.0), (0.8, 1.0)):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            minimum_detectable_effect(5, 3, alpha=alpha, power=power)


def test_detectable_in_units_of_the_pooled_spread():
    """detectable() at the smaller arm's n (values left out first), times the pooled SD written out here; a power
    passed through; None below two values on either side, two on each is enough."""
    import numpy as np

    from diffquant.stats.intervals import detectable

    a, b = [1.0, None, 2.0, 4.0, float("nan"), 3.0], [3.0, 5.0, 4.5, float("nan"), None]
    va, vb = np.var([1.0, 2.0, 4.0, 3.0], ddof=1), np.var([3.0, 5.0, 4.5], ddof=1)
    pooled = math.sqrt((3 * va + 2 * vb) / 5)
    got = detectable(a, b, tests=4)
    sd = _mde_by_bisection(3, 4)
    assert got == pytest.approx({"sd": sd, "units": sd * pooled, "n": 3, "tests": 4}, rel=1e-5)
    got = detectable(b, a, tests=4, power=0.9)
    assert got["sd"] == pytest.approx(_mde_by_bisection(3, 4, 0.9), rel=1e-5) and got["n"] == 3
    assert got["units"] == pytest.approx(got["sd"] * pooled, rel=1e-12)
    two = detectable([1.0, 2.0], [0.0, 3.0], tests=1)
    assert two["n"] == 2 and two["units"] == pytest.approx(_mde_by_bisection(2, 1) * math.sqrt((0.5 + 4.5) / 2),
                                                           rel=1e-5)
    for x, y in (([1.0], [1.0, 2.0]), ([1.0, 2.0], [None, 2.0, float("nan")]), ([], [])):
        assert detectable(x, y, tests=2) is None and detectable(y, x, tests=2) is None
