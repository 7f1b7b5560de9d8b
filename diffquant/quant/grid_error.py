"""What a static per-tensor grid does to each Linear input: outliers measured by what they cost, not by a ratio.

A top-1 / median ratio moves with the median (in the head-norm cells DIFF's down_proj ratio fell ×0.09 because its
median rose ~15× while its ∞-norm rose ×1.29), and at a static int8 step of max|x|/127 the median of a quiet input
rounds to zero in every model alike. So, per Linear-input site (`attn_in` read by q/k/v, `attn_out` by o_proj,
`mlp_in` by gate/up, `down_in` by down_proj) and bit width, with the grid a static W8A8 / W4A4 simulation uses
(symmetric int, one scale per tensor, absmax over a calibration draw: `quantize_` calibrates it, and its scales are
read back here), on held-out tokens:

- `zero_share`: the share of values the grid rounds to 0 (|x| < step/2, ties to even);
- `snr_db`: the quantized input's signal-to-noise ratio, 10·log10(Σx² / Σ(x − Q(x))²);
- `output_error`: the relative error of the readers' outputs from the input's rounding alone (float weights),
  Σ‖(x − Q(x))·Wᵀ‖² / Σ‖x·Wᵀ‖² summed over the site's readers, as e·G·eᵀ / x·G·xᵀ with G = Σ WᵀW
  (quant/layout.reader_gram);
- `scale`: the grid's step; `absmax`: the calibration's max |x| (scale × the format's half span).

Per kind of site: the same figures pooled over layers (sums of sums) and the worst layer's. Sums are float64.
"""

from __future__ import annotations

import math

import torch

from diffquant.errors import DiffquantError

KINDS = ("attn_in", "attn_out", "mlp_in", "down_in")


class _GridError:
    """The sums of one site under one grid (an observer tap: it changes nothing)."""

    transforms = False

    def __init__(self, scale: torch.Tensor, fmt, gram: torch.Tensor):
        self.scale, self.fmt, self.gram = scale, fmt, gram
        self.n = self.zeros = 0
        self.signal = self.noise = self.out_signal = self.out_noise = 0.0

    def __call__(self, x: torch.Tensor, ctx) -> None:
        from diffquant.quant.numerics import math as Q
        from diffquant.taps.context import token_valid

        x = x.detach().float()
        scale = self.scale.to(x.device)
        zero = torch.zeros_like(scale)
        q = Q.quantize(x, scale, zero, self.fmt)
        e = x - Q.dequantize(q.clone(), scale, zero, self.fmt)
        valid = token_valid(ctx, x)
        if valid is not None:
            keep = valid.expand(x.shape)
            x, e, q = x[keep].reshape(-1, x.shape[-1]), e[keep].reshape(-1, x.shape[-1]), q[keep]
        x, e = x.reshape(-1, x.shape[-1]).double(), e.reshape(-1, x.shape[-1]).double()
        g = self.gram.to(device=x.device, dtype=torch.float64)
        self.n += x.numel()
        self.zeros += int((q == 0).sum())
        self.signal += float((x * x).sum())
        self.noise += float((e * e).sum())
        self.out_signal += float(((x @ g) * x).sum())
        self.out_noise += float(((e @ g) * e).sum())

    def figures(self) -> dict:
        return figures(self.n, self.zeros, self.signal, self.noise, self.out_signal, self.out_noise)


def figures(n: int, zeros: int, signal: float, noise: float, out_signal: float, out_noise: float) -> dict:
    """The reported figures from the sums (also pooled sums of several sites)."""
    return {"values": n, "zero_share": zeros / n if n else None,
            "snr_db": 10 * math.log10(signal / noise) if noise > 0 and signal > 0 else math.inf if signal > 0 else None,
            "output_error": out_noise / out_signal if out_signal > 0 else None}


def static_grid_errors(model, held_out: torch.Tensor, calibration: torch.Tensor, bits=(8, 4), kinds=KINDS,
                       batch_size: int = 8) -> dict:
    """{"sites": {site: {"kind", "layer", "a8": {...}, "a4": {...}}}, "kinds": {kind: {"a8": {"pooled": {...},
    "worst_layer": {...}}}}} for a model on the Llama layout (quant/numerics/layout.py); `calibration` sets each grid's
    scale (as a static scheme's calibration does), `held_out` is measured. The model is left as it was."""
    from diffquant.quant.numerics import granularity as G
    from diffquant.quant.numerics.config import int_config
    from diffquant.quant.numerics.layout import reader_gram
    from diffquant.quant.recipe import quantize_
    from diffquant.quant.numerics.scheme import QuantScheme
    from diffquant.taps import site_table, tapped

    table = site_table(model)
    sites = [s for s in table if s.kind in kinds and s.layer is not None]
    if not sites:
        raise DiffquantError(f"the model has none of the Linear-input sites {', '.join(kinds)}")
    grams = {s.name: reader_gram(model, s.name) for s in sites}
    device = model.get_input_embeddings().weight.device
    out = {"sites": {s.name: {"kind": s.kind, "layer": s.layer} for s in sites}, "kinds": {}}
    for b in bits:
        config = int_config(b, G.PerTensor(), dynamic=False)
        scheme = QuantScheme(f"a{b}-static-grid", tuple((f"*.{k}", config) for k in kinds))
        with quantize_(model, scheme, calibration) as q:
            scales = {name: qz.scale.detach().clone() for name, qz in q.quantizers.items() if name in grams}
        taps = {name: _GridError(scales[name], config.format, grams[name]) for name in grams}
        with torch.no_grad(), tapped(model, taps):
            for batch in held_out.split(batch_size):
                model(batch.to(device), use_cache=False)
        key = f"a{b}"
        for name, tap in taps.items():
            out["sites"][name][key] = {**tap.figures(), "scale": float(scales[name].reshape(-1)[0]),
                                       "absmax": float(scales[name].reshape(-1)[0]) * config.format.half_span}
        for kind in kinds:
            mine = [taps[s.name] for s in sites if s.kind == kind]
            if not mine:
                continue
            pooled = figures(*(sum(getattr(t, f) for t in mine)
                               for f in ("n", "zeros", "signal", "noise", "out_signal", "out_noise")))
            worst = max((s for s in sites if s.kind == kind),
                        key=lambda s: out["sites"][s.name][key]["output_error"] or 0.0)
            out["kinds"].setdefault(kind, {})[key] = {"pooled": pooled, "worst_layer": {
                "layer": worst.layer, **out["sites"][worst.name][key]}}
    return out
