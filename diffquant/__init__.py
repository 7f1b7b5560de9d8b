"""diffquant: profile and quantize Differential Transformers and their matched baselines.

Heavy modules (torch, transformers) load lazily so `diffquant --help` answers at once. The rival attention
designs (diffquant.designs) register with transformers' Auto classes as soon as transformers loads its
Auto model classes, so after `import diffquant` a saved checkpoint of any design loads with
`AutoModelForCausalLM.from_pretrained(path)`, without diffquant importing transformers itself.
"""

import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"


class DiffquantError(Exception):
    """An error caused by the user's input; the CLI prints it as one line, without a traceback."""


_AUTO = "transformers.models.auto.modeling_auto"


def _register_designs() -> None:
    try:
        from diffquant.designs import register_auto_classes

        register_auto_classes()
    except Exception as e:  # noqa: BLE001 - never break the user's import of transformers
        import warnings

        warnings.warn(f"diffquant could not register its attention designs with transformers: {e}", stacklevel=2)


class _AfterAutoImport(importlib.abc.MetaPathFinder):
    """Runs `_register_designs` right after transformers' Auto model module has loaded (once)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _AUTO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register_designs()

        spec.loader.exec_module = exec_module
        return spec


if _AUTO in sys.modules:
    _register_designs()
elif not any(isinstance(f, _AfterAutoImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterAutoImport())
