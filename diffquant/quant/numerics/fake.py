"""FakeQuant: the tap that simulates a quantizer at a site (dynamic, or static after calibration)."""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from diffquant.errors import DiffquantError
from diffquant.quant.numerics import math as Q
from diffquant.quant.numerics.config import QuantConfig

MSE_ALPHAS = torch.linspace(0.3, 1.0, 15)


@functools.lru_cache(maxsize=32)
def _hadamard(n: int) -> torch.Tensor | None:
    from diffquant.quant.numerics.hadamard import hadamard

    h = hadamard(n)
    return None if h is None else h / n**0.5


def rotation(n: int, dtype, device, site: str) -> torch.Tensor:
    """The normalised n×n Hadamard matrix of a `hadamard` quantizer (QuaRot's unrandomised online one)."""
    h = _hadamard(n)
    if h is None:
        raise DiffquantError(f"{site}: no Hadamard matrix of order {n} can be built (2^k times a Paley order); "
                             "a hadamard quantizer needs one")
    return h.to(device=device, dtype=dtype)


class FakeQuant:
    """Quantize-dequantize the activation (or weight) passing a site, with a straight-through gradient.

    A quantized weight is recomputed at every access, so an edit of the float weight (even through
    `.data`, which no version counter sees) is never missed; evaluation loops reuse it within one
    `frozen_weights()` block instead (see `quant/numerics/scheme.py`)."""

    transforms = True

    def __init__(self, config: QuantConfig, compile: bool = False):
        self.config, self.compile = config, compile  # compile: fused integer round trip (see Q.fake_quantize)
        self.calibrating = False
        self.scale: torch.Tensor | None = None  # static scale, after calibration
        self.zero: torch.Tensor | None = None
        self._lo = self._hi = None
        self._mse_err: torch.Tensor | None = None
        self._hist = None
        self._range = None  # (lo, hi) of all query blocks of one attention call, see taps/attention.py
        self.fixed = False  # static scales given by a weight solver: calibration leaves them
        self.gram: torch.Tensor | None = None  # Σ WᵀW of the site's readers, for output-error calibration

    def __repr__(self) -> str:
        return f"FakeQuant({self.config.label()})"

    def kernel_scales(self):
        """How the flash-attention kernel applies this quantizer inside its tile (taps/triton_attention.py): a
        function from each logit row's max |logit| [batch, H, Q] to that row's scale, the max over the rows the
        scale covers (a sequence, a sequence's head, or the row) through `Q.qparams`; None where the kernel cannot
        apply it (static or calibrating, an asymmetric, min-max or float format, a Hadamard rotation, positions
        kept in full precision, another granularity). The quantizer answers, so the tap needs no type test."""
        from diffquant.quant.numerics.granularity import PerHead, PerTensor, PerToken

        c = self.config
        served = (c.dynamic and c.format.is_int and c.format.symmetric and not c.format.minmax and not c.hadamard
                  and not c.keep_first and not c.keep_last and isinstance(c.granularity, (PerTensor, PerHead, PerToken)))
        if self.calibrating or not served:
            return None
        dims = {PerTensor: (1, 2), PerHead: (2,), PerToken: ()}[type(c.granularity)]

        def scales(absmax: torch.Tensor) -> torch.Tensor:
            hi = absmax.amax(dim=dims, keepdim=True) if dims else absmax
            scale, _ = Q.qparams(-hi, hi, c.format)
            return scale.expand(absmax.shape).contiguous()

        return scales

    # ------------------------------------------------------------------ forward
    def __call__(self, x: torch.Tensor, ctx) -> torch.Tensor | None:
        """The quantized activation; positions a config keeps in full precision (`keep_first`, `keep_last`:
        attention sinks and a recent window) are passed through bit-exact, and never set a scale."""
        cfg = self.config
        if not (cfg.keep_first or cfg.keep_last):
            return self.apply_all(x, ctx)
        pos = ctx.site.dims.index("pos")
        start, end = cfg.quantized_span(x.shape[pos])
        if end <= start:
            return None
        valid = ctx.valid
        if valid is not None and valid.shape[pos] == x.shape[pos]:
            valid = valid.narrow(pos, start, end - start)
        y = self.apply_all(x.narrow(pos, start, end - start), replace(ctx, valid=valid))
        if y is None:
            return None
        return torch.cat([x.narrow(pos, 0, start), y, x.narrow(pos, end, x.shape[pos] - end)], dim=pos)

    def apply_all(self, x: torch.Tensor, ctx) -> torch.Tensor | None:
        """Quantize every position of x, ignoring the config's kept windows (the caller chose the span).
        `hadamard` (KV-cache sites only, see `scheme.plan`): each head's channels are quantized in the basis
        of a normalised Hadamard H and rotated back, Q(x·H)·Hᵀ: for keys what QuaRot's online rotation of Q
        and K after RoPE gives the logits, (q·H)·Q(k·H)ᵀ = q·(Q(k·H)·Hᵀ)ᵀ; for values what a rotation fused
        into v_proj and o_proj gives the output. Masked positions come back as they were, not as x·H·Hᵀ.
        The rotation, the quantizer and the rotation back run in float32, cast to x's dtype once at the end
        (see `Q.fake_quantize`)."""
        if self.config.hadamard:
            h = rotation(x.shape[-1], torch.float32, x.device, ctx.site.name)
            y = self._apply(x.float() @ h, ctx)
            if y is None:
                return None
            y = (y @ h.T).to(x.dtype)
            return y if ctx.valid is None else Q.keep_masked(y, x, ctx.valid)
        return self._apply(x, ctx)

    def _apply(self, x: torch.Tensor, ctx) -> torch.Tensor | None:
        cfg = self.config
        if self.calibrating:
            self._observe(x, ctx)
            return None
        if cfg.dynamic and self._range is not None:  # a query block: the scale of the whole call's range
            scale, zero = Q.qparams(*self._range, cfg.format)
            y = Q.fake_quantize(x, scale, zero, cfg.format, cfg.granularity, self.compile, ctx.site.dims)
        elif cfg.dynamic:
            y = Q.dynamic_fake_quantize(x, cfg.format, cfg.granularity, ctx.site.dims, ctx.valid, self.compile)
        else:
            if self.scale is None:
                raise DiffquantError(f"{ctx.site.name}: static quantizer used before calibration; run calibrate()")
            y = Q.fake_quantize(x, self.scale.to(x.device), self.zero.to(x.device), cfg.format, cfg.granularity,
                                self.compile, ctx.site.dims)
        if ctx.valid is not None:
            y = Q.keep_masked(y, x, ctx.valid)  # masked positions stay as they were (and stay masked)
        return y

    # ---------------------------------------------------- attention in query blocks
    def needs_range(self, ctx) -> bool:
        """Whether a dynamic scale spans the query positions (per tensor, per head, per key), so a call
        computed in query blocks must read every block's range first."""
        if not self.config.dynamic or self.calibrating or "q_pos" not in ctx.site.dims:
            return False
        x = torch.empty((1,) * len(ctx.site.dims), device="meta")
        _, reduce = Q.grouped(x, self.config.granularity, ctx.site.dims, per_sequence=True)
        return ctx.site.dims.index("q_pos") in reduce

    def start_range(self) -> None:
        self._range = None
        self._block_range = None

    def observe_range(self, x: torch.Tensor, ctx) -> None:
        xg, reduce = Q.grouped(x.detach().float(), self.config.granularity, ctx.site.dims, per_sequence=True)
        lo, hi = Q.value_range(xg, reduce, ctx.valid, self.config.format.symmetric, not self.config.format.minmax)
        if self._block_range is None:
            self._block_range = (lo, hi)
        else:
            self._block_range = (torch.minimum(self._block_range[0], lo), torch.maximum(self._block_range[1], hi))
        self._range = self._block_range

    def end_range(self) -> None:
        self._range = self._block_range = None

    # -------------------------------------------------------------- calibration
    def _observe(self, x: torch.Tensor, ctx) -> None:
        cfg = self.config
        xg, reduce = Q.grouped(x.detach().float(), cfg.granularity, ctx.site.dims)
        vg = None if ctx.valid is None else Q.grouped(ctx.valid.expand_as(x), cfg.granularity, ctx.site.dims)[0]
        if cfg.calibration == "percentile":
            from diffquant.stats.histogram import AbsHistogram

            self._hist = self._hist or AbsHistogram(x.device)
            self._hist.add(xg, vg)  # non-finite values are never counted
            return
        lo, hi = Q.value_range(xg, reduce, vg, cfg.format.symmetric, not cfg.format.minmax)
        if self._lo is None:
            self._lo, self._hi = lo, hi
        elif self._lo.shape != lo.shape:
            raise DiffquantError(f"{ctx.site.name}: calibration batches differ in shape for {cfg.label()}; "
                                 "use per-tensor/channel/head scales or equal batch shapes")
        elif cfg.calibration == "ema":
            m = cfg.ema_momentum
            self._lo, self._hi = m * self._lo + (1 - m) * lo, m * self._hi + (1 - m) * hi
        else:
            self._lo, self._hi = torch.minimum(self._lo, lo), torch.maximum(self._hi, hi)
        if cfg.calibration in ("mse", "output"):
            self._mse_observe(xg, reduce, vg)

    def _mse_observe(self, xg: torch.Tensor, reduce: tuple[int, ...], vg) -> None:
        """Squared error of each candidate clipping ratio, per scale group, on this batch: of the tensor itself
        (`mse`), or of its readers' outputs (`output`: ‖E·Wᵀ‖² summed over the readers, = Σ_t e_t·G·e_tᵀ
        with G = Σ WᵀW; per-tensor scales, x's last dim the readers' input channels)."""
        cfg = self.config
        gram = None
        if cfg.calibration == "output":
            if self.gram is None:
                raise DiffquantError("output-error calibration needs the readers' weights (scheme.calibrate sets "
                                     "them on Llama-layout Linear inputs)")
            gram = self.gram.to(device=xg.device, dtype=torch.float32)
        errs = []
        for alpha in MSE_ALPHAS.tolist():
            scale, zero = Q.qparams(self._lo * alpha, self._hi * alpha, cfg.format)
            y = Q.dequantize(Q.quantize(xg, scale, zero, cfg.format), scale, zero, cfg.format)
            e = y - xg
            if vg is not None:
                e = torch.where(vg, e, 0)
            e = torch.where(torch.isfinite(e), e, 0)
            e = e * e if gram is None else (e @ gram) * e
            errs.append(e.sum(dim=reduce, keepdim=True, dtype=torch.float64))
        err = torch.stack(errs)
        self._mse_err = err if self._mse_err is None or self._mse_err.shape != err.shape else self._mse_err + err

    def finish_calibration(self) -> None:
        cfg = self.config
        self.calibrating = False
        if self.fixed:
            return
        if cfg.calibration == "percentile":
            if self._hist is None:
                raise DiffquantError("calibration saw no data")
            amax = torch.tensor(self._hist.quantiles([cfg.percentile / 100])[0] or 0.0, device=self._hist.counts.device)
            self.scale, self.zero = Q.qparams(-amax, amax, cfg.format)
            return
        if self._lo is None:
            raise DiffquantError("calibration saw no data for a static quantizer; feed calibration batches")
        lo, hi = self._lo, self._hi
        if cfg.calibration in ("mse", "output"):  # every batch that set the range scored the ratios
            best = MSE_ALPHAS.to(lo.device)[self._mse_err.argmin(dim=0)].to(lo.dtype)
            lo, hi = lo * best, hi * best
        self.scale, self.zero = Q.qparams(lo, hi, cfg.format)

    def start_calibration(self) -> None:
        if self.config.dynamic or self.fixed:
            return
        self.calibrating = True
        self.scale = self.zero = self._lo = self._hi = self._mse_err = self._hist = None

    def fix(self, scale: torch.Tensor, zero: torch.Tensor) -> None:
        """Static scales a weight solver chose (GPTQ): the weight it solved lies on their grid, so a
        scale calibrated from that weight's own range could move it off. Calibration leaves them."""
        if self.config.dynamic:
            raise DiffquantError("fixed scales need a static quantizer")
        self.scale, self.zero, self.fixed = scale, zero, True

    def weight_grid(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scale, zero) of a canonical weight `w` ([out, in]) as this quantizer rounds it: the scales it
        holds (static: calibrated, or fixed by a solver) or takes from `w` (dynamic), by the same functions as
        the forward, and the codes `Q.quantize` gives ([out, in]; integer codes, or the unscaled grid values of
        a float format), so `Q.dequantize` of them is the simulated weight. Scales are shaped as `Q.grouped`
        leaves them (groups: [out, groups, 1]). For the export (`quant/checkpoints/export.py`)."""
        from diffquant.taps.sites import WEIGHT_DIMS

        cfg = self.config
        if cfg.dynamic:
            scale, zero = Q.dynamic_qparams(w, cfg.format, cfg.granularity, WEIGHT_DIMS)
        elif self.scale is None:
            raise DiffquantError("static weight quantizer used before calibration; run calibrate()")
        else:
            scale, zero = self.scale.to(w.device), self.zero.to(w.device)
        xf = w.detach() if w.dtype == torch.float32 else w.detach().float()
        codes = Q.quantize(Q.grouped(xf, cfg.granularity, WEIGHT_DIMS)[0], scale, zero, cfg.format)
        if cfg.granularity.group_size:
            codes = codes.flatten(-2)[..., :w.shape[-1]]  # a ragged last group's padding
        return codes, scale, zero

    def state(self) -> dict:
        """Static scales as lists (saved with a quantized checkpoint)."""
        if self.scale is None:
            return {}
        return {"scale": self.scale.cpu().tolist(), "zero": self.zero.cpu().tolist(), "shape": list(self.scale.shape)}

    def load_state(self, state: dict) -> None:
        if state:
            self.scale = torch.tensor(state["scale"]).reshape(state["shape"])
            self.zero = torch.tensor(state["zero"]).reshape(state["shape"])

