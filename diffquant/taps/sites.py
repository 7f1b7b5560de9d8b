"""Site names: every activation diffquant can observe or transform, in one table.

A site is `layers.{i}.{point}` or a weight `layers.{i}.{module path}.weight` (plus `embed`,
`final_norm` and `lm_head.weight`). Each point has one exact place in the computation and a declared
shape, so no code guesses a layout from a name. Points are defined by what the modules compute, not by
what one architecture calls them: each point lists the module paths it may live at (the first that
exists in a layer wins), so `attn_out` is the input of Llama's `o_proj`, OPT's `out_proj`, GPT-2's
`c_proj` or GPT-NeoX's `dense`. Module points are read with forward (pre-)hooks on the real Hugging Face
modules; attention points (the cached keys and values, logits, probabilities, the differential map, λ) are
only visible inside diffquant's registered attention function (see `taps/attention.py`), and the input of
a mixture of experts' down projections only inside its registered experts function (see `taps/experts.py`).

Weights are those of every projection: `nn.Linear`, transformers' `Conv1D` (GPT-2, stored [in, out]) and
the fused 3-D expert parameters of MoE layers. Taps always see a weight in one canonical layout,
[out_channel, in_channel]; an expert tensor [expert, out, in] is seen as [expert·out, in] (row
`e·out + o`), so per-channel scales are per expert and output channel.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Callable, Iterable

from diffquant.errors import DiffquantError

ATTENTION_MODULES = ("self_attn", "attn", "attention", "self_attention")
MOE_BLOCKS = ("mlp", "block_sparse_moe", "feed_forward")


@dataclass(frozen=True)
class Point:
    """One computation point inside a decoder layer.

    `where`: "output" (forward hook), "input" (forward pre-hook: the module's first argument),
    "attention" (inside the tapped attention function) or "experts" (inside the tapped experts function).
    `modules`: candidate paths inside the decoder layer, `{attn}` standing for the attention module."""

    name: str
    dims: tuple[str, ...]
    doc: str
    where: str = "output"
    modules: tuple[str, ...] = ("",)
    diff_only: bool = False
    flat: bool = False  # the module sees tokens flattened to [batch·pos, channel] (inside MoE blocks)

    @property
    def attention(self) -> bool:
        return self.where == "attention"


TOKENS = ("batch", "pos", "channel")
PAIRS = ("batch", "head", "q_pos", "k_pos")
CACHE = ("batch", "kv_head", "pos", "dim")
CACHE_POINTS = ("k_cache", "v_cache")

POINTS: dict[str, Point] = {
    p.name: p
    for p in (
        Point("attn_in", TOKENS, "input of the attention block's projections (q/k/v or fused qkv): the attention "
              "module's hidden-states argument (Llama: output of input_layernorm; OLMo2: the residual stream)",
              "input", ("{attn}",)),
        Point("q", TOKENS, "output of q_proj, before RoPE (separate q/k/v projections only)", "output", ("{attn}.q_proj",)),
        Point("k", TOKENS, "output of k_proj, before RoPE (separate q/k/v projections only)", "output", ("{attn}.k_proj",)),
        Point("v", TOKENS, "output of v_proj (separate q/k/v projections only)", "output", ("{attn}.v_proj",)),
        Point("k_cache", CACHE,
              "keys as the attention function receives them, i.e. what a KV cache stores: after RoPE (and any q/k "
              "norm), each KV head once (before grouped-query heads are repeated); DIFF: heads [0, KVH/2) are K1 "
              "(paired with queries [0, H/2)), the rest K2", "attention"),
        Point("v_cache", CACHE,
              "values as the attention function receives them (what a KV cache stores), each KV head once; DIFF: "
              "heads [0, KVH/2) are V1, the rest V2", "attention"),
        Point("attn_logits", PAIRS,
              "scaled q·k/√d after RoPE (and softcapping), before the mask and softmax; only causal (or in-window), "
              "unmasked positions are seen (DIFF: both softmax maps, map j pairs with j + H/2)", "attention"),
        Point("attn_probs", PAIRS, "softmax of the masked logits (fp32 softmax, cast to the model dtype)", "attention"),
        Point("attn_map", PAIRS, "DIFF only: the differential map A1 − λ·A2 per differential head", "attention",
              diff_only=True),
        Point("lambda", (), "DIFF only: the layer's λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init", "attention",
              diff_only=True),
        Point("attn_out", TOKENS, "input of the attention output projection (o_proj, out_proj, c_proj, dense); DIFF: "
              "after its per-head norm and (1−λ_init) gain", "input",
              ("{attn}.o_proj", "{attn}.out_proj", "{attn}.c_proj", "{attn}.dense")),
        Point("mlp_in", TOKENS, "input of the MLP block (after its norm where it has one); MoE: the block input that "
              "the router, the experts and a shared expert all read", "input", (*MOE_BLOCKS, "fc1")),
        Point("down_in", TOKENS, "input of the MLP's output projection (down_proj, c_proj, dense_4h_to_h, fc2): "
              "the SwiGLU product or the activation of the up projection (dense MLPs)", "input",
              ("mlp.down_proj", "mlp.c_proj", "mlp.dense_4h_to_h", "mlp.fc2", "fc2")),
        Point("experts.down_in", ("batch", "pos", "slot", "channel"),
              "MoE only: input of the routed experts' down projections, one row per (token, routed slot)", "experts",
              tuple(f"{b}.experts" for b in MOE_BLOCKS)),
        Point("shared_expert.down_in", TOKENS, "MoE with a shared expert only: input of its down projection",
              "input", tuple(f"{b}.{s}.down_proj" for b in MOE_BLOCKS for s in ("shared_expert", "shared_experts")),
              flat=True),
        Point("hidden", TOKENS, "output of the decoder layer, after both residual additions", "output", ("",)),
    )
}

WEIGHT_DIMS = ("out_channel", "in_channel")
MODEL_SITES = {
    "embed": Point("embed", TOKENS, "output of the token embedding (before any position embedding is added)"),
    "final_norm": Point("final_norm", TOKENS, "output of the final norm"),
}
FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm")


@dataclass(frozen=True)
class Site:
    """A resolved site: its name, layer (None for model-level sites) and point, or for weight sites the
    module path, parameter name and storage layout ("linear" [out, in], "conv1d" [in, out], "experts"
    [expert, out, in], "experts_t" [expert, in, out])."""

    name: str
    layer: int | None
    point: Point | None  # None for weights
    weight_module: str | None = None
    param: str = "weight"
    layout: str = "linear"
    router: bool = False  # an MoE router weight: wildcard weight patterns of schemes leave it in float

    @property
    def dims(self) -> tuple[str, ...]:
        return WEIGHT_DIMS if self.point is None else self.point.dims

    @property
    def is_weight(self) -> bool:
        return self.point is None

    @property
    def kind(self) -> str:
        """The point name, or 'weight' (used to group sites in reports)."""
        return "weight" if self.point is None else self.point.name


def _decoder_layers(model):
    """Return (path, ModuleList) of the decoder layers of any HF causal LM."""
    import torch.nn as nn

    best = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
            if best is None or len(name) < len(best[0]):
                best = (name, module)
    if best is None:
        raise DiffquantError(f"{type(model).__name__} has no decoder layer list (layers/h/blocks); diffquant cannot name its sites")
    return best


DIFF_MODEL_TYPES = ("diffllama", "diffquant_diff_gain", "diffquant_diff_nonorm", "diffquant_diff_frozen")  # DiffLlama and its subclasses


def is_diff(model) -> bool:
    return getattr(model.config, "model_type", "") in DIFF_MODEL_TYPES


def supports_attention_interface(model) -> bool:
    """True when the model calls attention through transformers' AttentionInterface."""
    can = getattr(type(model), "_can_set_attn_implementation", None)
    return bool(can and can())


def _get_submodule(module, path: str):
    if not path:
        return module
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def attention_path(layer) -> str | None:
    """Path of the attention module inside a decoder layer."""
    return next((name for name in ATTENTION_MODULES if _get_submodule(layer, name) is not None), None)


def is_experts(module) -> bool:
    """A fused MoE experts module: 3-D expert parameters and a registered experts implementation."""
    import torch

    return (any(p.dim() == 3 for p in module.parameters(recurse=False))
            and isinstance(getattr(module, "down_proj", None), torch.nn.Parameter))


def _resolve(layer, point: Point, attn: str | None):
    """(path, module) of the first candidate of `point` that exists in `layer`, or None."""
    for path in point.modules:
        if "{attn}" in path:
            if attn is None:
                continue
            path = path.format(attn=attn)
        module = _get_submodule(layer, path)
        if module is None:
            continue
        if point.where == "experts" and not is_experts(module):
            continue
        return path, module
    return None


def _weight_layout(module, param) -> str | None:
    import torch.nn as nn
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, nn.Linear) and param == "weight":
        return "linear"
    if isinstance(module, Conv1D) and param == "weight":
        return "conv1d"
    if is_experts(module) and getattr(module, param).dim() == 3:
        return "experts_t" if getattr(module, "is_transposed", False) else "experts"
    return None


