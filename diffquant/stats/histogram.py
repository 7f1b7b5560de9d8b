"""Histogram of |x| over float32 bit patterns, for quantiles with bounded relative error.

Bin i holds the float32 magnitudes that round (half up, in bit space) to the bfloat16 number f(i) whose bit
pattern is i << 16: the patterns [(i << 16) − 2^15, (i << 16) + 2^15). So every bfloat16 value sits at its
bin's centre, never on an edge: a bf16 model's activations are counted exactly, and a quantile reports the
bf16 numbers themselves (a histogram that truncated instead put every bf16 value on its bin's lower edge and
reported the midpoint above it, 0.4% high). Each bin spans at most 2^-8 of f(i) on either side (RESOLUTION),
so f(i) lies within 0.4% of any value in the bin. Finding the bin is an add and a shift of the bit pattern,
not a logarithm; then one index_add_ into the counts. Bin 0 ([0, 4.6e-41): zeros and the smallest subnormals) is reported as
0; the last bin holds the finite magnitudes that would round to infinity and is reported as float32's max.
"""

from __future__ import annotations

import torch

NBINS = 0x7F81  # bins of finite magnitudes: patterns 0x7F80 << 16 and up are inf and NaN (bin 0x7F80: see above)
_HALF = 0x8000  # half a bin, in bit-pattern units: rounds the upper 16 bits to nearest
RESOLUTION = 2.0**-8  # the most |v − f(i)| / f(i) of any v in bin i
FORMAT = "float32-round16"  # as `sparse` names it; "float32-high16" (truncated bins) in reports written before


def magnitude_bins(x: torch.Tensor) -> torch.Tensor:
    """The bin of each |x| (x float32) as int32: its bit pattern, sign cleared, rounded to the upper 16 bits.
    NaN patterns land on bins past NBINS (never counted); no pattern overflows."""
    bits = x.view(torch.int32)
    return torch.bitwise_right_shift(bits, 16).bitwise_and_(0x7FFF) + torch.bitwise_right_shift(bits, 15).bitwise_and_(1)


def abs_magnitude_bins(a: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """`magnitude_bins` of finite values whose sign bit is clear (`abs()` of float32): an add and a shift; with
    `in_place`, in a's own buffer (a then holds the bins' bit patterns). Non-finite values may give any bin,
    negative ones included: callers count only finite values (SiteStats checks their sum first)."""
    bits = a.view(torch.int32)
    return (bits.add_(_HALF) if in_place else bits + _HALF).bitwise_right_shift_(16)


def bin_edges(i: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper edges (float64) of bins i: the magnitudes that round to them."""
    i = i.long()
    lo = ((i << 16) - _HALF).clamp_min(0).to(torch.int32).view(torch.float32).double()
    hi = ((i << 16) + _HALF).clamp_max(0x7F7FFFFF).to(torch.int32).view(torch.float32).double()
    return lo, hi  # the last bin ends at float32 max


def bin_value(i: torch.Tensor) -> torch.Tensor:
    """The value reported for bins i: the bfloat16 number at their centre (0 for bin 0, float32 max for the last)."""
    i = i.long()
    return (i << 16).to(torch.int32).view(torch.float32).double().clamp_max(torch.finfo(torch.float32).max)


class AbsHistogram:
    """Counts of finite |x| by float32 magnitude bin (non-finite values are never counted)."""

    def __init__(self, device=None):
        self.counts = torch.zeros(NBINS, dtype=torch.int64, device=device)

    def add(self, x: torch.Tensor, ok: torch.Tensor | None = None) -> None:
        """Count |x| (x float32) where `ok` (broadcastable to x) is True; inf and NaN are skipped."""
        counted = torch.isfinite(x) if ok is None else torch.isfinite(x) & ok
        self.add_bins(torch.where(counted, magnitude_bins(x), 0), zeros_left_out=(~counted).sum())

    def add_bins(self, bins: torch.Tensor, zeros_left_out: torch.Tensor | int | None = None,
                 counted: torch.Tensor | None = None) -> None:
        """Count precomputed `magnitude_bins` (every one below NBINS), less `zeros_left_out` of the zeros (values
        that were masked out by setting them to 0: cheaper than a mask on the bins; None when none were), or only
        where `counted` (bool, bins' shape) is True: the others are added with weight 0 in their own bins (on a GPU
        the zeros' way sends every masked value to one address, where atomic adds wait for each other). An
        index_add_ rather than a bincount, which reads the bins' minimum (and on CUDA their maximum) back to the
        host: as fast on CPU."""
        flat = bins.reshape(-1)
        weights = self._ones(flat.numel()) if counted is None else counted.reshape(-1).to(self.counts.dtype)
        self.counts.index_add_(0, flat, weights)
        if zeros_left_out is not None:
            self.counts[0] -= zeros_left_out

    def _ones(self, n: int) -> torch.Tensor:
        return torch.ones(1, dtype=self.counts.dtype, device=self.counts.device).expand(n)

    def merge(self, other: "AbsHistogram") -> "AbsHistogram":
        out = AbsHistogram(self.counts.device)
        out.counts = self.counts + other.counts.to(self.counts.device)
        return out

    def quantiles(self, qs: list[float]) -> list[float | None]:
        """Quantiles of |x| with torch.quantile's convention (0-based rank q·(n − 1), linear between the two
        values either side of it), each value read as its bin's: exact for bfloat16 data, else within
        RESOLUTION (0.4%)."""
        counts = self.counts.cpu()
        cum = torch.cumsum(counts, 0).double()
        total = int(cum[-1])
        if total == 0:
            return [None for _ in qs]
        ranks = torch.tensor([q * (total - 1) for q in qs], dtype=torch.float64, device=cum.device)  # not the default
        below, above = (torch.searchsorted(cum, r, right=True).clamp_max(NBINS - 1)
                        for r in (ranks.floor(), ranks.ceil()))
        lo, hi = bin_value(below), bin_value(above)
        return (lo + (ranks - ranks.floor()) * (hi - lo)).tolist()

    def sparse(self) -> dict:
        """The non-empty bins, self-describing, for JSON (plots redraw densities from it)."""
        nz = self.counts.nonzero().flatten()
        return {"format": FORMAT, "bins": dict(zip(map(str, nz.tolist()), self.counts[nz].tolist()))}
