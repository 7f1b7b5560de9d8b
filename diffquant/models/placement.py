"""Where a model runs: the `--device` every model-taking command (and `dq.load`) accepts, checked in one
line before any work."""

from __future__ import annotations

from diffquant.errors import DiffquantError


def resolve_device(device: str | None) -> str:
    """"cpu", "cuda", "cuda:N" (or "mps"); None: CUDA when this machine has it, else the CPU. A device this
    machine does not have is refused in one line."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise DiffquantError(f"unknown device {device!r}; use cpu, cuda, cuda:N or mps") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DiffquantError(f"--device {device}: this machine has no CUDA device (torch {torch.__version__}); "
                                 "use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DiffquantError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise DiffquantError(f"--device {device}: MPS is not available here; use --device cpu")
    elif dev.type not in ("cpu", "cuda", "mps"):
        raise DiffquantError(f"unsupported device {device!r}; use cpu, cuda, cuda:N or mps")
    return str(dev)
