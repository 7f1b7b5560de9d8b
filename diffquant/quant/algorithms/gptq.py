"""GPTQ (Frantar et al. 2022, arXiv 2210.17323): round a weight one input column at a time and move each
column's rounding error onto the columns not yet rounded, weighted by the inverse Hessian of the layer's
output error, so the layer's output on calibration data changes as little as possible.

For a Linear y = x·Wᵀ and calibration inputs X ([tokens, in]), the output error ‖X·(W − Ŵ)ᵀ‖² has the
Hessian H = 2·XᵀX / tokens (the same for every output row). With U the upper Cholesky factor of H⁻¹
(after dampening H += λ·I, λ = 1% of mean diag H), column j is rounded to q_j and the error
e_j = (w_j − q_j) / U_jj is removed from the later columns: W[:, j:] −= e_j · U[j, j:]. Lazy blocks of 128
columns apply the same updates to the later blocks in one matrix product (exact reordering of the sums).

Scales come from `quant/numerics/math.py` (min-max of the weights they cover): per channel, per tensor or per input
column from the original weight, as the reference implementation; groups from the weights as updated by
every earlier column, when the group's first column is reached (blocks are aligned to groups, so that is
exact). With act-order (columns in order of decreasing diag H) group scales are taken from the original
weight before any column moves (the reference's `static_groups`), so each group stays a run of consecutive
input columns, the only groups diffquant's formats describe. The result lies on the scheme's grid: a fake
quantizer given these scales returns it unchanged.
"""

from __future__ import annotations

import torch

from diffquant.errors import DiffquantError
from diffquant.quant.numerics import math as Q
from diffquant.quant.numerics.config import QuantConfig
from diffquant.taps.sites import WEIGHT_DIMS


def scales(w: torch.Tensor, config: QuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) of `config` for the weight `w` ([out, in]) by min-max, shaped as a static fake
    quantizer keeps them."""
    wg, reduce = Q.grouped(w, config.granularity, WEIGHT_DIMS)
    lo, hi = Q.value_range(wg, reduce, None, config.format.symmetric)
    return Q.qparams(lo, hi, config.format)


def solve(w: torch.Tensor, h: torch.Tensor, config: QuantConfig, gptq) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ of one weight `w` ([out, in]) under Hessian `h` ([in, in]) with the settings `gptq` (gptq_config.py's
    GPTQ step: damp, block, act_order, static_groups): (quantized weight in w's dtype, scale, zero), the scales as
    `scales` shapes them. Solved in float64."""
    fmt, gran = config.format, config.granularity
    rows, cols = w.shape
    if h.shape != (cols, cols):
        raise DiffquantError(f"GPTQ: Hessian {tuple(h.shape)} does not match a weight with {cols} inputs")
    W = w.detach().double().clone()
    H = h.detach().double().clone()
    dead = H.diagonal() == 0  # inputs that are always zero: their weights cannot matter
    H[dead, dead] = 1
    W[:, dead] = 0
    group = gran.group_size
    lazy_groups = group is not None and not (gptq.act_order or gptq.static_groups)
    if group is None:
        s, z = scales(W, config)
        col_scale, col_zero = s.expand(rows, cols), z.expand(rows, cols)
    elif gptq.act_order or gptq.static_groups:  # static groups from the original weight
        s, z = scales(W, config)
        col_scale = s.squeeze(-1).repeat_interleave(group, dim=1)[:, :cols]
        col_zero = z.squeeze(-1).repeat_interleave(group, dim=1)[:, :cols]
    if gptq.act_order:  # without it the columns keep their order: no copies of W and H permuted by arange
        perm = torch.argsort(H.diagonal(), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]
        col_scale, col_zero = col_scale[:, perm], col_zero[:, perm]  # act-order always has static scales
    H.diagonal().add_(gptq.damp * H.diagonal().mean())
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    out = torch.empty_like(W)
    group_scales, group_zeros = [], []
    block = group * max(1, gptq.block // group) if lazy_groups else gptq.block
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        # the block transposed, one row per column of W: each step reads and updates contiguous rows where W's
        # columns are strided (the step's cost was mostly memory traffic). Every value gets the same operations
        # in the same order as in W's layout, so the result is bit-identical (tests/test_gptq.py checks it).
        W1, U1 = W[:, i1:i2].T.contiguous(), U[i1:i2, i1:i2]
        Q1, E1 = torch.empty_like(W1), torch.empty_like(W1)
        for i in range(i2 - i1):
            j = i1 + i
            if lazy_groups:
                if j % group == 0:  # the group's scale from its columns as they are now
                    s, z = scales(W1[i:i + group].T, config)
                    group_scales.append(s.reshape(rows, 1))
                    group_zeros.append(z.reshape(rows, 1))
                s, z = group_scales[-1][:, 0], group_zeros[-1][:, 0]
            else:
                s, z = col_scale[:, j], col_zero[:, j]
            q = Q.dequantize(Q.quantize(W1[i], s, z, fmt), s, z, fmt)
            err = (W1[i] - q) / U1[i, i]
            W1[i + 1:] -= U1[i, i + 1:, None] * err  # the block's later columns (column i is done)
            Q1[i], E1[i] = q, err
        out[:, i1:i2] = Q1.T
        W[:, i2:] -= E1.T.contiguous() @ U[i1:i2, i2:]  # the later blocks, as one product (the paper's lazy batch)
    if gptq.act_order:
        out = out[:, torch.argsort(perm)]
    if lazy_groups:
        scale = torch.stack(group_scales, dim=1)  # [out, groups, 1]
        zero = torch.stack(group_zeros, dim=1)
    else:
        scale, zero = scales(w.detach().double().masked_fill(dead[None, :], 0), config)
    scale, zero = scale.to(w.dtype), zero.to(w.dtype)
    # the float64 solution rounded once more with the scales in w's dtype: on the grid a fake quantizer with
    # these scales keeps bit-exactly (the codes do not change: they sit within 1e-7 of an integer)
    return Q.fake_quantize(out.to(w.dtype), scale, zero, fmt, gran), scale, zero


def layer_step(table, configs, by_layer, gptq, solved):
    """GPTQ as one of `solve_weights_`'s per-layer steps (quant/algorithms/solvers.py): (the Linears of layer i it
    reads inputs for, what it does with their Hessians): each weight solved, set on its module through the `Solved`
    handle (restored bit-exactly on removal) and its scales kept for the fake quantizer."""
    from diffquant.quant.algorithms.steps import LayerStep
    from diffquant.taps.tap import canonical_weight, stored_weight

    def apply(i, stats):
        for name, (h, _) in stats.items():
            module, site = table.modules[name], table.sites[name]
            w = getattr(module, site.param)
            wq, scale, zero = solve(canonical_weight(w.detach(), site.layout), h, configs[name], gptq)
            solved._applied.set(module, site.param, stored_weight(wq, site.layout, w.shape))
            solved.scales[name] = (scale.cpu(), zero.cpu())

    return LayerStep(lambda i: by_layer.get(i, {}), apply)
