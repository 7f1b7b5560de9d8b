"""The quantization arithmetic: choose scales, quantize, dequantize, fake-quantize (with STE).

Only this module computes scales. Ranges are taken over valid entries only (masked attention
positions and non-finite values never set a scale).
"""

from __future__ import annotations

import torch

from diffquant.compiled import CompiledOrEager
from diffquant.quant.numerics.formats import Format, grid
from diffquant.quant.numerics.granularity import Granularity, PerTensor


def grouped(x: torch.Tensor, gran: Granularity, dims: tuple[str, ...],
            per_sequence: bool = False) -> tuple[torch.Tensor, tuple[int, ...]]:
    """x viewed so that one scale covers the reduced dims, and those dims.

    Groups split the last dim into runs of G from index 0; where G does not divide it, the last group is
    ragged (the W mod G remaining values share one scale): x is padded with zeros (False for masks) to a
    multiple of G, which is exact, since a range always contains 0 and 0 quantizes to exactly 0.
    `per_sequence` keeps the batch dim out of the reduction, so a dynamic scale never mixes the sequences
    of a batch and results do not depend on the batch size."""
    if gran.group_size:
        pad = -x.shape[-1] % gran.size
        if pad:
            x = torch.cat([x, x.new_zeros(*x.shape[:-1], pad)], dim=-1)
        return x.unflatten(-1, (-1, gran.size)), (x.dim(),)
    if position_runs(gran):  # runs of G positions: [.., pos, ..] -> [.., run, G, ..], one scale per run
        pos = dims.index("pos")
        pad = -x.shape[pos] % gran.group
        if pad:
            x = torch.cat([x, x.new_zeros(*x.shape[:pos], pad, *x.shape[pos + 1:])], dim=pos)
        return x.unflatten(pos, (-1, gran.group)), (pos + 1,)
    reduce = gran.reduce_dims(x, dims)
    if per_sequence and "batch" in dims and len(dims) == x.dim():
        reduce = tuple(i for i in reduce if i != dims.index("batch"))
    return x, reduce


def position_runs(gran: Granularity) -> bool:
    """Whether scales cover runs of positions (KIVI's grouped per-channel keys), so x is regrouped."""
    return gran.position_run > 0


def elementwise_groups(gran: Granularity) -> bool:
    """Whether `grouped` reshapes x, so a broadcast mask must first be expanded to x's shape."""
    return bool(gran.group_size) or position_runs(gran)


def value_range(x: torch.Tensor, reduce: tuple[int, ...], valid: torch.Tensor | None, symmetric: bool,
                contain_zero: bool = True):
    """(lo, hi) per scale group with keepdim; symmetric formats only need hi = max |x|. `contain_zero=False`
    (min-max formats): the exact range of the valid entries."""
    if not contain_zero:
        ok = torch.isfinite(x) if valid is None else valid & torch.isfinite(x)
        lo = torch.where(ok, x, float("inf")).amin(dim=reduce, keepdim=True)
        hi = torch.where(ok, x, float("-inf")).amax(dim=reduce, keepdim=True)
        empty = ~torch.isfinite(lo)
        return torch.where(empty, 0, lo), torch.where(empty, 0, hi)
    # fast path: masked entries zeroed by a float multiply (bool masks are slow on CPU); the zeros they
    # leave cannot move the range, which always contains 0. A non-finite value anywhere sends it below.
    xm = x if valid is None else x * valid.to(x.dtype)
    if symmetric:
        hi = _absmax(xm, reduce)
        if bool(torch.isfinite(hi).all()):
            return -hi, hi
    else:
        lo, hi = _aminmax(xm, reduce)
        if bool(torch.isfinite(lo).all()) and bool(torch.isfinite(hi).all()):
            return lo.clamp_max(0), hi.clamp_min(0)
    ok = torch.isfinite(x) if valid is None else valid & torch.isfinite(x)
    if symmetric:
        hi = torch.where(ok, x.abs(), 0).amax(dim=reduce, keepdim=True)
        return -hi, hi
    lo = torch.where(ok, x, float("inf")).amin(dim=reduce, keepdim=True)
    hi = torch.where(ok, x, float("-inf")).amax(dim=reduce, keepdim=True)
    lo = torch.where(torch.isfinite(lo), lo, 0).clamp_max(0)  # zero is always representable
    hi = torch.where(torch.isfinite(hi), hi, 0).clamp_min(0)
    return lo, hi


