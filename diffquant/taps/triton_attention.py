"""The tapped attention's Triton path: a layer whose attention taps the flash kernel serves (kernels/flash.py) runs
that kernel instead of the explicit T × T computation of taps/attention.py, where the kernels resolve to "triton"
(diffquant/kernels: `kernels="auto"` on CUDA with Triton installed, or "triton").

The kernel serves the profile's observers and the logit sweep's quantizer: on `attn_logits` a statistics observer
(its SiteStats updated from the kernel: the visible logits only, with the top-k's rows recomputed by the same tile
code) and a dynamic symmetric integer quantizer per tensor, head or token (quant/numerics/fake.py's FakeQuant: its scales from a
first max-only pass over QKᵀ, `row_absmax`, as `Q.qparams` makes them; the statistics see the quantized logits where
their observer comes after it, as in the explicit path); the sink observers on `attn_probs` and `attn_map` (each
query's softmax mass on its first visible key; DIFF's differential map from the two maps' masses and λ, in the query's
dtype as the explicit path computes it) and λ. Any other tap, an eager-only variant (softcap, sinks, clipped softmax,
a sliding window), attention weights asked for, or dropout in training: the explicit path, as before.
"""

from __future__ import annotations

import torch

from diffquant import kernels

SERVED = {"attn_probs": "first_key", "attn_map": "first_key"}  # point: what each of its taps must have
EAGER_ONLY = ("softcap", "s_aux", "clip_softmax", "sliding_window", "cu_seq_lens_q")


def usable(module, taps: dict, query: torch.Tensor, attention_mask, kwargs: dict, dropout: float = 0.0) -> bool:
    """Whether this call's taps and inputs are the flash kernel's to serve (see the module docstring)."""
    if "attn_logits" not in taps or kernels.resolve(None, query.device) != "triton":
        return False  # a layer whose taps read no logits keeps its own kernel (taps/attention.py, first_key_only)
    if query.dtype not in (torch.float32, torch.bfloat16) or (dropout and module.training):
        return False
    if query.requires_grad and torch.is_grad_enabled():
        return False  # the kernel has no backward
    if any(kwargs.get(name) is not None for name in EAGER_ONLY) or kwargs.get("output_attentions"):
        return False
    if getattr(module, "_diffquant_paired", False) and not getattr(module, "_diffquant_fused", False):
        return False  # DiffLlama's two-call form: one call sees half of a differential head
    if attention_mask is not None and attention_mask.dim() not in (2, 4):
        return False
    logit_taps = [tap for tap, _ in taps["attn_logits"]]
    observers = [tap for tap in logit_taps if hasattr(tap, "site_stats")]
    quantizers = [tap for tap in logit_taps if _served_quantizer(tap)]
    if len(observers) > 1 or len(quantizers) > 1 or len(observers) + len(quantizers) != len(logit_taps):
        return False
    return all(point in SERVED and all(hasattr(tap, SERVED[point]) for tap, _ in entries)
               for point, entries in taps.items() if point not in ("lambda", "attn_logits"))


def _served_quantizer(tap) -> bool:
    """Whether a logit tap is a quantizer the kernel applies: the quantizer says so (FakeQuant's `kernel_scales`)."""
    return getattr(tap, "kernel_scales", None) is not None and tap.kernel_scales() is not None


def attend(taps: dict, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible, scaling: float,
           lam: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's attention through the flash kernel, its taps fed on the way (λ's tap, for DIFF, is the caller's).
    `visible`: taps/attention.py's `Visible` of the call. Returns [batch, query, H, d] (DIFF, with `lam` and the paired
    values [batch, H/2, key, 2d] as `value`: [batch, query, H/2, 2d], A1·V − λ·A2·V)."""
    from diffquant.kernels import flash

    heads, q_len, k_len = query.shape[1], query.shape[2], key.shape[2]
    masking = _masking(visible, query.device)
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    logit_taps = taps["attn_logits"]
    observer = next((i for i, (tap, _) in enumerate(logit_taps) if hasattr(tap, "site_stats")), None)
    quantizer = next((i for i, (tap, _) in enumerate(logit_taps) if _served_quantizer(tap)), None)
    quant = None
    if quantizer is not None:
        tap = logit_taps[quantizer][0]
        quant = flash.Quant(tap.kernel_scales()(flash.row_absmax(query, key, masking, scaling)),
                            tap.config.format.qmax,
                            stats_quantized=observer is not None and observer > quantizer)
    stats = None
    if observer is not None:
        tap, ctx = logit_taps[observer]
        stats = tap.site_stats(ctx, query.device)
    if lam is None:
        v_div, v_mod, out_dtype = heads // value.shape[1], value.shape[1], query.dtype
    else:  # DIFF: maps j and j + H/2 both read paired value j
        v_div, v_mod, out_dtype = 1, heads // 2, torch.float32
    result = flash.attention(query, key, value, masking, scaling, v_div=v_div, v_mod=v_mod,
                             hist=None if stats is None else stats.hist.counts,
                             nonfinite=None if stats is None else stats.nonfinite, quant=quant, out_dtype=out_dtype)
    if stats is not None:
        shape = torch.Size((query.shape[0], heads, q_len, k_len))
        stats.update_from_kernel(result.entry, result.rowmax, shape,
                                 lambda rows: flash.logit_rows(query, key, masking, scaling, rows, quant),
                                 ctx.batch.input_ids, ctx.batch.row_offset)
    _first_key_taps(taps, result, query.dtype, k_len, lam)
    if lam is None:
        return result.out
    half = heads // 2
    return (result.out[:, :, :half] - lam.float() * result.out[:, :, half:]).to(value.dtype)


def _masking(visible, device):
    """kernels/flash.py's Masking of what `Visible` holds: causality, flash-attention's [batch, key] padding mask
    (keys aligned to its right end) or a 4-D boolean or additive mask."""
    from diffquant.kernels.flash import FULL_MASK, KEY_MASK, Masking

    mask = visible.mask
    if mask is None:
        return Masking(visible.causal)
    if mask.dim() == 2:
        return Masking(visible.causal, KEY_MASK, mask[:, -visible.k_len:].to(device=device, dtype=torch.int8))
    if mask.dtype != torch.bool:  # additive (eager's): visible where it is not the dtype's minimum
        mask = mask > torch.finfo(mask.dtype).min / 2
    return Masking(False, FULL_MASK, mask.to(device=device).view(torch.int8))


def _first_key_taps(taps: dict, result, dtype: torch.dtype, k_len: int, lam) -> None:
    """The sink observers' first-key masses: each query's softmax mass on its first visible key (in the query's dtype,
    as the explicit path's probabilities are), rows counted where that key is not the query itself."""
    if not taps.get("attn_probs") and not taps.get("attn_map"):
        return
    mass = result.mass.to(dtype)
    first = result.first[:, :1]  # the same keys for every head
    own = torch.arange(first.shape[-1], device=first.device) + (k_len - first.shape[-1])
    rows = (first < k_len) & (first != own)
    for tap, ctx in taps.get("attn_probs", ()):
        tap.first_key(mass.float(), rows, ctx)
    if taps.get("attn_map"):
        half = mass.shape[1] // 2
        diff_map = (mass[:, :half] - lam.to(dtype) * mass[:, half:]).float()
        for tap, ctx in taps["attn_map"]:
            tap.first_key(diff_map, rows, ctx)

