"""Uncertainty of reported numbers: standard errors over sequences, paired differences, and t-intervals
over seeds.

- A metric averaged over held-out sequences (loss, accuracy) carries its standard error over sequences,
  s / √n, treating sequences as independent draws (lm-eval reports the same kind of standard error).
- Every 95% interval is Student's t with n − 1 degrees of freedom: mean ± t(0.975, n−1) · SE, for n
  sequences as for n seeds (t, not the normal 1.96, because n can be small: 32 sequences give 2.04).
- Perplexity has one interval, everywhere: the exponential of the loss interval, exp(loss ± t · SE). It is
  not symmetric around exp(loss), so it is written "84.08 [78.0, 90.6]", never "84.08 ± x".
- The difference between two settings of the same model on the same sequences (a quantized cell against
  the float model) is paired: the SE of the per-sequence differences, much tighter than the two SEs.
- A table of several tests (one design against another, metric by metric) controls the family-wise error
  with Holm's step-down correction; a verdict is drawn where the adjusted p < 0.05, and otherwise it says
  "no difference detected (n = …)", which is not "equal".
- A multiple-choice accuracy k / n is a binomial proportion: its interval is Wilson's score interval (it
  stays inside [0, 1] and keeps its coverage near 0 and 1, where p ± 1.96 SE does not). Two settings scored
  on the same examples are compared by the exact McNemar test: only the examples on which they disagree
  carry information, and under "no difference" each of those is equally likely to go either way.
"""

from __future__ import annotations

import math
from statistics import fmean, stdev

ALPHA = 0.05


def t95(n: int) -> float:
    """t(0.975, n − 1): the 95% multiplier of a standard error over n independent values."""
    if n < 2:
        raise ValueError(f"a t-interval needs at least two values, got {n}")
    return t_quantile(0.975, n - 1)


def half95(se: float | None, n: int | None) -> float | None:
    """Half-width of the 95% t-interval of a mean with standard error `se` over n values (None without both)."""
    return None if se is None or not n or n < 2 else t95(n) * se


def loss_interval(loss: float, se: float | None, n: int | None) -> list[float] | None:
    """[loss − t·SE, loss + t·SE] over n sequences."""
    half = half95(se, n)
    return None if half is None else [loss - half, loss + half]


def ppl_interval(loss: float, se: float | None, n: int | None) -> list[float] | None:
    """Perplexity's 95% interval: exp of the loss interval (capped at exp(700) against overflow)."""
    ci = loss_interval(loss, se, n)
    return None if ci is None else [math.exp(min(x, 700)) for x in ci]


def fmt_interval(value: float | None, ci: list[float] | None, digits: int = 4) -> str:
    """"84.08 [78.06, 90.57]": `digits` significant digits of the value, the bounds to the same decimals."""
    if value is None:
        return "-"
    decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(value))))) if value else digits
    text = f"{value:.{decimals}f}"
    return text if ci is None else f"{text} [{ci[0]:.{decimals}f}, {ci[1]:.{decimals}f}]"


def standard_error(values: list[float]) -> float | None:
    """s / √n of per-sequence values (None for fewer than two)."""
    if len(values) < 2:
        return None
    return stdev(values) / math.sqrt(len(values))


def paired(a: list[float], b: list[float]) -> dict:
    """Mean of b − a over the same sequences, its SE and 95% t-interval (n − 1 degrees of freedom)."""
    if len(a) != len(b):
        raise ValueError(f"paired values need the same sequences ({len(a)} vs {len(b)})")
    d = [y - x for x, y in zip(a, b)]
    se = standard_error(d)
    mean = fmean(d)
    return {"mean": mean, "se": se, "ci95": loss_interval(mean, se, len(d)), "n": len(d)}


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (scipy)."""
    from scipy.stats import t

    return float(t.ppf(p, df))


def t_interval(values: list[float], confidence: float = 0.95) -> dict:
    """Mean and the t-interval over independent runs (seeds)."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return {"mean": None, "half": None, "n": 0, "values": values}
    mean = fmean(vals)
    if len(vals) < 2:
        return {"mean": mean, "half": None, "n": len(vals), "values": values}
    half = t_quantile(0.5 + confidence / 2, len(vals) - 1) * stdev(vals) / math.sqrt(len(vals))
    return {"mean": mean, "half": half, "n": len(vals), "values": values}


