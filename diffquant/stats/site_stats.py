"""All streaming statistics of one site, and the observer tap that feeds them."""

from __future__ import annotations

from typing import NamedTuple

import torch

from diffquant.compiled import CompiledOrEager
from diffquant.kernels import register_check, resolve as resolve_kernels
from diffquant.stats.histogram import NBINS, AbsHistogram, abs_magnitude_bins, magnitude_bins
from diffquant.stats.moments import Moments, shift_central, sum64
from diffquant.stats.topk import TopK
from diffquant.taps.context import Block

QUANTILES = {"median": 0.5, "p99": 0.99, "p99.9": 0.999, "p99.99": 0.9999}
_CHANNEL_DIMS = ("channel", "head", "out_channel")
_POSITION_DIMS = ("pos", "q_pos")
TOKEN_DIMS = ("batch", "pos", "channel")


class Passes(NamedTuple):
    """What one update's full-tensor passes give (`_passes`)."""

    ok: torch.Tensor | None  # the values counted (bool, broadcastable to x); None: all of them
    bins: torch.Tensor  # every value's histogram bin (left-out values in bin 0; with `spread`, in their own bins)
    left_out: torch.Tensor  # how many values were left out (masked or non-finite)
    n: torch.Tensor  # float64 count of the values counted
    s1: torch.Tensor  # their float64 sum
    m2: torch.Tensor  # float64 central power sums about their own mean
    m3: torch.Tensor
    m4: torch.Tensor
    rowmax: torch.Tensor  # max |x| along the last dim (0 for rows without a counted value)
    chan: torch.Tensor | None  # max |x| per channel (head) and per position (query), where the site has them
    pos: torch.Tensor | None
    hits: torch.Tensor | None  # LLM.int8 hit counts per channel ([batch, pos, channel] sites)
    nonfinite: torch.Tensor  # non-finite values among the valid ones (counted only with `check`)
    checked: bool  # `check` was on (else nonfinite is 0)


def _zero_where_not(t: torch.Tensor, ok: torch.Tensor, dense: int) -> torch.Tensor:
    """t with 0 where `ok` is False, in t's own buffer when `dense` > 0: `ok` is then True in every column before
    `dense` (a causal block: only its last columns hold masked keys), so only the columns from there are masked."""
    if not dense:
        return torch.where(ok, t, 0.0)
    t[..., dense:].masked_fill_(~ok[..., dense:], 0.0)
    return t


