"""The exact statistics every workflow in benchmarks/peers.py is reduced with, in plain numpy.

It imports nothing but numpy so that the peers' own virtual environments (TransformerLens, nnsight) can
import it too: the same function reduces what diffquant's peers return, and the benchmark compares the
result with diffquant's streaming `profile`.
"""

from __future__ import annotations

import numpy as np

STATS = ("top1", "top10", "top100", "median", "kurtosis", "count")


def exact_stats(values) -> dict:
    """Exact statistics of all `values` (any shape, the valid values of one site only):
    top-r |x| (the r-th largest magnitude, None with fewer than r values), median |x| (linear
    interpolation, numpy's and torch.quantile's default), Pearson kurtosis m4 / m2² (not excess;
    float64 central moments), and the count."""
    x = np.asarray(values, dtype=np.float32).reshape(-1)
    n = x.size
    a = np.abs(x)
    out: dict = {"count": int(n)}
    if n == 0:
        return {**out, "top1": None, "top10": None, "top100": None, "median": None, "kurtosis": None}
    k = min(100, n)
    top = np.sort(np.partition(a, n - k)[n - k:])[::-1]
    for r in (1, 10, 100):
        out[f"top{r}"] = float(top[r - 1]) if r <= k else None
    out["median"] = float(np.median(a))
    x64 = x.astype(np.float64)
    d = x64 - x64.mean()
    d2 = d * d
    m2 = d2.mean()
    out["kurtosis"] = float((d2 * d2).mean() / m2**2) if m2 > 0 else None
    return out
