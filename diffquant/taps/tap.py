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
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

import torch

from diffquant import DiffquantError
from diffquant.taps import attention
from diffquant.taps.sites import Site, SiteTable


@dataclass
class Batch:
    """What the current forward pass is fed: set by the profiler so taps can name token ids."""

    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None  # [batch, pos], 1 = real token
    row_offset: int = 0  # global index of this batch's first row


@dataclass(frozen=True)
class TapContext:
    site: Site
    batch: Batch = field(default_factory=Batch)
    valid: torch.Tensor | None = None  # bool, broadcastable to the activation; None = all valid

    def with_valid(self, valid: torch.Tensor | None) -> "TapContext":
        return self if valid is None and self.valid is None else replace(self, valid=valid)


Tap = Callable[[torch.Tensor, TapContext], "torch.Tensor | None"]
Selector = "str | Iterable[str] | Callable[[Site], bool]"


def _token_valid(ctx: TapContext, x: torch.Tensor) -> torch.Tensor | None:
    """[batch, pos, 1] validity from the batch's padding mask, when shapes agree."""
    mask = ctx.batch.attention_mask
    if mask is None or x.dim() != 3 or mask.shape != x.shape[:2]:
        return None
    return mask.to(device=x.device, dtype=torch.bool)[..., None]


class _WeightParametrization(torch.nn.Module):
    def __init__(self, tap: Tap, ctx: TapContext):
        super().__init__()
        self.tap, self.ctx = tap, ctx

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        y = self.tap(weight, self.ctx)
        return weight if y is None else y


class Attachment:
    """The hooks one `attach` call added; `remove()` takes away exactly these."""

    def __init__(self, model, table: SiteTable, batch: Batch):
        self.model, self.table, self.batch = model, table, batch
        self._handles: list[Any] = []
        self._attention: list[tuple[Any, str, tuple]] = []
        self._weights: list[tuple[torch.nn.Module, _WeightParametrization]] = []
        self._switched = False
        self.sites: list[Site] = []

    def _add(self, site: Site, tap: Tap) -> None:
        ctx = TapContext(site, self.batch)
        module = self.table.modules[site.name]
        transforms = bool(getattr(tap, "transforms", False))
        if site.is_weight:
            if transforms:
                self._add_weight_transform(module, tap, ctx)
            else:
                with torch.no_grad():
                    tap(module.weight.detach(), ctx)
        elif site.point.attention:
            if transforms and site.point.name in ("attn_map", "lambda"):
                raise DiffquantError(f"{site.name} can be observed but not transformed")
            entry = (tap, ctx)
            module.__dict__.setdefault("_diffquant_taps", {}).setdefault(site.point.name, []).append(entry)
            module._diffquant_paired = self.table.diff
            self._attention.append((module, site.point.name, entry))
        elif site.point.hook == "input":
            self._handles.append(module.register_forward_pre_hook(_input_hook(tap, ctx)))
        else:
            self._handles.append(module.register_forward_hook(_output_hook(tap, ctx)))
        self.sites.append(site)

    def _add_weight_transform(self, module, tap: Tap, ctx: TapContext) -> None:
        from torch.nn.utils import parametrize

        param = _WeightParametrization(tap, ctx)
        parametrize.register_parametrization(module, "weight", param, unsafe=True)
        self._weights.append((module, param))

    def _switch_attention(self) -> None:
        model = self.model
        users = getattr(model, "_diffquant_attn_users", 0)
        if users == 0:
            model._diffquant_attn_original = model.config._attn_implementation
            model.set_attn_implementation(attention.NAME)
        model._diffquant_attn_users = users + 1
        self._switched = True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for module, point, entry in self._attention:
            taps = module.__dict__.get("_diffquant_taps", {})
            entries = taps.get(point, [])
            if entry in entries:
                entries.remove(entry)
            if not entries:
                taps.pop(point, None)
            module.__dict__.pop("_diffquant_pending", None)
        self._remove_weights()
        if self._switched:
            self.model._diffquant_attn_users -= 1
            if self.model._diffquant_attn_users == 0:
                self.model.set_attn_implementation(self.model._diffquant_attn_original)
        self._handles, self._attention, self._weights, self._switched = [], [], [], False

    def _remove_weights(self) -> None:
        from torch.nn.utils import parametrize

        for module, param in reversed(self._weights):
            plist = module.parametrizations["weight"]
            index = next(i for i, p in enumerate(plist) if p is param)
            if len(plist) == 1:
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            else:
                del plist[index]


def _output_hook(tap: Tap, ctx: TapContext):
    def hook(module, args, output):
        x = output[0] if isinstance(output, tuple) else output
        y = tap(x, ctx.with_valid(_token_valid(ctx, x)))
        if y is None:
            return None
        return (y, *output[1:]) if isinstance(output, tuple) else y

    return hook


def _input_hook(tap: Tap, ctx: TapContext):
    def hook(module, args):
        x = args[0]
        y = tap(x, ctx.with_valid(_token_valid(ctx, x)))
        return None if y is None else (y, *args[1:])

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
        if any(site.point is not None and site.point.attention for site, _ in plan):
            attachment._switch_attention()
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
