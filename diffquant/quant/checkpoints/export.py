"""Export the model diffquant simulates as a compressed-tensors checkpoint: what llm-compressor writes,
transformers loads with `AutoModelForCausalLM.from_pretrained` (compressed-tensors installed), vLLM serves.

Input: the model as the simulation runs it, i.e. after any function-preserving fix (SmoothQuant's scales are
folded into norms and weights already) and weight solver (GPTQ's, AWQ's weights are in the model), with the
scheme's attachment on it (`quantize_`, `Solved.install`, `calibrate`): the attachment holds the scheme and
every quantizer, and each weight quantizer gives the exact grid it rounds to (`FakeQuant.weight_grid`: the
scales a solver fixed, calibration chose, or round to nearest takes from the weight, and the codes).
Output: config.json with its `quantization_config`, safetensors, the tokenizer.

How diffquant's grids map onto the format, exactly (every written weight is decompressed by
compressed-tensors' own code and compared bit for bit with the simulated weight before the folder is
complete; a difference is a bug and nothing is written):

| diffquant                                      | compressed-tensors                                           |
|------------------------------------------------|--------------------------------------------------------------|
| int weights, symmetric: codes ±(2^(b−1)−1)     | int, symmetric (codes −2^(b−1)..2^(b−1)−1; the lowest unused) |
| int weights, asymmetric: codes 0..2^b−1, zero z| int, asymmetric: codes and zero point shifted by −2^(b−1)     |
| per output channel / per tensor                | strategy channel / tensor                                    |
| groups of G along the input (ragged last group)| groups of g = gcd(G, inputs), each scale repeated G/g times   |
| fp8 e4m3 weights per channel / tensor          | float 8-bit (e4m3), float-quantized                          |
| GPTQ act-order (groups set before columns move)| actorder "weight": groups stay runs of columns, no g_idx      |
| int8 / fp8 Linear inputs, dynamic per token    | input_activations: strategy token, dynamic                   |
| int8 / fp8 Linear inputs, static per tensor    | strategy tensor, static, `input_scale`                       |

GPTQ's act-order permutes the order in which columns are solved, not the grid: diffquant fixes each group's
scale on the original column order before any column moves (the reference's static groups), so a group stays
a run of consecutive columns and no `weight_g_idx` is needed (compressed-tensors 0.20 removed actorder "group",
the g_idx form, altogether).

Formats: weight-only int → `pack-quantized` (b bits per code, packed in int32), int8 weights and inputs →
`int-quantized`, fp8 → `float-quantized`. The activation quantizer runs in the loader (transformers or
vLLM), not in the file: compressed-tensors' fp8 arithmetic equals diffquant's (scale absmax/448, e4m3
rounding); its int8 grid is −128..127 where diffquant's is ±127, so a dynamic int8 scale is absmax/127.5
(diffquant: /127) and a static one clamps at −128 (diffquant: −127). vLLM's int8 kernels use absmax/127.
Everything else is refused before any work, in one line naming the part (`check`).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from diffquant.errors import DiffquantError

FORMAT = "compressed-tensors"
LINEAR_INPUTS = ("attn_in", "attn_out", "mlp_in", "down_in")  # the site points that are Linear inputs
PACK_BITS = (2, 4, 8)  # packed alike by every compressed-tensors version (0.20 packs 3, 5, 6, 7 bits anew)
INSTALL = "pip install 'diffquant[export]'"
REFUSED = {  # what the format cannot hold besides the steps that say so themselves (`refused()`)
    "logits, probs, other sites": "attention logits/probabilities, per-head logit scales: it holds Linear weights "
                                  "and inputs",
    "KV-cache schemes": "every diffquant cache preset (dynamic min-max per token; Hadamard; sinks; KIVI runs): it "
                        "holds static symmetric scales; those (fp8/int8 per tensor) transformers does not apply",
    "nf4, fp4, fp8 e5m2 weights": "no such weights with float scales (nvfp4/mxfp4 take fp8 or power-of-two ones)",
    "int3/5/6/7, min-max weights": "packing changed across versions; zero points are integers, not float offsets",
    "other Linear inputs": "only symmetric int8/fp8, dynamic per token or static per tensor",
    "Conv1D, fused MoE experts": "GPT-2's Conv1D and 3-D expert weights: it quantizes nn.Linear",
    "W8A8 off the Llama layout": "attention/MLP inputs whose readers diffquant maps on the Llama layout only "
                                 "(the weights export)",
}


def refused() -> dict[str, str]:
    """{what: why} the format cannot hold, refused by `check` in one line: the registered steps' own refusals
    (quant/algorithms/steps.py), then the rest; for `quantize --list` and docs."""
    from diffquant.quant.algorithms.steps import FIXES, SOLVERS

    steps = {}
    for registry in (FIXES, SOLVERS):
        for cls in registry.classes():
            if cls.export_refusal:
                steps[", ".join(cls.words)] = cls.export_refusal
    return {**steps, **REFUSED}


def _refuse(message: str):
    raise DiffquantError(f"export to {FORMAT}: {message}")


@dataclass(frozen=True)
class Target:
    """One quantized Linear: its module path, the weight site and activation site (None: weight only) whose
    quantizers it takes, and its compressed-tensors quantization args."""

    module: str
    weight_site: str
    weights: dict
    input_site: str | None = None
    inputs: dict | None = None

    @property
    def format(self) -> str:
        if self.weights["type"] == "float":
            return "float-quantized"
        return "int-quantized" if self.inputs is not None and self.weights["num_bits"] == 8 else "pack-quantized"

    def scheme(self) -> dict:
        return {"targets": [self.module], "weights": self.weights, "input_activations": self.inputs,
                "output_activations": None, "format": self.format}


@dataclass(frozen=True)
class Plan:
    targets: tuple[Target, ...]
    ignore: tuple[str, ...]  # Linear modules left in float (lm_head, MoE routers, any the scheme leaves)
    format: str
    notes: tuple[str, ...] = ()  # what a reader of the checkpoint must know (loader limitations)

    def quantization_config(self) -> dict:
        """`quantization_config` of config.json, validated and written by compressed-tensors itself: one
        config group per distinct scheme, targeting "Linear" where one scheme covers every quantized Linear."""
        import compressed_tensors
        from compressed_tensors.quantization import QuantizationConfig

        groups: dict[str, dict] = {}
        for t in self.targets:
            key = json.dumps([t.weights, t.inputs], sort_keys=True)
            groups.setdefault(key, {**t.scheme(), "targets": []})["targets"].append(t.module)
        if len(groups) == 1:
            next(iter(groups.values()))["targets"] = ["Linear"]
        config = {"quant_method": "compressed-tensors", "format": self.format, "quantization_status": "compressed",
                  "ignore": list(self.ignore), "config_groups": {f"group_{i}": g for i, g in enumerate(groups.values())}}
        qc = QuantizationConfig.model_validate(config)
        return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors", "sparsity_config": {},
                "transform_config": {}, **qc.model_dump(exclude=["quant_method"])}


def _weight_args(site: str, config, in_features: int, act_order: bool) -> dict:
    from diffquant.quant.numerics import granularity as G

    fmt, gran, where = config.format, config.granularity, f"{site} ({config.label()})"
    if fmt.minmax:
        _refuse(f"{where}: min-max weights keep a float offset, compressed-tensors' zero points are integers")
    if fmt.is_int:
        if fmt.bits not in PACK_BITS:
            _refuse(f"{where}: int{fmt.bits} weights; only 2, 4 and 8 bits are packed the same way by every "
                    "compressed-tensors version (0.20 changed the packing of 3, 5, 6 and 7 bits)")
        args = {"num_bits": fmt.bits, "type": "int", "symmetric": fmt.symmetric}
    elif fmt.name == "fp8_e4m3":
        args = {"num_bits": 8, "type": "float", "symmetric": True}
    else:
        _refuse(f"{where}: compressed-tensors has no {fmt.name} weights with float scales (its fp8 is e4m3; its fp4 "
                "formats, nvfp4 and mxfp4, take fp8 or power-of-two group scales; it has no NF4)")
    if isinstance(gran, G.PerTensor):
        args.update(strategy="tensor")
    elif gran.per_row:
        args.update(strategy="channel")
    elif gran.group_size and fmt.is_int:
        # groups of G from column 0 with a ragged tail are groups of gcd(G, inputs), each scale repeated: exact
        args.update(strategy="group", group_size=math.gcd(gran.size, in_features))
    else:
        _refuse(f"{where}: compressed-tensors holds weight scales per tensor, per output channel or per group "
                f"of integer weights, not {G.label(gran)}")
    args.update(dynamic=False, actorder="weight" if act_order else None)
    return args


def _input_args(site: str, config) -> dict:
    from diffquant.quant.numerics import granularity as G

    fmt, gran, where = config.format, config.granularity, f"{site} ({config.label()})"
    if config.keep_first or config.keep_last or config.hadamard:
        _refuse(f"{where}: positions kept in full precision or a Hadamard basis have no place in the format")
    if fmt.is_int and fmt.symmetric and fmt.bits == 8:
        args = {"num_bits": 8, "type": "int", "symmetric": True}
    elif fmt.name == "fp8_e4m3":
        args = {"num_bits": 8, "type": "float", "symmetric": True}
    else:
        _refuse(f"{where}: compressed-tensors' W8A8 formats take symmetric int8 or fp8 e4m3 Linear inputs")
    if config.dynamic and isinstance(gran, G.PerToken):
        return {**args, "strategy": "token", "dynamic": True}
    if not config.dynamic and isinstance(gran, G.PerTensor):
        return {**args, "strategy": "tensor", "dynamic": False}
    _refuse(f"{where}: Linear-input scales must be dynamic per token or static per tensor (dynamic per-tensor "
            "scales would span the sequences of a batch in the loader, diffquant's span one sequence)")


def _refuse_cache(site: str, config) -> None:
    """Why a KV-cache quantizer is not exported: compressed-tensors' `kv_cache_scheme` holds static symmetric
    scales per tensor or per head (vLLM serves fp8 per tensor), which diffquant's cache presets (dynamic min-max
    per token, Hadamard bases, sinks, KIVI runs) are not; a static symmetric per-tensor int8/fp8 quantizer would
    fit, but transformers 5.25 does not apply a checkpoint's kv_cache_scheme (k_scale/v_scale load as unexpected
    keys), so its parity cannot be checked here."""
    from diffquant.quant.numerics import granularity as G

    fmt, where = config.format, f"{site} ({config.label()})"
    fits = (not config.dynamic and isinstance(config.granularity, G.PerTensor) and fmt.symmetric and not config.hadamard
            and not (config.keep_first or config.keep_last) and (fmt.name == "fp8_e4m3" or (fmt.is_int and fmt.bits == 8)))
    if fits:
        _refuse(f"{where}: static per-tensor cache scales fit compressed-tensors' kv_cache_scheme, but transformers "
                "does not apply one on load (k_scale/v_scale are unexpected keys there), so the export could not be "
                "checked against the simulation; leave the cache out of the scheme to export the rest")
    _refuse(f"{where}: compressed-tensors' KV cache takes static symmetric scales per tensor or per head; diffquant's "
            "cache presets are dynamic min-max per token (Hadamard bases, sinks, KIVI runs); leave the cache out of "
            "the scheme to export the rest")


def _readers(model, table, site: str, names: dict) -> list[str]:
    """Module paths of the Linears that read a Linear-input site: the hooked module itself when it is a Linear
    (o_proj, down_proj), else the Llama layout's readers of the attention or MLP input."""
    import torch

    from diffquant.quant.numerics.layout import SUPPORTED, readers

    module = table.modules[site]
    if isinstance(module, torch.nn.Linear):
        return [names[id(module)]]
    if getattr(model.config, "model_type", None) not in SUPPORTED:
        _refuse(f"{site}: quantized attention/MLP inputs are exported for the Llama layout ({', '.join(SUPPORTED)}), "
                f"whose readers of them are known; {model.config.model_type} is not one (its weights alone export)")
    attn, mlp = readers(table.layers[table.sites[site].layer])
    return [names[id(m)] for m in (attn if table.sites[site].kind == "attn_in" else mlp)]


