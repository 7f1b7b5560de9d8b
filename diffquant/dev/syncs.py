"""Count the calls that make the host wait for an accelerator (host syncs), on any device.

On CUDA, `torch.cuda.set_sync_debug_mode("warn")` reports each one as it happens; on CPU nothing waits, so
`HostSyncs` counts the calls that would: reading a value back (`.item()`, `bool(t)`, `float(t)`, `int(t)`,
`.tolist()`, `torch.equal`), copying to the host (`.cpu()`, `.numpy()`, `.to("cpu")`), and the operators whose
output size depends on the data, which read it back to size their output (`nonzero`, indexing or assigning with a
boolean mask, `masked_select`, `unique`, `repeat_interleave`, and `bincount`, which reads the minimum of its input
back on CUDA whatever its `minlength`). It sees what Python code calls (a TorchFunctionMode), not what an operator
does inside.

    with HostSyncs() as syncs:
        model(ids)
    syncs.total, syncs.counts  # 0 and {} on a hot path ready for a GPU
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

T = torch.Tensor
READS = {T.item, T.tolist, T.__bool__, T.__float__, T.__int__, T.__index__, T.cpu, T.numpy, torch.equal}
SIZED_BY_DATA = {torch.nonzero, T.nonzero, torch.argwhere, T.argwhere, torch.masked_select, T.masked_select,
                 torch.unique, T.unique, torch.unique_consecutive, T.unique_consecutive, torch.bincount, T.bincount,
                 torch.repeat_interleave, T.repeat_interleave, torch.Tensor.nonzero_static}


def _is_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _to_host(args, kwargs) -> bool:
    """`.to("cpu")`: the host named as such (`.to(x.device)` on a CPU tensor copies nothing, and on a GPU would
    stay there)."""
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, str)), None))
    return isinstance(target, str) and torch.device(target).type == "cpu"


def sync_name(func, args, kwargs) -> str | None:
    """The name under which a call is counted, or None when it does not make the host wait."""
    name = getattr(func, "__name__", str(func))
    if func in READS or func in SIZED_BY_DATA:
        return name
    if func in (T.__getitem__, T.__setitem__) and len(args) > 1 and _is_mask(args[1]):
        return f"{name} with a boolean mask"
    if func is torch.where and len(args) == 1 and not kwargs:
        return "where(condition)"
    if func is T.to and _to_host(args, kwargs):
        return "to(cpu)"
    return None


class HostSyncs(TorchFunctionMode):
    """Counts, by name, the calls made inside it that would make the host wait for an accelerator."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = sync_name(func, args, kwargs)
        if name is not None:
            self.counts[name] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


# operators that only make a new view or read metadata: no kernel runs on any device
VIEWS = frozenset({"view", "_unsafe_view", "as_strided", "reshape", "_reshape_alias", "unsqueeze", "squeeze", "select",
                   "slice", "narrow", "expand", "transpose", "t", "permute", "alias", "detach", "unbind", "split",
                   "lift_fresh", "view_as_real", "view_as_complex", "_local_scalar_dense"})


class Launches(TorchDispatchMode):
    """Counts, by name, the operators run inside it that launch a kernel on an accelerator (every dispatched
    operator but views). On a GPU eager PyTorch spends some microseconds of host time on each, so where the
    kernels are small their number can set the time as much as their arithmetic does; counted here on any
    device."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())
