"""diffquant's attention function, registered with transformers' AttentionInterface as "diffquant".

It computes the logits explicitly so taps can observe or transform them, masks them, softmaxes in
fp32 and multiplies by V. The mask function registered beside it always materialises the mask:
transformers would otherwise pass `attention_mask=None` for unpadded input and rely on the kernel's
own causality, which an explicit matmul does not have. Layers without attention taps fall through to
SDPA when the model ran on SDPA (with no mask, its `is_causal` kernel, where the mask is plainly causal),
and to the explicit computation otherwise (eager models with logit softcapping or attention sinks,
flash-attention models, whose kernels cannot take the materialised mask).

DIFF: diffquant runs DiffLlama with one attention call per layer (models/fused.py, `diff_attention`
here): every logit, probability and differential map passes the taps once. A DiffLlama in transformers'
own two-call form is handled too: the second call (same Q and K) reuses the first call's probabilities;
the check compares Q and K as the layer passed them, before grouped-query heads are repeated.

Long contexts: queries are processed in blocks (`query_block`: as many query rows as fit a memory budget,
$DIFFQUANT_ATTN_MEMORY MiB, default 2048; $DIFFQUANT_ATTN_BLOCK fixes the rows instead), so the logits never
exist as one [batch, head, T, T] tensor: the extra memory is O(batch · head · block · T). Taps see
each block with its query offset (`ctx.block`), statistics are exactly those of the whole tensor, and a
quantizer whose scale spans queries (per tensor or per head) first reads every block's range
(`needs_range` / `observe_range`), then quantizes each block with the full range.

Sinks (`s_aux`, gpt-oss and diffquant's `sink` design) are a per-head logit in the softmax denominator:
they are parameters, not activations, so `attn_logits` never contains them.
"""

from __future__ import annotations

import os

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from diffquant.errors import DiffquantError
from diffquant.taps.sites import CACHE_POINTS

NAME = "diffquant"
BLOCK: int | None = int(os.environ["DIFFQUANT_ATTN_BLOCK"]) if os.environ.get("DIFFQUANT_ATTN_BLOCK") else None
MEMORY_MIB = int(os.environ.get("DIFFQUANT_ATTN_MEMORY", "2048"))
# Peak bytes per element of one query block's [batch, head, rows, T] logits while tapped: the logits, mask,
# probabilities and the statistics' temporaries. Measured on SmolLM2-135M-Instruct (default profile sites with
# sinks, one sequence of 2,048-8,192 tokens): peak RSS grows by about 158 bytes per block element.
BYTES_PER_LOGIT = 160


