"""Real low-bit backends: bitsandbytes and torchao through transformers' quantization configs,
optimum-quanto directly (its weights+activations mode is outside transformers).

Each backend names the diffquant scheme that simulates it, so a run can report the measured model
size and the metric gap between the real kernels and the simulation of the same scheme.
"""

from __future__ import annotations

import importlib.util
import io
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffquant.errors import DiffquantError

SKIP = ["lm_head"]  # diffquant's W/A schemes keep the output head in full precision too


@dataclass(frozen=True)
class Backend:
    name: str
    package: str  # import name
    extra: str  # pip extra
    simulated_by: str  # diffquant scheme preset
    description: str


BACKENDS = {b.name: b for b in (
    Backend("bnb-int8", "bitsandbytes", "bnb", "w8a8", "bitsandbytes LLM.int8 (outlier threshold 6.0)"),
    Backend("bnb-nf4", "bitsandbytes", "bnb", "nf4", "bitsandbytes NF4 weights, blocks of 64"),
    Backend("bnb-fp4", "bitsandbytes", "bnb", "fp4", "bitsandbytes FP4 weights, blocks of 64"),
    Backend("torchao-int8", "torchao", "torchao", "w8a8", "torchao int8 dynamic activations + int8 weights"),
    Backend("torchao-int8wo", "torchao", "torchao", "w8a16", "torchao int8 weight-only"),
    Backend("torchao-int4wo", "torchao", "torchao", "w4a16-g32", "torchao int4 weight-only, groups of 32"),
    Backend("quanto-int8", "optimum.quanto", "quanto", "w8a8-static", "optimum-quanto int8 weights + int8 activations (calibrated)"),
    Backend("quanto-w8", "optimum.quanto", "quanto", "w8a16", "optimum-quanto int8 weights"),
    Backend("quanto-w4", "optimum.quanto", "quanto", "w4a16", "optimum-quanto int4 weights (groups of 128)"),
)}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def backend_status() -> dict[str, str]:
    """One line per backend: usable here, or what is missing."""
    cuda = torch.cuda.is_available()
    out = {}
    for b in BACKENDS.values():
        if not _installed(b.package):
            out[b.name] = f"not installed (pip install 'diffquant[{b.extra}]')"
        else:
            out[b.name] = "available" + ("" if cuda else " (CPU)")
    return out


def require(name: str) -> Backend:
    if name not in BACKENDS:
        raise DiffquantError(f"unknown backend {name!r}; choose fake or one of: {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    if not _installed(backend.package):
        raise DiffquantError(f"backend {name} needs {backend.package}: pip install 'diffquant[{backend.extra}]'")
    return backend


def _quantization_config(name: str):
    from transformers import BitsAndBytesConfig, TorchAoConfig

    if name == "bnb-int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0, llm_int8_skip_modules=SKIP)
    if name in ("bnb-nf4", "bnb-fp4"):
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=name[4:], llm_int8_skip_modules=SKIP,
                                  bnb_4bit_compute_dtype=torch.float32)
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    config = {"torchao-int8": Int8DynamicActivationInt8WeightConfig(), "torchao-int8wo": Int8WeightOnlyConfig(),
              "torchao-int4wo": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))}[name]
    return TorchAoConfig(config, modules_to_not_convert=SKIP)


def load_real(name: str, model_dir: str | Path, calibration: torch.Tensor | None = None):
    """Load `model_dir` (a save_pretrained folder) into the backend's real low-bit form."""
    from transformers import AutoModelForCausalLM

    require(name)
    if name.startswith("quanto"):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        return _quanto(model, name, calibration)
    try:
        return AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=_quantization_config(name),
                                                    dtype=torch.float32).eval()
    except (RuntimeError, ValueError, AssertionError, ImportError) as e:
        raise DiffquantError(f"backend {name} could not quantize this model here: {str(e).splitlines()[0][:300]}") from None


def _quanto(model, name: str, calibration):
    from optimum.quanto import Calibration, freeze, qint4, qint8, quantize

    weights = qint4 if name == "quanto-w4" else qint8
    activations = qint8 if name == "quanto-int8" else None
    quantize(model, weights=weights, activations=activations, exclude=SKIP)
    if activations is not None:
        if calibration is None:
            raise DiffquantError("quanto-int8 quantizes activations and needs calibration data")
        with Calibration(), torch.no_grad():  # quanto's autograd.Function refuses inference tensors
            model(calibration, use_cache=False)
    freeze(model)
    model._diffquant_backend = name
    return model


def save_real(model, name: str, out: Path) -> None:
    """Save a real quantized model so `load_saved_real` (or transformers, for bnb/torchao) reloads it."""
    if name.startswith("quanto"):
        from optimum.quanto import quantization_map
        from safetensors.torch import save_file

        model.config.save_pretrained(out)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(out / "quanto.safetensors"))
        (out / "quanto_map.json").write_text(json.dumps(quantization_map(model)))
    else:
        model.save_pretrained(out, safe_serialization=not name.startswith("torchao"))
    (out / "diffquant_backend.json").write_text(json.dumps({"backend": name}))
    from diffquant.paths import fix_modes

    fix_modes(out)


def load_saved_real(path: Path):
    """Reload what `save_real` wrote."""
    from transformers import AutoConfig, AutoModelForCausalLM

    name = json.loads((path / "diffquant_backend.json").read_text())["backend"]
    if name.startswith("quanto"):
        from optimum.quanto import requantize
        from safetensors.torch import load_file

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        qmap = json.loads((path / "quanto_map.json").read_text())
        requantize(model, load_file(str(path / "quanto.safetensors")), qmap, device=torch.device("cpu"))
        return model.eval()
    return AutoModelForCausalLM.from_pretrained(path).eval()


def serialized_bytes(model) -> int:
    """Measured size: bytes of the serialized state dict (what a checkpoint of it takes)."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.tell()
