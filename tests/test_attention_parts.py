"""taps/attention.py's small parts, each against what is written here: when a layer may keep its own kernel
(`first_key_only`), the first-key masses that kernel gives, what the first-key observers are told, the differential
map a block's taps see, a block widened to every key and the masked scores (issue 50's mutants of the module)."""

import math

import pytest
import torch

from diffquant.taps.attention import (Visible, _differential_map, _widen, first_key_masses, first_key_only,
                                      first_key_taps, masked_scores)
from diffquant.taps.context import Block, TapContext
from diffquant.taps.sites import Site


def ctx(name="layers.0.attn_probs"):
    return TapContext(Site(name, 0, None))


class FirstKey:
    """An observer that reads only each query's mass on the first key; records what it is given."""

    def __init__(self):
        self.calls, self.seen = [], []

    def first_key(self, mass, rows, context):
        self.calls.append((mass.clone(), rows.clone(), context))

    def __call__(self, x, context):
        self.seen.append((x.clone(), context))


class Whole:
    """An observer that reads whole maps (no `first_key`)."""

    def __call__(self, x, context):
        return None


def module(paired=None, fused=None):
    m = torch.nn.Module()
    if paired is not None:
        m._diffquant_paired = paired
    if fused is not None:
        m._diffquant_fused = fused
    return m


def test_first_key_only_dispatch():
    """The layer's own kernel runs only for first-key observers (and λ) on a plainly causal call (mask None), and not
    in DiffLlama's two-call form unless fused."""
    fk = [(FirstKey(), ctx())]
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool)
    assert first_key_only(module(), {"attn_probs": fk}, None)
    assert first_key_only(module(), {"attn_map": fk, "lambda": [(FirstKey(), ctx())]}, None)
    assert not first_key_only(module(), {"attn_probs": fk}, mask)
    assert not first_key_only(module(paired=True), {"attn_probs": fk}, None)
    assert first_key_only(module(paired=True, fused=True), {"attn_probs": fk}, None)
    assert first_key_only(module(paired=False), {"attn_probs": fk}, None)
    assert not first_key_only(module(), {"attn_probs": fk, "attn_map": [(Whole(), ctx())]}, None)
    assert not first_key_only(module(), {"attn_map": [(Whole(), ctx())]}, None)
    assert not first_key_only(module(), {"attn_probs": fk, "attn_logits": [(Whole(), ctx())]}, None)