def _is_router(model, path: str) -> bool:
    """MoE routers: a module beside an experts module whose name says it gates (`gate`, `router`,
    `shared_expert_gate`): it decides which experts run, rather than computing with them."""
    parent, _, name = path.rpartition(".")
    if not name.endswith("gate") and name != "router":
        return False
    block = _get_submodule(model, parent)
    return block is not None and any(is_experts(c) for c in block.children())


class SiteTable:
    """All sites of one model, with the module each one hooks."""

    def __init__(self, model):
        self.model = model
        self.layers_path, self.layers = _decoder_layers(model)
        self.diff = is_diff(model)
        self.attention_interface = supports_attention_interface(model)
        self.sites: dict[str, Site] = {}
        self.modules: dict[str, object] = {}  # site name -> hooked module
        self.attention_modules: list = []
        self.fused_qkv: str | None = None  # path of a fused qkv projection, for error messages
        for i, layer in enumerate(self.layers):
            attn = attention_path(layer)
            if attn is not None:
                self.attention_modules.append(layer.get_submodule(attn))
                for fused in ("qkv_proj", "c_attn", "query_key_value", "Wqkv"):
                    if _get_submodule(layer, f"{attn}.{fused}") is not None:
                        self.fused_qkv = f"{attn}.{fused}"
            for point in POINTS.values():
                if point.diff_only and not self.diff:
                    continue
                if point.attention:
                    if attn is None or not self.attention_interface:
                        continue
                    module = layer.get_submodule(attn)
                    if point.name in CACHE_POINTS and self.diff and not getattr(module, "_diffquant_fused", False):
                        continue  # transformers' two-call DiffLlama passes each key twice (see miss_reason)
                else:
                    found = _resolve(layer, point, attn)
                    if found is None:
                        continue
                    module = found[1]
                name = f"layers.{i}.{point.name}"
                self.sites[name] = Site(name, i, point)
                self.modules[name] = module
        base = self.layers_path.rpartition(".")[0]
        embed = model.get_input_embeddings()
        if embed is not None:
            self.sites["embed"] = Site("embed", None, MODEL_SITES["embed"])
            self.modules["embed"] = embed
        for norm in FINAL_NORMS:
            module = _get_submodule(model, f"{base}.{norm}" if base else norm)
            if module is not None:
                self.sites["final_norm"] = Site("final_norm", None, MODEL_SITES["final_norm"])
                self.modules["final_norm"] = module
                break
        prefix = self.layers_path + "."
        for path, module in model.named_modules():
            for param, p in module.named_parameters(recurse=False):
                layout = _weight_layout(module, param)
                router = p.dim() == 2 and _is_router(model, path)
                if layout is None and not router:
                    continue
                full = path if param == "weight" else f"{path}.{param}"
                if path.startswith(prefix):
                    i, rest = full[len(prefix):].split(".", 1)
                    name, layer = f"layers.{i}.{rest}.weight", int(i)
                else:
                    name, layer = f"{full}.weight", None
                self.sites[name] = Site(name, layer, None, path, param, layout or "linear", router)
                self.modules[name] = module

    def __iter__(self):
        return iter(self.sites.values())

    def __len__(self) -> int:
        return len(self.sites)

    def points(self) -> list[str]:
        """The layer points this model has, in table order."""
        have = {s.point.name for s in self.sites.values() if s.layer is not None and s.point is not None}
        return [p for p in POINTS if p in have]

    def match(self, selector: str | Iterable[str] | Callable[[Site], bool]) -> list[Site]:
        """Sites matching a glob, a list of globs, or a predicate; an unmatched pattern is an error
        (all unmatched patterns are named at once)."""
        if callable(selector):
            found = [s for s in self.sites.values() if selector(s)]
            if not found:
                raise DiffquantError("the site predicate matched no site")
            return found
        patterns = [selector] if isinstance(selector, str) else list(selector)
        found: dict[str, Site] = {}
        missing = []
        for pattern in patterns:
            hits = [s for name, s in self.sites.items() if fnmatch.fnmatchcase(name, pattern)]
            if not hits:
                missing.append(pattern)
            found.update((s.name, s) for s in hits)
        if missing:
            raise DiffquantError("; ".join(self.miss_reason(p) for p in missing) + ". " + self.available())
        return list(found.values())

    def miss_reason(self, pattern: str) -> str:
        """Why `pattern` names no site of this model."""
        arch = type(self.model).__name__
        point = re.sub(r"^(layers\.[^.]+|\*)\.", "", pattern)
        if point in POINTS and POINTS[point].attention:
            if point in CACHE_POINTS and self.diff and self.attention_interface and not any(
                    site.kind == point for site in self):
                return (f"site {pattern!r}: transformers' two-call DiffLlama passes each key twice; give the model "
                        "the fused forward first (diffquant.models.fused.fuse; diffquant's loaders do)")
            if POINTS[point].diff_only and not self.diff:
                return f"site {pattern!r}: {point} exists only in DIFF (DiffLlama) models"
            if not self.attention_interface:
                return (f"site {pattern!r}: {arch} computes attention inside its own module, not through "
                        "transformers' AttentionInterface, so its attention (cached keys and values, logits, "
                        "probabilities) cannot be tapped")
        if point in ("q", "k", "v") and self.fused_qkv:
            return (f"site {pattern!r}: {arch} projects q, k and v with one fused projection "
                    f"({self.fused_qkv}), so it has no separate {point} site; its input is attn_in")
        if point == "down_in" and any(s.point is not None and s.point.name == "experts.down_in" for s in self):
            return (f"site {pattern!r}: {arch}'s MLPs are mixtures of experts; their down-projection inputs are "
                    "experts.down_in (and shared_expert.down_in where there is a shared expert)")
        if point in POINTS:
            return f"site {pattern!r}: {arch} has no {point} point ({POINTS[point].doc})"
        return f"no site matches {pattern!r}"

    def available(self) -> str:
        """What this model does have, for error messages."""
        weights = [n for n, s in self.sites.items() if s.is_weight and s.layer == 0]
        model_sites = [n for n, s in self.sites.items() if s.layer is None and not s.is_weight]
        return (f"{type(self.model).__name__} has layers.{{0..{len(self.layers) - 1}}}.<point> with points: "
                f"{', '.join(self.points())}; model sites: {', '.join(model_sites)}; weights such as "
                f"{', '.join(repr(w) for w in weights[:2]) or 'none'} ('*.weight' for all)")


