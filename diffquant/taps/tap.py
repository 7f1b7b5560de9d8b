"""Attach observers and transforms to sites: one mechanism for profiling and quantizing.

A tap is a callable `tap(x, ctx) -> Tensor | None`. Returning a tensor replaces the activation
(a transform, e.g. a fake quantizer); returning None leaves it (an observer). A tap with
`transforms = True` on a weight site is installed as a `torch.nn.utils.parametrize` parametrization
(reversible, differentiable); an observer on a weight site sees the weight once, at attach time.
A tap sees an activation during its call only: the model may reuse the tensor afterwards (the tapped
attention masks its logits in place), so an observer copies whatever it keeps.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Mapping

import torch

from diffquant.errors import DiffquantError
from diffquant.taps import attention, experts
from diffquant.taps.context import Batch, TapContext, token_valid  # noqa: F401 - re-exported
from diffquant.taps.sites import Site, SiteTable, is_experts


Tap = Callable[[torch.Tensor, TapContext], "torch.Tensor | None"]


def canonical_weight(w: torch.Tensor, layout: str) -> torch.Tensor:
    """A stored weight in the layout taps see: [out_channel, in_channel] (experts: [expert·out, in])."""
    if layout == "conv1d":
        return w.t()
    if layout == "experts":
        return w.reshape(-1, w.shape[-1])
    if layout == "experts_t":
        return w.transpose(1, 2).reshape(-1, w.shape[1])
    return w


def stored_weight(y: torch.Tensor, layout: str, shape: torch.Size) -> torch.Tensor:
    """The inverse of `canonical_weight`."""
    if layout == "conv1d":
        return y.t()
    if layout == "experts":
        return y.reshape(shape)
    if layout == "experts_t":
        return y.reshape(shape[0], shape[2], shape[1]).transpose(1, 2)
    return y


class _WeightParametrization(torch.nn.Module):
    def __init__(self, tap: Tap, ctx: TapContext):
        super().__init__()
        self.tap, self.ctx = tap, ctx

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        layout = self.ctx.site.layout
        y = self.tap(canonical_weight(weight, layout), self.ctx)
        return weight if y is None else stored_weight(y, layout, weight.shape)


class Attachment:
    """The hooks one `attach` call added; `remove()` takes away exactly these."""

    def __init__(self, model, table: SiteTable, batch: Batch):
        self.model, self.table, self.batch = model, table, batch
        self._handles: list[Any] = []
        self._inner: list[tuple[Any, str, tuple]] = []  # taps inside the attention / experts functions
        self._weights: list[tuple[torch.nn.Module, str, _WeightParametrization]] = []
        self._switched: list[str] = []
        self.sites: list[Site] = []

    def _add(self, site: Site, tap: Tap) -> None:
        ctx = TapContext(site, self.batch)
        module = self.table.modules[site.name]
        transforms = bool(getattr(tap, "transforms", False))
        if site.is_weight:
            if transforms:
                self._add_weight_transform(module, site.param, tap, ctx)
            else:
                with torch.no_grad():
                    tap(canonical_weight(getattr(module, site.param).detach(), site.layout), ctx)
        elif site.point.where in ("attention", "experts"):
            if transforms and site.point.name in ("attn_map", "lambda"):
                raise DiffquantError(f"{site.name} can be observed but not transformed")
            entry = (tap, ctx)
            module.__dict__.setdefault("_diffquant_taps", {}).setdefault(site.point.name, []).append(entry)
            if site.point.attention:
                module._diffquant_paired = self.table.diff
            self._inner.append((module, site.point.name, entry))
        elif site.point.where == "input":
            hook = _input_hook(tap, ctx, site.point.flat)
            self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        else:
            self._handles.append(module.register_forward_hook(_output_hook(tap, ctx)))
        self.sites.append(site)

    def _add_weight_transform(self, module, param: str, tap: Tap, ctx: TapContext) -> None:
        from torch.nn.utils import parametrize

        p = _WeightParametrization(tap, ctx)
        parametrize.register_parametrization(module, param, p, unsafe=True)
        self._weights.append((module, param, p))

    def _track_tokens(self) -> None:
        """Record (batch, pos) at the first decoder layer, for sites that see tokens flattened."""
        batch = self.batch

        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            if isinstance(x, torch.Tensor) and x.dim() == 3:
                batch.tokens = tuple(x.shape[:2])

        self._handles.append(self.table.layers[0].register_forward_pre_hook(hook, with_kwargs=True))

    def _switch(self, kind: str) -> None:
        """Switch the model to diffquant's attention or experts function while taps use it (refcounted);
        every module remembers the implementation to fall through to when it has no taps."""
        model = self.model
        users = model.__dict__.get(f"_diffquant_{kind}_users", 0)
        if users == 0:
            if kind == "attn":
                original = model.config._attn_implementation
                model.set_attn_implementation(attention.NAME)
                modules = self.table.attention_modules
            else:
                original = model.config._experts_implementation
                model.set_experts_implementation(experts.NAME)
                modules = [m for m in model.modules() if is_experts(m)]
            model.__dict__[f"_diffquant_{kind}_original"] = original
            for m in modules:
                m._diffquant_fallback = original
            if kind == "attn":  # so the mask function builds the mask this implementation gets
                attention.remember(self._configs(), original)
        model.__dict__[f"_diffquant_{kind}_users"] = users + 1
        self._switched.append(kind)

    def _configs(self) -> list:
        """The model's config and its attention modules' (transformers builds the mask from the decoder's)."""
        return [self.model.config, *(getattr(m, "config", None) for m in self.table.attention_modules)]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for module, point, entry in self._inner:
            taps = module.__dict__.get("_diffquant_taps", {})
            entries = taps.get(point, [])
            if entry in entries:
                entries.remove(entry)
            if not entries:
                taps.pop(point, None)
            module.__dict__.pop("_diffquant_pending", None)
        self._remove_weights()
        model = self.model
        for kind in self._switched:
            model.__dict__[f"_diffquant_{kind}_users"] -= 1
            if model.__dict__[f"_diffquant_{kind}_users"] == 0:
                original = model.__dict__.pop(f"_diffquant_{kind}_original")
                if kind == "attn":
                    attention.remember(self._configs(), None)
                    model.set_attn_implementation(original)
                else:
                    model.set_experts_implementation(original)
        self._handles, self._inner, self._weights, self._switched = [], [], [], []

    def _remove_weights(self) -> None:
        from torch.nn.utils import parametrize

        for module, param, p in reversed(self._weights):
            plist = module.parametrizations[param]
            index = next(i for i, q in enumerate(plist) if q is p)
            if len(plist) == 1:
                parametrize.remove_parametrizations(module, param, leave_parametrized=False)
            else:
                del plist[index]


def _output_hook(tap: Tap, ctx: TapContext):
    def hook(module, args, output):
        x = output[0] if isinstance(output, tuple) else output
        y = tap(x, ctx.with_valid(token_valid(ctx, x)))
        if y is None:
            return None
        return (y, *output[1:]) if isinstance(output, tuple) else y

    return hook


def _input_hook(tap: Tap, ctx: TapContext, flat: bool):
    """A pre-hook on the module's first argument, positional or `hidden_states=`. With `flat`, tokens
    arrive as [batch·pos, channel] and the tap sees them as [batch, pos, channel]."""

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        seen = x
        if flat:
            if ctx.batch.tokens is None or x.dim() != 2:
                raise DiffquantError(f"{ctx.site.name}: expected [tokens, channel] inside an MoE block")
            seen = x.view(*ctx.batch.tokens, x.shape[-1])
        y = tap(seen, ctx.with_valid(token_valid(ctx, seen)))
        if y is None:
            return None
        y = y.reshape(x.shape)
        if args:
            return (y, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": y}

    return hook


def site_table(model) -> SiteTable:
    """The model's site table (built once and cached on the model)."""
    table = model.__dict__.get("_diffquant_sites")
    if table is None:
        table = SiteTable(model)
        model.__dict__["_diffquant_sites"] = table
    return table


def attach(model, taps: Mapping[str, Tap | Iterable[Tap]], batch: Batch | None = None) -> Attachment:
    """Attach taps: {selector: tap or [taps]}; returns the Attachment to `remove()` later."""
    table = site_table(model)
    attachment = Attachment(model, table, batch or Batch())
    plan = []
    for selector, tap_or_taps in taps.items():
        tap_list = list(tap_or_taps) if isinstance(tap_or_taps, (list, tuple)) else [tap_or_taps]
        for site in table.match(selector):
            plan.extend((site, t) for t in tap_list)
    try:
        wheres = {site.point.where for site, _ in plan if site.point is not None}
        if "attention" in wheres:
            attachment._switch("attn")
        if "experts" in wheres:
            attachment._switch("experts")
        if "experts" in wheres or any(site.point.flat for site, _ in plan if site.point is not None):
            attachment._track_tokens()
        for site, tap in plan:
            attachment._add(site, tap)
    except BaseException:
        attachment.remove()
        raise
    return attachment


@contextmanager
def tapped(model, taps: Mapping[str, Tap | Iterable[Tap]], batch: Batch | None = None):
    """Context manager around `attach`: the taps are removed on exit, also on an exception."""
    attachment = attach(model, taps, batch)
    try:
        yield attachment
    finally:
        attachment.remove()
