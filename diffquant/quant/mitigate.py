"""Post-training outlier fixes: function-preserving transforms applied before a scheme's quantizers.

- `smoothquant:ALPHA` (Xiao et al. 2023, arXiv 2211.10438): per input channel j of a group of Linears that
  read the same activation X, s_j = max|X_j|^α / max|W_:,j|^(1−α) (absmax over calibration data, as the
  paper), X' = X / s and W' = W·diag(s), so X'·W'ᵀ = X·Wᵀ. X / s is folded into what produces X: the
  attention and MLP inputs into their RMSNorm's weight (q/k/v, and gate/up), the down-projection input into
  up_proj's rows (down_in = act(gate)·up is linear in up), so no op is added. o_proj's input is left alone
  (DIFF's per-head norm sits before it and does not commute with per-channel scales).
- `rotate` (QuaRot, Ashkboos et al. 2024, arXiv 2404.00456): fold every RMSNorm's weight into the Linears
  that read it (the norms become weightless, and commute with orthogonal maps: RMSNorm(hQ) = RMSNorm(h)Q),
  then rotate the residual stream by an orthogonal Q: the embedding and every stream writer (o_proj,
  down_proj) output h·Q, every stream reader (q/k/v, the gated design's gate, gate/up, lm_head) takes
  W·Q. The down-projection input gets an online rotation H (a forward pre-hook x → x·H, with
  down_proj W·H). Q and H are randomised Hadamard matrices where `quant/hadamard.py` can build one for the
  width, random orthogonal matrices otherwise (which it records).
- `clip:mse` / `clip:percentile:P`: range search instead of min-max: static activation scales calibrate by
  MSE-optimal clipping (or the P-th percentile of |x|, per-tensor static scales only), and weight scales by
  MSE-optimal clipping per scale group, computed once (weights become static). Dynamic activation scales are
  unchanged. A change of the scheme, not of the model.

Supported layouts for smoothquant and rotate: pre-RMSNorm decoders with SwiGLU MLPs (Llama, DiffLlama, Qwen2,
Qwen3, Mistral, SmolLM3, and diffquant's designs); other models get a clear refusal. `mitigate_` returns a
handle whose `remove()` restores every weight bit-exactly; `record` describes what was done, and
`apply_record` replays it without calibration data (saved quantized models carry it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from diffquant.errors import DiffquantError

if TYPE_CHECKING:
    import torch

SUPPORTED = ("llama", "diffllama", "qwen2", "qwen3", "mistral", "smollm3", "diffquant_gated", "diffquant_clipsoftmax",
             "diffquant_headnorm", "diffquant_diff_gain",
             "diffquant_sink")
ATTN_READERS = ("q_proj", "k_proj", "v_proj", "gate")  # Linears that read the attention input


@dataclass(frozen=True)
class SmoothQuant:
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise DiffquantError(f"smoothquant's alpha must be in [0, 1], got {self.alpha}")

    def label(self) -> str:
        return f"smoothquant:{self.alpha:g}"


@dataclass(frozen=True)
class Rotate:
    seed: int = 0

    def label(self) -> str:
        return "rotate" if self.seed == 0 else f"rotate:{self.seed}"


@dataclass(frozen=True)
class Clip:
    method: str = "mse"
    percentile: float = 99.99

    def __post_init__(self) -> None:
        if self.method == "output":
            raise DiffquantError("clip:output needs the scheme's weight formats: it is a weight solver, "
                                 "--weights clip:output")
        if self.method not in ("mse", "percentile"):
            raise DiffquantError(f"clip takes mse or percentile:P, got {self.method!r}")
        if not 0 < self.percentile <= 100:
            raise DiffquantError(f"clip percentile must be in (0, 100], got {self.percentile}")

    def label(self) -> str:
        return "clip:mse" if self.method == "mse" else f"clip:percentile:{self.percentile:g}"


Mitigation = SmoothQuant | Rotate | Clip
DOCS = {"none": "no transform", "smoothquant:ALPHA": "SmoothQuant scales (default α 0.5) folded into norms and up_proj",
        "rotate[:SEED]": "QuaRot: fused norms, Hadamard-rotated residual stream, online Hadamard before down_proj",
        "clip:mse | clip:percentile:P": "MSE-optimal (or percentile) ranges for static activations and for weights "
                                        "(each tensor's own error; the layer-output search is --weights clip:output)"}


def parse(text: str) -> Mitigation | None:
    """`none`, `smoothquant[:ALPHA]`, `rotate[:SEED]`, `clip:mse`, `clip:percentile:P`."""
    kind, _, arg = text.strip().lower().partition(":")
    try:
        if kind == "none" and not arg:
            return None
        if kind == "smoothquant":
            return SmoothQuant(float(arg) if arg else 0.5)
        if kind == "rotate":
            return Rotate(int(arg) if arg else 0)
        if kind == "clip":
            method, _, p = (arg or "mse").partition(":")
            return Clip(method, float(p) if p else 99.99)
    except ValueError:
        pass
    raise DiffquantError(f"unknown mitigation {text!r}; choose one of: {', '.join(DOCS)}")


def adjust_scheme(scheme, mitigation: Mitigation | None):
    """The scheme a mitigation asks for (clip changes calibration; the others leave the scheme as it is)."""
    if not isinstance(mitigation, Clip):
        return scheme
    from diffquant.quant import granularity as G

    def act(c):
        if c.dynamic:
            return c
        if mitigation.method == "percentile" and isinstance(c.granularity, G.PerTensor) and c.format.symmetric:
            return replace(c, calibration="percentile", percentile=mitigation.percentile)
        return replace(c, calibration="mse")

    weights = tuple((p, replace(c, dynamic=False, calibration="mse")) for p, c in scheme.weights)
    return replace(scheme, name=f"{scheme.name}+{mitigation.label()}",
                   activations=tuple((p, act(c)) for p, c in scheme.activations), weights=weights)


class Applied:
    """What one `mitigate_` changed: `remove()` puts back every tensor it replaced and takes its hooks away."""

    def __init__(self, model, mitigation):
        self.model, self.mitigation = model, mitigation
        self.record: dict = {"mitigation": None if mitigation is None else mitigation.label()}
        self._saved: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        self._handles: list = []
        self._untied = False

    def set(self, module, name: str, value: torch.Tensor) -> None:
        """Replace module.<name>'s data, keeping the original to restore."""
        param = getattr(module, name)
        self._saved.append((module, name, param.data))
        param.data = value.to(param.dtype).contiguous()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        for module, name, data in reversed(self._saved):
            getattr(module, name).data = data
        if self._untied:
            self.model.lm_head.weight = self.model.get_input_embeddings().weight
        self._saved, self._handles, self._untied = [], [], False