def query_block(batch: int, heads: int, k_len: int) -> int:
    """Query rows per block: $DIFFQUANT_ATTN_BLOCK if set, else the rows whose logits and temporaries fit
    MEMORY_MIB (a multiple of 64, at least 64)."""
    if BLOCK is not None:
        return BLOCK
    rows = (MEMORY_MIB << 20) // max(1, batch * heads * k_len * BYTES_PER_LOGIT)
    return max(64, rows // 64 * 64)


def diffquant_mask(*args, **kwargs):
    """SDPA's boolean mask, never skipped: True where a query may attend a key."""
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def valid_positions(attention_mask: torch.Tensor | None, q_len: int, k_len: int, device,
                    rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Boolean [batch|1, 1, q, k] mask of the positions a query may attend (bottom-right causal if None);
    with `rows`, only queries rows[0]:rows[1]."""
    r0, r1 = rows or (0, q_len)
    if attention_mask is None:
        q = torch.arange(r0, r1, device=device)[:, None] + (k_len - q_len)
        return (torch.arange(k_len, device=device)[None, :] <= q)[None, None]
    mask = attention_mask[:, :, r0:r1, :k_len]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2  # additive float mask (eager)


def diff_lambda(module) -> torch.Tensor:
    """λ of a DiffLlama attention layer, computed as transformers computes it."""
    l1 = torch.exp(torch.sum(module.lambda_q1 * module.lambda_k1, dim=-1, dtype=torch.float32))
    l2 = torch.exp(torch.sum(module.lambda_q2 * module.lambda_k2, dim=-1, dtype=torch.float32))
    return l1 - l2 + module.lambda_init


_last_mask: list = [None, False]  # (mask, is plain causal) of the last untapped call: one check per forward


def plain_causal(mask: torch.Tensor | None, q_len: int, k_len: int) -> bool:
    """Whether a boolean mask is exactly the causal mask of q_len == k_len (no padding), so an untapped
    layer can let SDPA use `is_causal` (1.7× faster than an explicit mask on CPU here)."""
    if mask is None or mask.dtype != torch.bool or q_len != k_len or q_len < 2:
        return False
    if _last_mask[0] is not mask:
        causal = valid_positions(None, q_len, k_len, mask.device)
        _last_mask[:] = [mask, mask.shape[-2:] == causal.shape[-2:] and bool((mask == causal).all())]
    return _last_mask[1]




def key_valid(attention_mask: torch.Tensor | None, q_len: int, k_len: int, device) -> torch.Tensor | None:
    """[batch|1, 1, k, 1]: the key positions some query may attend (None when every one is), the
    validity of a [batch, kv_head, pos, dim] cache site (left padding never sets a scale)."""
    if attention_mask is None:
        return None
    valid = valid_positions(attention_mask, q_len, k_len, device).any(dim=-2)
    return None if bool(valid.all()) else valid.unsqueeze(-1)


def cache_taps(module, q_len: int, key: torch.Tensor, value: torch.Tensor, attention_mask):
    """Keys and values through the `k_cache` / `v_cache` taps, each KV head once (before grouped-query
    heads are repeated): the tensors a KV cache stores, after RoPE. Returns (key, value, the other taps).
    DiffLlama has these sites in its fused form only (see `SiteTable`)."""
    taps = getattr(module, "_diffquant_taps", None) or {}
    if not any(p in taps for p in CACHE_POINTS):
        return key, value, taps
    valid = key_valid(attention_mask, q_len, key.shape[2], key.device)
    key = run_taps(taps.get("k_cache"), key, valid)
    value = run_taps(taps.get("v_cache"), value, valid)
    return key, value, {p: e for p, e in taps.items() if p not in CACHE_POINTS}


def tapped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    key, value, taps = cache_taps(module, query.shape[2], key, value, attention_mask)
    if not taps:
        plain = all(kwargs.get(k) is None for k in ("softcap", "s_aux", "clip_softmax"))
        if module.__dict__.get("_diffquant_fallback", "sdpa") == "sdpa" and plain:
            if plain_causal(attention_mask, query.shape[2], key.shape[2]):
                attention_mask = None  # SDPA then takes its is_causal path
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          **kwargs)
    return _attend(module, taps, query, key, value, attention_mask, scaling, dropout, kwargs)


def explicit_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention computed explicitly (fp32 softmax), as the tapped attention computes it without taps,
    including the variants transformers and diffquant's designs pass: `softcap`, `s_aux` (a per-head sink
    logit in the denominator) and `clip_softmax=(ζ, γ)` (clip((ζ − γ)·softmax + γ, 0, 1)). The eager
    attention of the designs whose softmax SDPA cannot compute."""
    return _attend(module, {}, query, key, value, attention_mask, scaling, dropout, kwargs)


def _attend(module, taps, query, key, value, attention_mask, scaling, dropout, kwargs):
    if dropout and module.training:
        raise DiffquantError("tapped attention does not apply attention dropout; use model.eval() or dropout 0")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    n_rep = query.shape[1] // key.shape[1]
    value = repeat_kv(value, query.shape[1] // value.shape[1])
    block = query_block(query.shape[0], query.shape[1], key.shape[2])
    if query.shape[2] > block:
        if getattr(module, "_diffquant_paired", False) and not getattr(module, "_diffquant_fused", False):
            raise DiffquantError("a long context in DiffLlama's two-call form: give the model the fused forward "
                                 "(diffquant.models.fused.fuse), which diffquant's loaders and taps do")
        out = _blocked(module, taps, query, repeat_kv(key, n_rep), attention_mask, scaling, kwargs,
                       lambda p, rows: torch.matmul(p.to(value.dtype), value), block)
        return out.transpose(1, 2).contiguous(), None
    pending = module.__dict__.pop("_diffquant_pending", None)
    if pending is not None and pending[0] is query and pending[1] is key:
        probs = pending[2]  # DiffLlama's second call: same Q and K, reuse (observed, maybe quantized) probs
    else:
        probs = _probabilities(module, taps, query, repeat_kv(key, n_rep), attention_mask, scaling, kwargs)
        if getattr(module, "_diffquant_paired", False):
            module._diffquant_pending = (query, key, probs)  # before repeat_kv, which makes a new tensor
            if "attn_map" in taps or "lambda" in taps:
                lam = diff_lambda(module)
                run_taps(taps.get("lambda"), lam, None)
                _differential_map(module, taps, probs, lam, query.shape[2], key.shape[2], attention_mask, None)
    out = torch.matmul(probs.to(value.dtype), value)
    return out.transpose(1, 2).contiguous(), probs


def diff_attention(module, query, key, vpair, attention_mask, scaling, lam, taps: dict):
    """DIFF in one call: the softmax maps of all H heads (taps on logits and probabilities see each once),
    A = P[:, :H/2] − λ·P[:, H/2:] per differential head (the `attn_map` site), and A·[V1 | V2].
    `taps`: the module's taps other than the cache sites (see `cache_taps`).
    Returns ([batch, pos, H/2, 2d], probabilities or None when computed in blocks)."""
    run_taps(taps.get("lambda"), lam.float(), None)
    key = repeat_kv(key, query.shape[1] // key.shape[1])
    q_len, k_len = query.shape[2], key.shape[2]

    def combine(probs, rows):
        a = _differential_map(module, taps, probs, lam, q_len, k_len, attention_mask, rows)
        return torch.matmul(a.to(vpair.dtype), vpair)

    block = query_block(query.shape[0], query.shape[1], k_len)
    if q_len > block:
        return _blocked(module, taps, query, key, attention_mask, scaling, {}, combine, block).transpose(1, 2), None
    probs = _probabilities(module, taps, query, key, attention_mask, scaling, {})
    return combine(probs, None).transpose(1, 2), probs


def _differential_map(module, taps, probs, lam, q_len, k_len, attention_mask, rows):
    half = probs.shape[1] // 2
    a = probs[:, :half] - lam.to(probs.dtype) * probs[:, half:]
    if "attn_map" in taps:
        valid = valid_positions(attention_mask, q_len, k_len, probs.device, rows)
        run_taps(taps["attn_map"], a, valid, _block_of(rows, q_len))
    return a


def _block_of(rows, q_len):
    return None if rows is None else (rows[0], rows[1], q_len)


def _blocked(module, taps, query, key, attention_mask, scaling, kwargs, consume, block):
    """Attention in query blocks of `block` rows: `consume(probs_block, rows)` turns each block's probabilities
    into its output rows; nothing of size T × T is kept."""
    q_len = query.shape[2]
    blocks = [(i, min(i + block, q_len)) for i in range(0, q_len, block)]
    ranged = [(tap, ctx) for tap, ctx in taps.get("attn_logits", ()) if getattr(tap, "needs_range", None)
              and tap.needs_range(ctx)]
    for tap, ctx in ranged:  # pass 1: the full range of quantizers whose scale spans query blocks
        tap.start_range()
        for rows in blocks:
            logits = _logits(query[:, :, rows[0]:rows[1]], key, scaling, kwargs.get("softcap"))
            valid = valid_positions(attention_mask, q_len, key.shape[2], query.device, rows)
            tap.observe_range(logits, ctx.with_valid(valid))
    try:
        outs = [consume(_probabilities(module, taps, query, key, attention_mask, scaling, kwargs, rows), rows)
                for rows in blocks]
    finally:
        for tap, _ in ranged:
            tap.end_range()
    return torch.cat(outs, dim=2)


def _logits(query, key, scaling, softcap):
    logits = torch.matmul(query, key.transpose(2, 3)).mul_(scaling)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _probabilities(module, taps, query, key, attention_mask, scaling, kwargs, rows=None):
    """Softmax probabilities of all queries (or of query rows `rows` of a blocked call), through the taps."""
    sinks, clip = kwargs.get("s_aux"), kwargs.get("clip_softmax")
    q_len = query.shape[2]
    if rows is not None:
        query = query[:, :, rows[0]:rows[1]]
    block = _block_of(rows, q_len)
    logits = _logits(query, key, scaling, kwargs.get("softcap"))
    valid = valid_positions(attention_mask, q_len, key.shape[2], query.device, rows)
    tapped = run_taps(taps.get("attn_logits"), logits, valid, block)
    scores = masked_scores(tapped, logits, valid)
    if sinks is not None:  # a learned per-head logit in the denominator only (gpt-oss): softmax, then drop it
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if clip is not None:  # Bondarenko et al.'s clipped softmax: exact zeros (and ones) become reachable
        zeta, gamma = clip
        probs = ((zeta - gamma) * probs + gamma).clamp_(0.0, 1.0).masked_fill_(~valid, 0.0)
    empty = ~valid.any(-1, keepdim=True)
    if bool(empty.any()):  # fully masked rows (padding): zeros, not NaN
        probs = probs.masked_fill(empty, 0.0)
    probs = probs.to(query.dtype)
    return run_taps(taps.get("attn_probs"), probs, valid, block)


def masked_scores(tapped: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """fp32 logits with -inf where a query may not attend. Finite logits take an additive 0/-inf bias,
    as transformers' eager attention does (a broadcast boolean masked_fill is several times slower on
    CPU); non-finite ones take masked_fill, since inf + -inf would be NaN. Works in place when the
    tensor is ours (taps see it during their call only) and autograd allows it."""
    scores = tapped.float()
    ours = (tapped is logits or scores is not tapped) and not scores.requires_grad
    if bool(torch.isfinite(scores.sum())):
        bias = torch.zeros(valid.shape, dtype=scores.dtype, device=scores.device).masked_fill_(~valid, float("-inf"))
        return scores.add_(bias) if ours else scores + bias
    return scores.masked_fill_(~valid, float("-inf")) if ours else scores.masked_fill(~valid, float("-inf"))


def run_taps(entries, x: torch.Tensor, valid: torch.Tensor | None, block=None) -> torch.Tensor:
    """Pass x through the (tap, context) entries of one site in attach order; `block` = (first query, end,
    all queries) when x holds one block of a longer attention."""
    for tap, ctx in entries or ():
        y = tap(x, ctx.with_valid(valid, block))
        if y is not None:
            x = y
    return x


AttentionInterface.register(NAME, tapped_attention)
AttentionMaskInterface.register(NAME, diffquant_mask)
