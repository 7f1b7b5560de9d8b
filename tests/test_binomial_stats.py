"""Wilson interval and exact McNemar test against scipy and hand-worked cases."""

import math

import pytest

from diffquant.stats.intervals import mcnemar_exact, wilson


@pytest.mark.parametrize("k,n", [(0, 10), (1, 10), (5, 10), (10, 10), (57, 300), (150, 300), (299, 300), (1, 1)])
def test_wilson_matches_scipy(k, n):
    from scipy.stats import binomtest

    ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert wilson(k, n) == pytest.approx([ref.low, ref.high], abs=1e-12)
    ref90 = binomtest(k, n).proportion_ci(confidence_level=0.90, method="wilson")
    assert wilson(k, n, 0.90) == pytest.approx([ref90.low, ref90.high], abs=1e-12)


def test_wilson_by_hand():
    # k = 8, n = 10, z = 1.96: centre (0.8 + 0.19208) / 1.38416 = 0.716710, half 1.96·√(0.016 + 0.0096040) / 1.38416
    z = 1.959963984540054
    centre = (0.8 + z * z / 20) / (1 + z * z / 10)
    half = z * math.sqrt(0.8 * 0.2 / 10 + z * z / 400) / (1 + z * z / 10)
    assert wilson(8, 10) == pytest.approx([centre - half, centre + half], abs=1e-15)
    assert wilson(8, 10) == pytest.approx([0.4902, 0.9433], abs=5e-5)  # the textbook values
    for bad in ((1, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError):
            wilson(*bad)


def _outcomes(both, only_a, only_b, neither):
    a = [True] * both + [True] * only_a + [False] * only_b + [False] * neither
    b = [True] * both + [False] * only_a + [True] * only_b + [False] * neither
    return a, b


@pytest.mark.parametrize("only_a,only_b", [(0, 0), (3, 0), (0, 1), (7, 2), (12, 25), (40, 41), (90, 140)])
def test_mcnemar_matches_scipy_binomial_test(only_a, only_b):
    from scipy.stats import binomtest

    a, b = _outcomes(50, only_a, only_b, 20)
    r = mcnemar_exact(a, b)
    m = only_a + only_b
    assert (r["lost"], r["gained"], r["discordant"]) == (only_a, only_b, m)
    expected = 1.0 if m == 0 else binomtest(only_b, m, 0.5).pvalue
    assert r["p"] == pytest.approx(expected, rel=1e-12)
    assert r["delta"] == pytest.approx((only_b - only_a) / len(a))


def test_mcnemar_by_hand():
    # 1 lost, 5 gained: P(X <= 1) = (1 + 6) / 64 for X ~ Bin(6, 1/2); two-sided 14/64
    a, b = _outcomes(3, 1, 5, 1)
    assert mcnemar_exact(a, b)["p"] == 14 / 64
    a, b = _outcomes(0, 0, 3, 0)  # 0 lost, 3 gained: 2 · 1/8
    assert mcnemar_exact(a, b)["p"] == 0.25
    a, b = _outcomes(0, 2, 2, 0)  # a tie: 2 · P(X <= 2 | m = 4) = 2 · 11/16 > 1, capped
    assert mcnemar_exact(a, b)["p"] == 1.0
    a, b = _outcomes(0, 0, 2000, 0)  # a huge, lopsided count stays finite (no float overflow of 2^m)
    assert mcnemar_exact(a, b)["p"] < 1e-300
    with pytest.raises(ValueError):
        mcnemar_exact([True], [True, False])