def _layers(model):
    from diffquant.taps.sites import _decoder_layers

    if getattr(model.config, "model_type", None) not in SUPPORTED:
        raise DiffquantError(f"smoothquant and rotate need a pre-RMSNorm SwiGLU decoder ({', '.join(SUPPORTED)}); "
                             f"{type(model).__name__} ({model.config.model_type}) is not one")
    return _decoder_layers(model)[1]


def _readers(layer) -> tuple[list, list]:
    import torch

    attn = [getattr(layer.self_attn, n) for n in ATTN_READERS if isinstance(getattr(layer.self_attn, n, None),
                                                                             torch.nn.Linear)]
    return attn, [layer.mlp.gate_proj, layer.mlp.up_proj]


def mitigate_(model, mitigation: Mitigation | None, calibration: torch.Tensor | None = None) -> Applied:
    """Apply a function-preserving transform in place; `calibration` ([n, seq] token ids) is needed by
    smoothquant. Clip changes only the scheme (see `adjust_scheme`): here it does nothing."""
    import torch

    applied = Applied(model, mitigation)
    with torch.no_grad():
        if isinstance(mitigation, SmoothQuant):
            if calibration is None or calibration.numel() == 0:
                raise DiffquantError("smoothquant needs calibration data")
            _smoothquant(model, mitigation, calibration, applied)
        elif isinstance(mitigation, Rotate):
            _rotate(model, mitigation, applied)
    return applied


def apply_record(model, record: dict) -> Applied:
    """Replay a mitigation from its record (saved scales, rotation seed), without calibration data."""
    import torch

    mitigation = parse(record["mitigation"]) if record.get("mitigation") else None
    applied = Applied(model, mitigation)
    with torch.no_grad():
        if isinstance(mitigation, SmoothQuant):
            layers = _layers(model)
            for i, layer in enumerate(layers):
                _fold_smoothing(layer, {k: torch.tensor(v, dtype=torch.float64)
                                        for k, v in record["scales"][str(i)].items()}, applied)
            applied.record = record
        elif isinstance(mitigation, Rotate):
            _rotate(model, mitigation, applied)
    return applied


