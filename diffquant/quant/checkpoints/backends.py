"""Real low-bit backends: bitsandbytes and torchao through transformers' quantization configs,
optimum-quanto directly (its weights+activations mode is outside transformers).

Each backend names the diffquant scheme that simulates it, so a run can report the measured model
size and the metric gap between the real kernels and the simulation of the same scheme. The real model is
loaded on the device and in the dtype the caller asks (`load_real(device=, dtype=)`: the float model's, so the
float, simulated and real passes compare like with like), and `kernels` records what its kernels compute in:
not always that dtype (bitsandbytes' fused CPU 4-bit kernel computes in bfloat16). `check` refuses up front
what a kernel would fail on: shapes a kernel cannot take, a missing compiler for quanto's kernels.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from diffquant.errors import DiffquantError

if TYPE_CHECKING:  # torch loads when a backend runs, not when the registry is read (`diffquant --help`)
    import torch

SKIP = ["lm_head"]  # diffquant's W/A schemes keep the output head in full precision too


@dataclass(frozen=True)
class Backend:
    name: str
    package: str  # import name
    extra: str  # pip extra
    simulated_by: str  # diffquant scheme preset
    description: str
    computes: str  # what its kernels compute in; {dtype} is the model's dtype


BACKENDS = {b.name: b for b in (
    Backend("bnb-int8", "bitsandbytes", "bnb", "w8a8", "bitsandbytes LLM.int8 (outlier threshold 6.0)",
            "int8 x int8 -> int32 for the input columns whose |x| stays under 6.0 (cast to float16, rows "
            "quantized to int8); the other columns in {dtype} against the dequantized int8 weights, so inputs "
            "beyond float16's 65,504 never pass through float16; output in {dtype}"),
    Backend("bnb-nf4", "bitsandbytes", "bnb", "nf4", "bitsandbytes NF4 weights, blocks of 64",
            "{dtype}: 4-bit weights dequantized (absmax per block of 64 of the flattened weight), F.linear"),
    Backend("bnb-fp4", "bitsandbytes", "bnb", "fp4", "bitsandbytes FP4 weights, blocks of 64",
            "{dtype}: 4-bit weights dequantized (absmax per block of 64 of the flattened weight), F.linear"),
    Backend("torchao-int8", "torchao", "torchao", "w8a8", "torchao int8 dynamic activations + int8 weights",
            "int8 x int8 -> int32 (torchao int_scaled_matmul): inputs quantized per token, rescaled to {dtype}"),
    Backend("torchao-int8wo", "torchao", "torchao", "w8a16", "torchao int8 weight-only",
            "{dtype}: int8 weights (per channel) times their scales, matmul with {dtype} inputs"),
    Backend("torchao-intx4wo", "torchao", "torchao", "w4a16-g32",
            "torchao IntxWeightOnlyConfig: int4 values stored in int8, groups of 32, dequantized before F.linear "
            "(no int4 kernel)",
            "{dtype}: int4 values (stored as int8) dequantized to {dtype}, then F.linear"),
    Backend("quanto-int8", "optimum.quanto", "quanto", "w8a8-static",
            "optimum-quanto int8 weights + int8 activations (calibrated)",
            "int8 x int8 -> int32 (torch._int_mm): inputs quantized with calibrated scales, rescaled in float32, "
            "output in {dtype}"),
    Backend("quanto-w8", "optimum.quanto", "quanto", "w8a16", "optimum-quanto int8 weights",
            "{dtype}: int8 weights (per channel) times their scales, matmul in {dtype}"),
    Backend("quanto-w4", "optimum.quanto", "quanto", "w4a16",
            "optimum-quanto int4 weights (groups of 128, or the largest multiple of 32 dividing the width, else "
            "per channel); compiles quanto's kernels at first use: C++ on CPU (about a minute), nvcc on CUDA "
            "(minutes), once per environment",
            "{dtype}: int4 codes unpacked by quanto's compiled kernel, dequantized to {dtype}, matmul in {dtype}"),
)}
RENAMED = {"torchao-int4wo": "torchao-intx4wo"}  # a name that no longer says what the backend is


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def backend_status() -> dict[str, str]:
    """One line per backend: usable here, or what is missing."""
    import torch

    cuda = torch.cuda.is_available()
    out = {}
    for b in BACKENDS.values():
        if not _installed(b.package):
            out[b.name] = f"not installed (pip install 'diffquant[{b.extra}]')"
        else:
            out[b.name] = "available" + ("" if cuda else " (CPU)")
    return out


def require(name: str) -> Backend:
    if name in RENAMED:
        raise DiffquantError(f"backend {name} is now {RENAMED[name]}: torchao's IntxWeightOnlyConfig stores the int4 "
                             "values in int8 and dequantizes them before F.linear, with no int4 kernel")
    if name not in BACKENDS:
        raise DiffquantError(f"unknown backend {name!r}; choose fake or one of: {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    if not _installed(backend.package):
        raise DiffquantError(f"backend {name} needs {backend.package}: pip install 'diffquant[{backend.extra}]'")
    return backend


# ------------------------------------------------------------------------------------------ up-front checks
def converted_linears(model) -> list[tuple[str, torch.nn.Linear]]:
    """(name, module) of the Linears a backend converts: every nn.Linear but SKIP's."""
    import torch

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] not in SKIP]


