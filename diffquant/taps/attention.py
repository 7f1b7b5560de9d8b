"""diffquant's attention function, registered with transformers' AttentionInterface as "diffquant".

While a tap sits on an attention site, the model runs this function in every layer, but only the layers
with taps leave their own kernel: a layer without attention taps calls the implementation the model was
loaded with (SDPA, flash-attention) on exactly the mask that implementation gets, so its output is the
untapped model's bit for bit. The mask function registered beside it builds that mask (`diffquant_mask`):
SDPA's (None where it is plainly causal: SDPA's `is_causal` path), eager's additive one, or flash-attention's
[batch, key] padding mask; for any other implementation, SDPA's boolean mask, always materialised, and
every layer explicit. A tapped layer computes the logits explicitly, so taps can observe or transform them,
masks them, softmaxes in fp32 and multiplies by V. Its mask is built per query block from whichever form
transformers passed (`Visible`): causality (the module's `is_causal`: transformers passes no mask for
plainly causal input and relies on the kernel being causal), flash-attention's padding mask and
`sliding_window`, or the rows of a 4-D mask. Eager models, and eager-only designs (logit softcapping,
attention sinks, clipped softmax), run the explicit computation in every layer, as their eager attention does.

What each site needs: `attn_logits` and a transforming tap on `attn_probs` need the explicit path in the layers
they tap (the T × T logits exist only there). The sink metrics read only each query's mass on the first key:
where a layer's only attention taps are such observers and the mask is plainly causal, that column comes from
a second call of the layer's own kernel with a one-hot value (`first_key_masses`), and the layer never goes
explicit. `k_cache` / `v_cache` and `lambda` keep the layer's own kernel.

DIFF: diffquant runs DiffLlama with one attention call per layer (models/fused.py, `diff_attention`
here): every logit, probability and differential map passes the taps once. A DiffLlama in transformers'
own two-call form is handled too: the second call (same Q and K) reuses the first call's probabilities;
the check compares Q and K as the layer passed them, before grouped-query heads are repeated.

Query blocks: queries are processed in blocks of `query_block` rows, so the logits never exist as one
[batch, head, T, T] tensor. On CPU a block's logits take about CPU_BLOCK_BYTES (a few MiB: each of the statistics'
passes then reads a block that is still in the core's cache; measured in benchmarks/peers_breakdown.py; not where a
quantizer's scale spans blocks, `_ranged`, whose logits blocking computes twice); on CUDA as
many rows as fit a memory budget: $DIFFQUANT_ATTN_MEMORY MiB if set, else an eighth of the device's memory or half of
what is free, whichever is less ($DIFFQUANT_ATTN_BLOCK fixes the rows instead; both are read at each call). Taps see
each block with its place in the call (`ctx.block`), statistics are exactly those of the whole tensor, and a quantizer
whose scale spans queries (per tensor or per head) first reads every block's range (`needs_range` /
`observe_range`), then quantizes each block with the full range.

Causal blocks end at their last visible key: where the mask is causal (plainly, or with flash-attention's padding
mask) and every tap on the layer's logits, probabilities and map says it takes such blocks (`cut_keys = True`, as
diffquant's statistics observers do), a block of query rows r0..r1 computes its logits, softmax and taps over keys
0..r1 only (rounded up to KEY_ALIGN; the keys after it are masked for every row of the block): about half the
T × T work of a long window, with statistics, softmax and output bit for bit those of the uncut block.
The product with V still runs over every key (the cut-off probabilities as zeros), because a shorter product rounds
differently: the layer's output is bit for bit what the uncut computation gives.

The Triton path: where the kernels resolve to "triton" (diffquant/kernels; on CUDA by default where Triton is
installed), a tapped layer whose taps are the profile's observers (logit statistics, sink metrics, λ) runs
taps/triton_attention.py instead of the explicit computation: one flash-attention kernel that computes each tile of
logits once, keeps their statistics on the way (visible logits only) and goes on to the output.

Sinks (`s_aux`, gpt-oss and diffquant's `sink` design) are a per-head logit in the softmax denominator:
they are parameters, not activations, so `attn_logits` never contains them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv
from transformers.masking_utils import (ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, eager_mask,
                                        flash_attention_mask, sdpa_mask)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from diffquant.errors import DiffquantError
from diffquant.taps import triton_attention
from diffquant.taps.context import Block
from diffquant.taps.sites import CACHE_POINTS

NAME = "diffquant"
CPU_MEMORY_MIB = 2048  # on CPU, the most one block may take (CPU_BLOCK_BYTES decides first)
CPU_BLOCK_BYTES = 4 << 20  # on CPU, one block's fp32 logits: measured on SmolLM2 (benchmarks/peers_breakdown.py)
# Peak bytes per element of one query block's [batch, head, rows, T] logits while tapped: the logits, mask,
# probabilities and the statistics' temporaries. Measured on SmolLM2-135M-Instruct (default profile sites with
# sinks, one sequence of 2,048-8,192 tokens): peak RSS grows by about 158 bytes per block element.
BYTES_PER_LOGIT = 160
# Causal blocks end at a multiple of this many keys: CPU kernels sum a row in vector lanes, so a row cut at an odd
# place rounds its softmax and row sums differently from the whole row (masked keys are exact zeros in both);
# cut at multiples of 32 they agreed bit for bit on AVX-512 (tests/test_hot_path.py checks it where the suite runs)
KEY_ALIGN = 64
_budgets: dict[str, int] = {}  # per CUDA device, its block budget in bytes, read once (reading syncs the device)
_originals: dict[int, str] = {}  # id(config) -> the implementation a tapped model was loaded with (see `remember`)


def _env_int(name: str) -> int | None:
    """An integer setting from the environment, read when it is used (so a caller may set it at any time)."""
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise DiffquantError(f"${name} must be a whole number, not {value!r}") from None


def memory_budget(device=None) -> int:
    """Bytes one query block's logits and temporaries may take (see the module docstring)."""
    mib = _env_int("DIFFQUANT_ATTN_MEMORY")
    if mib is not None:
        return mib << 20
    device = torch.device(device if device is not None else "cpu")
    if device.type != "cuda":
        return CPU_MEMORY_MIB << 20
    key = str(device)
    if key not in _budgets:
        free, total = torch.cuda.mem_get_info(device)
        _budgets[key] = min(total // 8, free // 2)
    return _budgets[key]


def query_block(batch: int, heads: int, k_len: int, device=None, cache: bool = True) -> int:
    """Query rows per block: $DIFFQUANT_ATTN_BLOCK if set, else the rows whose logits and temporaries fit the
    device's `memory_budget` (a multiple of 64, at least 64), and on CPU with `cache` no more than the rows whose
    fp32 logits take CPU_BLOCK_BYTES (a multiple of 16, at least 16)."""
    fixed = _env_int("DIFFQUANT_ATTN_BLOCK")
    if fixed is not None:
        return fixed
    rows = max(64, memory_budget(device) // max(1, batch * heads * k_len * BYTES_PER_LOGIT) // 64 * 64)
    if cache and torch.device(device if device is not None else "cpu").type == "cpu":
        rows = min(rows, max(16, CPU_BLOCK_BYTES // max(1, batch * heads * k_len * 4) // 16 * 16))
    return rows


def remember(configs, original: str | None) -> None:
    """While a model is tapped: the implementation it was loaded with, under each of its configs (the mask
    function is told only the config); `original=None` forgets them."""
    for config in configs:
        if original is None:
            _originals.pop(id(config), None)
        else:
            _originals[id(config)] = original


def _mask_kind(implementation: str | None) -> str | None:
    """"sdpa", "eager" or "flash" by the mask function transformers registers for an implementation; None for
    any other (flex attention's block masks, a user's own)."""
    fn = ALL_MASK_ATTENTION_FUNCTIONS.get(implementation) if implementation else None
    return {sdpa_mask: "sdpa", eager_mask: "eager", flash_attention_mask: "flash"}.get(fn)


def diffquant_mask(*args, **kwargs):
    """The mask the tapped model's own implementation gets (so its untapped layers run their own kernel on
    it); for an implementation diffquant cannot read the mask of, SDPA's boolean mask, never skipped."""
    original = _originals.get(id(kwargs.get("config")))
    if _mask_kind(original) is not None:
        return ALL_MASK_ATTENTION_FUNCTIONS[original](*args, **kwargs)
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def kernel_for(implementation: str | None, attention_mask):
    """The attention function of a kernel implementation (SDPA, flash-attention) that can run on the mask this
    call got; None for eager and implementations diffquant cannot read the masks of (computed explicitly)."""
    kind = _mask_kind(implementation)
    if kind == "sdpa" or (kind == "flash" and (attention_mask is None or attention_mask.dim() == 2)):
        return ALL_ATTENTION_FUNCTIONS[implementation]
    return None


@dataclass(frozen=True)
class Visible:
    """Which keys each query may attend, from the mask as transformers passed it to the layer's attention:
    None (causal when the module is, bottom-right aligned, as SDPA's `is_causal` and flash-attention align),
    flash-attention's [batch, key] padding mask (with `window`: its sliding window), or a [batch|1, 1, q, k]
    boolean or additive float mask. `rows` builds one query block's part: nothing of size T × T that
    transformers did not build already."""

    mask: torch.Tensor | None
    q_len: int
    k_len: int
    causal: bool = True
    window: int | None = None

    @classmethod
    def of(cls, module, attention_mask, q_len: int, k_len: int, kwargs: dict) -> "Visible":
        if "cu_seq_lens_q" in kwargs:
            raise DiffquantError("tapped attention does not take packed sequences (cu_seq_lens); pass a padded batch")
        causal = kwargs.get("is_causal")
        return cls(attention_mask, q_len, k_len, getattr(module, "is_causal", True) if causal is None else causal,
                   kwargs.get("sliding_window"))

    def rows(self, device, rows: tuple[int, int] | None = None, end: int | None = None) -> torch.Tensor:
        """Boolean [batch|1, 1, rows, end] of query rows rows[0]:rows[1] (all of them by default) and keys
        0..end (all of them by default)."""
        r0, r1 = rows or (0, self.q_len)
        end = self.k_len if end is None else end
        mask = self.mask
        if mask is not None and mask.dim() == 4:
            mask = mask[:, :, r0:r1, :end]
            return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2  # additive (eager)
        own = torch.arange(r0, r1, device=device)[:, None] + (self.k_len - self.q_len)  # each query's own key
        keys = torch.arange(end, device=device)[None, :]
        valid = keys <= own if self.causal else torch.ones(r1 - r0, end, dtype=torch.bool, device=device)
        if self.window is not None:
            valid = valid & (own - keys < self.window)
        valid = valid[None, None]
        if mask is not None:  # flash-attention's padding mask, keys aligned to its right end
            valid = valid & mask[:, None, None, -self.k_len:][..., :end].to(device=device, dtype=torch.bool)
        return valid

    def dense(self, rows: tuple[int, int] | None = None) -> int:
        """How many keys from the first every query of rows rows[0]:rows[1] may attend (its mask is True there):
        those up to the first row's own key where the mask is plainly causal, every key where it is plainly not, and
        0 (not known) with any mask or window."""
        if self.mask is not None or self.window is not None:
            return 0
        if not self.causal:
            return self.k_len
        return min(self.k_len, (rows or (0, self.q_len))[0] + self.k_len - self.q_len + 1)

    def key_end(self, rows: tuple[int, int]) -> int:
        """Where the keys that query rows rows[0]:rows[1] may attend end: after the last row's own key (rounded up
        to KEY_ALIGN) where the mask is causal and diffquant builds it (no mask, or flash-attention's padding
        mask), else all keys."""
        if self.causal and (self.mask is None or self.mask.dim() == 2):
            return min(self.k_len, -(-(rows[1] + self.k_len - self.q_len) // KEY_ALIGN) * KEY_ALIGN)
        return self.k_len

    def keys(self, device) -> torch.Tensor | None:
        """[batch|1, 1, k, 1]: the key positions some query may attend (None when every one is), the
        validity of a [batch, kv_head, pos, dim] cache site (left padding never sets a scale)."""
        if self.mask is None:
            return None
        if self.mask.dim() == 2:
            valid = self.mask[:, -self.k_len:].to(device=device, dtype=torch.bool)[:, None]
        else:
            valid = self.rows(device).any(dim=-2)
        return None if bool(valid.all()) else valid.unsqueeze(-1)


def diff_lambda(module) -> torch.Tensor:
    """λ of a DiffLlama attention layer as transformers computes it (float32): exp(λq1·λk1) − exp(λq2·λk2) + λ_init."""
    l1 = torch.exp(torch.sum(module.lambda_q1 * module.lambda_k1, dim=-1, dtype=torch.float32))
    l2 = torch.exp(torch.sum(module.lambda_q2 * module.lambda_k2, dim=-1, dtype=torch.float32))
    return l1 - l2 + module.lambda_init


def cache_taps(module, q_len: int, key: torch.Tensor, value: torch.Tensor, attention_mask, kwargs=None):
    """Keys and values through the `k_cache` / `v_cache` taps, each KV head once (before grouped-query
    heads are repeated): the tensors a KV cache stores, after RoPE. Returns (key, value, the other taps).
    DiffLlama has these sites in its fused form only (see `SiteTable`)."""
    taps = getattr(module, "_diffquant_taps", None) or {}
    if not any(p in taps for p in CACHE_POINTS):
        return key, value, taps
    valid = Visible.of(module, attention_mask, q_len, key.shape[2], kwargs or {}).keys(key.device)
    key = run_taps(taps.get("k_cache"), key, valid)
    value = run_taps(taps.get("v_cache"), value, valid)
    return key, value, {p: e for p, e in taps.items() if p not in CACHE_POINTS}


def tapped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    key, value, taps = cache_taps(module, query.shape[2], key, value, attention_mask, kwargs)
    kernel = kernel_for(module.__dict__.get("_diffquant_fallback"), attention_mask)
    if kernel is not None and (not taps or first_key_only(module, taps, attention_mask)):
        out = kernel(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if taps:
            first_key_taps(taps, first_key_masses(kernel, module, query, key, scaling, kwargs), key.shape[2])
        return out
    if triton_attention.usable(module, taps, query, attention_mask, kwargs, dropout):  # logits taps in Triton
        visible = Visible.of(module, attention_mask, query.shape[2], key.shape[2], kwargs)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return triton_attention.attend(taps, query, key, value, visible, scaling), None
    return _attend(module, taps, query, key, value, attention_mask, scaling, dropout, kwargs)


def first_key_only(module, taps: dict, attention_mask) -> bool:
    """Whether a layer's attention taps read no more than each query's mass on the first key (observers with a
    `first_key` method, and λ), so its own kernel can run: where the mask is plainly causal (None), and not in
    DiffLlama's two-call form (whose second call would count them again)."""
    if attention_mask is not None or (getattr(module, "_diffquant_paired", False)
                                      and not getattr(module, "_diffquant_fused", False)):
        return False
    return set(taps) <= {"attn_probs", "attn_map", "lambda"} and all(
        hasattr(tap, "first_key") for point in ("attn_probs", "attn_map") for tap, _ in taps.get(point, ()))


def first_key_masses(kernel, module, query, key, scaling, kwargs) -> torch.Tensor:
    """[batch, head, q]: each query's attention on key 0 (its first key: the mask is plainly causal), from the
    layer's own kernel run once more with a value that is 1 in channel 0 of key 0 and 0 elsewhere."""
    onehot = key.new_zeros(key.shape)  # as wide as the keys: every kernel takes that value width
    onehot[:, :, 0, 0] = 1
    out, _ = kernel(module, query, key, onehot, None, dropout=0.0, scaling=scaling, **kwargs)  # [batch, q, head, d]
    return out[..., 0].transpose(1, 2).float()


def first_key_taps(taps: dict, masses: torch.Tensor, k_len: int, lam: torch.Tensor | None = None) -> None:
    """Feed the observers of a `first_key_only` layer: `masses` ([batch, head, q], from `first_key_masses`) to
    attn_probs, and with DIFF's λ, A1 − λ·A2 of them to attn_map, as `first_key(mass, counted rows, ctx)`. Query
    rows whose first key is themselves (query 0 of a fresh sequence) are not counted."""
    q_len = masses.shape[-1]
    rows = torch.arange(q_len, device=masses.device) + (k_len - q_len) > 0
    run_taps(taps.get("lambda"), None if lam is None else lam.float(), None)
    for tap, ctx in taps.get("attn_probs", ()):
        tap.first_key(masses, rows, ctx)
    if taps.get("attn_map"):
        half = masses.shape[1] // 2
        diff_map = masses[:, :half] - lam.float() * masses[:, half:]
        for tap, ctx in taps["attn_map"]:
            tap.first_key(diff_map, rows, ctx)


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
    visible = Visible.of(module, attention_mask, query.shape[2], key.shape[2], kwargs)
    two_call = getattr(module, "_diffquant_paired", False) and not getattr(module, "_diffquant_fused", False)
    # DiffLlama's two-call form reuses the first call's whole probabilities in the second: blocks only where needed
    block = query_block(query.shape[0], query.shape[1], key.shape[2], query.device,
                        cache=not two_call and not _ranged(taps))
    if query.shape[2] > block:
        if two_call:
            raise DiffquantError("a long context in DiffLlama's two-call form: give the model the fused forward "
                                 "(diffquant.models.fused.fuse), which diffquant's loaders and taps do")
        out = _blocked(module, taps, query, repeat_kv(key, n_rep), visible, scaling, kwargs,
                       lambda p, rows: torch.matmul(_widen(p.to(value.dtype), visible.k_len), value), block)
        return out.transpose(1, 2).contiguous(), None
    pending = module.__dict__.pop("_diffquant_pending", None)
    if pending is not None and pending[0] is query and pending[1] is key:
        probs = pending[2]  # DiffLlama's second call: same Q and K, reuse (observed, maybe quantized) probs
    else:
        probs = _probabilities(module, taps, query, repeat_kv(key, n_rep), visible, scaling, kwargs)
        if two_call:
            module._diffquant_pending = (query, key, probs)  # before repeat_kv, which makes a new tensor
            if "attn_map" in taps or "lambda" in taps:
                lam = diff_lambda(module)
                run_taps(taps.get("lambda"), lam, None)
                _differential_map(taps, probs, lam, visible, None)
    out = torch.matmul(probs.to(value.dtype), value)
    return out.transpose(1, 2).contiguous(), probs


def diff_attention(module, query, key, vpair, attention_mask, scaling, lam, taps: dict, kwargs=None):
    """DIFF in one call: the softmax maps of all H heads (taps on logits and probabilities see each once),
    A = P[:, :H/2] − λ·P[:, H/2:] per differential head (the `attn_map` site), and A·[V1 | V2].
    `taps`: the module's taps other than the cache sites (see `cache_taps`).
    Returns ([batch, pos, H/2, 2d], probabilities or None when computed in blocks or by the Triton path)."""
    run_taps(taps.get("lambda"), lam.float(), None)
    visible = Visible.of(module, attention_mask, query.shape[2], key.shape[2], kwargs or {})
    if triton_attention.usable(module, taps, query, attention_mask, kwargs or {}):  # logits taps in Triton
        return triton_attention.attend(taps, query, key, vpair, visible, scaling, lam), None
    key = repeat_kv(key, query.shape[1] // key.shape[1])

    def combine(probs, rows):
        a = _differential_map(taps, probs, lam, visible, rows)
        return torch.matmul(_widen(a.to(vpair.dtype), visible.k_len), vpair)

    block = query_block(query.shape[0], query.shape[1], visible.k_len, query.device, cache=not _ranged(taps))
    if visible.q_len > block:
        return _blocked(module, taps, query, key, visible, scaling, {}, combine, block).transpose(1, 2), None
    probs = _probabilities(module, taps, query, key, visible, scaling, {})
    return combine(probs, None).transpose(1, 2), probs


def _differential_map(taps, probs, lam, visible: Visible, rows):
    half = probs.shape[1] // 2
    a = probs[:, :half] - lam.to(probs.dtype) * probs[:, half:]
    if "attn_map" in taps:
        run_taps(taps["attn_map"], a, visible.rows(probs.device, rows, probs.shape[-1]), _block_of(rows, visible))
    return a


def _block_of(rows, visible: Visible) -> Block | None:
    """The block a tap is told of; None for a whole call."""
    return None if rows is None else Block(rows[0], rows[1], visible.q_len, visible.k_len, visible.dense(rows))


def _widen(probs: torch.Tensor, k_len: int) -> torch.Tensor:
    """A block's probabilities over every key: those past where the block's keys end (`Visible.key_end`) as zeros."""
    return probs if probs.shape[-1] == k_len else torch.nn.functional.pad(probs, (0, k_len - probs.shape[-1]))


MAP_POINTS = ("attn_logits", "attn_probs", "attn_map")  # the sites that see a block's [.., rows, keys] maps


def _ranged(taps) -> list:
    """The logit taps whose quantization scale spans query blocks: blocked, they need the logits computed twice
    (their range first), so such calls take blocks as large as memory allows, not cache-sized ones (a per-tensor
    logit sweep on the tiny preset would otherwise compute every logit twice)."""
    return [(tap, ctx) for tap, ctx in taps.get("attn_logits", ()) if getattr(tap, "needs_range", None)
            and tap.needs_range(ctx)]


def _blocked(module, taps, query, key, visible: Visible, scaling, kwargs, consume, block):
    """Attention in query blocks of `block` rows: `consume(probs_block, rows)` turns each block's probabilities
    into its output rows; nothing of size T × T is kept. Each block's keys end where `Visible.key_end` says when
    every tap on the maps takes such blocks (`cut_keys`)."""
    q_len = query.shape[2]
    blocks = [(i, min(i + block, q_len)) for i in range(0, q_len, block)]
    cut = all(getattr(tap, "cut_keys", False) for point in MAP_POINTS for tap, _ in taps.get(point, ()))
    ends = [visible.key_end(rows) if cut else visible.k_len for rows in blocks]
    ranged = _ranged(taps)
    for tap, ctx in ranged:  # pass 1: the full range of quantizers whose scale spans query blocks
        tap.start_range()
        for rows, end in zip(blocks, ends):
            logits = _logits(query[:, :, rows[0]:rows[1]], key[:, :, :end], scaling, kwargs.get("softcap"))
            tap.observe_range(logits, ctx.with_valid(visible.rows(query.device, rows, end)))
    try:
        outs = [consume(_probabilities(module, taps, query, key[:, :, :end], visible, scaling, kwargs, rows), rows)
                for rows, end in zip(blocks, ends)]
    finally:
        for tap, _ in ranged:
            tap.end_range()
    return torch.cat(outs, dim=2)


def _logits(query, key, scaling, softcap):
    logits = torch.matmul(query, key.transpose(2, 3)).mul_(scaling)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _probabilities(module, taps, query, key, visible: Visible, scaling, kwargs, rows=None):
    """Softmax probabilities of all queries (or of query rows `rows` of a blocked call, over the keys `key` holds),
    through the taps."""
    sinks, clip = kwargs.get("s_aux"), kwargs.get("clip_softmax")
    if rows is not None:
        query = query[:, :, rows[0]:rows[1]]
    block = _block_of(rows, visible)
    logits = _logits(query, key, scaling, kwargs.get("softcap"))
    valid = visible.rows(query.device, rows, key.shape[2])
    tapped = run_taps(taps.get("attn_logits"), logits, valid, block)
    scores = masked_scores(tapped, logits, valid, visible.dense(rows))
    if sinks is not None:  # a learned per-head logit in the denominator only (gpt-oss): softmax, then drop it
        sink = sinks.float().reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    if clip is not None:  # Bondarenko et al.'s clipped softmax: exact zeros (and ones) become reachable
        zeta, gamma = clip
        probs = ((zeta - gamma) * probs + gamma).clamp_(0.0, 1.0).masked_fill_(~valid, 0.0)
    if visible.mask is not None:  # fully masked rows (padding): zeros, not NaN (only a mask can empty a row)
        probs = probs.masked_fill(~valid.any(-1, keepdim=True), 0.0)
    probs = probs.to(query.dtype)
    return run_taps(taps.get("attn_probs"), probs, valid, block)


def masked_scores(tapped: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor, dense: int = 0) -> torch.Tensor:
    """fp32 logits with -inf where a query may not attend (what masked_fill gives, also where a masked logit is
    inf or NaN), in place when the tensor is ours (taps see it during their call only) and autograd allows it: then
    only the columns from `dense` on (`Visible.dense`: every earlier one is visible) are written. Reads nothing back
    to the host."""
    scores = tapped.float()
    ours = (tapped is logits or scores is not tapped) and not scores.requires_grad
    if not ours:
        return torch.where(valid, scores, float("-inf"))
    if dense:
        scores[..., dense:].masked_fill_(~valid[..., dense:], float("-inf"))
        return scores
    return torch.where(valid, scores, scores.new_full((), float("-inf")), out=scores)


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
