"""llm-compressor's recipe files read as diffquant recipes: what a user ships, simulated, profiled and swept as is.

llm-compressor (the vLLM project's) writes a recipe as YAML, stage by stage, each stage's modifiers in order:

    quant_stage:
      quant_modifiers:
        SmoothQuantModifier: {smoothing_strength: 0.8}
        GPTQModifier: {targets: [Linear], scheme: W8A8, ignore: [lm_head]}

and saves the recipe it ran beside every checkpoint (recipe.yaml). `read(doc)` maps one onto diffquant's steps: a
SmoothQuantModifier onto `SmoothQuant(alpha=smoothing_strength)`; a GPTQModifier onto `GPTQ(damp, block,
act_order)` with its scheme; an AWQModifier (duo_scaling off: the paper's s = mean|x|^α) onto `awq:no-clip` with the
scheme of the QuantizationModifier after it; a QuantizationModifier alone onto round to nearest. A scheme is a preset
name (W8A8, W4A16, FP8, ...: compressed-tensors' own definitions, restated in PRESETS) or `config_groups`, on the
Linear layers; symmetric integers use compressed-tensors' full-range grid (int8: −128..127 at absmax/127.5, the
`-full` formats), so the simulation rounds as the shipped checkpoint does.

Anything diffquant cannot honour is refused in one line naming the field, never dropped: custom smoothing or AWQ
mappings, ignore lists beyond lm_head, block strategies, KV-cache and output quantization, act-order "group",
llm-compressor's default AWQ duo scaling, other modifiers. GPTQModifier's act-order default is llm-compressor's:
absent means "static" (= "weight", diffquant's act-order), null means none; a recipe.yaml llm-compressor saved
keeps the resolved value in its config group, which is read the same way.
"""

from __future__ import annotations

from diffquant.errors import DiffquantError

# compressed-tensors' preset schemes (quantization/quant_scheme.py, compressed-tensors 0.19): weights and input
# activations as QuantizationArgs fields
_W = lambda bits, group=128: {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group",  # noqa: E731
                              "group_size": group, "dynamic": False}
_A = lambda bits: {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "token",  # noqa: E731
                   "dynamic": True}
PRESETS = {
    **{f"W{w}A16": {"weights": _W(w)} for w in range(2, 9)},
    **{f"W{w}A8": {"weights": _W(w), "input_activations": _A(8)} for w in range(2, 8)},
    **{f"W{w}A4": {"weights": _W(w), "input_activations": _A(4)} for w in range(2, 5)},
    "W8A8": {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
             "input_activations": _A(8)},
    "W4A16_ASYM": {"weights": {**_W(4), "symmetric": False}},
    "FP8": {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                                  "dynamic": False}},
    "FP8_DYNAMIC": {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                                "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                          "dynamic": True}},
}
PRESETS["INT8"] = PRESETS["W8A8"]
LINEAR = ("Linear", ["Linear"])
LM_HEAD = ("lm_head", "re:.*lm_head", "re:.*lm_head$", "re:lm_head")
HARMLESS = {  # fields that change memory, speed or logging, never the result, with the values that mean nothing else
    "requires_calibration_data": (True,), "offload_hessians": (True, False), "batched_quantization": None,
    "offload_device": None, "bypass_divisibility_checks": (False,), "weight_observer": (None,),
    "input_observer": (None,), "output_observer": (None,), "observer": (None,), "kv_cache_scheme": (None,),
    "start": None, "end": None, "update": None, "index": None, "group": None,
}
ARGS_OK = {"observer": (None, "minmax", "memoryless_minmax", "static_minmax"), "observer_kwargs": (None, {}),
           "block_structure": (None,), "scale_dtype": (None,), "zp_dtype": (None,)}


def is_llmcompressor(doc) -> bool:
    """Whether a parsed YAML document is an llm-compressor recipe (a stage of `*_modifiers`)."""
    return isinstance(doc, dict) and any(isinstance(v, dict) and any(str(k).endswith("_modifiers") for k in v)
                                         for v in doc.values())


def modifiers(doc: dict) -> list[tuple[str, dict]]:
    """(modifier name, its arguments), stage by stage and group by group, in the file's order."""
    out = []
    for stage, body in doc.items():
        if not isinstance(body, dict):
            raise DiffquantError(f"llm-compressor recipe: stage {stage!r} is not a mapping of *_modifiers")
        for group, mods in body.items():
            if not str(group).endswith("_modifiers"):
                raise DiffquantError(f"llm-compressor recipe: {stage}.{group} is not a *_modifiers group "
                                     "(diffquant reads modifiers only)")
            if not isinstance(mods, dict):
                raise DiffquantError(f"llm-compressor recipe: {stage}.{group} is not a mapping of modifiers")
            out += [(name, args or {}) for name, args in mods.items()]
    return out