def _bnb_cpu_repacks() -> bool:
    """Whether bitsandbytes repacks 4-bit weights for its fused AVX512-BF16 CPU kernel at the first forward."""
    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16())


def check(name: str, model, device: torch.device | str = "cpu",
          which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """Refuse (one line, naming the layer and the rule) what `name`'s kernels cannot do with `model`'s shapes
    on `device`; returns notes to print (a kernel compiled at first use). `model` may be on the meta device.
    `which` finds executables (a parameter for tests)."""
    import torch

    require(name)
    device = torch.device(device)
    linears = converted_linears(model)
    if name == "torchao-intx4wo":
        for n, m in linears:
            if m.in_features % 32:
                raise DiffquantError(f"{name} quantizes weights in groups of 32 input columns: {n} has "
                                     f"{m.in_features} inputs, not a multiple of 32")
    if name in ("bnb-nf4", "bnb-fp4") and device.type == "cpu" and _bnb_cpu_repacks():
        for n, m in linears:
            if m.out_features % 32 or m.in_features % 2:
                raise DiffquantError(f"{name} on this CPU (AVX512-BF16) repacks each 4-bit weight for its fused "
                                     f"kernel in blocks of 32 output rows and pairs of inputs: {n} is "
                                     f"{m.out_features} x {m.in_features} (bitsandbytes: 'N must be divisible by "
                                     "block_n'); run it on CUDA or choose another backend")
    notes = []
    if name == "quanto-w4":
        note = quanto_compile_note(device, which)
        if note:
            notes.append(note)
    return notes


def _quanto_extension(device: torch.device):
    """quanto's compiled extension for `device` (None where quanto has none, e.g. CUDA absent here)."""
    import optimum.quanto  # noqa: F401  (registers its extensions)
    from optimum.quanto.library.extensions import get_extension, is_extension_available

    kind = {"cpu": "quanto_cpp", "cuda": "quanto_cuda"}.get(device.type)
    return get_extension(kind) if kind and is_extension_available(kind) else None


def _built(extension) -> bool:
    import torch

    version = Path(extension.build_directory) / "pytorch_version.txt"
    return version.is_file() and version.read_text().strip() == torch.__version__


def quanto_compile_note(device: torch.device, which: Callable[[str], str | None] = shutil.which,
                        extension=None) -> str | None:
    """quanto-w4's kernels are compiled by torch.utils.cpp_extension at their first use: on CPU a C++ unpack
    kernel (about a minute on 2 cores), on CUDA eight sources with nvcc (AWQ and Marlin int4 GEMMs, unpack:
    minutes), once per environment and torch version. None when built already; a note of the cost when it will
    compile; a refusal when the compiler it needs is missing."""
    ext = extension or _quanto_extension(device)
    if ext is None or _built(ext):
        return None
    missing = [tool for tool in ("ninja", os.environ.get("CXX", "c++")) if which(tool) is None]
    if device.type == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME is None and which("nvcc") is None:
            missing.append("nvcc (the CUDA toolkit; or set CUDA_HOME)")
    if missing:
        raise DiffquantError(f"quanto-w4 compiles optimum-quanto's {device.type.upper()} kernels at first use, which "
                             f"needs {', '.join(missing)}: not found; install them or choose another backend")
    cost = "minutes (nvcc)" if device.type == "cuda" else "about a minute"
    return f"quanto-w4: compiling optimum-quanto's {device.type.upper()} kernels at first use ({cost}, once)"


def kernels(model, name: str) -> dict:
    """What the loaded real model computes with: its device, its dtype, the classes holding its converted
    weights (quanto's class says which int4 kernel runs: AWQ on CUDA float16, TinyGemm on CUDA bfloat16, the
    unpacking one otherwise), quanto's group sizes, and the dtype its kernels compute in."""
    linears = converted_linears(model)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    device = next(model.parameters()).device
    computes = BACKENDS[name].computes
    weights = Counter(type(m.weight).__name__ for _, m in linears)
    if name in ("bnb-nf4", "bnb-fp4") and device.type == "cpu" and _bnb_cpu_repacks():
        computes = "bfloat16: bitsandbytes' fused AVX512-BF16 CPU kernel casts inputs and block scales to " \
                   "bfloat16; output cast back to {dtype}"
    if "AWQWeightQBitsTensor" in weights:
        computes = "float16: quanto's AWQ int4 GEMM (CUDA)"
    elif "TinyGemmWeightQBitsTensor" in weights:
        computes = "bfloat16: torch's tinygemm int4 kernel (_weight_int4pack_mm, CUDA)"
    out = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "weights": dict(weights),
           "computes": computes.format(dtype=str(dtype).removeprefix("torch."))}
    if name.startswith("quanto"):
        out["group_sizes"] = dict(Counter(str(getattr(m, "weight_group_size", None) or "per channel")
                                          for _, m in linears))
    return out