# -------------------------------------------------------------------------------------------- SmoothQuant
def _smoothquant(model, sq: SmoothQuant, calibration: torch.Tensor, applied: Applied) -> None:
    import torch

    from diffquant.calibrate import channel_absmax

    layers = _layers(model)
    absmax = channel_absmax(model, calibration, ["*.attn_in", "*.mlp_in", "*.down_in"])
    scales = {}
    for i, layer in enumerate(layers):
        attn, mlp = _readers(layer)
        per = {}
        for point, readers in (("attn_in", attn), ("mlp_in", mlp), ("down_in", [layer.mlp.down_proj])):
            x = absmax[f"layers.{i}.{point}"].double().cpu()
            w = torch.stack([r.weight.detach().abs().amax(dim=0) for r in readers]).amax(dim=0).double().cpu()
            s = x.pow(sq.alpha) / w.pow(1 - sq.alpha)
            per[point] = torch.where((x > 0) & (w > 0) & torch.isfinite(s), s, torch.ones_like(s)).clamp_min(1e-5)
        _fold_smoothing(layer, per, applied)
        scales[str(i)] = {k: v.tolist() for k, v in per.items()}
    applied.record.update(scales=scales, alpha=sq.alpha, calibration_tokens=int(calibration.numel()))


def _fold_smoothing(layer, s: dict[str, torch.Tensor], applied: Applied) -> None:
    """X' = X / s folded into the producer of X, W' = W·diag(s) for its readers."""
    attn, mlp = _readers(layer)
    for point, norm, readers in (("attn_in", layer.input_layernorm, attn),
                                 ("mlp_in", layer.post_attention_layernorm, mlp)):
        sc = s[point]
        applied.set(norm, "weight", (norm.weight.double() / sc.to(norm.weight.device)))
        for r in readers:
            applied.set(r, "weight", r.weight.double() * sc.to(r.weight.device))
    sc = s["down_in"]
    up, down = layer.mlp.up_proj, layer.mlp.down_proj
    applied.set(up, "weight", up.weight.double() / sc.to(up.weight.device)[:, None])
    if up.bias is not None:
        applied.set(up, "bias", up.bias.double() / sc.to(up.weight.device))
    applied.set(down, "weight", down.weight.double() * sc.to(down.weight.device))


# ------------------------------------------------------------------------------------------------- rotate
def _rotate(model, rot: Rotate, applied: Applied) -> None:
    import torch

    from diffquant.quant.hadamard import orthogonal

    layers = _layers(model)
    hidden = model.config.hidden_size
    Q, kind = orthogonal(hidden, rot.seed)
    embed = model.get_input_embeddings()
    head = model.lm_head
    if head.weight is embed.weight:  # tied: the head gets its own copy, since the two now differ
        head.weight = torch.nn.Parameter(embed.weight.detach().clone())
        applied._untied = True
    dev = embed.weight.device
    Qd = Q.to(dev)
    applied.set(embed, "weight", embed.weight.double() @ Qd)
    kinds = {"residual": kind}
    for layer in layers:
        attn, mlp = _readers(layer)
        for norm, readers in ((layer.input_layernorm, attn), (layer.post_attention_layernorm, mlp)):
            gamma = norm.weight.double()
            for r in readers:
                applied.set(r, "weight", (r.weight.double() * gamma) @ Qd)
            applied.set(norm, "weight", torch.ones_like(norm.weight))
        for writer in (layer.self_attn.o_proj, layer.mlp.down_proj):
            applied.set(writer, "weight", Qd.T @ writer.weight.double())
            if writer.bias is not None:
                applied.set(writer, "bias", writer.bias.double() @ Qd)
        down = layer.mlp.down_proj
        H, hkind = orthogonal(down.in_features, rot.seed + 1)
        Hd = H.to(dev)
        kinds["down_in"] = hkind
        applied.set(down, "weight", down.weight.double() @ Hd)
        applied._handles.append(down.register_forward_pre_hook(_online(Hd), prepend=True))
    norm = _final_norm(model)
    applied.set(head, "weight", (head.weight.double() * norm.weight.double()) @ Qd)
    applied.set(norm, "weight", torch.ones_like(norm.weight))
    applied.record.update(seed=rot.seed, matrices=kinds)


def _online(H: torch.Tensor):
    """x → x·H before down_proj (and before any tap on its input)."""
    cache: dict = {}

    def hook(module, args):
        x = args[0]
        h = cache.get(x.dtype)
        if h is None:
            h = cache[x.dtype] = H.to(x.dtype)
        return (x @ h, *args[1:])

    return hook


def _final_norm(model):
    from diffquant.taps import site_table

    return site_table(model).modules["final_norm"]
