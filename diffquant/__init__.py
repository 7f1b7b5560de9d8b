"""diffquant: profile and quantize Differential Transformers and their matched baselines.

    import diffquant as dq

The public API (`__all__`, from diffquant/api.py) loads on first use; `from diffquant import lab` adds what a study
needs beyond it (training runs, statistics, report helpers, presets: diffquant/lab.py, what experiments/ uses).
Importing diffquant registers its attention designs (gated, sink, clipsoftmax, the ablations) with transformers'
Auto classes, explicitly (diffquant.designs.register_auto_classes), so a saved checkpoint of any design loads with
`AutoModelForCausalLM.from_pretrained(path)` afterwards. That imports torch and transformers; the command line
starts through `diffquant_cli`, which skips it until a command needs a model, so `diffquant --help` answers at
once.
"""

import sys

from diffquant.errors import DiffquantError

__version__ = "0.1.0"

__all__ = ["DiffquantError", "load", "load_pair", "windows", "profile", "Profile", "quantize_", "Recipe", "Quantized",
           "SmoothQuant", "Rotate", "Clip", "GPTQ", "AWQ", "QuantScheme", "scheme", "perplexity", "multiple_choice",
           "sweep", "plot_sweep", "train", "registries", "keep_freed_memory"]


def __getattr__(name: str):
    if name in __all__:
        from diffquant import api

        return getattr(api, name)
    raise AttributeError(f"module 'diffquant' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])


# `python -m diffquant` imports this package before its __main__ starts the command line; runpy sets argv[0] to
# "-m" while it does, so the command line's lazy start (diffquant_cli) holds there too
if not getattr(sys, "_diffquant_command_line", False) and sys.argv[:1] != ["-m"]:
    import logging

    # transformers imports torchao (where installed) on its way to the Auto classes: without CUDA, torchao logs a
    # line for each CUDA kernel library it cannot load, and torch a deprecation of torchao's enum registration.
    # Neither concerns a diffquant user, so both loggers stay below ERROR for this import only.
    _loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    _levels = [logger.level for logger in _loggers]
    for _logger in _loggers:
        _logger.setLevel(logging.ERROR)
    try:
        from diffquant.designs import register_auto_classes

        register_auto_classes()
    finally:
        for _logger, _level in zip(_loggers, _levels):
            _logger.setLevel(_level)
    del _loggers, _levels, _logger, _level, logging