def _absmax(x: torch.Tensor, reduce: tuple[int, ...]) -> torch.Tensor:
    """max |x| over `reduce` (keepdim), without materialising |x|."""
    lo, hi = _aminmax(x, reduce)
    return torch.maximum(-lo, hi)


def _aminmax(x: torch.Tensor, reduce: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) over `reduce` with keepdim. torch.aminmax is one pass over the whole tensor but several
    times slower than amin + amax along a dim on CPU; vector_norm(inf) is slower still."""
    if len(reduce) == x.dim():
        lo, hi = torch.aminmax(x)
        return lo.reshape([1] * x.dim()), hi.reshape([1] * x.dim())
    return x.amin(dim=reduce, keepdim=True), x.amax(dim=reduce, keepdim=True)


def qparams(lo: torch.Tensor, hi: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero_point) covering [lo, hi]: absmax / qmax for symmetric formats (absmax / ((2^b − 1)/2) on the full
    range: `Format.half_span`), min/max otherwise."""
    if fmt.minmax:  # "zero" is the float offset lo: x ≈ q·scale + lo
        scale = (hi - lo) / fmt.qmax
        return torch.where(scale > 0, scale, torch.ones_like(scale)), lo.clone()
    if fmt.symmetric:
        scale = torch.maximum(lo.abs(), hi.abs()) / fmt.half_span
        zero = torch.zeros_like(scale)
    else:
        scale = (hi - lo) / fmt.qmax
        zero = None
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group keeps zeros
    if zero is None:
        zero = torch.round(-lo / scale).clamp(0, fmt.qmax)
    return scale, zero


def quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Integer codes (int formats) or unscaled grid values (float formats), as float tensors."""
    if fmt.minmax:
        return torch.sub(x, zero).div_(scale).round_().clamp_(0, fmt.qmax)
    if fmt.is_int:
        q = torch.div(x, scale).round_()  # one new tensor, then in place
        if fmt.symmetric:
            return q.clamp_(fmt.qmin, fmt.qmax)
        return q.add_(zero).clamp_(fmt.qmin, fmt.qmax)
    v = torch.clamp(x / scale, -fmt.qmax, fmt.qmax)
    if fmt.name == "fp8_e4m3":
        return v.to(torch.float8_e4m3fn).to(x.dtype)
    if fmt.name == "fp8_e5m2":
        return v.to(torch.float8_e5m2).to(x.dtype)
    values = grid(fmt.name).to(device=x.device, dtype=x.dtype)
    idx = torch.bucketize(v, (values[1:] + values[:-1]) / 2)
    return values[idx]


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fmt: Format) -> torch.Tensor:
    """Values from codes; works in place on `q`, which `quantize` created."""
    if fmt.minmax:
        return q.mul_(scale).add_(zero)
    if fmt.is_int and not fmt.symmetric:
        return q.sub_(zero).mul_(scale)
    return q.mul_(scale)


def _int_roundtrip(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, qmin: float, qmax: float):
    """`dequantize(quantize(x))` on an integer grid as one expression, which torch.compile fuses into a
    single pass (eager runs it as four). Bit-identical to the two functions: adding and subtracting a zero
    point of 0 is exact."""
    return (torch.round(x / scale) + zero).clamp(qmin, qmax).sub(zero).mul(scale)


_COMPILED_ROUNDTRIP = CompiledOrEager(_int_roundtrip)


def fake_quantize(x: torch.Tensor, scale, zero, fmt: Format, gran: Granularity | None = None,
                  compiled: bool = False, dims: tuple[str, ...] = ()) -> torch.Tensor:
    """Quantize-dequantize with a straight-through gradient (identity), in x's shape. `compiled` fuses
    the integer round trip with torch.compile (eager where it cannot compile); `dims` (the site's) are
    needed by granularities that group positions.

    The arithmetic runs in float32 whatever x's dtype (x, scales and the dequantized grid value q·s), and
    the result is cast to x's dtype once, rounding to nearest: exact for float32 x; for bfloat16 (8
    significant bits) within 2⁻⁸·|q·s| of the float32 grid point, so at int8's largest codes (|q| up to 127)
    up to half a step (127/256 of s) off the grid; for float16 (11 bits, normal range) within 2⁻¹¹·|q·s|. The
    straight-through form adds x − x.detach() (exactly 0) to that value, so its forward value is the
    rounded grid value itself, also where the quantizer clamps; without autograd nothing is added."""
    gran = gran if gran is not None else PerTensor()  # None: scales already shaped like x, nothing regrouped
    xf = x.detach() if x.dtype == torch.float32 else x.detach().float()
    if elementwise_groups(gran):
        xf = grouped(xf, gran, dims)[0]
    if compiled and fmt.is_int and not fmt.minmax:
        y = _COMPILED_ROUNDTRIP(xf, scale, zero, fmt.qmin, fmt.qmax).to(x.dtype)
    else:
        y = dequantize(quantize(xf, scale, zero, fmt), scale, zero, fmt).to(x.dtype)
    if gran.group_size:
        y = y.flatten(-2)[..., :x.shape[-1]]  # drop a ragged last group's padding
    elif position_runs(gran):
        pos = dims.index("pos")
        y = y.flatten(pos, pos + 1).narrow(pos, 0, x.shape[pos])
    if x.requires_grad and torch.is_grad_enabled():
        # straight-through estimator: y + (x − x.detach()) is y bit for bit; x + (y − x) is not where a clamp
        # leaves x far from y (y − x rounds: in bfloat16 by most of a step, or several far outside the range)
        y = y + (x - x.detach())
    return y


def dynamic_fake_quantize(x: torch.Tensor, fmt: Format, gran: Granularity, dims: tuple[str, ...],
                          valid: torch.Tensor | None = None, compiled: bool = False) -> torch.Tensor:
    """Scales from this tensor (the paper's dynamic absmax setting), then fake-quantize. Scales never span
    two sequences: "per tensor" is per tensor of one sequence (see `grouped`)."""
    scale, zero = dynamic_qparams(x, fmt, gran, dims, valid)
    return fake_quantize(x, scale, zero, fmt, gran, compiled, dims)


def dynamic_qparams(x: torch.Tensor, fmt: Format, gran: Granularity, dims: tuple[str, ...],
                    valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) that `dynamic_fake_quantize` takes from x (shaped as `grouped` leaves them); the export
    reads a round-to-nearest weight's grid from here, so it is the simulation's grid by construction."""
    xd = x.detach() if x.dtype == torch.float32 else x.detach().float()
    xg, reduce = grouped(xd, gran, dims, per_sequence=True)
    if fmt.minmax and valid is None and xg.numel() != x.numel():  # zero padding must not join a min-max range
        valid = torch.ones_like(x, dtype=torch.bool)
    vg = None
    if valid is not None:  # kept broadcast where it can be: no full-size mask
        vg = grouped(valid.expand_as(x) if elementwise_groups(gran) else valid, gran, dims)[0]
    lo, hi = value_range(xg, reduce, vg, fmt.symmetric, not fmt.minmax)
    return qparams(lo, hi, fmt)


def keep_masked(y: torch.Tensor, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """y where valid, x elsewhere. For finite values lerp with a 0/1 weight is exact (torch computes
    `end - diff * (1 - w)` for w >= 0.5) and one float pass; a broadcast boolean `where` is slower on CPU."""
    if bool(torch.isfinite(x.sum(dtype=torch.float32))) and bool(torch.isfinite(y.sum(dtype=torch.float32))):
        return torch.lerp(x, y, valid.to(y.dtype))
    return torch.where(valid, y, x)
