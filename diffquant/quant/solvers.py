"""Weight solvers: how a scheme's weights reach their grid. `rtn` rounds each weight to nearest (the
scheme's own fake quantizer, nothing done here); `gptq` (see `quant/gptq.py`) chooses the rounding that
keeps each layer's output on calibration data.

A solver runs after any mitigation and before the scheme's quantizers: `solve_weights_` replaces the weights
it solves by their quantized values (reversibly: `remove()` restores them bit-exactly) and fixes the weight
quantizers' scales to those the solver used (`install`), so the scheme's fake quantizer returns the solved
weights unchanged and every scheme, sweep and export works as with RTN.

Layers are solved one at a time in the model's order, the calibration inputs of each computed by the layers
before it with their weights already solved (the reference implementation's sequential mode; activations
stay in float while weights are solved). Within a layer every Linear sees the layer's float computation
(the reference's default; its `--true-sequential` is not implemented). Memory: one layer's Hessians.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from diffquant import DiffquantError
from diffquant.quant.gptq import GPTQ

if TYPE_CHECKING:
    import torch

Solver = GPTQ
DOCS = {"rtn": "round to nearest (the scheme's own quantizer)",
        "gptq[:act-order]": "GPTQ (Frantar et al. 2022): Hessian-weighted error feedback, layer by layer on "
                            "calibration data; act-order: columns by decreasing activation energy"}
CHUNK = 8  # calibration windows per forward pass
WEIGHTS_FILE = "diffquant_solved_weights.safetensors"  # beside a saved scheme: the solved weights, by site


def parse(text: str) -> Solver | None:
    """`rtn` (None: nothing to solve), `gptq`, `gptq:act-order`."""
    kind, _, arg = text.strip().lower().partition(":")
    if kind == "rtn" and not arg:
        return None
    if kind == "gptq" and arg in ("", "act-order"):
        return GPTQ(act_order=arg == "act-order")
    raise DiffquantError(f"unknown weight solver {text!r}; choose one of: {', '.join(DOCS)}")


class Solved:
    """The weights one `solve_weights_` replaced and the scales they lie on."""

    def __init__(self, model, solver: Solver | None):
        from diffquant.quant.mitigate import Applied

        self.solver = solver
        self._applied = Applied(model, None)  # its bit-exact set/restore of parameters
        self.scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.record: dict = {"weights": "rtn" if solver is None else solver.label()}

    def scheme(self, scheme):
        """`scheme` with the solved weights' scales static (fixed by `install`, never recalibrated)."""
        if self.solver is None:
            return scheme
        return replace(scheme, name=f"{scheme.name}+{self.solver.label()}",
                       weights=tuple((p, replace(c, dynamic=False)) for p, c in scheme.weights))

    def install(self, attachment) -> None:
        """Give the attachment's weight quantizers the solver's scales."""
        for name, (scale, zero) in self.scales.items():
            attachment.quantizers[name].fix(scale, zero)

    def remove(self) -> None:
        self._applied.remove()

    def save(self, folder) -> None:
        """The solved weights (as stored) to folder/WEIGHTS_FILE, for `load_solved`."""
        from pathlib import Path

        from safetensors.torch import save_file

        from diffquant.taps import site_table

        table = site_table(self._applied.model)
        tensors = {}
        for name in self.scales:
            module, param = table.modules[name], table.sites[name].param
            p = module.parametrizations[param].original if _parametrized(module, param) else getattr(module, param)
            tensors[name] = p.detach().cpu().contiguous()
        part = Path(folder) / (WEIGHTS_FILE + ".part")
        save_file(tensors, str(part))
        part.replace(Path(folder) / WEIGHTS_FILE)


def _parametrized(module, param: str) -> bool:
    return param in getattr(module, "parametrizations", {})


def load_solved(model, folder, record: dict) -> Solved:
    """Put the weights `Solved.save` wrote back into `model` (after its mitigation was replayed); their
    scales come with the saved scheme."""
    import torch
    from pathlib import Path

    from safetensors.torch import load_file

    from diffquant.taps import site_table

    solved = Solved(model, parse(record["weights"]))
    solved.record = record
    table = site_table(model)
    with torch.no_grad():
        for name, value in load_file(str(Path(folder) / WEIGHTS_FILE)).items():
            module = table.modules[name]
            solved._applied.set(module, table.sites[name].param, value.to(getattr(module, table.sites[name].param).device))
    return solved