def _passes(x: torch.Tensor, valid: torch.Tensor | None, check: bool, chan_dim: int | None, pos_dim: int | None,
            threshold: float | None, dense: int = 0, spread: bool = False) -> Passes:
    """Every full-tensor pass of one update in one function, so torch.compile can fuse them: count, sum and
    central power sums (float32 terms, float64 sums), row maxima of |x|, maxima along the channel and
    position dims, LLM.int8 hit counts per channel. Values outside `valid` (broadcastable) are left out;
    with `check`, non-finite values too (and counted). `dense`: `valid` is True in every column before it (see
    `_zero_where_not`; 0 when not known). `spread`: left-out values keep the bins of their own |x| (to be added with
    weight 0, `AbsHistogram.add_bins`' `counted`) instead of bin 0, which on a GPU would take every one of them as
    atomic adds to one address. x is not written to."""
    ok, left_out = valid, None
    if check:
        finite = torch.isfinite(x)
        ok = finite if valid is None else finite & valid
        nonfinite = (~ok).sum() if valid is None else (valid & ~finite).sum()
        if valid is None:
            left_out = nonfinite  # the same count: no second pass over the mask
        dense = 0  # a non-finite value may sit in any column
    else:
        nonfinite = torch.zeros((), dtype=torch.int64, device=x.device)
    if ok is None:
        left_out = torch.zeros((), dtype=torch.int64, device=x.device)
        xz = x
    else:  # left-out values become 0 (harmless in maxima; uncounted from histogram bin 0 by the caller)
        if left_out is None:
            left_out = x.numel() - ok.sum() * (x.numel() // ok.numel())  # a broadcast mask repeats
        xz = _zero_where_not(x.clone() if dense else x, ok, dense)
    n = (x.numel() - left_out).double()
    s1 = sum64(xz)
    mean = (s1 / n.clamp_min(1)).to(x.dtype)
    # left out: no deviation at all (xz - mean is x - mean wherever ok)
    d = xz - mean if ok is None else _zero_where_not(xz - mean, ok, dense)
    d2 = d * d
    e1 = sum64(d)
    p2 = sum64(d2)
    p3 = sum64(d.mul_(d2))  # d³ and d⁴ in place (d and d2 are not read again): the same products as d2 * d and
    p4 = sum64(d2.mul_(d2))  # d2 * d2, without two more full-size tensors to allocate
    # About the exact mean, not its float32 rounding (M₃ would be off by 3δ·M₂: ~6e-5 of Σ|x − μ|³ at a mean 1,000 σ
    # from 0), and the sum from the deviations (Σd is exact to float32 rounding of values near σ; the row sums of x,
    # near μ, are not): the mean is mean + Σd/n
    s1 = n * mean.double() + e1
    m2, m3, m4 = shift_central(n, e1 / n.clamp_min(1), e1, p2, p3, p4)
    a = xz.abs_() if xz is not x else x.abs()  # xz is not read again once it is our own copy
    rowmax = a.amax(dim=-1)
    chan = pos = hits = None
    if chan_dim is not None:
        src = a if chan_dim == x.dim() - 1 else rowmax
        other = tuple(i for i in range(src.dim()) if i != chan_dim)
        chan = (src.amax(dim=other) if other else src).clamp_min(0)
    if pos_dim is not None:
        other = tuple(i for i in range(rowmax.dim()) if i != pos_dim)
        pos = rowmax.amax(dim=other).clamp_min(0)
    if threshold is not None:  # [batch, pos, channel] sites
        # |x| >= t counted as all positions less those where |x| - t is negative (exactly those where |x| < t):
        # an arithmetic shift by 31 makes the sign bit -1, summed per channel in int32. In d's buffer (free since
        # m3); a third of the cost of summing a boolean mask
        below = torch.sub(a, threshold, out=d).view(torch.int32).bitwise_right_shift_(31)
        hits = (x.shape[0] * x.shape[1] + below.sum(dim=(0, 1), dtype=torch.int32)).long()
    if spread and ok is not None:  # NaN's patterns lie past the last bin: clamped (their weight is 0)
        bins = magnitude_bins(x).clamp_max_(NBINS - 1)
    else:
        bins = abs_magnitude_bins(a, in_place=True)  # a is not read again
    return Passes(ok, bins, left_out, n, s1, m2, m3, m4, rowmax, chan, pos, hits, nonfinite, check)


_FOLD_EVERY = 64  # updates whose sums wait in SiteStats._batches before they are folded in
# Devices where reading a value back to the host costs nothing (on CPU it is in host memory already). There an
# update first passes over the values unchecked and reads their sum back to decide whether to pass again leaving
# non-finite values out (the check's own passes, isfinite and a full-size mask, would add about a third to an
# update's time), and the top-k reads back whether any of its rows can still enter it (`TopK.add`). Elsewhere reading
# a value back makes the host wait for the device, so every update leaves non-finite values out in one pass (`check`)
# and searches its top-k candidates whatever they hold, which gives the same statistics (tests/test_hot_path.py).
FREE_READS = frozenset({"cpu"})


_COMPILED_PASSES = CompiledOrEager(_passes)  # shared by all sites: one compile per argument pattern


class SiteStats:
    """Pooled moments, top-k with locations, |x| histogram, per-channel and per-position absmax,
    non-finite count, and per-pass (Bondarenko et al.) kurtosis and ∞-norm, for one site."""

    kernels: str | None = None  # class defaults: profiles saved before these were recorded read None
    path: str | None = None
    _kernel = None  # the Triton path's kernel and buffers (kernels/site.py), made at its first update

    def __init__(self, dims: tuple[str, ...], k: int = 100, device=None, outlier_threshold: float = 6.0,
                 compile: bool = False, kernels: str | None = None):
        self.dims, self.k, self.threshold, self.compile = dims, k, outlier_threshold, compile
        self.kernels = kernels  # "auto", "triton", "torch" or None (the choice in force): see diffquant/kernels
        self.path: str | None = None  # the path that computed these statistics: "torch" or "triton"
        self.moments = Moments(device)
        self.topk = TopK(k, len(dims), device)
        self.hist = AbsHistogram(device)
        self.channel_absmax: torch.Tensor | None = None
        self.position_absmax: torch.Tensor | None = None
        # LLM.int8 outlier features: per channel, how many positions have |x| >= threshold
        self.channel_hits: torch.Tensor | None = None
        self.positions = torch.zeros((), dtype=torch.int64, device=device)
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        # per forward pass: sum and max of kurtosis and ∞-norm
        self.passes = 0
        self.pass_kurt = torch.zeros(2, dtype=torch.float64, device=device)
        self.pass_inf = torch.zeros(2, dtype=torch.float64, device=device)
        self._batches: list[torch.Tensor] = []  # per update: count, sum, central power sums, ∞-norm

    def update(self, x: torch.Tensor, valid: torch.Tensor | None = None, input_ids=None, row_offset: int = 0,
               block: tuple | None = None) -> None:
        """Add one activation (values where `valid`, broadcastable to x, is True; non-finite ones counted
        apart). `block` (taps/context.py's `Block`) when x is one query block of an attention call: its positions
        are offset, and the blocks of one call make one pass of the per-pass statistics. Reads nothing back to the
        host except on the devices in FREE_READS. The first update resolves `kernels` for x's device (`path`)."""
        x = x.detach()
        if self.path is None:
            self.path = resolve_kernels(self.kernels, x.device)
        offset = 0 if block is None else block[0]
        free_reads = x.device.type in FREE_READS and self.path == "torch"
        if self.path == "triton":
            entry, rowmax, ok = self._fused_update(x, valid, offset)
        else:
            entry, rowmax, ok = self._torch_update(x, valid, block, free_reads)
        if block is not None and block[0] > 0 and self._batches:
            entry = _same_pass(self._batches.pop(), entry)  # one attention call: one pass
        self._batches.append(entry)
        if len(self._batches) >= _FOLD_EVERY and (block is None or block[1] == block[2]):
            self._fold()
        self.topk.add(x, ok, self.dims, input_ids, row_offset, rowmax, offset,
                      None if block is None else block[2], read_back=free_reads, finite=self.path == "triton")

    def update_from_kernel(self, entry: torch.Tensor, rowmax: torch.Tensor, shape: torch.Size, fetch_rows,
                           input_ids=None, row_offset: int = 0) -> None:
        """One update whose full-tensor passes a Triton kernel ran where the values were made (the tapped attention's
        flash kernel, taps/triton_attention.py, which adds to this site's histogram and non-finite count in place):
        its [count, sum, central power sums, ∞-norm] `entry` (one pass), the row maxima of |x| for x shaped `shape`,
        and `fetch_rows(rows)` giving (values, counted) of chosen rows (flat indices over shape[:-1]) for the top-k."""
        self.path = _paths(self.path, "triton")
        self._batches.append(entry)
        if len(self._batches) >= _FOLD_EVERY:
            self._fold()
        chan_dim, pos_dim = self._dims()
        if chan_dim is not None:
            self.channel_absmax = _elementwise_max(self.channel_absmax, _max_along(rowmax, chan_dim))
        if pos_dim is not None:
            self._add_positions(_max_along(rowmax, pos_dim), 0)
        if rowmax.numel() > min(self.k, shape.numel()):  # as `TopK.add` searches: the rows of the k largest maxima
            rows = torch.topk(rowmax.reshape(-1), min(self.k, shape.numel())).indices
            values, counted = fetch_rows(rows)
            self.topk.add_rows(rows, values, counted, shape, self.dims, input_ids, row_offset, finite=True)
        else:  # every row: the whole tensor
            values, counted = fetch_rows(torch.arange(rowmax.numel(), device=rowmax.device))
            self.topk.add(values.reshape(shape), counted.reshape(shape), self.dims, input_ids, row_offset, finite=True)

    def _torch_update(self, x: torch.Tensor, valid, block, free_reads: bool):
        """The torch path (`_passes`): every statistic but the top-k. Returns (the update's [count, sum, central power
        sums, ∞-norm], the row maxima of |x|, the values counted)."""
        if x.dtype != torch.float32:
            x = x.float()
        dense = block.dense if isinstance(block, Block) else 0
        if free_reads:
            out = self._passes(x, valid, False, dense)
            if not bool(torch.isfinite(out.s1)):  # on CPU a read of host memory, not a wait for a device
                out = self._passes(x, valid, True, dense)  # inf or NaN among the values: leave them out
            self.hist.add_bins(out.bins, zeros_left_out=None if out.ok is None else out.left_out)
        else:  # left-out values in their own bins with weight 0: on a GPU, not all of them atomically into bin 0
            out = self._passes(x, valid, True, dense, spread=True)
            self.hist.add_bins(out.bins, counted=None if out.ok is None else out.ok.expand(x.shape))
        self.channel_absmax = _elementwise_max(self.channel_absmax, out.chan)
        self._add_positions(out.pos, 0 if block is None else block[0])
        if out.hits is not None:
            self.channel_hits = out.hits if self.channel_hits is None else self.channel_hits + out.hits
            self.positions += x.shape[0] * x.shape[1] if out.ok is None else out.ok.any(dim=-1).sum()
        if out.checked:
            self.nonfinite += out.nonfinite
        return torch.stack([out.n, out.s1, out.m2, out.m3, out.m4, out.rowmax.max().double()]), out.rowmax, out.ok

    def _fused_update(self, x: torch.Tensor, valid, offset: int):
        """The Triton path (kernels/site.py): one read of x, in its own dtype. The kernel adds the histogram, the
        non-finite count and, along x's last dim, the channel maxima and LLM.int8 hits to this site's state in place;
        maxima along other dims come from the row maxima. Returns what `_torch_update` returns (the values counted:
        `valid`; the top-k leaves non-finite ones out itself)."""
        if self._kernel is None:
            from diffquant.kernels.site import SiteKernel

            self._kernel = SiteKernel()
        if x.dim() == 0:
            x = x.reshape(1)
        chan_dim, pos_dim = self._dims()
        last = chan_dim == x.dim() - 1
        token = self.dims == TOKEN_DIMS
        if last and self.channel_absmax is None:
            self.channel_absmax = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
        if token and self.channel_hits is None:
            self.channel_hits = torch.zeros(x.shape[-1], dtype=torch.int64, device=x.device)
        entry, rowmax = self._kernel(x, valid, self.hist.counts, self.nonfinite, self.channel_absmax if last else None,
                                     self.channel_hits if token else None, self.positions if token else None,
                                     self.threshold)
        if chan_dim is not None and not last:
            self.channel_absmax = _elementwise_max(self.channel_absmax, _max_along(rowmax, chan_dim))
        if pos_dim is not None:
            self._add_positions(_max_along(rowmax, pos_dim), offset)
        return entry, rowmax, valid

    def _add_positions(self, pos: torch.Tensor | None, offset: int) -> None:
        if pos is not None and offset:
            pos = torch.nn.functional.pad(pos, (offset, 0))
        self.position_absmax = _elementwise_max(self.position_absmax, pos)

    def _dims(self) -> tuple[int | None, int | None]:
        """The channel (or head) dim and the position (or query) dim of this site, where it has them."""
        chan_dim = next((i for i, d in enumerate(self.dims) if d in _CHANNEL_DIMS), None)
        pos_dim = next((i for i, d in enumerate(self.dims) if d in _POSITION_DIMS), None)
        return chan_dim, pos_dim

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_kernel": None}  # buffers on the device: not saved with a profile

    def _passes(self, x: torch.Tensor, valid: torch.Tensor | None, check: bool, dense: int,
                spread: bool = False) -> Passes:
        chan_dim, pos_dim = self._dims()
        args = (x, valid, check, chan_dim, pos_dim, self.threshold if self.dims == TOKEN_DIMS else None, dense, spread)
        return (_COMPILED_PASSES if self.compile else _passes)(*args)

    def _fold(self) -> None:
        """Fold the pending per-update sums into the pooled moments and per-pass statistics, all at once
        (a few vector ops instead of dozens of scalar ops per update)."""
        if not self._batches:
            return
        n, s1, m2, m3, m4, inf = torch.stack(self._batches).unbind(1)
        self._batches = []
        self.moments = self.moments.merge(Moments.pool(n, s1, m2, m3, m4))
        var = m2 / n.clamp_min(1)
        kurt = torch.where(var > 0, (m4 / n.clamp_min(1)) / var.clamp_min(1e-300) ** 2, 0.0)
        inf = inf.clamp_min(0)
        self.passes += len(n)
        self.pass_kurt = torch.stack([self.pass_kurt[0] + kurt.sum(), torch.maximum(self.pass_kurt[1], kurt.max())])
        self.pass_inf = torch.stack([self.pass_inf[0] + inf.sum(), torch.maximum(self.pass_inf[1], inf.max())])

    def merge(self, other: "SiteStats") -> "SiteStats":
        self._fold()
        other._fold()
        out = SiteStats(self.dims, self.k, self.nonfinite.device, self.threshold, self.compile, self.kernels)
        out.path = _paths(self.path, other.path)
        out.moments = self.moments.merge(other.moments)
        out.topk = self.topk.merge(other.topk)
        out.hist = self.hist.merge(other.hist)
        dev = out.nonfinite.device  # self's: where a merge (or `to`) leaves every sum
        out.channel_absmax = _moved(_elementwise_max(self.channel_absmax, other.channel_absmax), dev)
        out.position_absmax = _moved(_elementwise_max(self.position_absmax, other.position_absmax), dev)
        out.nonfinite = self.nonfinite + other.nonfinite.to(dev)
        out.positions = self.positions + other.positions.to(dev)
        if self.channel_hits is None or other.channel_hits is None:
            out.channel_hits = _moved(self.channel_hits if other.channel_hits is None else other.channel_hits, dev)
        else:
            out.channel_hits = self.channel_hits.to(dev) + other.channel_hits.to(dev)
        out.passes = self.passes + other.passes
        out.pass_kurt = torch.stack([self.pass_kurt[0] + other.pass_kurt[0].to(dev),
                                     torch.maximum(self.pass_kurt[1], other.pass_kurt[1].to(dev))])
        out.pass_inf = torch.stack([self.pass_inf[0] + other.pass_inf[0].to(dev),
                                    torch.maximum(self.pass_inf[1], other.pass_inf[1].to(dev))])
        return out

    def to(self, device) -> "SiteStats":
        """A copy on another device (for gathering across ranks)."""
        out = SiteStats(self.dims, self.k, device, self.threshold, kernels=self.kernels)
        return out.merge(self)

    def summary(self, full: bool = True) -> dict:
        """Every number as plain Python, for JSON."""
        self._fold()
        s = self.moments.summary()
        s["nonfinite"] = int(self.nonfinite)
        s["absmax"] = self.topk.rank(1)
        s["top"] = {f"top{r}": self.topk.rank(r) for r in (1, 2, 3, 10, 100) if r <= self.k}
        s["quantiles"] = dict(zip(QUANTILES, self.hist.quantiles(list(QUANTILES.values()))))
        s["passes"] = self.passes
        s["kernels"] = self.path
        if self.passes:
            s["pass_kurtosis_mean"] = float(self.pass_kurt[0]) / self.passes
            s["pass_kurtosis_max"] = float(self.pass_kurt[1])
            s["pass_infnorm_mean"] = float(self.pass_inf[0]) / self.passes
            s["pass_infnorm_max"] = float(self.pass_inf[1])
        if full:
            s["topk"] = self.top_entries()
            if self.channel_absmax is not None:
                s["channel_absmax"] = [round(float(v), 6) for v in self.channel_absmax.cpu()]
            if self.channel_hits is not None:
                s["channel_hit_fraction"] = [round(float(v) / max(1, int(self.positions)), 6)
                                             for v in self.channel_hits.cpu()]
            if self.position_absmax is not None:
                s["position_absmax"] = [round(float(v), 6) for v in self.position_absmax.cpu()]
        return s

    def top_entries(self) -> list[dict]:
        rows = []
        for value, coords in zip(self.topk.values.cpu().tolist(), self.topk.coords.cpu().tolist()):
            row = {"value": value, **dict(zip(self.dims, coords[:-1]))}
            if coords[-1] >= 0:
                row["token_id"] = coords[-1]
            rows.append(row)
        return rows


def _same_pass(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two updates' [count, sum, central power sums, ∞-norm] pooled into one (blocks of one pass)."""
    pooled = Moments.pool(*torch.stack([a, b])[:, :5].unbind(1))
    return torch.stack([pooled.n, pooled.mean * pooled.n, pooled.m2, pooled.m3, pooled.m4, torch.maximum(a[5], b[5])])


def _paths(*paths: str | None) -> str | None:
    """The paths that computed statistics merged: "torch", "triton" or both ("torch+triton")."""
    names = {name for path in paths if path for name in path.split("+")}
    return "+".join(sorted(names)) or None


def _max_along(rowmax: torch.Tensor, dim: int) -> torch.Tensor:
    """Max over every dim of the row maxima but `dim` (x's dims less its last)."""
    other = tuple(i for i in range(rowmax.dim()) if i != dim)
    return (rowmax.amax(dim=other) if other else rowmax).clamp_min(0)


def _moved(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def _elementwise_max(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """Max of two vectors that may differ in length (positions): the shorter is padded with 0."""
    if a is None or b is None:
        return b if a is None else a
    b = b.to(a.device)
    if a.numel() != b.numel():
        n = max(a.numel(), b.numel())
        a = torch.nn.functional.pad(a, (0, n - a.numel()))
        b = torch.nn.functional.pad(b, (0, n - b.numel()))
    return torch.maximum(a, b)


def contract_sample() -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """The contract check's input, the same on every call: x [3, 37, 48] with 20 equal values larger than every
    other finite |x| (a tie inside the top-24 past 16 elements, where an unstable sort shows), one inf (at a
    position the mask leaves out), one NaN (at one it keeps) and one subnormal, a mask that leaves out some
    positions of each sequence, and x cut along positions into two
    blocks of unequal length (20 and 17)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 48, generator=g) * 3
    x[0, 0, :20] = 40.0  # ties past 16 elements, at the top of |x|
    x[1, 2, 3], x[2, 6, 7], x[0, 9, 1] = float("inf"), float("nan"), 1e-40  # non-finite and a subnormal
    valid = torch.rand(3, 37, 1, generator=g) > 0.2
    return x, valid, (x[:, :20], x[:, 20:])


def contract_check(device) -> str | None:
    """The Triton path against the torch path on `device`, on `contract_sample` fed as two blocks and then whole
    under its mask (diffquant.kernels.verify runs it once per device before "auto" chooses Triton): None, or what
    differs."""
    x, valid, blocks = contract_sample()
    got = {}
    for path in ("triton", "torch"):
        stats = SiteStats(("batch", "pos", "channel"), k=24, device=device, kernels=path)
        for block in blocks:
            stats.update(block.to(device), None)
        stats.update(x.to(device), valid.to(device))
        got[path] = stats.summary()
    t, r = got["triton"], got["torch"]
    for key in ("count", "nonfinite", "absmax", "top", "topk", "quantiles", "channel_absmax", "channel_hit_fraction"):
        if t.get(key) != r.get(key):
            return f"{key} differs from torch's"
    for key in ("std", "kurtosis"):
        if abs(t[key] - r[key]) > 1e-6 * abs(r[key]):
            return f"{key} {t[key]!r} against torch's {r[key]!r}"
    return None


register_check(contract_check)
