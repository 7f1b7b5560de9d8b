"""The fused site kernel: one read of an activation gives every statistic of one update (what stats/site_stats.py's
`_passes` gives on the torch path), under the contract of diffquant/kernels.

x (float32 or bfloat16, read in its own dtype) is seen as rows of its last dim. Each program takes BR rows and walks
their columns in chunks of BW: per chunk, float32 values and float64 sums of the count, the sum and the central power
sums about the chunk's own mean, merged chunk after chunk (Pébay's pairwise formulas) into the program's; a second
one-program kernel pools the programs' sums in a fixed order. So two runs give the same bits. Integers and maxima come
from x's bit pattern with the sign cleared (|x| without float arithmetic, which a GPU may flush to zero for subnormals):
each row's max |x|, LLM.int8 hits (|x| ≥ threshold) and max |x| per column (token sites: channels), and the |x|
histogram bin (the upper 16 bits rounded: stats/histogram.py), added by integer atomics straight into the running
counts. Masked and non-finite values enter none of it; non-finite ones are counted apart.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from diffquant.kernels import interpreting

STATS = 6  # per program: count, sum, central power sums M2..M4 about its own mean, max |x|
POOL_BLOCK = 1024  # programs pooled per step of the pooling kernel


@triton.jit
def merge_moments(na, sa, a2, a3, a4, nb, sb, b2, b3, b4):
    """Count, sum and central power sums of two disjoint sets (float64; Pébay 2008, as stats/moments.py merges)."""
    n = na + nb
    safe = tl.maximum(n, 1.0)
    delta = sb / tl.maximum(nb, 1.0) - sa / tl.maximum(na, 1.0)
    delta = tl.where((na > 0) & (nb > 0), delta, 0.0)
    m2 = a2 + b2 + delta * delta * na * nb / safe
    m3 = (a3 + b3 + delta * delta * delta * na * nb * (na - nb) / (safe * safe)
          + 3.0 * delta * (na * b2 - nb * a2) / safe)
    m4 = (a4 + b4 + delta * delta * delta * delta * na * nb * (na * na - na * nb + nb * nb) / (safe * safe * safe)
          + 6.0 * delta * delta * (na * na * b2 + nb * nb * a2) / (safe * safe)
          + 4.0 * delta * (na * b3 - nb * a3) / safe)
    return n, sa + sb, m2, m3, m4


@triton.jit
def tile_moments(x, ok):
    """Count, sum and central power sums (float64) of the float32 values x where `ok`: deviations from the float32
    mean c in float32, their powers summed in float64, then moved to the exact mean (μ = c + δ): Σ(d − δ)^p expanded."""
    n = tl.sum(tl.sum(ok.to(tl.int32), axis=1), axis=0).to(tl.float64)
    s1 = tl.sum(tl.sum(tl.where(ok, x, 0.0).to(tl.float64), axis=1), axis=0)
    c = (s1 / tl.maximum(n, 1.0)).to(tl.float32)
    d = tl.where(ok, x - c, 0.0)
    d2 = d * d
    e1 = tl.sum(tl.sum(d.to(tl.float64), axis=1), axis=0)
    p2 = tl.sum(tl.sum(d2.to(tl.float64), axis=1), axis=0)
    p3 = tl.sum(tl.sum((d2 * d).to(tl.float64), axis=1), axis=0)
    p4 = tl.sum(tl.sum((d2 * d2).to(tl.float64), axis=1), axis=0)
    delta = s1 / tl.maximum(n, 1.0) - c.to(tl.float64)
    m2 = p2 - 2.0 * delta * e1 + n * delta * delta
    m3 = p3 - 3.0 * delta * p2 + 3.0 * delta * delta * e1 - n * delta * delta * delta
    m4 = p4 - 4.0 * delta * p3 + 6.0 * delta * delta * p2 - 4.0 * delta * delta * delta * e1 + n * delta * delta * delta * delta
    return n, s1, m2, m3, m4


@triton.jit
def count_bins(hist_ptr, abits, ok):
    """Add each counted |x| (bit pattern, sign clear) to its histogram bin: the upper 16 bits rounded to nearest."""
    tl.atomic_add(hist_ptr + ((abits + 0x8000) >> 16), tl.full(abits.shape, 1, tl.int64), mask=ok)


@triton.jit
def _site_kernel(x_ptr, mask_ptr, stats_ptr, rowmax_ptr, hist_ptr, colmax_ptr, hits_ptr, nonfinite_ptr,
                 positions_ptr, R, W, D1, D2, ms0, ms1, ms2, ms3, threshold_bits,
                 MASKED: tl.constexpr, COLMAX: tl.constexpr, HITS: tl.constexpr, BR: tl.constexpr,
                 BW: tl.constexpr, CHUNKS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BR + tl.arange(0, BR)
    in_rows = rows < R
    r64 = rows.to(tl.int64)
    if MASKED:  # x seen as [A, D1, D2, W]; the mask broadcast to it by its strides (0 along broadcast dims)
        mrow = (r64 // (D1 * D2)) * ms0 + ((r64 // D2) % D1) * ms1 + (r64 % D2) * ms2
    n = tl.zeros((), tl.float64)
    s1 = tl.zeros((), tl.float64)
    m2 = tl.zeros((), tl.float64)
    m3 = tl.zeros((), tl.float64)
    m4 = tl.zeros((), tl.float64)
    rowmax = tl.zeros([BR], tl.int32)
    counted = tl.zeros([BR], tl.int32)
    nonfinite = tl.zeros((), tl.int32)
    for chunk in range(CHUNKS):
        cols = chunk * BW + tl.arange(0, BW)
        inside = in_rows[:, None] & (cols < W)[None, :]
        x = tl.load(x_ptr + r64[:, None] * W + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        abits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        finite = abits < 0x7F800000
        valid = inside
        if MASKED:
            valid = valid & (tl.load(mask_ptr + mrow[:, None] + cols[None, :].to(tl.int64) * ms3, mask=inside,
                                     other=0) != 0)
        ok = valid & finite
        nonfinite += tl.sum(tl.sum((valid & ~finite).to(tl.int32), axis=1), axis=0)
        cn, cs, c2, c3, c4 = tile_moments(x, ok)
        n, s1, m2, m3, m4 = merge_moments(n, s1, m2, m3, m4, cn, cs, c2, c3, c4)
        abits = tl.where(ok, abits, 0)
        rowmax = tl.maximum(rowmax, tl.max(abits, axis=1))
        counted += tl.sum(ok.to(tl.int32), axis=1)
        if COLMAX:  # |x| bit patterns order as the values do: an integer max of the float32 buffer's bits
            tl.atomic_max(colmax_ptr + cols, tl.max(abits, axis=0), mask=cols < W)
        if HITS:
            hit = ok & (abits >= threshold_bits)
            tl.atomic_add(hits_ptr + cols, tl.sum(hit.to(tl.int32), axis=0).to(tl.int64), mask=cols < W)
        count_bins(hist_ptr, abits, ok)
    tl.store(rowmax_ptr + rows, rowmax.to(tl.float32, bitcast=True), mask=in_rows)
    out = stats_ptr + pid * 6
    tl.store(out, n)
    tl.store(out + 1, s1)
    tl.store(out + 2, m2)
    tl.store(out + 3, m3)
    tl.store(out + 4, m4)
    tl.store(out + 5, tl.max(rowmax, axis=0).to(tl.float32, bitcast=True).to(tl.float64))
    tl.atomic_add(nonfinite_ptr, nonfinite.to(tl.int64))
    if HITS:  # positions with a counted value: LLM.int8 hit fractions divide by them
        tl.atomic_add(positions_ptr, tl.sum((counted > 0).to(tl.int64), axis=0))


@triton.jit
def _pool_kernel(stats_ptr, out_ptr, P, BLOCK: tl.constexpr):
    """One program: the programs' [count, sum, M2, M3, M4, max] pooled, in a fixed order, into the update's
    (each program's central sums moved to the pooled mean, as stats/moments.py's `Moments.pool`)."""
    n = tl.zeros((), tl.float64)
    s1 = tl.zeros((), tl.float64)
    top = tl.zeros((), tl.float64)
    for start in range(0, P, BLOCK):
        i = start + tl.arange(0, BLOCK)
        n += tl.sum(tl.load(stats_ptr + i * 6, mask=i < P, other=0.0), axis=0)
        s1 += tl.sum(tl.load(stats_ptr + i * 6 + 1, mask=i < P, other=0.0), axis=0)
        top = tl.maximum(top, tl.max(tl.load(stats_ptr + i * 6 + 5, mask=i < P, other=0.0), axis=0))
    mean = s1 / tl.maximum(n, 1.0)
    m2 = tl.zeros((), tl.float64)
    m3 = tl.zeros((), tl.float64)
    m4 = tl.zeros((), tl.float64)
    for start in range(0, P, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ni = tl.load(stats_ptr + i * 6, mask=i < P, other=0.0)
        si = tl.load(stats_ptr + i * 6 + 1, mask=i < P, other=0.0)
        a2 = tl.load(stats_ptr + i * 6 + 2, mask=i < P, other=0.0)
        a3 = tl.load(stats_ptr + i * 6 + 3, mask=i < P, other=0.0)
        a4 = tl.load(stats_ptr + i * 6 + 4, mask=i < P, other=0.0)
        d = tl.where(ni > 0, si / tl.maximum(ni, 1.0) - mean, 0.0)
        d2 = d * d
        m2 += tl.sum(a2 + ni * d2, axis=0)
        m3 += tl.sum(a3 + 3.0 * d * a2 + ni * d2 * d, axis=0)
        m4 += tl.sum(a4 + 4.0 * d * a3 + 6.0 * d2 * a2 + ni * d2 * d2, axis=0)
    tl.store(out_ptr, n)
    tl.store(out_ptr + 1, s1)
    tl.store(out_ptr + 2, m2)
    tl.store(out_ptr + 3, m3)
    tl.store(out_ptr + 4, m4)
    tl.store(out_ptr + 5, top)


def tiles(rows: int, width: int) -> tuple[int, int]:
    """(BR, BW): rows per program and columns per chunk. On a GPU about 4,096 values per chunk and at most 512
    columns (a 1,376-wide row in three chunks wastes 10% of a chunk's lanes, not 33%); in the interpreter, which
    costs about 12 ms per program whatever its size, as large as 2^16 values."""
    bw = min(triton.next_power_of_2(max(width, 1)), 4096 if interpreting() else 512)
    budget = 1 << 16 if interpreting() else 4096
    br = max(1, min(budget // bw, triton.next_power_of_2(max(rows, 1))))
    return br, bw


class SiteKernel:
    """The fused update of one site, with its buffers kept per activation shape (allocated once, so the update can be
    captured in a CUDA graph). Running state it adds to in place: the histogram counts, the non-finite count, and where
    the site has them the per-column maxima (float32), LLM.int8 hits per column (int64) and the positions counted."""

    def __init__(self):
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, valid: torch.Tensor | None, hist: torch.Tensor, nonfinite: torch.Tensor,
                 colmax: torch.Tensor | None = None, hits: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, threshold: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """([count, sum, M2, M3, M4, max |x|] float64 of the values counted, each row's max |x| shaped x.shape[:-1]).
        `valid` (bool, broadcastable to x) leaves values out; `hits` counts |x| ≥ `threshold` (> 0) per column."""
        x = x.contiguous()
        width = x.shape[-1] if x.dim() else 1
        rows = x.numel() // max(width, 1)
        br, bw = tiles(rows, width)
        programs = triton.cdiv(rows, br)
        key = (x.shape, x.device)
        if key not in self._buffers:
            self._buffers[key] = (torch.empty(programs, STATS, dtype=torch.float64, device=x.device),
                                  torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))
        stats, rowmax = self._buffers[key]
        mask, lead, strides = _mask_view(x, valid)
        threshold_bits = struct.unpack("<i", struct.pack("<f", threshold))[0]  # |x| ≥ t compared as bit patterns
        _site_kernel[(programs,)](
            x, mask if mask is not None else x, stats, rowmax, hist,
            colmax.view(torch.int32) if colmax is not None else stats, hits if hits is not None else stats,
            nonfinite, positions if positions is not None else nonfinite, rows, width, lead[1], lead[2], *strides,
            threshold_bits, MASKED=mask is not None, COLMAX=colmax is not None, HITS=hits is not None, BR=br, BW=bw,
            CHUNKS=triton.cdiv(width, bw))
        entry = torch.empty(STATS, dtype=torch.float64, device=x.device)
        _pool_kernel[(1,)](stats, entry, programs, BLOCK=POOL_BLOCK)
        return entry, rowmax


def _mask_view(x: torch.Tensor, valid: torch.Tensor | None):
    """(the mask as int8 or None, x's leading dims as [A, D1, D2], the mask's strides over [A, D1, D2, W] in
    elements): a broadcast mask is read in place, through stride 0 along the dims it repeats."""
    shape = (1,) * max(0, 4 - x.dim()) + tuple(x.shape)[-4:] if x.dim() <= 4 else None
    if shape is None:  # more than 4 dims: the leading ones flattened, the mask expanded to them
        shape = (x.shape[:-3].numel(), *x.shape[-3:])
        valid = None if valid is None else valid.expand(x.shape).reshape(shape)
    if valid is None:
        return None, shape[:3], (0, 0, 0, 0)
    mask = valid.expand(*x.shape) if x.dim() <= 4 else valid
    strides = (0,) * (4 - mask.dim()) + mask.stride()
    strides = tuple(0 if size == 1 else s for size, s in zip(shape, strides))
    return mask.view(torch.int8), shape[:3], strides
