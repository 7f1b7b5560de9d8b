"""Calibration: run a few training windows through a model and keep what a post-training transform needs.

A small service below both the profiler and the quantization layer: SmoothQuant (and any other transform that
scales channels) asks for per-channel absolute maxima of Linear inputs, and nothing more. It uses the taps
directly, so the quantization layer does not depend on the profile command's module.
"""

from __future__ import annotations

from typing import Iterable

import torch

from diffquant.errors import DiffquantError
from diffquant.frozen import evaluating
from diffquant.taps import Batch, site_table, tapped


class _ChannelAbsMax:
    """Running max |x| over every dimension but the last (the channel), ignoring padded entries."""

    transforms = False

    def __init__(self):
        self.absmax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, ctx) -> None:
        a = x.detach().abs()
        if ctx.valid is not None:
            a = a.masked_fill(~ctx.valid.expand_as(a), 0)
        m = a.reshape(-1, a.shape[-1]).amax(dim=0).float()
        self.absmax = m if self.absmax is None else torch.maximum(self.absmax, m)


def channel_absmax(model, calibration: torch.Tensor, sites: Iterable[str], batch_size: int = 8) -> dict[str, torch.Tensor]:
    """{site name: per-channel max |x|} over `calibration` ([n, seq_len] token ids) at every site matched by `sites`."""
    if calibration.numel() == 0:
        raise DiffquantError("no calibration tokens")
    selected = [s for s in site_table(model).match(list(sites)) if not s.is_weight]
    observers = {s.name: _ChannelAbsMax() for s in selected}
    batch = Batch()
    device = model.get_input_embeddings().weight.device
    with tapped(model, {name: [o] for name, o in observers.items()}, batch), evaluating(model):
        for start in range(0, len(calibration), batch_size):
            ids = calibration[start:start + batch_size].to(device)
            batch.input_ids, batch.row_offset = ids, start
            model(ids, use_cache=False)
    return {name: o.absmax for name, o in observers.items() if o.absmax is not None}