def fmt_pm(mean: float | None, half: float | None, digits: int = 3) -> str:
    """"74.1 ± 1.2": `digits` significant digits of the larger of |mean| and the half-width, both to the same
    decimals (so a mean near zero with a wide interval reads "-0.0003 ± 0.0165", not twelve digits)."""
    if mean is None:
        return "-"
    if half is None:
        return f"{mean:.{digits}g}"
    scale = max(abs(mean), abs(half))
    decimals = max(0, digits - 1 - int(math.floor(math.log10(scale)))) if scale else digits
    return f"{mean:.{decimals}f} ± {half:.{decimals}f}"


def welch(a: list[float], b: list[float]) -> dict | None:
    """Welch's t-test of mean(a) against mean(b) over independent runs (seeds): {"diff", "p", "sign", "n"} with
    sign -1, 0 or +1 (0 when p >= 0.05, uncorrected: a table of several tests corrects with `holm`); None with
    fewer than two values on either side."""
    from scipy.stats import ttest_ind

    a = [v for v in a if v is not None and not math.isnan(v)]
    b = [v for v in b if v is not None and not math.isnan(v)]
    if len(a) < 2 or len(b) < 2:
        return None
    if stdev(a) == 0 and stdev(b) == 0:  # identical constants: no test, the difference is exact
        d = fmean(a) - fmean(b)
        return {"diff": d, "p": 0.0 if d else 1.0, "sign": (d > 0) - (d < 0), "n": min(len(a), len(b))}
    p = float(ttest_ind(a, b, equal_var=False).pvalue)
    d = fmean(a) - fmean(b)
    return {"diff": d, "p": p, "sign": ((d > 0) - (d < 0)) if p < ALPHA else 0, "n": min(len(a), len(b))}