def site_globs(value) -> list[str]:
    """The command line's one site grammar: globs space- or comma-separated (`layers.3.attn_logits`,
    `*.attn_logits`, `*.weight`), where a bare point (`attn_logits`) means every layer's (`*.attn_logits`). A bare
    word that is no point is an error naming the points (a glob is checked against a model when one loads)."""
    parts = value if isinstance(value, (list, tuple)) else [value]
    globs = [x.strip() for part in parts for x in str(part).split(",") if x.strip()]
    if not globs:
        raise DiffquantError("--sites is empty; name at least one site glob or point (see `diffquant sites`)")
    out = []
    for g in globs:
        if "." in g or any(c in g for c in "*?["):
            out.append(g)
        elif g in POINTS:
            out.append(f"*.{g}")
        elif g in MODEL_SITES:
            out.append(g)
        else:
            raise DiffquantError(f"unknown site {g!r}: a glob such as '*.attn_logits' or 'layers.3.hidden', or a point: "
                                 f"{', '.join([*POINTS, *MODEL_SITES])}")
    return list(dict.fromkeys(out))


def site_points(value) -> list[str]:
    """The points of `--sites` globs that name a point in every layer (`*.POINT` or `POINT`), for commands that
    quantize a point everywhere (sweep); any other glob is refused in one line."""
    points = []
    for g in site_globs(value):
        point = g.removeprefix("*.")
        if g == point or point not in POINTS:
            raise DiffquantError(f"sweep quantizes a point in every layer: --sites takes *.POINT or POINT, got {g!r} "
                                 "(for one layer at a time use --per-layer BITS)")
        points.append(point)
    return points


def site_docs(diff: bool = True) -> list[tuple[str, str, str]]:
    """(point, shape, doc) rows for `diffquant sites` and the README."""
    rows = [(p.name, "[" + ", ".join(p.dims) + "]", p.doc) for p in POINTS.values() if diff or not p.diff_only]
    rows += [(p.name, "[" + ", ".join(p.dims) + "]", p.doc) for p in MODEL_SITES.values()]
    rows.append(("<projection>.weight", "[out_channel, in_channel]",
                 "weight of every nn.Linear, Conv1D and MoE expert tensor (experts: rows expert·out + o)"))
    return rows
