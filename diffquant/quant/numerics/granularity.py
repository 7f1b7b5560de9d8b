"""Granularity: which elements share one scale.

| granularity     | one scale per                                   | for [batch, pos, channel] | for [batch, head, q, k] | for weights [out, in] |
|-----------------|-------------------------------------------------|---------------------------|-------------------------|-----------------------|
| PerTensor()     | the whole tensor of one call                    | 1 (dynamic: per sequence) | 1 (dynamic: per seq.)   | 1                     |
| PerChannel(a)   | index along axis a (default: last)              | channel                   | k position              | PerChannel(0): row    |
| PerToken()      | row: all but the last dim                       | (batch, pos)              | (batch, head, q) row    | out channel           |
| PerHead()       | head (attention sites only)                     | -                         | head (dynamic: per seq.)| -                     |
| PerGroup(G)     | G consecutive elements of the last dim, per row | G channels of a token     | G keys of a row         | G inputs of an output |
| KVChannel(G)    | channel (and head), over positions in runs of G | channel, over its tokens  | -                       | -                     |

KVChannel is KIVI's per-channel key quantization: at a cache site [batch, kv_head, pos, dim] one scale per
(kv_head, dim) over the positions (G > 0: over each run of G consecutive positions, from the first one);
at a token site [batch, pos, channel] (the pre-RoPE `k`) one scale per channel. At cache sites "per token"
is one scale per (token, KV head) and "per head" one per KV head.

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


class Scales:
    """What code outside this module asks of a granularity, so that it never tests which one it is: the size of
    the groups along the last dim (None: no groups), whether a 2-D weight [out, in] gets one scale per output
    row, and how many positions one scale covers (0: not runs of positions)."""

    group_size: int | None = None
    per_row = False
    position_run = 0


@dataclass(frozen=True)
class PerTensor(Scales):
    def reduce_dims(self, x: torch.Tensor, dims: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(range(x.dim()))


@dataclass(frozen=True)
class PerChannel(Scales):
    axis: int = -1

    @property
    def per_row(self) -> bool:
        return self.axis % 2 == 0

    def reduce_dims(self, x: torch.Tensor, dims: tuple[str, ...]) -> tuple[int, ...]:
        axis = self.axis % x.dim()
        return tuple(i for i in range(x.dim()) if i != axis)


@dataclass(frozen=True)
class PerToken(Scales):
    per_row = True

    def reduce_dims(self, x: torch.Tensor, dims: tuple[str, ...]) -> tuple[int, ...]:
        return (x.dim() - 1,)


HEAD_DIMS = ("head", "kv_head")


def head_axis(dims: tuple[str, ...]) -> int | None:
    return next((dims.index(d) for d in HEAD_DIMS if d in dims), None)


@dataclass(frozen=True)
class PerHead(Scales):
    def reduce_dims(self, x: torch.Tensor, dims: tuple[str, ...]) -> tuple[int, ...]:
        h = head_axis(dims)
        if h is None:
            raise DiffquantError(f"per-head granularity needs a site with a head dimension, not [{', '.join(dims)}]")
        return tuple(i for i in range(x.dim()) if i != h)


@dataclass(frozen=True)
class KVChannel(Scales):
    """One scale per channel over the positions of a sequence (runs of `group` positions when > 0)."""

    group: int = 0

    @property
    def position_run(self) -> int:
        return self.group

    def __post_init__(self) -> None:
        if not isinstance(self.group, int) or isinstance(self.group, bool) or self.group < 0:
            raise ValueError(f"position group must be a non-negative integer, got {self.group!r}")

    def reduce_dims(self, x: torch.Tensor, dims: tuple[str, ...]) -> tuple[int, ...]:
        if "pos" not in dims:
            raise DiffquantError(f"kv-channel granularity needs a site with a pos dimension, not [{', '.join(dims)}]")
        pos = dims.index("pos")
        return tuple(i for i in range(x.dim()) if i == pos or dims[i] == "batch")


@dataclass(frozen=True)
class PerGroup(Scales):
    size: int = 128

    @property
    def group_size(self) -> int:
        return self.size

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"group size must be a positive integer, got {self.size!r}")


Granularity = PerTensor | PerChannel | PerToken | PerHead | PerGroup | KVChannel


def validate(g: Granularity, dims: tuple[str, ...], site: str) -> None:
    """Refuse a granularity that cannot apply to a site of these dims (before any forward runs)."""
    shape = f"[{', '.join(dims)}]"
    if not dims and not isinstance(g, PerTensor):
        raise DiffquantError(f"{site} is a scalar: only per-tensor scales apply, not {label(g)}")
    if isinstance(g, PerHead) and head_axis(dims) is None:
        raise DiffquantError(f"{site}: per-head granularity needs a site with a head dimension, not {shape}")
    if isinstance(g, PerChannel) and not -len(dims) <= g.axis < len(dims):
        raise DiffquantError(f"{site}: channel axis {g.axis} is outside its dims {shape}")
    if isinstance(g, KVChannel) and "pos" not in dims:
        raise DiffquantError(f"{site}: kv-channel granularity needs a site with a pos dimension, not {shape}")

_KINDS = {"tensor": PerTensor, "channel": PerChannel, "token": PerToken, "head": PerHead, "group": PerGroup,
          "kv-channel": KVChannel}


def to_dict(g: Granularity) -> dict:
    kind = next(k for k, cls in _KINDS.items() if isinstance(g, cls))
    out = {"kind": kind}
    if isinstance(g, PerChannel):
        out["axis"] = g.axis
    if isinstance(g, PerGroup):
        out["size"] = g.size
    if isinstance(g, KVChannel) and g.group:
        out["group"] = g.group
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
    """`tensor`, `channel`, `channel:0`, `token`, `row` (= token), `head`, `group:128`, `kv-channel`,
    `kv-channel:32` (KIVI: per channel over runs of 32 positions)."""
    kind, _, arg = text.strip().lower().partition(":")
    kind = {"row": "token", "per-tensor": "tensor"}.get(kind, kind)
    if kind not in _KINDS:
        raise DiffquantError(f"unknown granularity {text!r}; choose tensor, channel[:AXIS], token, head, group:SIZE "
                             "or kv-channel[:POSITIONS]")
    if kind == "kv-channel":
        if arg and not arg.isdigit():
            raise DiffquantError(f"kv-channel granularity takes a position run length, e.g. kv-channel:32 (got {text!r})")
        return KVChannel(int(arg or 0))
    if kind == "group":
        if not arg.isdigit() or int(arg) < 1:
            raise DiffquantError(f"group granularity needs a positive size, e.g. group:128 (got {text!r})")
        return PerGroup(int(arg))
    if kind == "channel" and arg:
        return PerChannel(int(arg))
    return _KINDS[kind]()


def label(g: Granularity) -> str:
    d = to_dict(g)
    if "group" in d:
        return f"{d['kind']}:{d['group']}"
    return d["kind"] + (f":{d['size']}" if "size" in d else f":{d['axis']}" if d.get("axis", -1) != -1 else "")
