"""Real low-bit backends (bitsandbytes, torchao, optimum-quanto): availability here."""

from __future__ import annotations

import importlib.util

BACKEND_PACKAGES = {"bitsandbytes": "bitsandbytes", "torchao": "torchao", "quanto": "optimum.quanto"}
INSTALL_HINT = {"bitsandbytes": "pip install 'diffquant[bnb]'", "torchao": "pip install 'diffquant[torchao]'",
                "quanto": "pip install 'diffquant[quanto]'"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def backend_status() -> dict[str, str]:
    """One line per backend: installed or not, and whether CUDA is present for it."""
    import torch

    cuda = torch.cuda.is_available()
    status = {}
    for name, module in BACKEND_PACKAGES.items():
        if not _installed(module):
            status[name] = f"not installed ({INSTALL_HINT[name]})"
        else:
            status[name] = "installed" + ("" if cuda else " (CPU only here)")
    return status
