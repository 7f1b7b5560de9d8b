"""One evaluation, one set of quantized weights."""

from __future__ import annotations


def frozen_weights():
    """Within this block each parametrized (e.g. fake-quantized) weight is computed once and reused by
    every forward of an evaluation loop; outside it a weight is computed again at each access, so an edit
    of the float weight (even through `.data`) is always seen."""
    from torch.nn.utils import parametrize

    return parametrize.cached()
