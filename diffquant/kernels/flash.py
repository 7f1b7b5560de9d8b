"""Causal, grouped-query flash attention that keeps the attention-logit statistics on the way (Triton).

Each program takes BM query rows of one (sequence, head) and walks the keys in tiles of BN, as FlashAttention does
(online softmax: a running row max and denominator, the output rescaled as the max grows; Triton's fused-attention
tutorial has the structure). Each tile of logits QKᵀ·scale is computed once, in float32 (`input_precision="ieee"` for
float32 inputs; bfloat16 inputs give bfloat16 logits, rounded where the explicit attention rounds them), and serves:

- the statistics of the visible logits only (causality, a key-padding mask or a 4-D mask decide): count, sum and
  central power sums merged tile after tile, the row maxima of |x|, the |x| histogram by integer atomics and the
  non-finite count, as kernels/site.py computes them for a tensor (the contract of diffquant/kernels);
- each row's first visible key and its logit, for the attention sinks' first-key mass (softmax of that logit against
  the final row max and denominator);
- optionally, fake quantization of the logits before the softmax with one scale per row (`Quant`: per tensor and
  per head are per-row scales that happen to be equal; `row_absmax`, a first pass over QKᵀ, gives the ranges);
- the online softmax and the product with V. V may be wider than Q and K and have its own head map
  (`v_div`, `v_mod`): DIFF's paired values [V1 | V2] of width 2d serve maps j and j + H/2.

The top-k of the logits needs the values of its rows: `logit_rows` recomputes chosen rows with the same tile code
(the same q tile and key tiles, so the same bits), and stats/topk.py searches them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from diffquant.kernels import interpreting
from diffquant.kernels.site import POOL_BLOCK, STATS, _pool_kernel, count_bins, merge_moments, tile_moments

NO_MASK, KEY_MASK, FULL_MASK = 0, 1, 2  # the masks a call may carry besides causality: none, [batch, key], 4-D


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """a @ b accumulated in float32. WIDEN (Triton's interpreter, whose dot of bfloat16 tiles multiplies their raw
    bits) widens both to float32 first: the same exact products, summed in float32."""
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _round_bf16(x):
    """x (float32) rounded to the nearest bfloat16, ties to even, as torch rounds (integer operations: the
    interpreter's own conversion truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _logit_tile(q, k_ptr, cols, dq, K, D, skn, scale, PRECISION: tl.constexpr, BF16_LOGITS: tl.constexpr,
                WIDEN: tl.constexpr):
    """Logits of the q tile against key tile `cols`, as the explicit attention computes them: matmul, then the
    scale; in bfloat16 each of the two rounded to bfloat16, as torch rounds a bfloat16 matmul and product."""
    kt = tl.load(k_ptr + cols[None, :].to(tl.int64) * skn + dq[:, None], mask=(cols < K)[None, :] & (dq < D)[:, None],
                 other=0.0)
    s = _dot(q, kt, PRECISION, WIDEN)
    if BF16_LOGITS:
        s = _round_bf16(_round_bf16(s) * scale)
    else:
        s = s * scale
    return s


@triton.jit
def _fake_quantize(s, vis, scale, qmax, BF16_LOGITS: tl.constexpr):
    """Symmetric integer fake quantization of the visible logits with each row's `scale`, as quant/numerics/math.py's
    `fake_quantize` computes it (x / scale correctly rounded, rounded half to even, clamped to ±qmax, times scale;
    in the logits' dtype), masked ones kept as they were. Rounding: adding and taking away 1.5·2²³ leaves the
    nearest integer (ties to even) of any |v| ≤ 2²² in float32, and the clamp comes first (the same result, since
    qmax is an integer)."""
    v = tl.math.div_rn(s, scale[:, None])
    v = tl.minimum(tl.maximum(v, -qmax), qmax)
    v = (v + 12582912.0) - 12582912.0
    y = tl.where(s != s, s, v * scale[:, None])  # NaN stays NaN
    if BF16_LOGITS:
        y = _round_bf16(y)
    return tl.where(vis, y, s)


