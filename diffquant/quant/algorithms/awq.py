"""AWQ (Lin et al. 2023, arXiv 2306.00978): protect the weights of salient input channels by scaling them up
before rounding, with per-input-channel scales s = mean|x|^α chosen on the layer's output error, then
clip each weight group's range where that lowers the output error.

For Linears reading one input X (tokens × in) with the Hessian H = 2·XᵀX / tokens, quantizing W·diag(s)
and feeding X / s gives the output error
    E(s) = Σ_readers tr(ΔW · H · ΔWᵀ),  ΔW = W − Q(W·diag(s))·diag(1/s),
(the mean squared output error, times 2, exactly: no tokens need to be kept). α runs over the reference
code's grid 0, 0.05, …, 0.95 (20 points), s is normalised by √(max s · min s) as there, and the α of least
error wins (α = 0 is plain RTN, so the search never does worse on calibration data). The scales fold into
what produces X (see `quant/algorithms/mitigate.py`'s `_fold_smoothing`). The clip search then tries, per output row
and scale group, max|w| × (1 − i/20) for i = 0..9 and keeps the one of least error of that group's own
output contribution, Δw_g · H_gg · Δw_gᵀ (the reference's criterion); q_proj and k_proj are not clipped
(the reference skips them: their error passes through the Q·K product), nor is any group holding a
super-weight (`quant/algorithms/superweights.py`).

Two differences from the reference code, both stated in results: the scale search measures the output of
the Linears themselves, not of the whole attention or MLP block; and o_proj's input is not scaled through
v_proj (DIFF's per-head norm sits between them).
"""

from __future__ import annotations

import torch

from diffquant.quant.numerics import math as Q
from diffquant.quant.numerics.config import QuantConfig
from diffquant.taps.sites import WEIGHT_DIMS

GRID = 20  # α = i / GRID for i < GRID (the reference's n_grid)
CLIP_STEPS = 10  # shrink = 1 − i / GRID for i < CLIP_STEPS (the reference's max_shrink 0.5)


def rtn(w: torch.Tensor, config: QuantConfig) -> torch.Tensor:
    """The scheme's own round to nearest of a weight [out, in] (min-max scales per its granularity)."""
    return Q.dynamic_fake_quantize(w, config.format, config.granularity, WEIGHT_DIMS)


def output_error(w: torch.Tensor, wq: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """tr(ΔW · H · ΔWᵀ), ΔW = w − wq, in float64."""
    d = (w - wq).double()
    return ((d @ h) * d).sum()


def search_scale(weights: list[tuple[torch.Tensor, QuantConfig]], h: torch.Tensor, mean_abs: torch.Tensor
                 ) -> tuple[torch.Tensor, float, list[float]]:
    """(s, the chosen α, the error at each α) for Linears reading one input."""
    h = h.double()
    errors, best = [], None
    for i in range(GRID):
        alpha = i / GRID
        s = mean_abs.double().pow(alpha).clamp_min(1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = 0.0
        for w, config in weights:
            wd = w.double()
            err += float(output_error(wd, rtn(wd * s, config) / s, h))
        errors.append(err)
        if best is None or err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2], errors


def search_clip(w: torch.Tensor, h: torch.Tensor, config: QuantConfig, protect: tuple[tuple[int, int], ...] = ()
                ) -> torch.Tensor:
    """w with each (row, scale group) clamped to the shrink of least output error of that group; the groups
    holding a `protect`ed (row, col) weight (super-weights) keep their full range."""
    gran = config.granularity
    rows, cols = w.shape
    size = gran.group_size or cols
    if not gran.group_size and not gran.per_row:
        return w  # per-tensor or per-column scales: no per-row range to clip
    wd = w.double()
    pad = -cols % size
    wg = torch.nn.functional.pad(wd, (0, pad)).unflatten(1, (-1, size))  # [rows, groups, size]
    hp = torch.nn.functional.pad(h.double(), (0, pad, 0, pad))
    n = wg.shape[1]
    blocks = torch.stack([hp[g * size:(g + 1) * size, g * size:(g + 1) * size] for g in range(n)])  # [groups, s, s]
    org = wg.abs().amax(dim=-1, keepdim=True)
    best_err, best_max = None, org
    for i in range(CLIP_STEPS):
        m = org * (1 - i / GRID)
        cur = torch.maximum(torch.minimum(wg, m), -m)
        q = rtn(cur.flatten(1)[:, :cols], config)
        d = wd - q
        d = torch.nn.functional.pad(d, (0, pad)).unflatten(1, (-1, size))
        err = torch.einsum("rgi,gij,rgj->rg", d, blocks, d)[..., None]
        if best_err is None:
            best_err = err
        else:
            better = err < best_err
            best_err, best_max = torch.where(better, err, best_err), torch.where(better, m, best_max)
    for r, c in protect:
        best_max[r, c // size] = org[r, c // size]
    clipped = torch.maximum(torch.minimum(wg, best_max), -best_max)
    return clipped.flatten(1)[:, :cols].to(w.dtype)

