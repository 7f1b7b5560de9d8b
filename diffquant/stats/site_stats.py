"""All streaming statistics of one site, and the observer tap that feeds them."""

from __future__ import annotations

import torch

from diffquant.stats.histogram import LogHistogram, bin_index
from diffquant.stats.moments import Moments, sum64
from diffquant.stats.topk import TopK

QUANTILES = {"median": 0.5, "p99": 0.99, "p99.9": 0.999, "p99.99": 0.9999}
_CHANNEL_DIMS = ("channel", "head", "out_channel")
_POSITION_DIMS = ("pos", "q_pos")
TOKEN_DIMS = ("batch", "pos", "channel")


def _token_core(x: torch.Tensor):
    """Every elementwise statistic of an unmasked [batch, pos, channel] activation in one function, so
    torch.compile can fuse it into a few passes: sums for the moments, row maxima, histogram bins,
    channel maxima and LLM.int8 hit counts."""
    s1 = sum64(x)
    d = x - (s1 / x.numel()).to(x.dtype)
    d2 = d * d
    a = x.abs()
    return (s1, sum64(d2), sum64(d2 * d), sum64(d2 * d2), a.amax(dim=-1), bin_index(a), a.amax(dim=(0, 1)),
            (a >= 6.0).sum(dim=(0, 1)))


_compiled_core = None


def _core(compiled: bool):
    """The fused core (compiled once per process; falls back to eager where compilation fails)."""
    global _compiled_core
    if not compiled:
        return _token_core
    if _compiled_core is None:
        _compiled_core = torch.compile(_token_core, dynamic=None)
    return _compiled_core


