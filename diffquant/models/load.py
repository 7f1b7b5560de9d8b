"""Load any Hugging Face causal LM: a preset, a zoo name, a local directory or GGUF, or (on request) a hub id."""

from __future__ import annotations

import shutil

from pathlib import Path

from diffquant.errors import DiffquantError
from diffquant.models.files import check_folder, check_gguf, read_json
from diffquant.models.presets import PRESETS
from diffquant.pretrained import from_pretrained
from diffquant.models.zoo import ALIASES, ZOO, zoo_file


DTYPES = {"auto": "auto", "fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}


def check_dtype(name: str | None) -> None:
    """A --dtype the loaders accept (no torch: argument errors answer at once)."""
    if name is not None and name not in DTYPES:
        raise DiffquantError(f"unknown dtype {name!r}; choose fp32, bf16, fp16 or auto")


def _dtype(name: str | None):
    import torch

    check_dtype(name)
    return None if name is None else "auto" if name == "auto" else getattr(torch, DTYPES[name])


def load_model(source: str, *, dtype: str | None = "fp32", device: str | None = None, device_map=None,
               hub: bool = False, attn_implementation: str | None = None, cache: str | None = None):
    """Return (model, tokenizer or None) for `source`.

    `source` is a preset and design (`tiny:diff`, `tiny:baseline`, `tiny:gated`; random weights, with a
    byte-level tokenizer, one token per UTF-8 byte), a zoo name (`smollm2-135m`), a directory written by
    `save_pretrained`, a folder written by `diffquant quantize` (a scheme and the model it applies to), a
    `.gguf` file, or a hub id when `hub=True`. Nothing is downloaded from a hub unless `hub=True`. A
    compressed-tensors checkpoint (llm-compressor's, or `diffquant quantize --export`'s) loads as a float model
    of its dequantized weights, with what it held in `model._diffquant_source_quantization` (see
    `quant/checkpoints/compressed.py`).
    """
    kwargs = {"dtype": _dtype(dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if device_map is not None:
        kwargs["device_map"] = device_map
    from diffquant.designs import DESIGNS

    name, _, arch = source.partition(":")
    tokenizer = None
    if name in PRESETS and arch in DESIGNS:
        from diffquant.data.tokens import byte_tokenizer
        from diffquant.models.presets import build

        model, tokenizer = build(PRESETS[name], arch), byte_tokenizer()  # random weights: bytes as tokens
        if kwargs["dtype"] not in (None, "auto"):
            model = model.to(kwargs["dtype"])
    elif source in ALIASES:
        model, tokenizer = _load_zoo(source, kwargs, cache)
    else:
        path = Path(source)
        if path.suffix == ".gguf":
            if not path.is_file():
                raise DiffquantError(f"model file {source} does not exist")
            check_gguf(path)
            model, tokenizer = _from_pretrained(path.parent, kwargs, gguf_file=path.name)
        elif path.is_dir():
            scheme_file = path / "diffquant_scheme.json"
            if not (path / "config.json").is_file():
                if not scheme_file.is_file():
                    raise DiffquantError(f"{source} is a directory without config.json; point at a save_pretrained "
                                         "folder")
                # a simulated scheme saved without weights: load the model it names, then apply the scheme
                ref = read_json(scheme_file, "a scheme diffquant quantize saved").get("source")
                if not ref:
                    raise DiffquantError(f"{scheme_file} names no source model and {source} holds no weights")
                model, tokenizer = load_model(ref["model"], dtype=dtype, device=None, hub=ref.get("hub", False),
                                              cache=cache)
                model._diffquant_quant = _apply_scheme(model, path)
            elif (path / "diffquant_backend.json").is_file():
                from diffquant.quant.checkpoints.backends import load_saved_real

                check_folder(path)
                model, tokenizer = load_saved_real(path, device or "cpu"), _tokenizer(path)
                device = None  # placed by the backend's loader (a bitsandbytes model refuses .to())
            else:
                check_folder(path)
                model, tokenizer = _from_pretrained(path, kwargs)
                if scheme_file.is_file():
                    model._diffquant_quant = _apply_scheme(model, path)
        elif hub:
            model, tokenizer = _from_pretrained(source, kwargs, local_files_only=False)
        else:
            raise DiffquantError(
                f"unknown model {source!r}: not a directory, a .gguf file, a zoo name ({', '.join(ZOO)}) or a preset "
                f"PRESET:DESIGN ({'|'.join(PRESETS)}:{'|'.join(DESIGNS)}). For a hub id pass --hub (needs network)"
            )
    caveat = source_caveat(source, model)
    if caveat:
        model._diffquant_caveat = caveat
    if device is not None and device_map is None:
        model = model.to(device)
    from diffquant.models.fused import fuse

    fuse(model)  # DIFF: one softmax per layer (same weights, same numbers)
    return model.eval(), tokenizer


def source_caveat(source: str, model) -> str | None:
    """What a report must say beside weight quantization of this model, when its weights were already quantized
    before diffquant saw them: a zoo model's own caveat, a GGUF file of a quantized type, a compressed-tensors
    checkpoint (all dequantized on load), so "W4" on it re-quantizes weights that sit on a grid already."""
    from diffquant.models.zoo import zoo_entry

    entry = zoo_entry(source)
    if entry is not None and entry.weight_caveat:
        return f"{entry.display}: {entry.weight_caveat}, dequantized on load; weight quantization re-quantizes them"
    if source.endswith(".gguf"):
        kind = gguf_file_type(Path(source))
        if kind and not kind.endswith(("F32", "F16", "BF16")):
            return (f"{Path(source).name}: weights were {kind} in the GGUF file, dequantized on load; weight "
                    "quantization re-quantizes them")
    held = getattr(model, "_diffquant_source_quantization", None)
    if held:
        from diffquant.quant.checkpoints.compressed import label

        return (f"{source}: a compressed-tensors checkpoint {label(held, next(model.parameters()).dtype)}, dequantized "
                "on load; weight quantization re-quantizes its weights")
    return None


def gguf_file_type(path: Path) -> str | None:
    """The GGUF's general.file_type as gguf names it (MOSTLY_Q4_1, ALL_F32, ...), or None when it has none."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path).get_field("general.file_type")
    if field is None:
        return None
    value = int(field.parts[field.data[0]][0])
    try:
        return LlamaFileType(value).name
    except ValueError:
        return f"file type {value}"


def _apply_scheme(model, folder: Path):
    from diffquant.quant.recipe import load_quantized

    return load_quantized(model, folder)


def load_pair(folder: str | Path, device: str | None = None, archs=("baseline", "diff")) -> dict[str, tuple]:
    """{"Transformer": (model, tokenizer), "DIFF": (...)} from a folder written by `diffquant train`."""
    from diffquant.models.describe import display

    return {display(arch): load_model(str(Path(folder) / arch), device=device) for arch in archs}


def _load_zoo(name: str, kwargs: dict, cache: str | None):
    """Load a zoo model; the first load converts the GGUF once into a safetensors folder beside it."""
    from diffquant.paths import fix_modes, folder_lock

    gguf = zoo_file(name, cache)
    converted = gguf.parent / "hf"
    if not (converted / "config.json").is_file():
        with folder_lock(gguf.parent):  # one converter at a time; the others find the folder done
            if not (converted / "config.json").is_file():
                model, tokenizer = _from_pretrained(gguf.parent, {"dtype": None}, gguf_file=gguf.name)
                # the weights are plain dequantized tensors now; drop the GGUF quantizer so they serialize
                model.hf_quantizer = None
                model.is_quantized = False
                if hasattr(model.config, "quantization_config"):
                    del model.config.quantization_config
                tmp = gguf.parent / "hf.part"
                shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted conversion
                model.save_pretrained(tmp)
                if tokenizer is not None:
                    tokenizer.save_pretrained(tmp)
                fix_modes(tmp)
                shutil.rmtree(converted, ignore_errors=True)  # a folder without config.json is incomplete
                tmp.replace(converted)
    return _from_pretrained(converted, kwargs)


def _from_pretrained(path, kwargs: dict, local_files_only: bool = True, **extra):
    import warnings

    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from diffquant.quant.checkpoints import compressed

    held = None  # a compressed-tensors checkpoint's quantization_config
    if "gguf_file" not in extra:
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=local_files_only)
        except (OSError, ValueError) as e:
            raise DiffquantError(f"could not read the config of {path}: {str(e).splitlines()[0][:300]}") from None
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:  # transformers' own and registered ones (diffquant's designs)
            raise DiffquantError(f"{path} is a {config.model_type!r} model, not a causal language model")
        held = compressed.quantization_config(config)
        extra = {**extra, **compressed.load_kwargs(path, config)}  # compressed-tensors: dequantized on load
    try:
        with warnings.catch_warnings():  # "loading attributes (e.g. ['dequantize']) will be overwritten": meant so
            warnings.filterwarnings("ignore", message="You passed `quantization_config`")
            model = from_pretrained(path, local_files_only=local_files_only, **kwargs, **extra)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e) or "does not recognize this architecture" in str(e):
            raise DiffquantError(f"{path} is not a causal language model ({str(e).splitlines()[0][:200]})") from None
        raise
    except OSError as e:
        raise DiffquantError(f"could not load {path}: {str(e).splitlines()[0][:300]}") from None
    compressed.as_float(model, held)
    extra.pop("quantization_config", None)
    return model, _tokenizer(path, local_files_only, **extra)


def _tokenizer(path, local_files_only: bool = True, **extra):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=local_files_only, **extra)
    except (OSError, ValueError, TypeError):
        return None
