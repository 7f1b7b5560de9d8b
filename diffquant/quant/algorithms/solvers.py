"""Weight solvers: how a scheme's weights reach their grid. `rtn` rounds each weight to nearest (the
scheme's own fake quantizer, nothing done here); `gptq` (see `quant/algorithms/gptq.py`) chooses the rounding that
keeps each layer's output on calibration data; `awq` (see `quant/algorithms/awq.py`) rescales salient input channels
and clips weight ranges on the same objective, then rounds to nearest (or `awq+gptq`: solves by GPTQ);
`clip:output` is AWQ's clip search alone.

A solver runs after any mitigation and before the scheme's quantizers: `solve_weights_` replaces the weights
it changes (reversibly: `remove()` restores them bit-exactly). GPTQ's weights lie on a grid of scales it
chose: `install` fixes the weight quantizers' scales to those, so the scheme's fake quantizer returns the
solved weights unchanged and every scheme, sweep and export works as with RTN. AWQ's weights are float
weights that the scheme's own quantizer then rounds (as the reference code does).

Layers are solved one at a time in the model's order, the calibration inputs of each computed by the layers
before it as already solved (the reference GPTQ's sequential mode; activations stay in float while weights
are solved). Within a layer every Linear sees the layer's float computation (the reference's default; its
`--true-sequential` is not implemented). Memory: one layer's Hessians. Fused MoE experts and weights outside
the decoder layers are refused (their Hessians need each expert's routed tokens; lm_head is not in the
presets' weights).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from diffquant.errors import DiffquantError
from diffquant.quant.algorithms.gptq_config import GPTQ
from diffquant.quant.algorithms.steps import SOLVERS, LayerStep, Solver

if TYPE_CHECKING:
    import torch




@SOLVERS.register
@dataclass(frozen=True)
class AWQ(Solver):
    """`scale=False, clip=True` is the clip search alone: `clip:output`, the range search on the layer's
    output error (where `clip:mse` minimises each weight tensor's own error)."""

    scale: bool = True  # the activation-aware scale search
    clip: bool = True  # the output-error clip search after the scales
    gptq: bool = False  # GPTQ the scaled and clipped weights instead of rounding them to nearest
    words = ("awq", "clip")
    docs = {"awq[:no-clip][+gptq]": "AWQ (Lin et al. 2023): activation-aware per-channel scales searched on the "
                                    "output error and folded into the norms/up_proj, then an output-error clip search; "
                                    "+gptq: GPTQ instead of RTN on the result",
            "clip:output[+gptq]": "weight ranges clipped where that lowers each layer's output error (AWQ's clip "
                                  "search alone), super-weights never clipped; clip:mse is the tensor-MSE search"}

    @classmethod
    def from_text(cls, word: str, arg: str) -> "AWQ":
        base = arg.removesuffix("+gptq")
        if (word, base) not in (("awq", ""), ("awq", "no-clip"), ("clip", "output")):
            raise ValueError(arg)
        return cls(scale=word == "awq", clip=base != "no-clip", gptq=arg.endswith("+gptq"))

    @property
    def fixes_scales(self) -> bool:
        return self.gptq

    def label(self) -> str:
        base = ("awq" + ("" if self.clip else ":no-clip")) if self.scale else "clip:output"
        return base + ("+gptq" if self.gptq else "")

    def layer_steps(self, model, table, configs, by_layer, solved, calibration) -> list:
        """AWQ's scale and clip search per layer (on the layouts SmoothQuant folds into), then GPTQ if asked."""
        from diffquant.quant.algorithms import superweights
        from diffquant.quant.numerics.layout import layers

        layers(model)  # AWQ folds its scales like SmoothQuant: the same layouts, or a clear refusal
        supers = [o for o in superweights.find(model, calibration) if o["super"]] if self.clip else []
        solved.record["super_weights"] = [{k: o[k] for k in ("layer", "row", "col", "weight")} for o in supers]
        steps = [_awq_step(table, configs, self, solved, supers)]
        if self.gptq:
            from diffquant.quant.algorithms.gptq import layer_step

            steps.append(layer_step(table, configs, by_layer, GPTQ(), solved))
        return steps


CHUNK = 8  # calibration windows per forward pass
WEIGHTS_FILE = "diffquant_solved_weights.safetensors"  # beside a saved scheme: what a solver changed


def parse(text: str) -> Solver | None:
    """The weight solver a spelling names (`rtn`: None, nothing to solve), from the registry (quant/algorithms/steps.py)."""
    return SOLVERS.parse(text)


class Solved:
    """The weights one `solve_weights_` replaced and the scales they lie on."""

    def __init__(self, model, solver: Solver | None):
        from diffquant.quant.algorithms.mitigate import Applied

        self.solver = solver
        self._applied = Applied(model, None)  # its bit-exact set/restore of parameters
        self.scales: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.record: dict = {"weights": "rtn" if solver is None else solver.label()}

    def scheme(self, scheme):
        """`scheme` named after the solver, with the solved weights' scales static where the solver chose
        them (fixed by `install`, never recalibrated)."""
        if self.solver is None:
            return scheme
        weights = scheme.weights
        if self.solver.fixes_scales:
            weights = tuple((p, replace(c, dynamic=False)) for p, c in scheme.weights)
        return replace(scheme, name=f"{scheme.name}+{self.solver.label()}", weights=weights)

    def install(self, attachment) -> None:
        """Give the attachment's weight quantizers the solver's scales."""
        for name, (scale, zero) in self.scales.items():
            attachment.quantizers[name].fix(scale, zero)

    def remove(self) -> None:
        self._applied.remove()

    @property
    def changed(self) -> bool:
        return bool(self._applied._saved)

    def save(self, folder) -> None:
        """Every parameter the solver changed (as stored, by module path) to folder/WEIGHTS_FILE, for
        `load_solved`."""
        from pathlib import Path

        from safetensors.torch import save_file

        paths = {id(m): path for path, m in self._applied.model.named_modules()}
        tensors = {}
        for module, param, _ in self._applied._saved:
            p = module.parametrizations[param].original if _parametrized(module, param) else getattr(module, param)
            tensors[f"{paths[id(module)]}:{param}"] = p.detach().cpu().contiguous()
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

    solved = Solved(model, parse(record["weights"]))
    solved.record = record
    with torch.no_grad():
        for key, value in load_file(str(Path(folder) / WEIGHTS_FILE)).items():
            path, _, param = key.rpartition(":")
            module = model.get_submodule(path)
            solved._applied.set(module, param, value.to(getattr(module, param).device))
    return solved


def solve_weights_(model, solver: Solver | None, scheme, calibration: torch.Tensor | None,
                   progress: bool = True) -> Solved:
    """Solve the weights `scheme` quantizes with `solver` on `calibration` ([n, seq] token ids, from the
    training split); returns the handle (see `Solved`). `rtn` changes nothing."""
    import torch

    from diffquant.quant.numerics.scheme import plan
    from diffquant.taps import site_table

    solved = Solved(model, solver)
    if solver is None:
        return solved
    if calibration is None or calibration.numel() == 0:
        raise DiffquantError(f"{solver.label()} needs calibration data")
    table = site_table(model)
    configs = {name: c for name, c in plan(model, scheme).items() if table.sites[name].is_weight}
    by_layer: dict[int, dict[str, torch.nn.Module]] = {}
    for name in configs:
        site = table.sites[name]
        if site.layer is None:
            raise DiffquantError(f"{solver.label()} solves the weights of decoder layers; {name} is outside them "
                                 "(leave it out of the scheme's weights, or use --solver rtn)")
        if site.layout not in ("linear", "conv1d"):
            raise DiffquantError(f"{solver.label()} does not support fused MoE expert weights ({name}): their "
                                 "Hessians need each expert's routed tokens; use --solver rtn")
        by_layer.setdefault(site.layer, {})[name] = table.modules[name]
    if not configs:
        return solved
    steps = solver.layer_steps(model, table, configs, by_layer, solved, calibration)
    with torch.no_grad():
        _layer_by_layer(model, table, calibration, steps, max(by_layer), solver.label(), progress)
    solved.record.update(calibration_tokens=int(calibration.numel()), sites=len(configs))
    return solved


def _layer_by_layer(model, table, calibration, steps, last: int, desc: str, progress: bool) -> None:
    """Each step of each layer in turn: the step names the modules whose inputs it needs ({key: module});
    one pass of the layer over the calibration inputs gathers them, then the step changes the layer. The
    next layer's inputs come from this layer as changed."""
    from tqdm.auto import tqdm

    layers = table.layers
    inputs = _first_layer_inputs(model, layers[0], calibration)
    for i in tqdm(range(last + 1), desc=desc, unit="layer", disable=not progress):
        layer = layers[i]
        for step in steps:
            wanted = step.modules(i)
            if wanted:
                step.apply(i, _input_stats(layer, inputs, wanted, step.mean_abs))
        if i < last:
            inputs = [_with_hidden(args, kwargs, _hidden(layer(*args, **kwargs))) for args, kwargs in inputs]


def _awq_step(table, configs, awq: AWQ, solved: Solved, supers: list[dict]):
    """Per layer: scales for the attention input (q/k/v), the MLP input (gate/up) and the down-projection
    input, folded as SmoothQuant's; then the clip search on every quantized reader but q_proj and k_proj."""
    import torch

    from diffquant.quant.algorithms import awq as A
    from diffquant.quant.numerics.layout import readers as _readers
    from diffquant.quant.algorithms.mitigate import _fold_smoothing

    layers = table.layers
    names = {id(m): n for n, m in table.modules.items() if n in configs}
    alphas: dict[str, list] = {}

    def readers(i):
        attn, mlp = _readers(layers[i])
        return {"attn_in": attn, "mlp_in": mlp, "down_in": [layers[i].mlp.down_proj]}

    def modules(i):
        return {point: rs[0] for point, rs in readers(i).items()}

    def apply(i, stats):
        scales = {}
        for point, rs in readers(i).items():
            h, mean_abs = stats[point]
            ws = [(r.weight.detach(), configs[names[id(r)]]) for r in rs if id(r) in names]
            if not awq.scale:
                s, alpha = torch.ones_like(mean_abs), None
            elif point == "down_in" and rs[0]._forward_pre_hooks:  # rotate's online Hadamard: scales would not commute
                s, alpha = torch.ones_like(mean_abs), None
            else:
                s, alpha, _ = A.search_scale(ws, h, mean_abs) if ws else (torch.ones_like(mean_abs), None, None)
            scales[point] = s
            alphas.setdefault(point, []).append(alpha)
        if awq.scale:
            _fold_smoothing(layers[i], scales, solved._applied)
            solved.record["alphas"] = alphas
        if not awq.clip:
            return
        for point, rs in readers(i).items():
            s = scales[point].to(stats[point][0].dtype)
            hs = stats[point][0] / s[:, None] / s[None, :]  # the Hessian of the scaled input X / s
            for r in rs:
                name = names.get(id(r))
                if name is None or name.endswith(("q_proj.weight", "k_proj.weight")):
                    continue
                protect = tuple((o["row"], o["col"]) for o in supers
                                if o["layer"] == i and r is layers[i].mlp.down_proj)
                solved._applied.set(r, "weight", A.search_clip(r.weight.detach(), hs, configs[name], protect))

    return LayerStep(modules, apply, mean_abs=True)


def _input_stats(layer, inputs, modules: dict, mean_abs: bool = True) -> dict:
    """{key: (H = 2·XᵀX / tokens, mean |x| per channel, or None without `mean_abs`)} of each module's input
    (float64) over one pass of the layer. Modules that read the same tensor (q/k/v, gate/up) share one product,
    and each chunk's XᵀX is taken in float32 (as the reference GPTQ does) and summed over chunks in float64: on
    SmolLM2-135M that is 0.24 s per layer and 2,048 tokens on one thread, where a float64 product per module
    took 0.65 s. Mean |x| costs another 0.4 s per layer and 128 windows: only AWQ reads it.

    A chunk's pass stops once every module has seen its input: the rest of the layer (for a Llama, down_proj
    and the residual, a quarter of its matmuls) would only compute an output that is thrown away. Each module
    is assumed to run once per pass, as every Linear of the supported decoder layers does."""
    import torch

    sums: dict = {}
    last: list = [None, None]  # the tensor the previous hook saw and its (XᵀX, Σ|x|, n)
    seen: set = set()  # the keys whose input this chunk has given

    def hook_for(key):
        def hook(module, args):
            if args[0] is not last[0]:
                x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
                ax = x.abs().sum(dim=0, dtype=torch.float64) if mean_abs else 0
                last[:] = args[0], ((x.T @ x).double(), ax, x.shape[0])
            xx, ax, n = sums.get(key, (0, 0, 0))
            dxx, dax, dn = last[1]
            sums[key] = (xx + dxx, ax + dax, n + dn)
            seen.add(key)
            if len(seen) == len(modules):
                raise _Caught  # the layer's remaining computation is not needed

        return hook

    handles = [m.register_forward_pre_hook(hook_for(key)) for key, m in modules.items()]
    try:
        for args, kwargs in inputs:
            seen.clear()
            try:
                layer(*args, **kwargs)
            except _Caught:
                pass
    finally:
        for h in handles:
            h.remove()
        last[:] = None, None
    return {key: (2 * xx / n, ax / n if mean_abs else None) for key, (xx, ax, n) in sums.items()}


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