class SiteStats:
    """Pooled moments, top-k with locations, |x| histogram, per-channel and per-position absmax,
    non-finite count, and per-pass (Bondarenko et al.) kurtosis and ∞-norm, for one site."""

    def __init__(self, dims: tuple[str, ...], k: int = 100, device=None, outlier_threshold: float = 6.0,
                 compile: bool = False):
        self.dims, self.k, self.threshold, self.compile = dims, k, outlier_threshold, compile
        self.moments = Moments(device)
        self.topk = TopK(k, len(dims), device)
        self.hist = LogHistogram(device)
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

    def update(self, x: torch.Tensor, valid: torch.Tensor | None = None, input_ids=None, row_offset: int = 0) -> None:
        x = x.detach()
        if x.dtype != torch.float32:
            x = x.float()
        if valid is not None and valid.shape != x.shape:
            valid = valid.expand_as(x)
        if valid is None and self.dims == TOKEN_DIMS and self.threshold == 6.0 and self._update_tokens(x, input_ids,
                                                                                                        row_offset):
            return
        if valid is None and bool(torch.isfinite(x.sum())):
            mask, a = None, x.abs()  # fast path: every value counts (a finite sum means no inf/NaN)
        else:
            finite = torch.isfinite(x)
            bad = ~finite if valid is None else valid & ~finite
            self.nonfinite += bad.sum()
            mask = finite if valid is None else valid & finite
            a = torch.where(mask, x.abs(), -1.0)
        m = Moments.of(x, mask)
        self.moments = self.moments.merge(m)
        rowmax = a.amax(dim=-1) if a.dim() >= 2 else None
        self.topk.add(x, a, self.dims, input_ids, row_offset, rowmax)
        self.hist.add(a, mask)
        self._absmax_along(a, rowmax)
        self._count_hits(a, mask)
        self._pass(m, a if rowmax is None else rowmax)

    def _update_tokens(self, x: torch.Tensor, input_ids, row_offset: int) -> bool:
        """The fast path for unmasked token activations; False (nothing recorded) if x is not all finite."""
        try:
            s1, m2, m3, m4, rowmax, idx, chan, hits = _core(self.compile)(x)
        except Exception:  # noqa: BLE001 - no compiler or backend here: stay eager from now on
            if not self.compile:
                raise
            self.compile = False
            return self._update_tokens(x, input_ids, row_offset)
        if not bool(torch.isfinite(s1)):
            return False
        m = Moments(x.device)
        m.n = torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device)
        m.mean, m.m2, m.m3, m.m4 = s1 / m.n, m2, m3, m4
        self.moments = self.moments.merge(m)
        self.topk.add(x, None, self.dims, input_ids, row_offset, rowmax)
        self.hist.add_index(idx)
        self.channel_absmax = _elementwise_max(self.channel_absmax, chan)
        self.position_absmax = _elementwise_max(self.position_absmax, rowmax.amax(dim=0))
        self.channel_hits = hits if self.channel_hits is None else self.channel_hits + hits
        self.positions += x.shape[0] * x.shape[1]
        self._pass(m, rowmax)
        return True

    def _absmax_along(self, a: torch.Tensor, rowmax: torch.Tensor | None) -> None:
        for names, attr in ((_CHANNEL_DIMS, "channel_absmax"), (_POSITION_DIMS, "position_absmax")):
            dim = next((i for i, d in enumerate(self.dims) if d in names), None)
            if dim is None:
                continue
            src = a
            if rowmax is not None and dim < a.dim() - 1:
                src = rowmax  # reduce the (already reduced) last dim once, not again
            other = [i for i in range(src.dim()) if i != dim]
            cur = src.amax(dim=other) if other else src
            setattr(self, attr, _elementwise_max(getattr(self, attr), cur.clamp_min(0)))

    def _count_hits(self, a: torch.Tensor, mask: torch.Tensor) -> None:
        """Per channel, positions with |x| >= threshold (only for [batch, pos, channel] sites)."""
        if self.dims != ("batch", "pos", "channel"):
            return
        hits = (a >= self.threshold).sum(dim=(0, 1))
        self.channel_hits = hits if self.channel_hits is None else self.channel_hits + hits
        self.positions += a.shape[0] * a.shape[1] if mask is None else mask.any(dim=-1).sum()

    def _pass(self, m: Moments, a: torch.Tensor) -> None:
        var = m.m2 / m.n.clamp_min(1)
        kurt = torch.where(var > 0, (m.m4 / m.n.clamp_min(1)) / var.clamp_min(1e-300) ** 2, 0.0)
        inf = a.max().double().clamp_min(0)
        self.passes += 1
        self.pass_kurt = torch.stack([self.pass_kurt[0] + kurt, torch.maximum(self.pass_kurt[1], kurt)])
        self.pass_inf = torch.stack([self.pass_inf[0] + inf, torch.maximum(self.pass_inf[1], inf)])

    def merge(self, other: "SiteStats") -> "SiteStats":
        out = SiteStats(self.dims, self.k, self.nonfinite.device, self.threshold, self.compile)
        out.moments = self.moments.merge(other.moments)
        out.topk = self.topk.merge(other.topk)
        out.hist = self.hist.merge(other.hist)
        out.channel_absmax = _elementwise_max(self.channel_absmax, other.channel_absmax)
        out.position_absmax = _elementwise_max(self.position_absmax, other.position_absmax)
        out.nonfinite = self.nonfinite + other.nonfinite.to(out.nonfinite.device)
        out.positions = self.positions + other.positions.to(out.positions.device)
        if self.channel_hits is None or other.channel_hits is None:
            out.channel_hits = self.channel_hits if other.channel_hits is None else other.channel_hits
        else:
            out.channel_hits = self.channel_hits + other.channel_hits.to(self.channel_hits.device)
        out.passes = self.passes + other.passes
        dev = out.nonfinite.device
        out.pass_kurt = torch.stack([self.pass_kurt[0] + other.pass_kurt[0].to(dev),
                                     torch.maximum(self.pass_kurt[1], other.pass_kurt[1].to(dev))])
        out.pass_inf = torch.stack([self.pass_inf[0] + other.pass_inf[0].to(dev),
                                    torch.maximum(self.pass_inf[1], other.pass_inf[1].to(dev))])
        return out

    def to(self, device) -> "SiteStats":
        """A copy on another device (for gathering across ranks)."""
        out = SiteStats(self.dims, self.k, device, self.threshold)
        return out.merge(self)

    def summary(self, full: bool = True) -> dict:
        """Every number as plain Python, for JSON."""
        s = self.moments.summary()
        s["nonfinite"] = int(self.nonfinite)
        s["absmax"] = self.topk.rank(1)
        s["top"] = {f"top{r}": self.topk.rank(r) for r in (1, 2, 3, 10, 100) if r <= self.k}
        s["quantiles"] = dict(zip(QUANTILES, self.hist.quantiles(list(QUANTILES.values()))))
        s["passes"] = self.passes
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
