"""diffquant: profile and quantize Differential Transformers and their matched baselines.

Heavy modules (torch, transformers) load lazily so `diffquant --help` answers at once. The rival attention
designs (diffquant.designs) register with transformers' Auto classes the first time those are used, so after
`import diffquant` a saved checkpoint of any design loads with `AutoModelForCausalLM.from_pretrained(path)`,
without diffquant importing transformers itself.
"""

import importlib.abc
import importlib.util
import sys

from diffquant.errors import DiffquantError  # noqa: F401 - the public name stays `diffquant.DiffquantError`

__version__ = "0.1.0"

_AUTO = "transformers.models.auto.modeling_auto"


def _register_designs() -> None:
    try:
        from diffquant.designs import register_auto_classes

        register_auto_classes()
    except Exception as e:  # noqa: BLE001 - never break the user's import of transformers
        import warnings

        warnings.warn(f"diffquant could not register its attention designs with transformers: {e}", stacklevel=2)


def _register_on_first_use(modeling_auto) -> None:
    """Make the Auto classes register the designs on their first use (and then be themselves again): when
    transformers loads its Auto module it may be in the middle of importing other models, too early to
    import ours."""
    from transformers.models.auto import configuration_auto

    targets = [(configuration_auto.AutoConfig, "from_pretrained"), (configuration_auto.AutoConfig, "for_model"),
               (modeling_auto._BaseAutoModelClass, "from_pretrained"), (modeling_auto._BaseAutoModelClass, "from_config")]
    originals = {(cls, name): cls.__dict__[name] for cls, name in targets}

    def restore():
        for (cls, name), original in originals.items():
            setattr(cls, name, original)

    for (cls, name), original in originals.items():
        def first_use(klass, *args, _func=original.__func__, **kwargs):
            restore()
            _register_designs()
            return _func(klass, *args, **kwargs)

        setattr(cls, name, classmethod(first_use))


class _AfterAutoImport(importlib.abc.MetaPathFinder):
    """Arms `_register_on_first_use` right after transformers' Auto model module has loaded (once)."""

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
            _register_on_first_use(module)

        spec.loader.exec_module = exec_module
        return spec


if _AUTO in sys.modules:
    _register_designs()
elif not any(isinstance(f, _AfterAutoImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterAutoImport())
