"""Site names: every activation diffquant can observe or transform, in one table.

A site is `layers.{i}.{point}` or a weight `layers.{i}.{module path}.weight` (plus `embed`,
`final_norm` and `lm_head.weight`). Each point has one exact place in the computation and a declared
shape, so no code guesses a layout from a name. Module points are read with forward (pre-)hooks on the
real Hugging Face modules; attention points (logits, probabilities, the differential map, λ) are only
visible inside diffquant's registered attention function (see `taps/attention.py`).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from typing import Callable, Iterable

from diffquant import DiffquantError


@dataclass(frozen=True)
class Point:
    """One computation point inside a decoder layer."""

    name: str
    dims: tuple[str, ...]
    doc: str
    module: str | None = None  # path inside the decoder layer, for module points
    hook: str = "output"  # "output" (forward hook) or "input" (forward pre-hook)
    attention: bool = False  # only visible inside the tapped attention function
    diff_only: bool = False


POINTS: dict[str, Point] = {
    p.name: p
    for p in (
        Point("attn_in", ("batch", "pos", "channel"), "input of q/k/v_proj: output of input_layernorm", "input_layernorm"),
        Point("q", ("batch", "pos", "channel"), "output of q_proj, before RoPE", "self_attn.q_proj"),
        Point("k", ("batch", "pos", "channel"), "output of k_proj, before RoPE", "self_attn.k_proj"),
        Point("v", ("batch", "pos", "channel"), "output of v_proj", "self_attn.v_proj"),
        Point(
            "attn_logits",
            ("batch", "head", "q_pos", "k_pos"),
            "scaled q·k/√d after RoPE, before the mask and softmax; only causal, unmasked positions are seen"
            " (DIFF: both softmax maps, map j pairs with j + H/2)",
            attention=True,
        ),
        Point(
            "attn_probs",
            ("batch", "head", "q_pos", "k_pos"),
            "softmax of the masked logits (fp32 softmax, cast to the model dtype)",
            attention=True,
        ),
        Point(
            "attn_map",
            ("batch", "head", "q_pos", "k_pos"),
            "DIFF only: the differential map A1 − λ·A2 per differential head",
            attention=True,
            diff_only=True,
        ),
        Point("lambda", (), "DIFF only: the layer's λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init", attention=True, diff_only=True),
        Point("attn_out", ("batch", "pos", "channel"), "input of o_proj (after DIFF's per-head norm and (1−λ_init) gain)", "self_attn.o_proj", "input"),
        Point("mlp_in", ("batch", "pos", "channel"), "input of the MLP, after post_attention_layernorm", "mlp", "input"),
        Point("down_in", ("batch", "pos", "channel"), "input of down_proj (SwiGLU product)", "mlp.down_proj", "input"),
        Point("hidden", ("batch", "pos", "channel"), "output of the decoder layer, after both residual additions", "", "output"),
    )
}

WEIGHT_DIMS = ("out_channel", "in_channel")
MODEL_SITES = {
    "embed": Point("embed", ("batch", "pos", "channel"), "output of the token embedding", "embed_tokens"),
    "final_norm": Point("final_norm", ("batch", "pos", "channel"), "output of the final RMSNorm", "norm"),
}


@dataclass(frozen=True)
class Site:
    """A resolved site: its name, layer (None for model-level sites) and point or weight path."""

    name: str
    layer: int | None
    point: Point | None  # None for weights
    weight_module: str | None = None  # full module path of the Linear, for weight sites

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


def is_diff(model) -> bool:
    return getattr(model.config, "model_type", "") == "diffllama"


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


def _attention_module(layer):
    for name in ("self_attn", "attn", "self_attention"):
        module = _get_submodule(layer, name)
        if module is not None:
            return module
    return None


class SiteTable:
    """All sites of one model, with the module each one hooks."""

    def __init__(self, model):
        self.model = model
        self.layers_path, self.layers = _decoder_layers(model)
        self.diff = is_diff(model)
        self.attention_interface = supports_attention_interface(model)
        self.sites: dict[str, Site] = {}
        self.modules: dict[str, object] = {}  # site name -> hooked module
        for i, layer in enumerate(self.layers):
            for point in POINTS.values():
                if point.diff_only and not self.diff:
                    continue
                if point.attention:
                    module = _attention_module(layer)
                    if module is None or not self.attention_interface:
                        continue
                else:
                    module = _get_submodule(layer, point.module)
                    if module is None:
                        continue
                name = f"layers.{i}.{point.name}"
                self.sites[name] = Site(name, i, point)
                self.modules[name] = module
        base = self.layers_path.rsplit(".", 1)[0] if "." in self.layers_path else ""
        for point in MODEL_SITES.values():
            module = _get_submodule(model, f"{base}.{point.module}" if base else point.module)
            if module is not None:
                self.sites[point.name] = Site(point.name, None, point)
                self.modules[point.name] = module
        import torch.nn as nn

        prefix = self.layers_path + "."
        for path, module in model.named_modules():
            if isinstance(module, nn.Linear):
                if path.startswith(prefix):
                    i, rest = path[len(prefix):].split(".", 1)
                    name, layer = f"layers.{i}.{rest}.weight", int(i)
                else:
                    name, layer = f"{path}.weight", None
                self.sites[name] = Site(name, layer, None, path)
                self.modules[name] = module

    def __iter__(self):
        return iter(self.sites.values())

    def __len__(self) -> int:
        return len(self.sites)

    def match(self, selector: str | Iterable[str] | Callable[[Site], bool]) -> list[Site]:
        """Sites matching a glob, a list of globs, or a predicate; an unmatched pattern is an error."""
        if callable(selector):
            found = [s for s in self.sites.values() if selector(s)]
            if not found:
                raise DiffquantError("the site predicate matched no site")
            return found
        patterns = [selector] if isinstance(selector, str) else list(selector)
        found: dict[str, Site] = {}
        for pattern in patterns:
            hits = [s for name, s in self.sites.items() if fnmatch.fnmatchcase(name, pattern)]
            if not hits:
                raise DiffquantError(self._miss_message(pattern))
            found.update((s.name, s) for s in hits)
        return list(found.values())

    def _miss_message(self, pattern: str) -> str:
        point = pattern.rsplit(".", 1)[-1]
        if point in POINTS and POINTS[point].attention:
            if POINTS[point].diff_only and not self.diff:
                return f"site {pattern!r}: {POINTS[point].name} exists only in DIFF (DiffLlama) models"
            if not self.attention_interface:
                return (
                    f"site {pattern!r}: {type(self.model).__name__} does not use transformers' AttentionInterface, "
                    "so attention logits/probabilities cannot be tapped; module sites (hidden, attn_out, mlp_in, "
                    "down_in, q, k, v, weights) still work"
                )
        points = sorted({re.sub(r"^layers\.\d+\.", "layers.*.", n) for n in self.sites if not n.endswith(".weight")})
        return (
            f"no site matches {pattern!r}. Sites are layers.{{0..{len(self.layers) - 1}}}.<point> with points: "
            f"{', '.join(p.split('.')[-1] for p in points if p.startswith('layers'))}; model sites: "
            f"{', '.join(p for p in points if not p.startswith('layers'))}; weights such as "
            "'layers.0.self_attn.q_proj.weight' or '*.weight'"
        )


def site_docs(diff: bool = True) -> list[tuple[str, str, str]]:
    """(point, shape, doc) rows for `diffquant sites` and the README."""
    rows = [(p.name, "[" + ", ".join(p.dims) + "]", p.doc) for p in POINTS.values() if diff or not p.diff_only]
    rows += [(p.name, "[" + ", ".join(p.dims) + "]", p.doc) for p in MODEL_SITES.values()]
    rows.append(("<linear>.weight", "[out_channel, in_channel]", "weight of every nn.Linear"))
    return rows
