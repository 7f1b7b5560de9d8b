"""What a tap is told about the activation it sees: the site, the batch being run, which entries are valid.

Kept below both the tap machinery (`tap`) and the functions the model runs while tapped (`attention`, `experts`),
so those functions can read the context without importing the machinery that installs them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from diffquant.taps.sites import Site


@dataclass
class Batch:
    """What the current forward pass is fed: set by the profiler so taps can name token ids."""

    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None  # [batch, pos], 1 = real token
    row_offset: int = 0  # global index of this batch's first row
    tokens: tuple[int, int] | None = None  # (batch, pos) of the current forward, for sites that see tokens flat


class Block(NamedTuple):
    """Where one query block of a blocked attention call sits. Its taps see rows start..end of the call's `queries`
    query rows, over the call's keys (`keys`) or, where the block ends at its last visible key
    (taps/attention.py, `cut_keys`), fewer; every query of the block may attend the first `dense` keys (0: not
    known), so a mask of the block is False only from there on."""

    start: int
    end: int
    queries: int
    keys: int
    dense: int = 0


@dataclass(frozen=True)
class TapContext:
    site: Site
    batch: Batch = field(default_factory=Batch)
    valid: torch.Tensor | None = None  # bool, broadcastable to the activation; None = all valid
    block: Block | None = None  # where a blocked attention call's block sits

    def with_valid(self, valid: torch.Tensor | None, block: Block | None = None) -> "TapContext":
        if valid is None and self.valid is None and block is None and self.block is None:
            return self
        return replace(self, valid=valid, block=block)


def token_valid(ctx: TapContext, x: torch.Tensor) -> torch.Tensor | None:
    """[batch, pos, 1, ...] validity from the batch's padding mask, when shapes agree."""
    mask = ctx.batch.attention_mask
    if mask is None or x.dim() < 3 or mask.shape != x.shape[:2]:
        return None
    return mask.to(device=x.device, dtype=torch.bool).reshape(*mask.shape, *[1] * (x.dim() - 2))