def check(model, scheme, fixes=(), solver=None) -> Plan:
    """What the checkpoint will hold, or a DiffquantError naming the first part the format cannot hold, before
    any calibration or solving. `fixes`: the recipe's fixes applied before the scheme (steps or their spellings;
    each step says itself whether the format holds it, `export_refusal`); `solver`: its weight solver (GPTQ's
    act-order is recorded)."""
    import torch

    from diffquant.quant.numerics.scheme import plan as site_plan
    from diffquant.quant.algorithms.steps import FIXES, SOLVERS
    from diffquant.taps import site_table
    from diffquant.taps.sites import CACHE_POINTS

    fixes = [fixes] if isinstance(fixes, str) else list(fixes or ())
    solver = SOLVERS.parse(solver) if isinstance(solver, str) else solver
    for step in [FIXES.parse(f) if isinstance(f, str) else f for f in fixes] + [solver]:
        if step is not None and step.export_refusal:
            _refuse(f"{step.label()}: {step.export_refusal}")
    act_order = solver is not None and solver.act_order
    if getattr(model.config, "quantization_config", None) is not None or getattr(model, "_diffquant_quant", None):
        _refuse("the model was loaded quantized (a quantized checkpoint, or a folder with a saved diffquant scheme); "
                "export from its float source")
    planned = site_plan(model, scheme)
    table = site_table(model)
    names = {id(m): n for n, m in model.named_modules()}
    weights: dict[str, tuple[str, dict]] = {}
    inputs: dict[str, tuple[str, dict]] = {}
    for site, config in planned.items():
        info = table.sites[site]
        if info.is_weight:
            module = table.modules[site]
            if info.layout != "linear" or info.param != "weight" or not isinstance(module, torch.nn.Linear):
                kind = type(module).__name__.removeprefix("Parametrized")
                _refuse(f"{site}: compressed-tensors quantizes nn.Linear weights, not a {kind} ({info.layout}) weight")
            weights[names[id(module)]] = (site, _weight_args(site, config, module.in_features, act_order))
        elif info.kind in LINEAR_INPUTS:
            args = _input_args(site, config)
            for path in _readers(model, table, site, names):
                inputs[path] = (site, args)
        elif info.kind in CACHE_POINTS:
            _refuse_cache(site, config)
        else:
            _refuse(f"{site} ({config.label()}): compressed-tensors quantizes Linear weights and inputs; {info.kind} "
                    "quantization (attention logits or probabilities, per-head logit scales, other activations) has "
                    "no place in it")
    for path, (site, _) in inputs.items():
        if path not in weights:
            _refuse(f"{path}: its input is quantized ({site}) but its weight is not; the W8A8 formats quantize both")
    head = getattr(model, "lm_head", None)
    if head is not None and names.get(id(head)) in weights and head.weight is model.get_input_embeddings().weight:
        _refuse("lm_head is tied to the embedding: quantizing it would quantize the embedding too")
    targets = tuple(Target(path, site, args, *inputs.get(path, (None, None))) for path, (site, args) in weights.items())
    if not targets:
        _refuse(f"scheme {scheme.name!r} quantizes no Linear weight")
    formats = sorted({t.format for t in targets})
    if len(formats) > 1:
        _refuse(f"scheme {scheme.name!r} mixes {' and '.join(formats)} Linears; one checkpoint takes one format")
    ignore = tuple(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n not in weights)
    return Plan(targets, ignore, formats[0], _notes(model, targets))