def _refuse(where: str, what: str):
    raise DiffquantError(f"llm-compressor recipe: {where}: {what}")


def _take(where: str, args: dict, known: dict) -> dict:
    """`args` checked against `known` ({field: allowed values or None for any}), HARMLESS fields allowed too; an
    unknown field or a value diffquant cannot honour is refused."""
    args = dict(args)
    for field, value in args.items():
        allowed = known[field] if field in known else HARMLESS.get(field, "unknown")
        if allowed == "unknown":
            _refuse(where, f"{field} is not a field diffquant reads or can honour; remove it to simulate the rest")
        if allowed is not None and value not in allowed:
            _refuse(where, f"{field}: {value!r} is not something diffquant can do (it does {allowed!r})")
    return args


def _config(where: str, args: dict | None, weights: bool):
    """A QuantConfig from compressed-tensors QuantizationArgs fields (None: not quantized)."""
    from diffquant.quant.numerics import granularity as G
    from diffquant.quant.numerics.config import QuantConfig
    from diffquant.quant.numerics.formats import Format

    if args is None:
        return None
    args = dict(args)
    for field, allowed in ARGS_OK.items():
        if args.pop(field, None) not in allowed:
            _refuse(where, f"{field} is not something diffquant can simulate")
    args.pop("actorder", None)  # read by the GPTQ step
    bits, kind = int(args.pop("num_bits", 8)), args.pop("type", "int")
    symmetric, strategy = bool(args.pop("symmetric", True)), args.pop("strategy", None)
    group, dynamic = args.pop("group_size", None), args.pop("dynamic", False)
    if args:
        _refuse(where, f"unknown quantization fields {sorted(args)}")
    if kind == "float":
        if bits != 8 or not symmetric:
            _refuse(where, f"float{bits} {'symmetric' if symmetric else 'asymmetric'}: diffquant simulates fp8 e4m3")
        fmt = Format("fp8_e4m3")
    elif kind == "int":
        fmt = Format("int", bits, True, full=True) if symmetric else Format("int", bits, False)
    else:
        _refuse(where, f"type {kind!r}")
    if dynamic not in (True, False):
        _refuse(where, f"dynamic: {dynamic!r} (diffquant's scales are dynamic per tensor/token or static)")
    strategy = strategy or ("group" if group else "tensor")
    grans = {"tensor": G.PerTensor(), "channel": G.PerChannel(0) if weights else None,
             "group": G.PerGroup(int(group or 0)) if group else None, "token": None if weights else G.PerToken()}
    gran = grans.get(strategy)
    if gran is None:
        _refuse(where, f"strategy {strategy!r} for {'weights' if weights else 'input activations'}"
                + (" without group_size" if strategy == "group" else ""))
    return QuantConfig(fmt, gran, dynamic=True if weights else bool(dynamic))


def _scheme(where: str, args: dict, name: str):
    """The QuantScheme of a quantization modifier's scheme / config_groups, targets and ignore."""
    from diffquant.quant.numerics.scheme import LAYER_WEIGHTS, LINEAR_INPUTS, QuantScheme

    targets = args.pop("targets", ["Linear"])
    if targets not in LINEAR:
        _refuse(where, f"targets {targets!r}: diffquant quantizes the decoder layers' Linears (targets: [Linear])")
    ignore = args.pop("ignore", None) or []
    if any(i not in LM_HEAD for i in ignore):
        _refuse(where, f"ignore {ignore!r}: diffquant leaves lm_head in full precision and quantizes every other "
                       "Linear of the decoder layers; other exclusions are not simulated")
    scheme, groups = args.pop("scheme", None), args.pop("config_groups", None)
    if (scheme is None) == (groups is None):
        _refuse(where, "give exactly one of scheme and config_groups")
    if isinstance(scheme, str):
        if scheme.upper() not in PRESETS:
            _refuse(where, f"scheme {scheme!r}: diffquant simulates {', '.join(sorted(PRESETS))}")
        groups = {"group_0": {"targets": ["Linear"], **PRESETS[scheme.upper()]}}
        label = scheme.upper()
    elif isinstance(scheme, dict):  # {PRESET: [targets]}
        if len(scheme) != 1:
            _refuse(where, "scheme: one preset for the Linear layers")
        (preset, on), = scheme.items()
        return _scheme(where, {**args, "targets": on, "scheme": preset, "ignore": ignore}, name)
    else:
        label = "config_groups"
    if len(groups) != 1:
        _refuse(where, f"{len(groups)} config groups: diffquant simulates one scheme for all Linears")
    (gname, group), = groups.items()
    group = dict(group)
    if group.pop("targets", ["Linear"]) not in LINEAR:
        _refuse(f"{where}.{gname}", "targets: diffquant's scheme covers the Linear layers")
    if group.pop("output_activations", None) is not None:
        _refuse(f"{where}.{gname}", "output_activations: diffquant simulates weights and Linear inputs")
    group.pop("format", None)  # how a checkpoint is packed, not what is computed
    w = _config(f"{where}.{gname}.weights", group.pop("weights", None), weights=True)
    a = _config(f"{where}.{gname}.input_activations", group.pop("input_activations", None), weights=False)
    if group:
        _refuse(f"{where}.{gname}", f"unknown fields {sorted(group)}")
    return QuantScheme(f"{name}:{label}", tuple((p, a) for p in LINEAR_INPUTS) if a else (),
                       ((LAYER_WEIGHTS, w),) if w else (),
                       f"llm-compressor's {label} on the decoder Linears (compressed-tensors' grids)")