def holm(pvalues: list[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values, in the input order: sort ascending, multiply the i-th smallest
    (i from 0) by m − i, carry the running maximum so the adjusted values keep the order, cap at 1. Rejecting
    where the adjusted p < α controls the family-wise error rate at α over the m tests (Holm 1979)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def verdict(diff: float, p_adjusted: float, n: int, words=("higher", "lower"), detectable: dict | None = None) -> str:
    """"higher (p 0.004)" / "lower (p 0.004)" where the adjusted p < α; otherwise "no difference detected (n = 3,
    p 0.2)", which says what the test saw, not that the two are equal; with `detectable` (see `detectable`) it also
    says the smallest difference the test could have detected: "no difference detected (n = 3, detectable 7.2 SD
    = 0.31, p 0.2)"."""
    if p_adjusted < ALPHA and diff:
        return f"{words[0] if diff > 0 else words[1]} (p {p_adjusted:.2g})"
    size = f", detectable {detectable['sd']:.1f} SD = {detectable['units']:.3g}" if detectable else ""
    return f"no difference detected (n = {n}{size}, p {p_adjusted:.2g})"


def wilson(k: int, n: int, confidence: float = 0.95) -> list[float]:
    """Wilson's score interval for a binomial proportion k / n:
    (p + z²/2n ± z·√(p(1−p)/n + z²/4n²)) / (1 + z²/n), with z the normal quantile of the confidence."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"a binomial proportion needs 0 <= k <= n and n > 0, got k={k}, n={n}")
    z = _normal_quantile(0.5 + confidence / 2)
    p = k / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return [max(0.0, (centre - half) / (1 + z * z / n)), min(1.0, (centre + half) / (1 + z * z / n))]


def _normal_quantile(p: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(p)


def mcnemar_exact(a: list[bool], b: list[bool]) -> dict:
    """Exact two-sided McNemar test of paired 0/1 outcomes of two settings on the same examples: with
    `gained` = examples b gets right and a wrong, `lost` the reverse, and m = gained + lost, the p-value is
    P(X <= min(gained, lost)) doubled (capped at 1) for X ~ Binomial(m, 1/2); p = 1 when m = 0.
    Also returns the accuracy change b − a."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes need the same examples ({len(a)} vs {len(b)})")
    if not a:
        raise ValueError("paired outcomes need at least one example")
    gained = sum(1 for x, y in zip(a, b) if y and not x)
    lost = sum(1 for x, y in zip(a, b) if x and not y)
    m = gained + lost
    tail = sum(math.comb(m, i) for i in range(min(gained, lost) + 1)) / 2 ** m  # exact integers, then one division
    return {"gained": gained, "lost": lost, "discordant": m, "p": min(1.0, 2 * tail),
            "delta": (gained - lost) / len(a)}


def holm_adjust(pvalues: list[float | None]) -> list[float | None]:
    """`holm` over the entries that are tests; None entries (no test) stay None and do not count in m."""
    present = [i for i, p in enumerate(pvalues) if p is not None]
    adjusted = holm([pvalues[i] for i in present])
    out: list[float | None] = [None] * len(pvalues)
    for i, a in zip(present, adjusted):
        out[i] = a
    return out


def _welch_parts(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(mean(a) − mean(b), its standard error, the Welch–Satterthwaite degrees of freedom)."""
    va, vb = stdev(a) ** 2 / len(a), stdev(b) ** 2 / len(b)
    se = math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1)) if va + vb else float("inf")
    return fmean(a) - fmean(b), se, df


def tost(a: list[float], b: list[float], margin: float) -> dict | None:
    """Equivalence of mean(a) and mean(b) within ±margin by two one-sided Welch tests (Schuirmann's TOST):
    H0⁻: d ≤ −margin rejected when t = (d + margin)/SE is large, H0⁺: d ≥ margin when (d − margin)/SE is small;
    p = the larger one-sided p. "Equivalent" at level α exactly when the (1 − 2α) Welch interval of d lies in
    (−margin, margin). None with fewer than two values on either side or no spread at all."""
    from scipy.stats import t as student

    a = [v for v in a if v is not None and not math.isnan(v)]
    b = [v for v in b if v is not None and not math.isnan(v)]
    if margin <= 0:
        raise ValueError(f"an equivalence margin must be positive, got {margin}")
    if len(a) < 2 or len(b) < 2:
        return None
    d, se, df = _welch_parts(a, b)
    if se == 0:
        return {"diff": d, "p": 0.0 if abs(d) < margin else 1.0, "ci90": [d, d], "margin": margin}
    p_lower = float(student.sf((d + margin) / se, df))
    p_upper = float(student.cdf((d - margin) / se, df))
    half = float(student.ppf(0.95, df)) * se
    return {"diff": d, "p": max(p_lower, p_upper), "ci90": [d - half, d + half], "margin": margin}


def minimum_detectable_effect(n: int, tests: int, alpha: float = ALPHA, power: float = 0.8) -> float:
    """The smallest true difference, in standard deviations, that a two-sided two-sample t-test with n runs per
    group detects with probability `power` at the level of Holm's first step over `tests` tests (α / tests),
    assuming equal variances (df = 2n − 2): the noncentral-t solution, exact for the pooled test and close for
    Welch's when the spreads are alike."""
    from scipy.optimize import brentq
    from scipy.stats import nct
    from scipy.stats import t as student

    if n < 2 or tests < 1:
        raise ValueError(f"needs n >= 2 runs per group and at least one test, got n={n}, tests={tests}")
    if not (0 < power < 1 and 0 < alpha < 1):
        raise ValueError(f"power and alpha are probabilities strictly between 0 and 1, got {power} and {alpha}")
    df = 2 * n - 2
    crit = float(student.ppf(1 - alpha / tests / 2, df))

    def shortfall(d: float) -> float:
        return nct.sf(crit, df, d * math.sqrt(n / 2)) - power

    high = 100.0  # two runs and hundreds of tests need more than 100 SD: widen until the power is reached
    while shortfall(high) < 0:
        high *= 2
    return float(brentq(shortfall, 1e-3, high))


def pooled_sd(a: list[float], b: list[float]) -> float:
    """√(((n_a − 1)·s_a² + (n_b − 1)·s_b²) / (n_a + n_b − 2)): the spread that turns an effect in standard
    deviations into the metric's units."""
    a = [v for v in a if v is not None and not math.isnan(v)]
    b = [v for v in b if v is not None and not math.isnan(v)]
    return math.sqrt(((len(a) - 1) * stdev(a) ** 2 + (len(b) - 1) * stdev(b) ** 2) / (len(a) + len(b) - 2))


def detectable(a: list[float], b: list[float], tests: int, power: float = 0.8) -> dict | None:
    """The smallest true difference between mean(a) and mean(b) that one of `tests` Holm-corrected tests detects
    with probability `power`: {"sd": `minimum_detectable_effect` at the smaller group's n, "units": that times
    `pooled_sd`, "n", "tests"}. What a "no difference detected" could have seen; None with fewer than two values
    on either side."""
    a = [v for v in a if v is not None and not math.isnan(v)]
    b = [v for v in b if v is not None and not math.isnan(v)]
    if len(a) < 2 or len(b) < 2:
        return None
    n = min(len(a), len(b))
    sd = minimum_detectable_effect(n, tests, power=power)
    return {"sd": sd, "units": sd * pooled_sd(a, b), "n": n, "tests": tests}