DEQUANTIZE = "AutoModelForCausalLM.from_pretrained(DIR, quantization_config=CompressedTensorsConfig(dequantize=True))"


def _notes(model, targets) -> tuple[str, ...]:
    """Where transformers' loader (5.25, compressed-tensors 0.20) needs `dequantize=True`: the weights are in
    the format all the same, and load bit-identically that way (tests/test_export.py)."""
    notes = []
    if any(not t.weights["symmetric"] and t.format == "pack-quantized" for t in targets):
        notes.append("asymmetric packed weights: transformers' compressed-tensors loader initialises their zero "
                     f"points unpacked and refuses the packed ones (llm-compressor#1618); load with {DEQUANTIZE}")
    if model.config.model_type == "falcon":
        notes.append(f"Falcon: transformers' weight init reads FalconLinear.weight, which the packed layout replaces; "
                     f"load with {DEQUANTIZE}")
    return tuple(notes)


def _grid_tensors(t: Target, codes, scale, zero, granularity) -> dict:
    """The tensors compressed-tensors stores for one weight, from diffquant's codes ([out, in]) and scales (as
    `Q.grouped` shapes them) of `granularity`."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    w, out = t.weights, codes.shape[0]
    if w["strategy"] == "tensor":
        scale, zero = scale.reshape(1), zero.reshape(1)
    elif w["strategy"] == "channel":
        scale, zero = scale.reshape(out, 1), zero.reshape(out, 1)
    else:  # diffquant's groups of G: [out, groups, 1] → groups of g, group k of g inside diffquant's k·g // G
        g = w["group_size"]
        pick = torch.arange(codes.shape[1] // g) * g // granularity.size
        scale, zero = scale[:, pick, 0], zero[:, pick, 0]
    tensors = {"weight_scale": scale.float().contiguous()}
    if w["type"] == "float":
        return {**tensors, "weight": codes.to(torch.float8_e4m3fn).contiguous()}
    shift = 0 if w["symmetric"] else 2 ** (w["num_bits"] - 1)  # unsigned codes 0..2^b−1 → signed
    q = (codes - shift).to(torch.int8)
    if not w["symmetric"]:
        zp = (zero - shift).to(torch.int8)
        packed = t.format == "pack-quantized" and w["strategy"] in ("group", "channel")
        tensors["weight_zero_point"] = (pack_to_int32(zp, w["num_bits"], packed_dim=0) if packed else zp).contiguous()
    if t.format == "int-quantized":
        return {**tensors, "weight": q.contiguous()}
    return {**tensors, "weight_packed": pack_to_int32(q, w["num_bits"]), "weight_shape": torch.tensor(list(codes.shape))}


def _decompressed(t: Target, tensors: dict):
    """The weight compressed-tensors' loader makes of `tensors` (its own decompression)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme.model_validate(t.scheme())
    return BaseCompressor.get_value_from_registry(t.format).decompress(dict(tensors), scheme)["weight"]


