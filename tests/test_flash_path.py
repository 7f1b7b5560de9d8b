"""Models loaded with flash-attention: DIFF's fused forward on the kernel, the taps on its [batch, key] padding mask,
sinks without the explicit path. flash_attn cannot be installed on a CPU machine, so its two entry points
(`flash_attn_func`, `flash_attn_varlen_func`) are given here as plain per-sequence attention in torch, and
everything above them runs for real: transformers' `flash_attention_forward` under the implementation string
"flash_attention_2", its unpadding of padded batches, its mask function, and diffquant."""

import copy

import pytest
import torch
from transformers import modeling_flash_attention_utils as fa_utils

from diffquant.profiler import profile_model
from diffquant.taps import attention as A
from diffquant.taps import tapped

CALLS = []  # one entry per call of a flash entry point: "dense" or "varlen"


def _one_sequence(q, k, v, causal, scale, window):
    """FlashAttention on one sequence: q [T, H, d], k and v [S, KVH, d]; causal aligned bottom-right, a window of
    (left, right) keys, grouped-query heads as flash-attention maps them (head h reads KV head h // (H / KVH))."""
    rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(rep, dim=1).float() for x in (k, v))
    scores = torch.einsum("thd,shd->hts", q.float(), k) * (scale if scale is not None else q.shape[-1] ** -0.5)
    own = torch.arange(q.shape[0])[:, None] + (k.shape[0] - q.shape[0])
    keys = torch.arange(k.shape[0])[None, :]
    ok = keys <= own if causal else torch.ones_like(keys <= own)
    if window[0] >= 0:
        ok = ok & (own - keys <= window[0])
    probs = torch.softmax(scores.masked_fill(~ok, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hts,shd->thd", probs, v).to(q.dtype)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    deterministic=False):
    CALLS.append("dense")
    return torch.stack([_one_sequence(q[b], k[b], v[b], causal, softmax_scale, window_size) for b in range(len(q))])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    CALLS.append("varlen")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return torch.cat([_one_sequence(q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], causal,
                                    softmax_scale, window_size) for i in range(len(cq) - 1)])


@pytest.fixture
def flash(monkeypatch):
    """Runs a model under "flash_attention_2" (its config's implementation string, set as loading with
    attn_implementation="flash_attention_2" sets it) with the entry points above."""
    monkeypatch.setattr(fa_utils, "_lazy_imports", lambda *a, **k: (flash_attn_func, flash_attn_varlen_func, None,
                                                                     fa_utils._pad_input, fa_utils._unpad_input))
    monkeypatch.setattr(fa_utils, "_loaded_implementation", None)
    originals = []

    def use(model, impl="flash_attention_2"):
        originals.append((model, model.config._attn_implementation))
        model.config._attn_implementation = impl
        return model

    CALLS.clear()
    yield use
    for model, impl in originals:
        model.config._attn_implementation = impl


def _padded(n=3, t=20, seed=0):
    ids = torch.randint(0, 512, (n, t), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(n, t, dtype=torch.long)
    mask[1, :7] = 0  # left padding
    mask[2, 15:] = 0  # right padding
    return ids, mask


def _logits(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


def _explicit_layers(monkeypatch) -> list:
    """The layer of every explicit (T × T) attention computation from now on."""
    seen = []
    real = A._probabilities
    monkeypatch.setattr(A, "_probabilities", lambda module, *a, **k: seen.append(module.layer_idx) or real(module, *a, **k))
    return seen


def test_the_reference_kernels_are_flash_attention(flash, micro_pair):
    """The stand-in entry points, through transformers' flash path, give SDPA's outputs (valid positions)."""
    model = micro_pair[0]
    ids, mask = _padded()
    for m in (None, mask):
        ref = _logits(model, ids, m)
        out = _logits(flash(model), ids, m)
        valid = torch.ones_like(ids, dtype=torch.bool) if m is None else m.bool()
        assert (out - ref)[valid].abs().max() <= 1e-5
        model.config._attn_implementation = "sdpa"
    assert CALLS == ["dense"] * 2 + ["varlen"] * 2  # one call per layer; padding goes through the varlen path


def test_fused_diff_on_flash_equals_transformers_two_call_diffllama(flash, micro_pair, monkeypatch):
    """diffquant's fused DiffLlama under "flash_attention_2" equals transformers' own two-call DiffLlama under the
    same implementation, padded (a [batch, key] mask) and not, and SDPA's fused forward; it runs the kernel
    twice per layer (the two halves of V), never the explicit computation."""
    fused = micro_pair[1]
    two_call = copy.deepcopy(fused)
    for layer in two_call.model.layers:
        attn = layer.self_attn
        del attn.forward, attn._diffquant_fused  # back to transformers' forward
    explicit = _explicit_layers(monkeypatch)
    ids, mask = _padded()
    for m in (None, mask):
        valid = torch.ones_like(ids, dtype=torch.bool) if m is None else m.bool()
        sdpa = _logits(fused, ids, m)
        CALLS.clear()
        ref = _logits(flash(two_call), ids, m)
        assert len(CALLS) == 2 * fused.config.num_hidden_layers
        CALLS.clear()
        out = _logits(flash(fused), ids, m)
        assert CALLS == [("dense" if m is None else "varlen")] * 2 * fused.config.num_hidden_layers
        assert (out - ref)[valid].abs().max() <= 1e-5 and (out - sdpa)[valid].abs().max() <= 1e-5
        fused.config._attn_implementation = two_call.config._attn_implementation = "sdpa"
    assert explicit == []


@pytest.mark.parametrize("which", [0, 1])
def test_taps_on_a_flash_model_with_padding(flash, micro_pair, monkeypatch, which):
    """A tap on layer 0's logits of a padded batch under flash-attention: the tapped layer reads the [batch, key]
    mask (it crashed indexing it as [batch, 1, q, k]), counts the (query, key) pairs SDPA's mask allows (each
    query, padded ones too, with the valid keys up to itself), and the untapped layer stays on the kernel; the
    output is the untapped model's."""
    model = micro_pair[which]
    ids, mask = _padded()
    ref = _logits(flash(model), ids, mask)
    explicit = _explicit_layers(monkeypatch)
    seen = []
    with tapped(model, {"layers.0.attn_logits": lambda x, ctx: seen.append(int(ctx.valid.expand(x.shape).sum()))}):
        CALLS.clear()
        out = _logits(model, ids, mask)
    assert explicit == [0]
    assert CALLS == ["varlen"] * (2 if which else 1) * (model.config.num_hidden_layers - 1)
    valid = mask.bool()
    assert (out - ref)[valid].abs().max() <= 1e-5
    pairs = int(valid.long().cumsum(1).sum())  # query q of row b: the valid keys at or before q
    sdpa = []
    model.config._attn_implementation = "sdpa"
    with tapped(model, {"layers.0.attn_logits": lambda x, ctx: sdpa.append(int(ctx.valid.expand(x.shape).sum()))}):
        _logits(model, ids, mask)
    assert seen == sdpa == [pairs * model.config.num_attention_heads]


@pytest.mark.parametrize("which", [0, 1])
def test_sinks_on_a_flash_model_stay_on_the_kernel(flash, micro_pair, monkeypatch, which):
    """The default profile's sink metrics with hidden-state sites only: no layer computes its T × T map (the
    first-key mass comes from one more kernel call per layer), and the sinks equal the explicit computation's."""
    model = micro_pair[which]
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = profile_model(model, ids, ["*.attn_logits"], sinks=True, progress=False).sink_summary()
    explicit = _explicit_layers(monkeypatch)
    got = profile_model(flash(model), ids, ["*.hidden"], sinks=True, progress=False).sink_summary()
    assert explicit == []
    assert CALLS == ["dense"] * (3 if which else 2) * model.config.num_hidden_layers
    for layer, want in ref["layers"].items():
        for key in ("first_mass", "share", "first_mass_map"):
            if key in want:
                assert got["layers"][layer][key] == pytest.approx(want[key], rel=1e-5, abs=1e-7)
    assert got["model"]["sink_rate"] == ref["model"]["sink_rate"]
