"""Histogram of |x| over float32 bit patterns, for quantiles with bounded relative error.

Bin i holds the float32 magnitudes whose upper 16 bits (sign cleared) equal i, i.e. [f(i), f(i + 1))
with f(i) the float whose bit pattern is i << 16 (bfloat16 truncation). Every finite float32 has a bin,
each bin is 2^-7 wide relative to its lower edge, so its midpoint lies within 0.4% of any value in it.
Finding the bin is a shift and a mask of the bit pattern, not a logarithm; then one bincount.
Bin 0 ([0, 9.2e-41): zeros and the smallest subnormals) is reported as 0.
"""

from __future__ import annotations

import torch

NBINS = 0x7F80  # bins of finite magnitudes; patterns from 0x7F80 up are inf and NaN
_DROP = 0x7FFF  # a NaN pattern: where masked-out values are sent (never counted)


def magnitude_bins(x: torch.Tensor) -> torch.Tensor:
    """The bin of each |x| (x float32) as int32: the upper 16 bits of its bit pattern, sign cleared."""
    return torch.bitwise_right_shift(x.view(torch.int32), 16).bitwise_and_(0x7FFF)


def abs_magnitude_bins(a: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """`magnitude_bins` of values whose sign bit is clear (`abs()` of float32): one shift, no mask; with
    `in_place`, in a's own buffer (a then holds the bins' bit patterns)."""
    bits = a.view(torch.int32)
    return bits.bitwise_right_shift_(16) if in_place else torch.bitwise_right_shift(bits, 16)


def bin_edges(i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper edges (float64) of bins i."""
    i = torch.as_tensor(i, dtype=torch.int64)
    lo = (i << 16).to(torch.int32).view(torch.float32).double()
    hi = ((i + 1) << 16).to(torch.int32).view(torch.float32).double()
    return lo, hi.clamp_max(torch.finfo(torch.float32).max)  # the last finite bin ends at float32 max


def bin_value(i: torch.Tensor) -> torch.Tensor:
    """The value reported for bins i: their midpoint, 0 for bin 0."""
    lo, hi = bin_edges(i)
    return torch.where(torch.as_tensor(i) == 0, 0.0, (lo + hi) / 2)


class AbsHistogram:
    """Counts of finite |x| by float32 magnitude bin (non-finite values are never counted)."""

    def __init__(self, device=None):
        self.counts = torch.zeros(NBINS, dtype=torch.int64, device=device)

    def add(self, x: torch.Tensor, ok: torch.Tensor | None = None) -> None:
        """Count |x| (x float32) where `ok` (broadcastable to x) is True; inf and NaN are skipped."""
        bins = magnitude_bins(x)
        self.add_bins(bins if ok is None else torch.where(ok, bins, _DROP))

    def add_bins(self, bins: torch.Tensor, zeros_left_out: torch.Tensor | int = 0) -> None:
        """Count precomputed `magnitude_bins`, less `zeros_left_out` of the zeros (values that were masked
        out by setting them to 0: cheaper than a mask on the bins)."""
        counts = torch.bincount(bins.reshape(-1), minlength=_DROP + 1)[:NBINS]
        counts[0] -= zeros_left_out
        self.counts += counts

    def merge(self, other: "AbsHistogram") -> "AbsHistogram":
        out = AbsHistogram(self.counts.device)
        out.counts = self.counts + other.counts.to(self.counts.device)
        return out

    def quantiles(self, qs: list[float]) -> list[float | None]:
        """Quantiles of |x| with torch.quantile's rank convention (linear, 0-based), to within 0.4%."""
        counts = self.counts.cpu()
        cum = torch.cumsum(counts, 0)
        total = int(cum[-1])
        if total == 0:
            return [None for _ in qs]
        ranks = torch.tensor([q * (total - 1) for q in qs], dtype=torch.float64)
        idx = torch.searchsorted(cum.double(), ranks, right=True).clamp_max(NBINS - 1)
        return bin_value(idx).tolist()

    def sparse(self) -> dict:
        """The non-empty bins, self-describing, for JSON (plots redraw densities from it)."""
        nz = self.counts.nonzero().flatten()
        return {"format": "float32-high16", "bins": dict(zip(map(str, nz.tolist()), self.counts[nz].tolist()))}