def solve_weights_(model, solver: Solver | None, scheme, calibration: torch.Tensor | None,
                   progress: bool = True) -> Solved:
    """Solve the weights `scheme` quantizes with `solver` on `calibration` ([n, seq] token ids, from the
    training split); returns the handle (see `Solved`). `rtn` changes nothing."""
    import torch

    from diffquant.quant.scheme import plan
    from diffquant.taps import site_table

    solved = Solved(model, solver)
    if solver is None:
        return solved
    if calibration is None or calibration.numel() == 0:
        raise DiffquantError(f"{solver.label()} needs calibration data")
    table = site_table(model)
    configs = {name: c for name, c in plan(model, solved.scheme(scheme)).items() if table.sites[name].is_weight}
    by_layer: dict[int, list[str]] = {}
    for name in configs:
        site = table.sites[name]
        if site.layer is None:
            raise DiffquantError(f"{solver.label()} solves the weights of decoder layers; {name} is outside them "
                                 "(leave it out of the scheme's weights, or use --weights rtn)")
        if site.layout not in ("linear", "conv1d"):
            raise DiffquantError(f"{solver.label()} does not support fused MoE expert weights ({name}): their "
                                 "Hessians need each expert's routed tokens; use --weights rtn")
        by_layer.setdefault(site.layer, []).append(name)
    if not configs:
        return solved
    with torch.no_grad():
        _sequential(model, table, configs, by_layer, solver, calibration, solved, progress)
    solved.record.update(calibration_tokens=int(calibration.numel()), sites=len(configs))
    return solved


def _sequential(model, table, configs, by_layer, solver, calibration, solved: Solved, progress: bool) -> None:
    from tqdm.auto import tqdm

    from diffquant.quant import gptq
    from diffquant.taps.tap import canonical_weight, stored_weight

    layers = table.layers
    inputs = _first_layer_inputs(model, layers[0], calibration)
    last = max(by_layer)
    for i in tqdm(range(last + 1), desc=solver.label(), unit="layer", disable=not progress):
        layer, names = layers[i], by_layer.get(i, [])
        modules = {name: table.modules[name] for name in names}
        hess: dict[str, list] = {}
        handles = [m.register_forward_pre_hook(_accumulate(hess, name)) for name, m in modules.items()]
        try:
            for args, kwargs in inputs:
                layer(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        for name, module in modules.items():
            site = table.sites[name]
            total, n = hess.pop(name)
            w = canonical_weight(getattr(module, site.param).detach(), site.layout)
            wq, scale, zero = gptq.solve(w, total / n, configs[name], solver)
            solved._applied.set(module, site.param, stored_weight(wq, site.layout, getattr(module, site.param).shape))
            solved.scales[name] = (scale.cpu(), zero.cpu())
        if i < last:
            inputs = [_with_hidden(args, kwargs, _hidden(layer(*args, **kwargs))) for args, kwargs in inputs]


def _accumulate(hess: dict, name: str):
    """A pre-hook adding 2·xᵀx of the module's input (float64) and the token count to hess[name]."""

    def hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        total, n = hess.get(name, (0, 0))
        hess[name] = (total + 2 * x.T @ x, n + x.shape[0])

    return hook


class _Caught(Exception):
    pass


def _first_layer_inputs(model, first, calibration) -> list[tuple[tuple, dict]]:
    """(args, kwargs) of the first decoder layer's call, per chunk of calibration windows."""
    device = next(model.parameters()).device
    caught = []

    def hook(module, args, kwargs):
        caught.append((args, dict(kwargs)))
        raise _Caught

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for ids in calibration.split(CHUNK):
            try:
                model(ids.to(device), use_cache=False)
            except _Caught:
                pass
    finally:
        handle.remove()
    return caught


def _hidden(out):
    return out[0] if isinstance(out, tuple) else out


def _with_hidden(args: tuple, kwargs: dict, hidden) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}
