"""Uncertainty of reported numbers: standard errors over sequences, paired differences, and t-intervals
over seeds.

- A metric averaged over held-out sequences (loss, accuracy) carries its standard error over sequences,
  s / √n, treating sequences as independent draws (lm-eval reports the same kind of standard error).
  Perplexity's interval is exp(mean loss ± 1.96 SE).
- The difference between two settings of the same model on the same sequences (a quantized cell against
  the float model) is paired: the SE of the per-sequence differences, much tighter than the two SEs.
- A claim over training seeds uses Student's t: mean ± t(0.975, n−1) · s / √n.
- A multiple-choice accuracy k / n is a binomial proportion: its interval is Wilson's score interval (it
  stays inside [0, 1] and keeps its coverage near 0 and 1, where p ± 1.96 SE does not). Two settings scored
  on the same examples are compared by the exact McNemar test: only the examples on which they disagree
  carry information, and under "no difference" each of those is equally likely to go either way.
"""

from __future__ import annotations

import math
from statistics import fmean, stdev

Z95 = 1.959963984540054


def standard_error(values: list[float]) -> float | None:
    """s / √n of per-sequence values (None for fewer than two)."""
    if len(values) < 2:
        return None
    return stdev(values) / math.sqrt(len(values))


def paired(a: list[float], b: list[float]) -> dict:
    """Mean of b − a over the same sequences, its SE and 95% interval (normal)."""
    if len(a) != len(b):
        raise ValueError(f"paired values need the same sequences ({len(a)} vs {len(b)})")
    d = [y - x for x, y in zip(a, b)]
    se = standard_error(d)
    mean = fmean(d)
    return {"mean": mean, "se": se, "ci95": None if se is None else [mean - Z95 * se, mean + Z95 * se], "n": len(d)}


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
    """Welch's t-test of mean(a) against mean(b) over independent runs (seeds): {"diff", "p", "sign"} with sign
    -1, 0 or +1 (0 when p >= 0.05); None with fewer than two values on either side."""
    from scipy.stats import ttest_ind

    a = [v for v in a if v is not None and not math.isnan(v)]
    b = [v for v in b if v is not None and not math.isnan(v)]
    if len(a) < 2 or len(b) < 2:
        return None
    if stdev(a) == 0 and stdev(b) == 0:  # identical constants: no test, the difference is exact
        d = fmean(a) - fmean(b)
        return {"diff": d, "p": 0.0 if d else 1.0, "sign": (d > 0) - (d < 0)}
    p = float(ttest_ind(a, b, equal_var=False).pvalue)
    d = fmean(a) - fmean(b)
    return {"diff": d, "p": p, "sign": ((d > 0) - (d < 0)) if p < 0.05 else 0}


def wilson(k: int, n: int, confidence: float = 0.95) -> list[float]:
    """Wilson's score interval for a binomial proportion k / n:
    (p + z²/2n ± z·√(p(1−p)/n + z²/4n²)) / (1 + z²/n), with z the normal quantile of the confidence."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"a binomial proportion needs 0 <= k <= n and n > 0, got k={k}, n={n}")
    z = Z95 if confidence == 0.95 else _normal_quantile(0.5 + confidence / 2)
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
