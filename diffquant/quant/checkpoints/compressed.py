"""Reading compressed-tensors checkpoints (llm-compressor's output, diffquant's own export) as `--model DIR`.

A folder whose config.json carries `quantization_config.quant_method: compressed-tensors` loads through
transformers with `CompressedTensorsConfig(dequantize=True)`: every weight is decompressed on load to its
dequantized values (exactly the grid the checkpoint holds), and the model becomes a plain float model on
which diffquant's sites, schemes and solvers work as on any other. The checkpoint's activation quantizers
(W8A8's int8/fp8 Linear inputs, a KV-cache scheme) are settings of the serving runtime, not weights: they
are recorded (`source_quantization`, in every report) and not applied; a diffquant scheme simulates
activations (e.g. `--scheme w8a8`). Why not transformers' default route: it keeps weights packed until the
first forward (diffquant reads weights before that), would run the checkpoint's activation quantizers under
diffquant's own, and cannot load asymmetric packed weights (transformers 5.25 with compressed-tensors 0.20,
llm-compressor#1618).
"""

from __future__ import annotations

import importlib.util

from diffquant.errors import DiffquantError
from diffquant.quant.checkpoints.export import FORMAT, INSTALL


def quantization_config(config) -> dict | None:
    """The compressed-tensors `quantization_config` of a transformers config (None for any other model)."""
    qc = getattr(config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    return qc if qc and qc.get("quant_method") == FORMAT else None


def load_kwargs(path, config) -> dict:
    """`from_pretrained` arguments that decompress a compressed-tensors checkpoint on load ({} for others)."""
    if quantization_config(config) is None:
        return {}
    if importlib.util.find_spec("compressed_tensors") is None:
        raise DiffquantError(f"{path} is a {FORMAT} checkpoint; reading it needs the compressed-tensors package: "
                             f"{INSTALL}")
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


def as_float(model, qc: dict | None) -> dict | None:
    """Make a model loaded with `load_kwargs` a plain float model (its weights stay the dequantized ones) and
    record what its checkpoint held (`qc`, the config's `quantization_config`) for reports."""
    if qc is None:
        return None
    model.hf_quantizer = None  # transformers leaves a dequantizing quantizer attached; the weights are plain now
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model._diffquant_source_quantization = summary(qc)
    return model._diffquant_source_quantization


def _args(a: dict | None) -> str | None:
    if not a:
        return None
    kind = f"{a.get('type', 'int')}{a.get('num_bits')}"
    strategy = a.get("strategy") or "tensor"
    parts = [kind, "symmetric" if a.get("symmetric", True) else "asymmetric",
             f"group {a['group_size']}" if strategy == "group" else f"per {strategy}",
             "dynamic" if a.get("dynamic") else "static"]
    if a.get("actorder"):
        parts.append(f"actorder {a['actorder']}")
    return ", ".join(parts)


def label(held: dict, dtype) -> str:
    """How reports name a model loaded from such a checkpoint, as a GGUF one is named: "(compressed-tensors int4
    group 32 → fp32)"."""
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    first = (held["groups"] or [{"weights": None}])[0]  # the first config group: llm-compressor writes one
    w = (first["weights"] or "").split(", ")  # "int4, symmetric, group 32, static" (`_args`)
    parts = [" ".join(x for x in (w[0], w[2] if len(w) > 2 else "") if x)]
    if first.get("input_activations"):
        parts.append("inputs " + first["input_activations"].split(", ")[0])
    dt = str(dtype).replace("torch.", "")
    return f"({FORMAT} {', '.join(parts)} → {short.get(dt, dt)})"


def summary(qc: dict) -> dict:
    """What a compressed-tensors `quantization_config` says, in a few readable fields."""
    groups = [{"targets": g.get("targets"), "weights": _args(g.get("weights")),
               "input_activations": _args(g.get("input_activations"))}
              for g in (qc.get("config_groups") or {}).values()]
    return {"format": FORMAT, "compression": qc.get("format"), "version": qc.get("version"), "groups": groups,
            "ignore": qc.get("ignore") or [], "kv_cache_scheme": _args(qc.get("kv_cache_scheme")),
            "applied": "weights dequantized on load (their exact grid); the checkpoint's activation and KV-cache "
                       "quantizers are not applied (simulate them with a diffquant scheme)"}
