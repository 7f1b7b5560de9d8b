"""Granularity: which elements share one scale.

| granularity     | one scale per                                   | for [batch, pos, channel] | for [batch, head, q, k] | for weights [out, in] |
|-----------------|-------------------------------------------------|---------------------------|-------------------------|-----------------------|
| PerTensor()     | the whole tensor of one call                    | 1 (dynamic: per sequence) | 1 (dynamic: per seq.)   | 1                     |
| PerChannel(a)   | index along axis a (default: last)              | channel                   | k position              | PerChannel(0): row    |
| PerToken()      | row: all but the last dim                       | (batch, pos)              | (batch, head, q) row    | out channel           |
| PerHead()       | head (attention sites only)                     | -                         | head (dynamic: per seq.)| -                     |
| PerGroup(G)     | G consecutive elements of the last dim, per row | G channels of a token     | G keys of a row         | G inputs of an output |

Dynamic scales are computed from each sequence of a batch alone (the batch dim is never reduced), so a
result does not depend on how many sequences were evaluated together; static (calibrated) scales span
all calibration data. Groups whose size does not divide the last dim end with one ragged group.
Weights are seen as [out_channel, in_channel] whatever their storage (see `taps/sites.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffquant.errors import DiffquantError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PerTensor:
    def reduce_dims(self, x: torch.Tensor, dims: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(range(x.dim()))


@dataclass(frozen=True)
class PerChannel:
    axis: int = -1

    def reduce_dims(self, x: torch.Tensor, dims: tuple[str, ...]) -> tuple[int, ...]:
        axis = self.axis % x.dim()
        return tuple(i for i in range(x.dim()) if i != axis)


@dataclass(frozen=True)
class PerToken:
    def reduce_dims(self, x: torch.Tensor, dims: tuple[str, ...]) -> tuple[int, ...]:
        return (x.dim() - 1,)


@dataclass(frozen=True)
class PerHead:
    def reduce_dims(self, x: torch.Tensor, dims: tuple[str, ...]) -> tuple[int, ...]:
        if "head" not in dims:
            raise DiffquantError(f"per-head granularity needs a site with a head dimension, not [{', '.join(dims)}]")
        h = dims.index("head")
        return tuple(i for i in range(x.dim()) if i != h)


@dataclass(frozen=True)
class PerGroup:
    size: int = 128

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"group size must be a positive integer, got {self.size!r}")


Granularity = PerTensor | PerChannel | PerToken | PerHead | PerGroup


def validate(g: Granularity, dims: tuple[str, ...], site: str) -> None:
    """Refuse a granularity that cannot apply to a site of these dims (before any forward runs)."""
    shape = f"[{', '.join(dims)}]"
    if not dims and not isinstance(g, PerTensor):
        raise DiffquantError(f"{site} is a scalar: only per-tensor scales apply, not {label(g)}")
    if isinstance(g, PerHead) and "head" not in dims:
        raise DiffquantError(f"{site}: per-head granularity needs a site with a head dimension, not {shape}")
    if isinstance(g, PerChannel) and not -len(dims) <= g.axis < len(dims):
        raise DiffquantError(f"{site}: channel axis {g.axis} is outside its dims {shape}")
_KINDS = {"tensor": PerTensor, "channel": PerChannel, "token": PerToken, "head": PerHead, "group": PerGroup}


def to_dict(g: Granularity) -> dict:
    kind = next(k for k, cls in _KINDS.items() if isinstance(g, cls))
    out = {"kind": kind}
    if isinstance(g, PerChannel):
        out["axis"] = g.axis
    if isinstance(g, PerGroup):
        out["size"] = g.size
    return out


def from_dict(d: dict | str) -> Granularity:
    if isinstance(d, str):
        return parse_granularity(d)
    kind = d.get("kind")
    if kind not in _KINDS:
        raise DiffquantError(f"unknown granularity {kind!r}; choose one of: {', '.join(_KINDS)}")
    args = {k: v for k, v in d.items() if k != "kind"}
    return _KINDS[kind](**args)


def parse_granularity(text: str) -> Granularity:
    """`tensor`, `channel`, `channel:0`, `token`, `row` (= token), `head`, `group:128`."""
    kind, _, arg = text.strip().lower().partition(":")
    kind = {"row": "token", "per-tensor": "tensor"}.get(kind, kind)
    if kind not in _KINDS:
        raise DiffquantError(f"unknown granularity {text!r}; choose tensor, channel[:AXIS], token, head or group:SIZE")
    if kind == "group":
        if not arg.isdigit() or int(arg) < 1:
            raise DiffquantError(f"group granularity needs a positive size, e.g. group:128 (got {text!r})")
        return PerGroup(int(arg))
    if kind == "channel" and arg:
        return PerChannel(int(arg))
    return _KINDS[kind]()


def label(g: Granularity) -> str:
    d = to_dict(g)
    return d["kind"] + (f":{d['size']}" if "size" in d else f":{d['axis']}" if d.get("axis", -1) != -1 else "")