def export_compressed_tensors(model, attachment, out, tokenizer=None, fixes=(), solver=None) -> dict:
    """Write the model `attachment` simulates on `model` to the folder `out` as a compressed-tensors checkpoint
    (see the module doc); returns what was written: format, quantization_config, bytes per file, and the
    largest |Δ| between a decompressed and a simulated weight (0: they are checked bit-identical).
    `fixes`, `solver`: the recipe's steps before the scheme (see `check`)."""
    import torch

    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise DiffquantError(f"export to {FORMAT} needs the compressed-tensors package: {INSTALL}") from None
    plan = check(model, attachment.scheme, fixes, solver)
    tensors, quantized = {}, set()
    with torch.no_grad():
        for t in plan.targets:
            module = model.get_submodule(t.module)
            simulated = module.weight.detach()  # through the scheme's parametrization: what the simulation uses
            quantizer = attachment.quantizers[t.weight_site]
            codes, scale, zero = quantizer.weight_grid(module.parametrizations["weight"].original.detach())
            own = _grid_tensors(t, codes, scale, zero, quantizer.config.granularity)
            if t.inputs is not None and not t.inputs["dynamic"]:
                own["input_scale"] = attachment.quantizers[t.input_site].scale.reshape(1).float().clone()
            back = _decompressed(t, own).to(simulated.dtype)
            if not torch.equal(back, simulated):
                raise DiffquantError(f"export to {FORMAT}: {t.module}'s weight decompresses to something other than "
                                     f"the simulated weight (max |Δ| {(back - simulated).abs().max():.3g}); this is a "
                                     "bug, nothing was written")
            tensors.update({f"{t.module}.{k}": v.cpu() for k, v in own.items()})
            quantized.add(f"{t.module}.weight")
        state = {}
        for key, value in model.state_dict().items():
            key = key.replace(".parametrizations.weight.original", ".weight")
            if key not in quantized:
                state[key] = value
        state.update(tensors)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".export.part"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp, state_dict=state)
        config = json.loads((tmp / "config.json").read_text())
        config["quantization_config"] = plan.quantization_config()
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        from diffquant.paths import fix_modes

        fix_modes(tmp)
        for old in out.glob("model*.safetensors*"):  # shards of an earlier export (--force)
            old.unlink()
        (out / "config.json").unlink(missing_ok=True)
        files = sorted(tmp.iterdir(), key=lambda f: f.name == "config.json")  # config.json last: a folder
        for f in files:  # without it is incomplete
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    weights = {f.name: f.stat().st_size for f in out.glob("model*.safetensors")}
    return {"format": FORMAT, "folder": str(out), "quantization_config": config["quantization_config"],
            "quantized_linears": len(plan.targets), "float_linears": list(plan.ignore),
            "safetensors_bytes": sum(weights.values()), "files": weights, "max_abs_weight_difference": 0.0,
            "notes": list(plan.notes)}
