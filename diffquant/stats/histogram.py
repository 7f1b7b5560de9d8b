"""Log-spaced histogram of |x| for quantiles with bounded relative error.

Bins grow by a ratio of 1.01 from 1e-8 to 1e8, so the geometric centre of a bin is within 0.5% of any
value inside it. |x| below 1e-8 (zeros included) goes to an underflow bin reported as 0; values above
1e8 to an overflow bin reported as the bin's lower edge.
"""

from __future__ import annotations

import math

import torch

LO, HI, RATIO = 1e-8, 1e8, 1.01
NBINS = math.ceil(math.log(HI / LO) / math.log(RATIO))
_LOG_LO, _LOG_R = math.log(LO), math.log(RATIO)
_SCALE, _SHIFT = 1 / _LOG_R, 1 - _LOG_LO / _LOG_R


def bin_index(a: torch.Tensor) -> torch.Tensor:
    """Bin of each |x| (≥ 0): floor((log|x| − log LO) / log r) + 1, clamped into [0, NBINS + 1].
    Below LO (zeros: log = −inf) lands in bin 0; after the clamp truncation equals floor."""
    return (torch.log(a) * _SCALE + _SHIFT).clamp(0, NBINS + 1).long()


class LogHistogram:
    def __init__(self, device=None):
        # bin 0: |x| < LO; bins 1..NBINS: [LO·r^(i-1), LO·r^i); bin NBINS+1: ≥ HI
        self.counts = torch.zeros(NBINS + 2, dtype=torch.int64, device=device)

    def add(self, a: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Count |x| values `a` (float32, ≥ 0) where mask is True."""
        idx = bin_index(a)
        if mask is not None:
            idx = torch.where(mask, idx, NBINS + 2)  # dropped below
        self.add_index(idx)

    def add_index(self, idx: torch.Tensor) -> None:
        """Count precomputed bin indices (NBINS + 2 = not counted)."""
        self.counts += torch.bincount(idx.reshape(-1), minlength=NBINS + 3)[: NBINS + 2]

    def merge(self, other: "LogHistogram") -> "LogHistogram":
        out = LogHistogram(self.counts.device)
        out.counts = self.counts + other.counts.to(self.counts.device)
        return out

    def quantiles(self, qs: list[float]) -> list[float | None]:
        counts = self.counts.cpu().double()
        total = float(counts.sum())
        if total == 0:
            return [None for _ in qs]
        cum = torch.cumsum(counts, 0)
        out = []
        for q in qs:
            rank = q * (total - 1)  # same convention as torch.quantile (linear, 0-based rank)
            i = int(torch.searchsorted(cum, torch.tensor(rank, dtype=torch.float64), right=True))
            i = min(i, NBINS + 1)
            out.append(0.0 if i == 0 else LO * RATIO ** (i - 1) if i == NBINS + 1 else LO * RATIO ** (i - 0.5))
        return out