def _quantization_config(name: str, dtype: torch.dtype):
    import torch

    from transformers import BitsAndBytesConfig, TorchAoConfig

    if name == "bnb-int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=6.0, llm_int8_skip_modules=SKIP)
    if name in ("bnb-nf4", "bnb-fp4"):
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=name[4:], llm_int8_skip_modules=SKIP,
                                  bnb_4bit_compute_dtype=dtype)
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup

    config = {"torchao-int8": Int8DynamicActivationInt8WeightConfig(), "torchao-int8wo": Int8WeightOnlyConfig(),
              "torchao-intx4wo": IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))}[name]
    return TorchAoConfig(config, modules_to_not_convert=SKIP)


def load_real(name: str, model_dir: str | Path, calibration: torch.Tensor | None = None,
              device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
    """Load `model_dir` (a save_pretrained folder) into the backend's real low-bit form on `device`, its float
    parts in `dtype` (pass the float model's device and dtype; without a device transformers would place a
    bitsandbytes model on cuda:0 whatever the float model ran on). Refused up front where `check` refuses."""
    import torch

    from transformers import AutoConfig, AutoModelForCausalLM

    from diffquant.pretrained import from_pretrained

    require(name)
    device, dtype = torch.device(device), dtype or torch.float32
    with torch.device("meta"):
        check(name, AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)), device)
    if name.startswith("quanto"):
        model = from_pretrained(model_dir, dtype=dtype).to(device).eval()
        return _quanto(model, name, None if calibration is None else calibration.to(device))
    try:
        return from_pretrained(model_dir, quantization_config=_quantization_config(name, dtype), dtype=dtype,
                               device_map={"": device}).eval()
    except (RuntimeError, ValueError, AssertionError, ImportError) as e:
        raise DiffquantError(f"backend {name} could not quantize this model here: {str(e).splitlines()[0][:300]}") from None


def _quanto(model, name: str, calibration):
    import torch

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


def load_saved_real(path: Path, device: torch.device | str = "cpu"):
    """Reload what `save_real` wrote, on `device`."""
    import torch

    from transformers import AutoConfig, AutoModelForCausalLM

    from diffquant.pretrained import from_pretrained

    name = json.loads((path / "diffquant_backend.json").read_text())["backend"]
    if name.startswith("quanto"):
        from optimum.quanto import requantize
        from safetensors.torch import load_file

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        qmap = json.loads((path / "quanto_map.json").read_text())
        requantize(model, load_file(str(path / "quanto.safetensors")), qmap, device=torch.device(device))
        return model.eval()
    return from_pretrained(path, device_map={"": torch.device(device)}).eval()


def serialized_bytes(model) -> int:
    """Measured size: bytes of the serialized state dict (what a checkpoint of it takes)."""
    import torch

    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.tell()