@triton.jit
def _visible(rows, cols, Q, K, offset, mask_ptr, smm, smn, CAUSAL: tl.constexpr, MASK: tl.constexpr):
    """Which (query, key) pairs of a tile may attend: inside the call, causal (keys up to the query's own, bottom-right
    aligned), and the mask's entries (`mask_ptr` already at the sequence's row)."""
    vis = (rows < Q)[:, None] & (cols < K)[None, :]
    if CAUSAL:
        vis = vis & (cols[None, :] <= rows[:, None] + offset)
    if MASK == 1:
        vis = vis & (tl.load(mask_ptr + cols.to(tl.int64) * smn, mask=cols < K, other=0) != 0)[None, :]
    if MASK == 2:
        vis = vis & (tl.load(mask_ptr + rows[:, None].to(tl.int64) * smm + cols[None, :].to(tl.int64) * smn,
                             mask=(rows < Q)[:, None] & (cols < K)[None, :], other=0) != 0)
    return vis


@triton.jit
def _flash_kernel(q_ptr, k_ptr, v_ptr, out_ptr, mask_ptr, stats_ptr, rowmax_ptr, hist_ptr, nonfinite_ptr, first_ptr,
                  mass_ptr, logits_ptr, qscale_ptr, sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, som, soh, smb,
                  smm, smn, H, Q, K, D, DV, kv_div, v_div, v_mod, offset, scale, qmax,
                  CAUSAL: tl.constexpr, MASK: tl.constexpr, STATS: tl.constexpr, QUANT: tl.constexpr,
                  STATS_QUANTIZED: tl.constexpr, WRITE_LOGITS: tl.constexpr,
                  BF16_LOGITS: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, DP: tl.constexpr, DVP: tl.constexpr):
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = qb * BM + tl.arange(0, BM)
    dq = tl.arange(0, DP)
    dv = tl.arange(0, DVP)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h * sqh + rows[:, None].to(tl.int64) * sqm + dq[None, :],
                mask=(rows < Q)[:, None] & (dq < D)[None, :], other=0.0)
    k_ptr += b.to(tl.int64) * skb + (h // kv_div) * skh
    v_ptr += b.to(tl.int64) * svb + ((h // v_div) % v_mod) * svh
    mask_ptr += b.to(tl.int64) * smb
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, DVP], tl.float32)
    first = tl.full([BM], K, tl.int32)  # each row's first visible key (K: none yet)
    s_first = tl.zeros([BM], tl.float32)
    n = tl.zeros((), tl.float64)
    s1 = tl.zeros((), tl.float64)
    m2 = tl.zeros((), tl.float64)
    m3 = tl.zeros((), tl.float64)
    m4 = tl.zeros((), tl.float64)
    rowmax = tl.zeros([BM], tl.int32)
    nonfinite = tl.zeros((), tl.int32)
    row_index = bh.to(tl.int64) * Q + rows
    if QUANT:
        qscale = tl.load(qscale_ptr + row_index, mask=rows < Q, other=1.0)
    hi = K
    if CAUSAL:
        hi = tl.minimum(K, (qb + 1) * BM + offset)
    for start in range(0, hi, BN):
        cols = start + tl.arange(0, BN)
        s = _logit_tile(q, k_ptr, cols, dq, K, D, skn, scale, PRECISION, BF16_LOGITS, WIDEN)
        vis = _visible(rows, cols, Q, K, offset, mask_ptr, smm, smn, CAUSAL, MASK)
        if QUANT and STATS_QUANTIZED:
            s = _fake_quantize(s, vis, qscale, qmax, BF16_LOGITS)
        if STATS:
            abits = s.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            finite = abits < 0x7F800000
            ok = vis & finite
            nonfinite += tl.sum(tl.sum((vis & ~finite).to(tl.int32), axis=1), axis=0)
            cn, cs, c2, c3, c4 = tile_moments(s, ok)
            n, s1, m2, m3, m4 = merge_moments(n, s1, m2, m3, m4, cn, cs, c2, c3, c4)
            abits = tl.where(ok, abits, 0)
            rowmax = tl.maximum(rowmax, tl.max(abits, axis=1))
            count_bins(hist_ptr, abits, ok)
        if QUANT and not STATS_QUANTIZED:
            s = _fake_quantize(s, vis, qscale, qmax, BF16_LOGITS)
        if WRITE_LOGITS:  # for tests and checks: the logits the softmax reads, as this kernel computed them
            tl.store(logits_ptr + (bh.to(tl.int64) * Q + rows[:, None]) * K + cols[None, :], s,
                     mask=(rows < Q)[:, None] & (cols < K)[None, :])
        fc = tl.min(tl.where(vis, cols[None, :], K), axis=1)
        new = (first == K) & (fc < K)
        s_first = tl.where(new, tl.max(tl.where(cols[None, :] == fc[:, None], s, float("-inf")), axis=1), s_first)
        first = tl.where(new, fc, first)
        scores = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + cols[:, None].to(tl.int64) * svn + dv[None, :],
                    mask=(cols < K)[:, None] & (dv < DV)[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN)
        m_i = m_new
    out = tl.where((l_i > 0)[:, None], acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(out_ptr + b.to(tl.int64) * sob + rows[:, None].to(tl.int64) * som + h * soh + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(rows < Q)[:, None] & (dv < DV)[None, :])
    mass = tl.exp(s_first - tl.where(m_i == float("-inf"), 0.0, m_i)) / tl.where(l_i > 0, l_i, 1.0)
    tl.store(mass_ptr + row_index, tl.where(first < K, mass, 0.0), mask=rows < Q)
    tl.store(first_ptr + row_index, first, mask=rows < Q)
    if STATS:
        tl.store(rowmax_ptr + row_index, rowmax.to(tl.float32, bitcast=True), mask=rows < Q)
        out_stats = stats_ptr + (bh.to(tl.int64) * tl.num_programs(0) + qb) * 6
        tl.store(out_stats, n)
        tl.store(out_stats + 1, s1)
        tl.store(out_stats + 2, m2)
        tl.store(out_stats + 3, m3)
        tl.store(out_stats + 4, m4)
        tl.store(out_stats + 5, tl.max(rowmax, axis=0).to(tl.float32, bitcast=True).to(tl.float64))
        tl.atomic_add(nonfinite_ptr, nonfinite.to(tl.int64))


@triton.jit
def _rows_kernel(q_ptr, k_ptr, mask_ptr, sel_ptr, values_ptr, ok_ptr, qscale_ptr, sqb, sqh, sqm, skb, skh, skn, smb,
                 smm, smn, H, Q, K, D, kv_div, offset, scale, qmax, CAUSAL: tl.constexpr, MASK: tl.constexpr,
                 QUANT: tl.constexpr,
                 BF16_LOGITS: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, DP: tl.constexpr):
    """The logits (and visibility) of chosen rows (flat indices over [batch, head, query]), each computed in the q
    tile the flash kernel computes it in: the same bits (fake-quantized with QUANT, as the statistics saw them)."""
    i = tl.program_id(0)
    r = tl.load(sel_ptr + i)
    b = r // (H * Q)
    h = (r // Q) % H
    qi = r % Q
    rows = (qi // BM) * BM + tl.arange(0, BM)
    dq = tl.arange(0, DP)
    q = tl.load(q_ptr + b * sqb + h * sqh + rows[:, None].to(tl.int64) * sqm + dq[None, :],
                mask=(rows < Q)[:, None] & (dq < D)[None, :], other=0.0)
    k_ptr += b * skb + (h // kv_div) * skh
    mask_ptr += b * smb
    chosen = rows[:, None] == qi
    if QUANT:
        qscale = tl.load(qscale_ptr + (r - qi) + rows, mask=rows < Q, other=1.0)
    for start in range(0, K, BN):
        cols = start + tl.arange(0, BN)
        s = _logit_tile(q, k_ptr, cols, dq, K, D, skn, scale, PRECISION, BF16_LOGITS, WIDEN)
        vis = _visible(rows, cols, Q, K, offset, mask_ptr, smm, smn, CAUSAL, MASK)
        if QUANT:
            s = _fake_quantize(s, vis, qscale, qmax, BF16_LOGITS)
        tl.store(values_ptr + i.to(tl.int64) * K + cols, tl.max(tl.where(chosen, s, float("-inf")), axis=0),
                 mask=cols < K)
        tl.store(ok_ptr + i.to(tl.int64) * K + cols, tl.max(tl.where(chosen, vis.to(tl.int8), 0), axis=0), mask=cols < K)


@triton.jit
def _absmax_kernel(q_ptr, k_ptr, mask_ptr, rowmax_ptr, sqb, sqh, sqm, skb, skh, skn, smb, smm, smn, H, Q, K, D, kv_div,
                   offset, scale, CAUSAL: tl.constexpr, MASK: tl.constexpr, BF16_LOGITS: tl.constexpr,
                   PRECISION: tl.constexpr, WIDEN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   DP: tl.constexpr):
    """Each row's max |logit| over its visible finite logits: the range a dynamic quantizer's scale needs before any
    logit is quantized (a first pass over QKᵀ, without softmax or V)."""
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = qb * BM + tl.arange(0, BM)
    dq = tl.arange(0, DP)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h * sqh + rows[:, None].to(tl.int64) * sqm + dq[None, :],
                mask=(rows < Q)[:, None] & (dq < D)[None, :], other=0.0)
    k_ptr += b.to(tl.int64) * skb + (h // kv_div) * skh
    mask_ptr += b.to(tl.int64) * smb
    rowmax = tl.zeros([BM], tl.int32)
    hi = K
    if CAUSAL:
        hi = tl.minimum(K, (qb + 1) * BM + offset)
    for start in range(0, hi, BN):
        cols = start + tl.arange(0, BN)
        s = _logit_tile(q, k_ptr, cols, dq, K, D, skn, scale, PRECISION, BF16_LOGITS, WIDEN)
        vis = _visible(rows, cols, Q, K, offset, mask_ptr, smm, smn, CAUSAL, MASK)
        abits = s.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        rowmax = tl.maximum(rowmax, tl.max(tl.where(vis & (abits < 0x7F800000), abits, 0), axis=1))
    tl.store(rowmax_ptr + bh.to(tl.int64) * Q + rows, rowmax.to(tl.float32, bitcast=True), mask=rows < Q)


class Masking(NamedTuple):
    """Which keys each query may attend besides `causal`: no mask, a [batch, key] mask (`kind` KEY_MASK) or a
    [batch|1, 1, query, key] one (FULL_MASK), as int8 with its strides."""

    causal: bool
    kind: int = NO_MASK
    mask: torch.Tensor | None = None

    def strides(self) -> tuple[int, int, int]:
        if self.kind == KEY_MASK:
            return self.mask.stride(0), 0, self.mask.stride(1)
        if self.kind == FULL_MASK:
            return (self.mask.stride(0) if self.mask.shape[0] > 1 else 0), self.mask.stride(2), self.mask.stride(3)
        return 0, 0, 0


class Quant(NamedTuple):
    """Symmetric integer fake quantization of the logits before the softmax: one scale per (sequence, head, query) row
    ([batch, H, Q] float32), the grid's largest code, and whether the statistics see the quantized logits (their
    observer comes after the quantizer) or the logits as computed."""

    scales: torch.Tensor
    qmax: float
    stats_quantized: bool = False


class Flash(NamedTuple):
    """What the flash kernel gives: the attention output, each row's first visible key and the softmax mass on it
    ([batch, head, query]; key K where none), and with statistics the update's [count, sum, M2, M3, M4, max |x|] and
    the row maxima of |x| ([batch, head, query])."""

    out: torch.Tensor
    first: torch.Tensor
    mass: torch.Tensor
    entry: torch.Tensor | None
    rowmax: torch.Tensor | None
    logits: torch.Tensor | None


def tiles(q_len: int, k_len: int) -> tuple[int, int]:
    """(BM, BN): 64 × 64 (on a GPU; in the interpreter, where a program and a tile step cost about the same whatever
    their size, as small as the call allows, at least 16)."""
    if interpreting():
        return min(64, max(16, triton.next_power_of_2(q_len))), min(64, max(16, triton.next_power_of_2(k_len)))
    return 64, 64


def _common(q: torch.Tensor, k: torch.Tensor, masking: Masking, scale: float) -> dict:
    bm, bn = tiles(q.shape[2], k.shape[2])
    return dict(CAUSAL=masking.causal, MASK=masking.kind, BF16_LOGITS=q.dtype == torch.bfloat16,
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32", WIDEN=interpreting(), BM=bm, BN=bn,
                DP=max(16, triton.next_power_of_2(q.shape[3])))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masking: Masking, scale: float, *, v_div: int,
              v_mod: int, hist: torch.Tensor | None = None, nonfinite: torch.Tensor | None = None,
              quant: Quant | None = None, out_dtype: torch.dtype | None = None, write_logits: bool = False) -> Flash:
    """Attention of q [batch, H, Q, d] over k [batch, H_kv, K, d] and v [batch, H_v, K, d_v] (query head h reads key
    head h // (H / H_kv) and value head (h // v_div) % v_mod); the output [batch, Q, H, d_v] in `out_dtype` (q's by
    default). With `hist` (int64 counts) and `nonfinite`, the visible logits' statistics are computed too (added to
    those two in place); with `quant`, the logits are fake-quantized before the softmax. `write_logits` (tests,
    checks) also returns the logits the softmax read, [batch, H, Q, K]."""
    batch, heads, q_len, d = q.shape
    k_len, dv = k.shape[2], v.shape[3]
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("flash attention takes tensors whose last dim is contiguous")
    common = _common(q, k, masking, scale)
    bm = common["BM"]
    blocks = triton.cdiv(q_len, bm)
    out = torch.empty(batch, q_len, heads, dv, dtype=out_dtype or q.dtype, device=q.device)
    first = torch.empty(batch, heads, q_len, dtype=torch.int32, device=q.device)
    mass = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device)
    stats = hist is not None
    per_program = torch.empty(batch * heads * blocks, STATS, dtype=torch.float64, device=q.device) if stats else mass
    rowmax = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device) if stats else None
    logits = torch.empty(batch, heads, q_len, k_len, dtype=torch.float32, device=q.device) if write_logits else None
    mask = masking.mask if masking.mask is not None else first
    _flash_kernel[(blocks, batch * heads)](
        q, k, v, out, mask, per_program, rowmax if stats else mass, hist if stats else first,
        nonfinite if stats else first, first, mass, logits if write_logits else mass,
        quant.scales if quant else mass, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2), *masking.strides(),
        heads, q_len, k_len, d, dv, heads // k.shape[1], v_div, v_mod, k_len - q_len, scale,
        quant.qmax if quant else 0.0, STATS=stats, QUANT=quant is not None,
        STATS_QUANTIZED=bool(quant and quant.stats_quantized), WRITE_LOGITS=write_logits,
        DVP=max(16, triton.next_power_of_2(dv)), **common)
    entry = None
    if stats:
        entry = torch.empty(STATS, dtype=torch.float64, device=q.device)
        _pool_kernel[(1,)](per_program, entry, per_program.shape[0], BLOCK=POOL_BLOCK)
    return Flash(out, first, mass, entry, rowmax, logits)


def logit_rows(q: torch.Tensor, k: torch.Tensor, masking: Masking, scale: float, rows: torch.Tensor,
               quant: Quant | None = None):
    """(values [n, K] float32, visible [n, K] bool) of the logits rows `rows` (flat indices over [batch, H, Q]), as the
    flash kernel's statistics saw them (quantized where `quant.stats_quantized`)."""
    batch, heads, q_len, d = q.shape
    k_len = k.shape[2]
    values = torch.empty(rows.numel(), k_len, dtype=torch.float32, device=q.device)
    ok = torch.empty(rows.numel(), k_len, dtype=torch.int8, device=q.device)
    quantized = quant is not None and quant.stats_quantized
    if rows.numel():
        mask = masking.mask if masking.mask is not None else ok
        _rows_kernel[(rows.numel(),)](
            q, k, mask, rows.contiguous(), values, ok, quant.scales if quantized else values, q.stride(0), q.stride(1),
            q.stride(2), k.stride(0), k.stride(1), k.stride(2), *masking.strides(), heads, q_len, k_len, d,
            heads // k.shape[1], k_len - q_len, scale, quant.qmax if quantized else 0.0, QUANT=quantized,
            **_common(q, k, masking, scale))
    return values, ok.bool()


def row_absmax(q: torch.Tensor, k: torch.Tensor, masking: Masking, scale: float) -> torch.Tensor:
    """[batch, H, Q] float32: each row's max |logit| over its visible finite logits (0 where none), computed by the
    flash kernel's tile code: what a dynamic logit quantizer reads before quantizing (`_absmax_kernel`)."""
    batch, heads, q_len, d = q.shape
    common = _common(q, k, masking, scale)
    rowmax = torch.empty(batch, heads, q_len, dtype=torch.float32, device=q.device)
    mask = masking.mask if masking.mask is not None else rowmax
    _absmax_kernel[(triton.cdiv(q_len, common["BM"]), batch * heads)](
        q, k, mask, rowmax, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        *masking.strides(), heads, q_len, k.shape[2], d, heads // k.shape[1], k.shape[2] - q_len, scale, **common)
    return rowmax
