"""QuantScheme: site patterns → activation quantizers, Linear-weight patterns → weight quantizers.

`attach_scheme(model, scheme)` attaches FakeQuant taps through the same mechanism the profiler uses and
returns the Attachment; `remove()` restores the exact float model. DiffLlama's λ vectors and every
norm stay in full precision: they are not Linear weights, and no activation site reaches them.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from pathlib import Path

from diffquant.errors import DiffquantError
from diffquant.frozen import evaluating
from diffquant.quant.numerics import granularity as G
from diffquant.quant.numerics.config import QuantConfig, int_config
from diffquant.quant.numerics.formats import Format

LINEAR_INPUTS = ("*.attn_in", "*.attn_out", "*.mlp_in", "*.down_in")  # MoE: `*.down_in` also matches
# experts.down_in and shared_expert.down_in
LAYER_WEIGHTS = "layers.*.weight"  # lm_head stays in full precision, as is usual for W/A schemes
# MoE routers (the weights that choose experts) stay in full precision under wildcard patterns: a rounding
# error there changes which experts run, not just a value. Name a router weight exactly to quantize it.


@dataclass(frozen=True)
class QuantScheme:
    name: str
    activations: tuple[tuple[str, QuantConfig], ...] = ()
    weights: tuple[tuple[str, QuantConfig], ...] = ()
    description: str = ""

    def __post_init__(self) -> None:
        for pattern, _ in self.weights:
            if not pattern.endswith(".weight"):
                raise DiffquantError(f"weight pattern {pattern!r} must end with '.weight'")
        for pattern, _ in self.activations:
            if pattern.endswith(".weight"):
                raise DiffquantError(f"activation pattern {pattern!r} names a weight; put it under 'weights'")

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description,
                "activations": {p: c.to_dict() for p, c in self.activations},
                "weights": {p: c.to_dict() for p, c in self.weights}}

    @staticmethod
    def from_dict(d: dict) -> "QuantScheme":
        unknown = set(d) - {"name", "description", "activations", "weights"}
        if unknown:
            raise DiffquantError(f"unknown scheme keys {sorted(unknown)}")
        try:
            return QuantScheme(
                name=d.get("name", "custom"), description=d.get("description", ""),
                activations=tuple((p, QuantConfig.from_dict(c)) for p, c in d.get("activations", {}).items()),
                weights=tuple((p, QuantConfig.from_dict(c)) for p, c in d.get("weights", {}).items()))
        except (ValueError, TypeError) as e:
            raise DiffquantError(f"invalid scheme: {e}") from None

    @property
    def is_identity(self) -> bool:
        return not self.activations and not self.weights


def _w(bits: int, gran=None) -> QuantConfig:
    return int_config(bits, gran or G.PerChannel(0))


def _a(bits: int) -> QuantConfig:
    return int_config(bits, G.PerToken())


def _presets() -> dict[str, QuantScheme]:
    out = {"fp": QuantScheme("fp", description="no quantization: the model's own precision (the paper's 16 bits)")}
    for b in (8, 6, 4, 3, 2):
        out[f"logits-int{b}"] = QuantScheme(
            f"logits-int{b}", activations=(("*.attn_logits", int_config(b)),),
            description=f"attention logits, int{b} dynamic absmax per tensor" + (" (the paper's Figure 8)" if b in (8, 6, 4) else ""))
    acts = lambda b: tuple((p, _a(b)) for p in LINEAR_INPUTS)  # noqa: E731
    out["w8a8"] = QuantScheme("w8a8", acts(8), ((LAYER_WEIGHTS, _w(8)),),
                              "int8 per-channel weights, int8 per-token dynamic Linear inputs")
    out["w4a16"] = QuantScheme("w4a16", (), ((LAYER_WEIGHTS, _w(4, G.PerGroup(128))),),
                               "int4 weights in groups of 128, activations in full precision")
    out["w4a16-g32"] = QuantScheme("w4a16-g32", (), ((LAYER_WEIGHTS, _w(4, G.PerGroup(32))),),
                                   "int4 weights in groups of 32 (torchao's int4 weight-only setting)")
    out["w8a16"] = QuantScheme("w8a16", (), ((LAYER_WEIGHTS, _w(8)),), "int8 per-channel weights only")
    out["w4a8"] = QuantScheme("w4a8", acts(8), ((LAYER_WEIGHTS, _w(4, G.PerGroup(128))),),
                              "int4 group-128 weights, int8 per-token Linear inputs")
    out["w6a6"] = QuantScheme("w6a6", acts(6), ((LAYER_WEIGHTS, _w(6)),),
                              "int6 per-channel weights, int6 per-token Linear inputs")
    out["w4a4"] = QuantScheme("w4a4", acts(4), ((LAYER_WEIGHTS, _w(4)),),
                              "int4 per-channel weights, int4 per-token Linear inputs (QuaRot's setting)")
    out["w8a8-static"] = QuantScheme(
        "w8a8-static", tuple((p, int_config(8, G.PerTensor(), dynamic=False)) for p in LINEAR_INPUTS),
        ((LAYER_WEIGHTS, _w(8)),), "int8 weights, int8 per-tensor static activations (min-max calibration, "
                                   "Bondarenko et al.'s W8A8)")
    out["w4a4-static"] = QuantScheme(
        "w4a4-static", tuple((p, int_config(4, G.PerTensor(), dynamic=False)) for p in LINEAR_INPUTS),
        ((LAYER_WEIGHTS, _w(4)),), "int4 per-channel weights, int4 per-tensor static activations (min-max "
                                   "calibration; Bondarenko et al.'s setting at 4 bits)")
    out["fp8"] = QuantScheme("fp8", tuple((p, QuantConfig(Format("fp8_e4m3"), G.PerToken())) for p in LINEAR_INPUTS),
                             ((LAYER_WEIGHTS, QuantConfig(Format("fp8_e4m3"), G.PerChannel(0))),),
                             "fp8 e4m3 weights (per channel) and Linear inputs (per token)")
    out["nf4"] = QuantScheme("nf4", (), ((LAYER_WEIGHTS, QuantConfig(Format("nf4"), G.PerGroup(64))),),
                             "NF4 weights in groups of 64 (QLoRA), activations in full precision")
    out.update(kv_presets())
    out["fp4"] = QuantScheme("fp4", (), ((LAYER_WEIGHTS, QuantConfig(Format("fp4_e2m1"), G.PerGroup(64))),),
                             "FP4 (e2m1) weights in groups of 64, activations in full precision")
    return out


def kv_scheme(name: str, k: QuantConfig, v: QuantConfig, description: str, pre_rope: bool = False) -> QuantScheme:
    """Keys and values of the KV cache with their own quantizers: keys after RoPE at `k_cache` (what a
    cache stores), or before it at `k` (KVQuant's pre-RoPE keys; separate k projections only)."""
    where = "pre-RoPE keys (k_proj output)" if pre_rope else "post-RoPE keys"
    return QuantScheme(name, (("*.k" if pre_rope else "*.k_cache", k), ("*.v_cache", v)),
                       description=f"KV cache, {where}: {description}")


def kv_config(bits: int, granularity=None, sink: int = 0, recent: int = 0, hadamard: bool = False) -> QuantConfig:
    """A KV-cache quantizer: integer min-max with a float offset (KIVI's and quanto's cache quantizers),
    dynamic, `sink` first and `recent` last positions kept in full precision; `hadamard`: each head's
    channels quantized in a Hadamard basis (QuaRot's KV cache: Q and K rotated alike after RoPE, V's
    rotation fused into v_proj and o_proj, a head norm's gain folded into o_proj first, as `rotate` does;
    attention is unchanged in float)."""
    return QuantConfig(Format("int", bits, False, minmax=True), granularity or G.PerToken(), keep_first=sink,
                       keep_last=recent, hadamard=hadamard)


def kv_presets() -> dict[str, QuantScheme]:
    tok = "per token and KV head"
    out = [kv_scheme("kv8", kv_config(8), kv_config(8), f"int8 min-max keys and values, {tok}"),
           kv_scheme("kv4", kv_config(4), kv_config(4), f"int4 min-max keys and values, {tok}"),
           kv_scheme("k4v2", kv_config(4), kv_config(2), f"int4 keys, int2 values (min-max, {tok})"),
           kv_scheme("kv4-had", kv_config(4, hadamard=True), kv_config(4, hadamard=True),
                     f"QuaRot's KV4: int4 min-max keys and values, {tok}, each head's channels in a Hadamard basis"),
           kv_scheme("k4v2-had", kv_config(4, hadamard=True), kv_config(2, hadamard=True),
                     f"int4 keys, int2 values (min-max, {tok}), each head's channels in a Hadamard basis"),
           kv_scheme("kv4-sink1", kv_config(4, sink=1), kv_config(4, sink=1),
                     f"int4 min-max keys and values, {tok}; the first token (the attention sink) in full precision"),
           kv_scheme("kv4-g128", kv_config(4, G.PerGroup(128)), kv_config(4, G.PerGroup(128)),
                     "int4 min-max keys and values, per token in groups of 128 channels (one scale per 128 channels "
                     "whatever the head width: DIFF's 128-wide K1/K2 heads and a softmax design's 256-wide head get "
                     "the same number of scales)"),
           kv_scheme("kivi2", kv_config(2, G.KVChannel(32), recent=128), kv_config(2, G.PerGroup(32), recent=128),
                     "KIVI-2: int2 min-max keys per channel over runs of 32 positions, values per token in groups "
                     "of 32 channels; the 128 most recent positions in full precision"),
           kv_scheme("kvquant4-sink1", kv_config(4, G.KVChannel(), sink=1), kv_config(4, sink=1),
                     f"KVQuant-style int4: keys per channel over the sequence, values {tok}, min-max; the first "
                     "token in full precision", pre_rope=True)]
    return {s.name: s for s in out}


SCHEME_PRESETS = _presets()


def get_scheme(name_or_path: str) -> QuantScheme:
    """A preset name, or a JSON/YAML file describing a scheme."""
    if name_or_path in SCHEME_PRESETS:
        return SCHEME_PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.suffix.lower() in (".json", ".yaml", ".yml"):
        if not path.is_file():
            raise DiffquantError(f"scheme file {path} does not exist")
        text = path.read_text()
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as e:  # noqa: BLE001 - parse errors of either library
            raise DiffquantError(f"cannot parse {path}: {e}") from None
        if not isinstance(data, dict):
            raise DiffquantError(f"{path} must hold a mapping with 'activations' and/or 'weights'")
        return QuantScheme.from_dict(data)
    raise DiffquantError(f"unknown scheme {name_or_path!r}; choose one of: {', '.join(SCHEME_PRESETS)}, or a .json/.yaml file")


def plan(model, scheme: QuantScheme) -> dict[str, QuantConfig]:
    """{site name: config} of `scheme` on `model`, or a DiffquantError naming every pattern that matches
    nothing and every granularity that cannot apply, before any forward runs. Later patterns override
    earlier ones on the same site."""
    from diffquant.taps import site_table

    table = site_table(model)
    patterns = [p for p, _ in (*scheme.activations, *scheme.weights)]
    missing = [p for p in patterns if not any(fnmatch.fnmatchcase(s.name, p) for s in table)]
    if missing:
        raise DiffquantError(f"scheme {scheme.name!r} cannot apply to {type(model).__name__}: "
                             + "; ".join(table.miss_reason(p) for p in missing) + ". " + table.available())
    out = {}
    for pattern, config in (*scheme.activations, *scheme.weights):
        for site in table.match(pattern):
            if site.router and any(c in pattern for c in "*?["):
                continue
            G.validate(config.granularity, site.dims, site.name)
            if (config.keep_first or config.keep_last) and "pos" not in site.dims:
                raise DiffquantError(f"{site.name}: keep_first/keep_last keep positions in full precision, but its "
                                     f"dims [{', '.join(site.dims)}] have no pos dimension")
            if config.hadamard and site.kind not in ("k_cache", "v_cache"):
                raise DiffquantError(f"{site.name}: hadamard quantizers are for the KV cache (k_cache, v_cache), "
                                     "whose readers absorb the rotation exactly; elsewhere the weights would need "
                                     "it too (use --fix rotate)")
            out[site.name] = config
    return out


def applies(model, scheme: QuantScheme) -> str | None:
    """None if `scheme` applies to `model`, else the reason it does not."""
    try:
        plan(model, scheme)
    except DiffquantError as e:
        return str(e)
    return None


def attach_scheme(model, scheme: QuantScheme, compile: bool = False):
    """Attach the scheme's fake quantizers to `model` in place; returns the Attachment (`.remove()` undoes it).
    A scheme that cannot apply is refused before anything is attached (see `plan`).
    `compile=True` fuses each integer quantize-dequantize into one pass with torch.compile (a one-off
    compile of a few seconds per shape and bit-width; falls back to eager where it cannot compile).

    The attachment's `quantizers` maps site name → FakeQuant (for calibration and saving scales).
    """
    from diffquant.quant.numerics.fake import FakeQuant
    from diffquant.taps import attach

    quantizers = {name: FakeQuant(config, compile) for name, config in plan(model, scheme).items()}
    attachment = attach(model, dict(quantizers))
    attachment.quantizers = quantizers
    attachment.scheme = scheme
    return attachment


CALIBRATION_BATCH = 8  # windows per forward pass when static scales calibrate (the pipeline and the α search alike)


def calibrate(model, attachment, batches, device=None) -> None:
    """Run calibration batches through the model to fix the static scales of `attachment`'s quantizers."""
    static = [q for q in attachment.quantizers.values() if not q.config.dynamic and not q.fixed]
    if not static:
        return
    for name, q in attachment.quantizers.items():
        if q.config.calibration == "output" and q.gram is None and not q.config.dynamic:
            from diffquant.quant.numerics.layout import reader_gram

            q.gram = reader_gram(model, name)
    for q in static:
        q.start_calibration()
    seen = 0
    with evaluating(model):
        for ids in batches:
            model(ids.to(device) if device else ids, use_cache=False)
            seen += 1
    if seen == 0:
        raise DiffquantError("calibration needs at least one batch")
    for q in static:
        q.finish_calibration()


SCHEME_FILE = "diffquant_scheme.json"
