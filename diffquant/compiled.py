"""torch.compile with an eager fallback: one mechanism for every fused kernel diffquant offers."""

from __future__ import annotations

import warnings
from typing import Callable

import torch


class CompiledOrEager:
    """Calls `fn` through torch.compile (compiled once per process and argument pattern). Where
    compiling or running the compiled code fails (no C++ compiler, an unsupported device), it warns
    once and calls the eager `fn` from then on, which computes the same result."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self._compiled: Callable | None = None
        self.failed = False

    def __call__(self, *args):
        if self.failed:
            return self.fn(*args)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=None)
        try:
            return self._compiled(*args)
        except Exception as e:  # noqa: BLE001 - any compiler failure: stay eager
            self.failed = True
            warnings.warn(f"torch.compile of {self.fn.__name__} failed ({type(e).__name__}: {e}); running eager",
                          RuntimeWarning, stacklevel=2)
            return self.fn(*args)
