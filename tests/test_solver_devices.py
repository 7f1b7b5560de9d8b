"""Every tensor the weight solvers and mitigations create is made on an explicit device, in an explicit dtype
where it holds floats (issue 38: GPTQ's error block was made on the default device, so a CUDA model's weight
met a CPU tensor). This machine has one device, so the test watches the factory calls themselves: a
TorchFunctionMode records each call made from diffquant's code without `device=` (or, for float factories,
without `dtype=`), while GPTQ, AWQ, the clip search, SmoothQuant and the rotations run on a model."""

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import diffquant

PACKAGE = str(Path(diffquant.__file__).resolve().parent)
FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.eye, torch.arange, torch.linspace,
             torch.logspace, torch.rand, torch.randn, torch.randint, torch.randperm, torch.tensor, torch.as_tensor}
FLOAT_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.eye, torch.linspace, torch.logspace,
                   torch.rand, torch.randn}


class FactoryCalls(TorchFunctionMode):
    """Records (file:line, function) of every factory call made directly by diffquant's code that leaves the
    device (or a float tensor's dtype) to torch's defaults."""

    def __init__(self):
        super().__init__()
        self.missing: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                lacks = [k for k in ("device",) + (("dtype",) if func in FLOAT_FACTORIES else ()) if k not in kwargs]
                if lacks:
                    where = f"{Path(caller.f_code.co_filename).relative_to(PACKAGE)}:{caller.f_lineno}"
                    self.missing.append(f"{where} torch.{func.__name__} without {' and '.join(lacks)}")
        return func(*args, **kwargs)


def test_the_mode_sees_a_factory_call_without_device():
    """The watcher itself: a call from diffquant's code without device is seen (a saved static scale, made on the
    host and moved where it is used), one from the test is not, nor one with device and dtype."""
    from diffquant.quant.numerics import hadamard
    from diffquant.quant.numerics.fake import FakeQuant

    with FactoryCalls() as calls:
        torch.zeros(2)
        hadamard.hadamard(12)
        FakeQuant(None).load_state({"scale": [1.0], "zero": [0.0], "shape": [1]})
    assert [m.split(" ", 1)[1] for m in calls.missing] == ["torch.tensor without device"] * 2


@pytest.mark.parametrize("text", ["gptq", "gptq:act-order", "awq", "awq+gptq", "clip:output"])
def test_weight_solvers_make_tensors_on_an_explicit_device(micro_pair, text):
    from diffquant.quant.numerics.scheme import get_scheme
    from diffquant.quant.algorithms.solvers import parse, solve_weights_

    model = micro_pair[1]
    calib = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    with FactoryCalls() as calls:
        solved = solve_weights_(model, parse(text), get_scheme("w4a16-g32"), calib, progress=False)
    solved.remove()
    assert sorted(set(calls.missing)) == []


@pytest.mark.parametrize("text", ["smoothquant:0.5", "rotate", "quarot"])
def test_mitigations_make_tensors_on_an_explicit_device(micro_pair, text):
    from diffquant.quant.algorithms.mitigate import mitigate_, parse

    model = micro_pair[1]
    calib = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    with FactoryCalls() as calls:
        applied = mitigate_(model, parse(text), calib)
        with torch.no_grad():
            model(calib[:1])  # the online Hadamard before down_proj
    applied.remove()
    assert sorted(set(calls.missing)) == []