def causal_first_key(query, key, scaling):
    """[batch, head, q]: softmax(q·kᵀ·scaling) under a bottom-right causal mask, column 0, by loops."""
    b, h, q_len, _ = query.shape
    k_len = key.shape[2]
    out = torch.zeros(b, h, q_len, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(q_len):
                own = i + k_len - q_len
                s = [float(query[bi, hi, i] @ key[bi, hi, j]) * scaling for j in range(own + 1)]
                top = max(s)
                out[bi, hi, i] = math.exp(s[0] - top) / sum(math.exp(v - top) for v in s)
    return out


@pytest.mark.parametrize("q_len, k_len", [(4, 4), (1, 6)])
def test_first_key_masses_with_sdpa(q_len, k_len):
    """transformers passes no mask (so the layer's own kernel may run) where queries and keys are equal in number, or
    one query decodes after past keys (SDPA's is_causal aligns top-left, so past keys with several queries get a
    mask)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(3)
    query, key = torch.randn(2, 3, q_len, 8, generator=g), torch.randn(2, 3, k_len, 8, generator=g)
    layer = module()
    layer.is_causal = True
    got = first_key_masses(sdpa_attention_forward, layer, query, key, 0.37, {})
    torch.testing.assert_close(got.double(), causal_first_key(query, key, 0.37), atol=1e-6, rtol=1e-5)


def test_first_key_masses_passes_the_layers_arguments():
    """The kernel is called as the layer calls it: its module, the scaling, dropout 0 and the call's other keyword
    arguments, on a value that is 1 in channel 0 of key 0."""
    calls = []

    def kernel(mod, query, key, value, mask, *, dropout, scaling, **kwargs):
        calls.append((mod, mask, dropout, scaling, kwargs, value.clone()))
        scores = query @ key.transpose(2, 3) * scaling
        q_len, k_len = query.shape[2], key.shape[2]
        allowed = torch.arange(k_len)[None] <= torch.arange(q_len)[:, None] + (k_len - q_len)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        return (probs @ value).transpose(1, 2), None

    g = torch.Generator().manual_seed(4)
    query, key = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 5, 4, generator=g)
    layer = module()
    got = first_key_masses(kernel, layer, query, key, 0.61, {"sliding_window": None, "tag": 7})
    (mod, mask, dropout, scaling, kwargs, value), = calls
    assert mod is layer and mask is None and dropout == 0.0 and scaling == 0.61
    assert kwargs == {"sliding_window": None, "tag": 7}
    onehot = torch.zeros(1, 2, 5, 4)
    onehot[:, :, 0, 0] = 1
    assert torch.equal(value, onehot)
    assert got.shape == (1, 2, 3) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), causal_first_key(query, key, 0.61), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("q_len, k_len", [(4, 4), (3, 5)])
def test_first_key_taps_tell_each_observer_its_rows(q_len, k_len):
    """attn_probs observers get the masses, attn_map observers A1 − λ·A2 of them, λ its taps; a query whose first
    key is itself (query 0 of a fresh sequence) is not counted, and with past keys every query is."""
    g = torch.Generator().manual_seed(5)
    masses = torch.rand(2, 4, q_len, generator=g)
    lam = torch.tensor(0.3)
    probs, amap, lam_tap = FirstKey(), FirstKey(), FirstKey()
    cp, cm, cl = ctx(), ctx("layers.0.attn_map"), ctx("layers.0.lambda")
    first_key_taps({"attn_probs": [(probs, cp)], "attn_map": [(amap, cm)], "lambda": [(lam_tap, cl)]}, masses,
                   k_len, lam)
    rows = torch.tensor([i + k_len - q_len > 0 for i in range(q_len)])
    (m, r, c), = probs.calls
    assert torch.equal(m, masses) and torch.equal(r, rows) and c is cp
    (m, r, c), = amap.calls
    want = torch.stack([masses[:, h] - 0.3 * masses[:, h + 2] for h in range(2)], dim=1)
    torch.testing.assert_close(m, want)
    assert torch.equal(r, rows) and c is cm
    (x, c), = lam_tap.seen
    assert float(x) == pytest.approx(0.3) and c is cl


def test_first_key_taps_with_the_map_alone():
    amap = FirstKey()
    cm = ctx("layers.0.attn_map")
    masses = torch.rand(1, 2, 3, generator=torch.Generator().manual_seed(6))
    first_key_taps({"attn_map": [(amap, cm)]}, masses, 3, torch.tensor(0.8))
    (m, r, c), = amap.calls
    torch.testing.assert_close(m, masses[:, :1] - 0.8 * masses[:, 1:])
    assert r.tolist() == [False, True, True] and c is cm


def test_widen():
    """A block's probabilities over every key: the missing keys as zeros; no copy when the block has them all (the
    test's shapes put the key count at another axis too)."""
    for shape in [(1, 4, 2, 3), (1, 2, 4, 3), (4, 1, 1, 3)]:
        p = torch.rand(shape)
        wide = _widen(p, 4)
        assert wide.shape == shape[:-1] + (4,)
        assert torch.equal(wide[..., :3], p) and not wide[..., 3].any()
    p = torch.rand(1, 3, 2, 3)
    assert _widen(p, 3) is p


class Recorder:
    def __init__(self):
        self.seen = []

    def __call__(self, x, context):
        self.seen.append((x.clone(), context.valid, context.block))


def test_differential_map_tells_the_block():
    """The map of query rows 2..4 of 4 over 5 keys (one past key): A1 − λ·A2 in the probabilities' dtype, each row's
    visible keys, and where the block sits."""
    g = torch.Generator().manual_seed(7)
    probs = torch.rand(1, 4, 2, 5, generator=g).to(torch.bfloat16)
    lam = torch.tensor(0.3)
    tap = Recorder()
    visible = Visible(None, 4, 5)
    a = _differential_map({"attn_map": [(tap, ctx("layers.0.attn_map"))]}, probs, lam, visible, (2, 4))
    assert a.dtype == torch.bfloat16
    want = probs[:, :2].float() - 0.3 * probs[:, 2:].float()
    torch.testing.assert_close(a.float(), want, atol=1e-2, rtol=0)
    (x, valid, block), = tap.seen
    assert torch.equal(x, a)
    assert valid.tolist() == [[[[j <= i + 1 for j in range(5)] for i in (2, 3)]]]
    assert block == Block(2, 4, 4, 5, 4)
    tap.seen.clear()
    _differential_map({"attn_map": [(tap, ctx("layers.0.attn_map"))]}, probs, lam, Visible(None, 2, 5), None)
    (_, valid, block), = tap.seen
    assert block is None and valid.shape == (1, 1, 2, 5) and valid[0, 0, 0].tolist() == [True] * 4 + [False]


def test_masked_scores_default_masks_from_the_first_key():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(1, 1, 3, 4, generator=g)
    valid = torch.tensor([[True, True, False, False], [False, True, True, False], [True, True, True, True]])[None, None]
    want = torch.where(valid, logits, float("-inf"))
    assert torch.equal(masked_scores(logits.clone(), logits.clone(), valid), want)
    ours = logits.clone()
    assert torch.equal(masked_scores(ours, ours, valid), want)


def test_keys_of_an_integer_padding_mask_are_boolean():
    v = Visible(torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]), 2, 3)  # keys right-aligned: the last three positions
    keys = v.keys("cpu")
    assert keys.dtype == torch.bool and keys.shape == (2, 1, 3, 1)
    assert keys[:, 0, :, 0].tolist() == [[False, True, True], [True, True, True]]
