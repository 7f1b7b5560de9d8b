"""One evaluation, one set of quantized weights."""

from __future__ import annotations

import contextlib


def frozen_weights():
    """Within this block each parametrized (e.g. fake-quantized) weight is computed once and reused by
    every forward of an evaluation loop; outside it a weight is computed again at each access, so an edit
    of the float weight (even through `.data`) is always seen."""
    from torch.nn.utils import parametrize

    return parametrize.cached()


def holds_tensor_subclass(model) -> bool:
    """Whether a parameter of `model` is a tensor subclass: the real low-bit backends' weights (quanto's
    QBitsTensor, torchao's Int8Tensor, bitsandbytes' Params4bit/Int8Params), never diffquant's own fake
    quantization, which keeps plain float parameters."""
    import torch

    return any(type(p) is not torch.nn.Parameter or type(p.data) is not torch.Tensor for p in model.parameters())


def no_autograd(model):
    """Forward passes without autograd: `torch.inference_mode()`, or `torch.no_grad()` where the model holds
    tensor-subclass weights. quanto's int4 weights go through an autograd.Function that sets a version
    counter, which inference tensors refuse ("Cannot set version_counter for inference tensor"): every
    `quanto-w4` evaluation crashed. Plain models keep inference mode, measurably faster where a forward is
    dominated by per-op overhead (micro DIFF model, 32 tokens, one thread: 2.35 ms vs 2.61 ms per forward)."""
    import torch

    return torch.no_grad() if holds_tensor_subclass(model) else torch.inference_mode()


@contextlib.contextmanager
def evaluating(model):
    """What every evaluation, calibration and profile loop runs under: `no_autograd(model)` and
    `frozen_weights()`."""
    with no_autograd(model), frozen_weights():
        yield