def _actorder(where: str, args: dict) -> bool:
    """Whether GPTQ orders columns by activation, resolved as llm-compressor resolves it: a modifier without
    `actorder` takes its config group's weights.actorder, or "static" where that is null; a modifier's own value
    (null included) must agree with a non-null group value."""
    absent = object()
    given = args.pop("actorder", absent)
    groups = args.get("config_groups") or {}
    existing = next((g.get("weights") or {} for g in groups.values() if isinstance(g, dict)), {}).get("actorder")
    if given is absent:
        value = "static" if existing is None else existing
    elif existing is None or given == existing:
        value = given
    else:
        _refuse(where, f"actorder {given!r} and the config group's {existing!r} differ (llm-compressor refuses it too)")
    if value in ("static", "weight"):
        return True
    if value is None:
        return False
    _refuse(where, f"actorder {value!r}: diffquant's GPTQ orders columns by activation (weight/static) or not (null)")


def read(doc: dict, name: str = "llm-compressor") -> list:
    """The diffquant recipe steps of an llm-compressor recipe document (parsed YAML), in order, as `Recipe.of`
    reads them: the fixes, the solver if any, the scheme (recipe.py builds the Recipe: this module is below it)."""
    from diffquant.quant.algorithms.gptq_config import GPTQ
    from diffquant.quant.algorithms.mitigate import SmoothQuant
    from diffquant.quant.algorithms.solvers import AWQ

    fixes, solver, scheme = [], None, None
    for mod, args in modifiers(doc):
        where = mod
        if scheme is not None:
            _refuse(where, "comes after the quantization modifier: diffquant applies fixes, then one solver and "
                           "scheme")
        if mod == "SmoothQuantModifier":
            a = _take(where, args, {"smoothing_strength": None, "mappings": (None,), "ignore": (None, []),
                                    "num_calibration_steps": (None,), "calibration_function": (None,),
                                    "algorithm": ("smoothquant",)})
            fixes.append(SmoothQuant(alpha=float(a.get("smoothing_strength", 0.5))))
        elif mod == "AWQModifier":
            a = _take(where, args, {"mappings": (None,), "duo_scaling": (False,), "n_grid": (20,),
                                    "ignore": (None, []), "targets": None, "scheme": None, "config_groups": None})
            if "duo_scaling" not in a:
                _refuse(where, "duo_scaling is llm-compressor's default (true: s = mean|x|^α / mean|W|^(1−α)); "
                               "diffquant's AWQ searches the paper's s = mean|x|^α: set duo_scaling: false")
            solver = AWQ(clip=False)  # llm-compressor's AWQ has no clip search
            if a.get("scheme") or a.get("config_groups"):
                scheme = _scheme(where, {k: v for k, v in a.items() if k in ("targets", "ignore", "scheme",
                                                                               "config_groups")}, name)
        elif mod in ("GPTQModifier", "QuantizationModifier"):
            known = {"targets": None, "ignore": None, "scheme": None, "config_groups": None}
            if mod == "GPTQModifier":
                known.update({"block_size": None, "dampening_frac": None, "actorder": None,
                              "sequential_update": (True, None), "true_sequential": (False, None)})
                if solver is not None:
                    _refuse(where, f"a second weight solver after {solver.label()}")
            a = _take(where, args, known)
            if mod == "GPTQModifier":
                act = _actorder(where, a)
                solver = GPTQ(damp=float(a.pop("dampening_frac", 0.01) or 0.0), block=int(a.pop("block_size", 128)),
                              act_order=act, static_groups=True)  # llm-compressor's group scales: the float weight's
                a.pop("sequential_update", None), a.pop("true_sequential", None)
            scheme = _scheme(where, a, name)
        else:
            _refuse(mod, "diffquant reads SmoothQuantModifier, GPTQModifier, AWQModifier and QuantizationModifier")
    if scheme is None:
        raise DiffquantError("llm-compressor recipe: no GPTQModifier, QuantizationModifier or AWQModifier with a scheme")
    return [*fixes, *([solver] if solver is not None else []), scheme]
