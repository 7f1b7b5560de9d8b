"""Post-training outlier fixes: function-preserving transforms applied before a scheme's quantizers.

- `smoothquant:ALPHA` (Xiao et al. 2023, arXiv 2211.10438): per input channel j of a group of Linears that
  read the same activation X, s_j = max|X_j|^α / max|W_:,j|^(1−α) (absmax over calibration data, as the
  paper), X' = X / s and W' = W·diag(s), so X'·W'ᵀ = X·Wᵀ. X / s is folded into what produces X: the
  attention and MLP inputs into their RMSNorm's weight (q/k/v, and gate/up), the down-projection input into
  up_proj's rows (down_in = act(gate)·up is linear in up), so no op is added. o_proj's input is smoothed
  through v_proj's rows (attention weights do not depend on V: P·(V/s) = (P·V)/s), one scale per KV-head
  channel shared by the query heads that read it; not under DIFF's and the head-norm design's per-head
  norms, which do not commute with per-channel scales (the record says which).
  `smoothquant:search` chooses α per model, as the paper does: each α of `ALPHAS` is applied, the scheme
  attached (static scales calibrated) and scored by the loss on the first `SEARCH_WINDOWS` calibration
  windows with round-to-nearest weights; the lowest wins (the record keeps every candidate's loss).
- `rotate` (QuaRot, Ashkboos et al. 2024, arXiv 2404.00456): fold every RMSNorm's weight into the Linears
  that read it (the norms become weightless, and commute with orthogonal maps: RMSNorm(hQ) = RMSNorm(h)Q),
  then rotate the residual stream by an orthogonal Q: the embedding and every stream writer (o_proj,
  down_proj) output h·Q, every stream reader (q/k/v, the gated design's gate, gate/up, lm_head) takes
  W·Q. The down-projection input gets an online rotation H (a forward pre-hook x → x·H, with
  down_proj W·H). Each value head is rotated by a head_dim matrix H_v fused into v_proj's rows (V → V·H_v)
  and o_proj's columns (W_o·blockdiag(H_v)), so o_proj's input is rotated: attention mixes positions, not
  channels, and the heads' norms of DIFF and the head-norm design are RMSNorms over whole head outputs,
  which commute with it (DIFF's gain, diff-gain's, is first folded into o_proj). The elementwise output
  gate of the gated designs does not commute (σ(g)⊙(o·H) ≠ (σ(g)⊙o)·H): there V/O is left unrotated,
  recorded. Keys are rotated online after RoPE, as QuaRot's Q/K Hadamard: `adjust_scheme` gives the
  scheme's `k_cache` quantizers a Hadamard basis (Q and K rotated alike leave the logits unchanged).
  Q, H and H_v are randomised Hadamard matrices where `quant/numerics/hadamard.py` can build one for the width,
  random orthogonal matrices otherwise (which it records). QuaRot's online Hadamard across heads before
  o_proj is not applied (SmolLM2's 9 heads have no Hadamard matrix).
- `quarot[:SEED]`: `rotate` with GPTQ weights (QuaRot's W4A4 recipe); with no solver named it runs GPTQ, an
  explicit `--solver gptq[:act-order]` is kept, any other solver is refused (`Rotate.solver_for`).
- `clip:mse` / `clip:percentile:P`: range search instead of min-max: static activation scales calibrate by
  MSE-optimal clipping (or the P-th percentile of |x|, per-tensor static scales only), and weight scales by
  MSE-optimal clipping per scale group, computed once (weights become static). Dynamic activation scales are
  unchanged. A change of the scheme, not of the model.
- `clip:output`: the range search on the readers' output error instead of the tensor's own: static per-tensor
  activation scales minimise Σ‖(X − Q(X))·Wᵀ‖² over the Linears that read X (`reader_gram`: e·G·eᵀ with
  G = Σ WᵀW, the objective of AWQ's clip search and OmniQuant's LWC, without training), other static scales
  fall back to MSE; weights go to the `clip:output` solver (quant/algorithms/solvers.py), which never clips a
  super-weight. Clipping the activation that carries a massive activation costs a tensor little of its own
  MSE and its readers a great deal: this objective sees it.

Supported layouts for smoothquant and rotate: pre-RMSNorm decoders with SwiGLU MLPs (Llama, DiffLlama, Qwen2,
Qwen3, Mistral, SmolLM3, and diffquant's designs); other models get a clear refusal. `mitigate_` returns a
handle whose `remove()` restores every weight bit-exactly; `record` describes what was done, and
`apply_record` replays it without calibration data (saved quantized models carry it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from diffquant.errors import DiffquantError
from diffquant.quant.numerics.layout import layers as _layers, readers as _readers
from diffquant.quant.algorithms.steps import FIXES, Fix, number

if TYPE_CHECKING:
    import torch



ALPHAS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # smoothquant:search's grid
SEARCH_WINDOWS = 16  # calibration windows the α search scores each candidate on


@FIXES.register
@dataclass(frozen=True)
class SmoothQuant(Fix):
    alpha: float | None = 0.5  # None: searched per model (`smoothquant:search`)
    needs_calibration = True
    words = ("smoothquant",)
    docs = {"smoothquant:ALPHA": "SmoothQuant scales (default α 0.5) folded into norms, up_proj and v_proj",
            "smoothquant:search": "SmoothQuant with α chosen per model by the scheme's loss on calibration windows"}

    @classmethod
    def from_text(cls, word: str, arg: str) -> "SmoothQuant":
        return cls(None if arg == "search" else float(arg) if arg else 0.5)

    def __post_init__(self) -> None:
        if self.alpha is not None and not 0 <= self.alpha <= 1:
            raise DiffquantError(f"smoothquant's alpha must be in [0, 1], got {self.alpha}")

    def label(self) -> str:
        return "smoothquant:search" if self.alpha is None else f"smoothquant:{number(self.alpha)}"

    def apply(self, model, calibration, scheme, applied: "Applied") -> None:
        if calibration is None or calibration.numel() == 0:
            raise DiffquantError("smoothquant needs calibration data")
        if self.alpha is None:
            _search_alpha(model, calibration, scheme, applied)
        else:
            _smoothquant(model, self, calibration, applied)

    def replay(self, model, record: dict, applied: "Applied") -> None:
        import torch

        for i, layer in enumerate(_layers(model)):
            _fold_smoothing(layer, {k: torch.tensor(v, dtype=torch.float64) for k, v in record["scales"][str(i)].items()},
                            applied)
        applied.record = record


@FIXES.register
@dataclass(frozen=True)
class Rotate(Fix):
    """QuaRot's rotation (the module doc). QuaRot's recipe is this with GPTQ weights: spelt `quarot`, it runs
    with GPTQ where no other solver is named (`solver_for`)."""

    seed: int = 0
    words = ("rotate", "quarot")
    docs = {"rotate[:SEED]": "QuaRot's rotation: fused norms, Hadamard-rotated residual stream, per-head V/O, online "
                             "Hadamard before down_proj and on keys after RoPE",
            "quarot[:SEED]": "rotate with GPTQ weights (QuaRot's recipe)"}
    export_refusal = ("QuaRot's online Hadamard rotations (of down_proj's input, and of the keys after RoPE) have no "
                      "place in a compressed-tensors checkpoint")

    @classmethod
    def from_text(cls, word: str, arg: str) -> "Rotate":
        return cls(int(arg) if arg else 0)

    def solver_for(self, word: str, solver: str) -> str:
        """`quarot`: rtn becomes gptq, an explicit gptq[:act-order] is kept, any other solver is refused."""
        if word != "quarot":
            return solver
        if solver == "rtn":
            return "gptq"
        if solver not in ("gptq", "gptq:act-order"):
            raise DiffquantError(f"quarot is the rotation with GPTQ weights; --solver {solver} does not go with it "
                                 "(use rotate with that solver)")
        return solver

    def label(self) -> str:
        return "rotate" if self.seed == 0 else f"rotate:{self.seed}"

    def adjust(self, scheme):
        """Keys of the cache quantized in the Hadamard basis of the online Q/K rotation."""
        keys = tuple((p, replace(c, hadamard=True) if p.endswith("k_cache") else c) for p, c in scheme.activations)
        return scheme if keys == scheme.activations else replace(scheme, activations=keys)

    def apply(self, model, calibration, scheme, applied: "Applied") -> None:
        _rotate(model, self, applied)


@FIXES.register
@dataclass(frozen=True)
class Clip(Fix):
    method: str = "mse"
    percentile: float = 99.99
    words = ("clip",)
    docs = {"clip:mse | clip:percentile:P": "MSE-optimal (or percentile) ranges for static activations and for weights "
                                            "(each tensor's own error)",
            "clip:output": "ranges of least output error of the readers: static per-tensor activation scales, and "
                           "weights by the clip:output solver (super-weights never clipped)"}

    @classmethod
    def from_text(cls, word: str, arg: str) -> "Clip":
        method, _, p = (arg or "mse").partition(":")
        return cls(method, float(p) if p else 99.99)

    def solver_for(self, word: str, solver: str) -> str:
        """`clip:output` clips the weights by the clip:output solver unless another solver is named."""
        return "clip:output" if self.method == "output" and solver == "rtn" else solver

    def __post_init__(self) -> None:
        if self.method not in ("mse", "percentile", "output"):
            raise DiffquantError(f"clip takes mse, percentile:P or output, got {self.method!r}")
        if not 0 < self.percentile <= 100:
            raise DiffquantError(f"clip percentile must be in (0, 100], got {self.percentile}")

    def label(self) -> str:
        return f"clip:percentile:{number(self.percentile)}" if self.method == "percentile" else f"clip:{self.method}"

    def adjust(self, scheme):
        """Range search instead of min-max for static activations (and, except `output`, for weights)."""
        from diffquant.quant.numerics import granularity as G

        def act(c):
            if c.dynamic:
                return c
            if self.method == "percentile" and isinstance(c.granularity, G.PerTensor) and c.format.symmetric:
                return replace(c, calibration="percentile", percentile=self.percentile)
            if self.method == "output" and isinstance(c.granularity, G.PerTensor):
                return replace(c, calibration="output")
            return replace(c, calibration="mse")

        weights = scheme.weights if self.method == "output" else tuple(  # output: the weight solver's ranges
            (p, replace(c, dynamic=False, calibration="mse")) for p, c in scheme.weights)
        return replace(scheme, name=f"{scheme.name}+{self.label()}",
                       activations=tuple((p, act(c)) for p, c in scheme.activations), weights=weights)


def parse(text: str) -> Fix | None:
    """The fix a spelling names (`none`: None), from the registry (quant/algorithms/steps.py)."""
    return FIXES.parse(text)


def adjust_scheme(scheme, fix: Fix | None):
    """The scheme a fix asks for (see each fix's `adjust`)."""
    return scheme if fix is None else fix.adjust(scheme)


class Applied:
    """What one fix changed: `remove()` puts back every tensor it replaced and takes its hooks away."""

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


def mitigate_(model, fix: Fix | None, calibration: torch.Tensor | None = None, scheme=None) -> Applied:
    """Apply one fix in place (see `Fix.apply`); `calibration` ([n, seq] token ids) is needed by smoothquant,
    and `scheme` by smoothquant:search. Returns the handle whose `remove()` undoes it."""
    import torch

    applied = Applied(model, fix)
    if fix is not None:
        with torch.no_grad():
            fix.apply(model, calibration, scheme, applied)
    return applied


def apply_record(model, record: dict) -> Applied:
    """Replay a fix from its record (saved scales, rotation seed), without calibration data."""
    import torch

    fix = parse(record["mitigation"]) if record.get("mitigation") else None
    applied = Applied(model, fix)
    if fix is not None:
        with torch.no_grad():
            fix.replay(model, record, applied)
    return applied


# -------------------------------------------------------------------------------------------- SmoothQuant
def _search_alpha(model, calibration: torch.Tensor, scheme, applied: Applied) -> None:
    """Each α of ALPHAS applied and scored (see the module doc); the best applied into `applied`."""
    from diffquant.calibration import channel_absmax
    from diffquant.evaluate import language_modeling
    from diffquant.quant.numerics.scheme import CALIBRATION_BATCH, attach_scheme, calibrate

    if scheme is None:
        raise DiffquantError("smoothquant:search chooses α by a scheme's loss: give the scheme")
    layers = _layers(model)
    absmax = channel_absmax(model, calibration, ["*.attn_in", "*.mlp_in", "*.down_in"]
                            + ([] if _value_blocked(layers[0]) else ["*.attn_out"]))
    scored = calibration[:SEARCH_WINDOWS]
    losses = {}
    for alpha in ALPHAS:
        trial = Applied(model, None)
        _smoothquant(model, SmoothQuant(alpha), calibration, trial, absmax, layers)
        attachment = attach_scheme(model, scheme)
        try:
            if any(not q.config.dynamic for q in attachment.quantizers.values()):
                calibrate(model, attachment, calibration.split(CALIBRATION_BATCH))  # as the pipeline calibrates
            losses[alpha] = language_modeling(model, scored)["loss"]
        finally:
            attachment.remove()
            trial.remove()
    best = min(losses, key=losses.get)
    _smoothquant(model, SmoothQuant(best), calibration, applied, absmax, layers)
    applied.record.update(search={"alphas": list(ALPHAS), "loss": [losses[a] for a in ALPHAS],
                                  "scored_tokens": int(scored.numel()), "scheme": scheme.name})


def _smoothquant(model, sq: SmoothQuant, calibration: torch.Tensor, applied: Applied, absmax=None,
                 layers=None) -> None:
    import torch

    from diffquant.calibration import channel_absmax

    layers = layers if layers is not None else _layers(model)
    why = _value_blocked(layers[0])
    if absmax is None:
        absmax = channel_absmax(model, calibration, ["*.attn_in", "*.mlp_in", "*.down_in"]
                                + ([] if why is not None else ["*.attn_out"]))
    scales = {}
    for i, layer in enumerate(layers):
        attn, mlp = _readers(layer)
        per = {}
        for point, readers in (("attn_in", attn), ("mlp_in", mlp), ("down_in", [layer.mlp.down_proj])):
            x = absmax[f"layers.{i}.{point}"].double().cpu()
            w = torch.stack([r.weight.detach().abs().amax(dim=0) for r in readers]).amax(dim=0).double().cpu()
            s = x.pow(sq.alpha) / w.pow(1 - sq.alpha)
            per[point] = torch.where((x > 0) & (w > 0) & torch.isfinite(s), s, torch.ones_like(s)).clamp_min(1e-5)
        if why is None:
            per["attn_out"] = _value_scales(layer.self_attn, absmax[f"layers.{i}.attn_out"], sq.alpha)
        _fold_smoothing(layer, per, applied)
        scales[str(i)] = {k: v.tolist() for k, v in per.items()}
    applied.record.update(scales=scales, alpha=sq.alpha, calibration_tokens=int(calibration.numel()),
                          o_proj_input="smoothed through v_proj" if why is None else f"not smoothed: {why}")


def _value_blocked(layer) -> str | None:
    """Why o_proj's input cannot be smoothed through v_proj (None: it can). Attention mixes positions with
    weights that do not depend on V, so V/s per channel gives (P·V)/s; a norm over each head's output does not
    commute with per-channel scales."""
    import torch

    attn = layer.self_attn
    norm = getattr(attn, "groupnorm", None) or getattr(attn, "head_norm", None)
    if norm is not None and not isinstance(norm, torch.nn.Identity):
        return "a norm over each head's output (DIFF, head-norm) does not commute with per-channel scales"
    if norm is not None:  # diff-nonorm: no norm, but DIFF's value layout
        return "DIFF's o_proj input concatenates two value halves per differential head, not v_proj's head blocks"
    if attn.o_proj.in_features != attn.config.num_attention_heads * attn.head_dim:
        return "o_proj's input is not one head_dim block per attention head"
    return None


def _value_scales(attn, x: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per o_proj input channel (heads·d): s = max|X|^α / max|W_o|^(1−α), one value per KV head channel, as
    every query head sharing a KV head reads the same v_proj output (the maxima taken over the group)."""
    import torch

    d = attn.head_dim
    kv = attn.v_proj.out_features // d
    x = x.double().cpu().view(kv, -1, d).amax(dim=1)
    w = attn.o_proj.weight.detach().abs().amax(dim=0).double().cpu().view(kv, -1, d).amax(dim=1)
    s = x.pow(alpha) / w.pow(1 - alpha)
    s = torch.where((x > 0) & (w > 0) & torch.isfinite(s), s, torch.ones_like(s)).clamp_min(1e-5)
    return s.unsqueeze(1).expand(kv, attn.o_proj.in_features // (kv * d), d).flatten()


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
    if "attn_out" in s:  # o_proj's input through v_proj: V / s per KV channel, W_o·diag(s) per query head
        v, o = layer.self_attn.v_proj, layer.self_attn.o_proj
        d = layer.self_attn.head_dim
        sc = s["attn_out"].to(o.weight.device)
        kv = sc.view(v.out_features // d, -1, d)[:, 0].flatten()
        applied.set(v, "weight", v.weight.double() / kv[:, None])
        if v.bias is not None:
            applied.set(v, "bias", v.bias.double() / kv)
        applied.set(o, "weight", o.weight.double() * sc)


# ------------------------------------------------------------------------------------------------- rotate
def _rotate(model, rot: Rotate, applied: Applied) -> None:
    import torch

    from diffquant.quant.numerics.hadamard import orthogonal

    layers = _layers(model)
    hidden = model.config.hidden_size
    Q, kind = orthogonal(hidden, rot.seed)
    embed = model.get_input_embeddings()
    head = model.lm_head
    if head.weight is embed.weight:  # tied: the head gets its own copy, since the two now differ
        head.weight = torch.nn.Parameter(embed.weight.detach().clone())
        applied._untied = True
    Qd = _on_device(Q)  # each weight is rotated on its own device (a model split over several GPUs)
    applied.set(embed, "weight", embed.weight.double() @ Qd(embed.weight))
    kinds = {"residual": kind}
    for layer in layers:
        attn, mlp = _readers(layer)
        for norm, readers in ((layer.input_layernorm, attn), (layer.post_attention_layernorm, mlp)):
            gamma = norm.weight.double()
            for r in readers:
                applied.set(r, "weight", (r.weight.double() * gamma.to(r.weight.device)) @ Qd(r.weight))
            applied.set(norm, "weight", torch.ones_like(norm.weight))
        for writer in (layer.self_attn.o_proj, layer.mlp.down_proj):
            applied.set(writer, "weight", Qd(writer.weight).T @ writer.weight.double())
            if writer.bias is not None:
                applied.set(writer, "bias", writer.bias.double() @ Qd(writer.weight))
        down = layer.mlp.down_proj
        H, hkind = orthogonal(down.in_features, rot.seed + 1)
        Hd = H.to(down.weight.device)
        kinds["down_in"] = hkind
        applied.set(down, "weight", down.weight.double() @ Hd)
        applied._handles.append(down.register_forward_pre_hook(_online(Hd), prepend=True))
    kinds["v_o"] = _rotate_values(layers, rot.seed, applied)
    norm = _final_norm(model)
    applied.set(head, "weight", (head.weight.double() * norm.weight.double().to(head.weight.device))
                @ Qd(head.weight))
    applied.set(norm, "weight", torch.ones_like(norm.weight))
    applied.record.update(seed=rot.seed, matrices=kinds)


def _rotate_values(layers, seed: int, applied: Applied) -> str:
    """Every value head V → V·H (v_proj's rows per KV head: Hᵀ·W_v, bias b·H) and o_proj's input heads back
    (W_o·blockdiag(H)); a head norm's gain is folded into o_proj first. Returns H's kind, or why not done."""
    import torch

    from diffquant.quant.numerics.hadamard import orthogonal

    attn = layers[0].self_attn
    gate = getattr(attn, "gate", None)
    d = attn.head_dim
    if isinstance(gate, torch.nn.Linear) and gate.out_features != attn.o_proj.in_features // d:
        return "not rotated: the elementwise output gate does not commute with a rotation of the heads"
    H, kind = orthogonal(d, seed + 2)
    for layer in layers:
        a = layer.self_attn
        v, o = a.v_proj, a.o_proj
        Hd = H.to(v.weight.device)
        norm = getattr(a, "groupnorm", None) or getattr(a, "head_norm", None)
        gain = getattr(norm, "weight", None) if norm is not None else None
        wo = o.weight.double()
        if gain is not None:  # fold the gain into o_proj's columns: the norm becomes weightless, and commutes
            wo = wo * gain.double().repeat(o.in_features // gain.numel())
            applied.set(norm, "weight", torch.ones_like(gain))
        applied.set(v, "weight", (Hd.T @ v.weight.double().unflatten(0, (-1, d))).flatten(0, 1))
        if v.bias is not None:
            applied.set(v, "bias", (v.bias.double().unflatten(0, (-1, d)) @ Hd).flatten())
        applied.set(o, "weight", (wo.unflatten(1, (-1, d)) @ Hd).flatten(1))
    return kind


def _on_device(m: torch.Tensor):
    """weight → m on weight's device (float64), moved once per device."""
    cache: dict = {}

    def on(weight: torch.Tensor) -> torch.Tensor:
        if weight.device not in cache:
            cache[weight.device] = m.to(weight.device)
        return cache[weight.device]

    return on


def _online(H: torch.Tensor):
    """x → x·H before down_proj (and before any tap on its input), in x's dtype on x's device."""
    cache: dict = {}

    def hook(module, args):
        x = args[0]
        h = cache.get((x.device, x.dtype))
        if h is None:
            h = cache[x.device, x.dtype] = H.to(device=x.device, dtype=x.dtype)
        return (x @ h, *args[1:])

    return hook


def _final_norm(model):
    from diffquant.taps import site_table

    return site_table(model).modules["final_norm"]
