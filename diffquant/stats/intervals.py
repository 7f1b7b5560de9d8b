"""Uncertainty of reported numbers: standard errors over sequences, paired differences, and t-intervals
over seeds.

- A metric averaged over held-out sequences (loss, accuracy) carries its standard error over sequences,
  s / √n, treating sequences as independent draws (lm-eval reports the same kind of standard error).
  Perplexity's interval is exp(mean loss ± 1.96 SE).
- The difference between two settings of the same model on the same sequences (a quantized cell against
  the float model) is paired: the SE of the per-sequence differences, much tighter than the two SEs.
- A claim over training seeds uses Student's t: mean ± t(0.975, n−1) · s / √n.
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


def holm_adjust(pvalues: list[float | None]) -> list[float | None]:
    """Holm's step-down adjusted p-values for a family of tests (None entries are no test and stay None):
    sort the m p-values ascending, multiply the i-th (0-based) by m − i, take the running maximum and cap at
    1. Rejecting where the adjusted value is below α controls the family-wise error rate at α."""
    present = [(p, i) for i, p in enumerate(pvalues) if p is not None]
    m = len(present)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, (p, i) in enumerate(sorted(present)):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out
