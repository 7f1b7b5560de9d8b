"""taps/attention.py's Visible (which keys each query may attend) against a loop written here, over every kind of
mask transformers passes (none, flash-attention's [batch, key] padding, 4-D boolean and additive), with past keys,
a sliding window, non-causal attention, a block of rows and a cut of keys (issue 50's mutants of the module)."""

import pytest
import torch

from diffquant.taps.attention import KEY_ALIGN, Visible


def by_loop(q_len, k_len, causal=True, window=None, pad=None, rows=None, end=None):
    """[batch, 1, rows, end]: query i's own key is i + k_len − q_len (bottom-right aligned); key j is visible when
    j ≤ own (causal), own − j < window, and the padding mask (right-aligned to the keys) keeps j."""
    r0, r1 = rows or (0, q_len)
    end = k_len if end is None else end
    batch = 1 if pad is None else pad.shape[0]
    out = torch.zeros(batch, 1, r1 - r0, end, dtype=torch.bool)
    for b in range(batch):
        for i in range(r0, r1):
            own = i + k_len - q_len
            for j in range(end):
                ok = (not causal or j <= own) and (window is None or own - j < window)
                if pad is not None:
                    ok = ok and bool(pad[b, pad.shape[1] - k_len + j])
                out[b, 0, i - r0, j] = ok
    return out


PAD = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 1, 1, 1]])  # 9 positions, right-aligned to keys


@pytest.mark.parametrize("causal, window, pad, rows, end", [
    (True, None, None, None, None), (True, None, None, (1, 3), 5), (False, None, None, (1, 4), 6),
    (True, 3, None, None, None), (True, 2, None, (2, 4), None), (True, None, PAD, None, None),
    (True, 3, PAD, (1, 3), 6), (False, None, PAD, (2, 4), None)])
def test_rows_against_a_loop(causal, window, pad, rows, end):
    """4 queries over 7 keys (3 past keys)."""
    v = Visible(pad, 4, 7, causal, window)
    got = v.rows("cpu", rows, end)
    want = by_loop(4, 7, causal, window, pad, rows, end)
    assert got.dtype == torch.bool and got.shape == want.shape  # [batch|1, 1, rows, end], as documented
    assert torch.equal(got, want)


def test_rows_of_four_dimensional_masks():
    """A [batch, 1, q, k] mask is cut to the rows and keys asked for; an additive float mask (0 kept, the dtype's
    minimum masked) reads as boolean."""
    keep = by_loop(4, 7, True, None, PAD)
    additive = torch.where(keep, 0.0, torch.finfo(torch.float32).min)
    for mask in (keep, additive):
        got = Visible(mask, 4, 7).rows("cpu", (1, 3), 5)
        assert got.dtype == torch.bool and torch.equal(got, keep[:, :, 1:3, :5])


def test_keys_some_query_may_attend():
    """[batch, 1, k, 1] of the keys any query attends, None where every key is; a padding mask longer than the keys
    is read from its right end; a 4-D mask through its rows."""
    assert Visible(None, 4, 7).keys("cpu") is None
    assert Visible(torch.ones(2, 9, dtype=torch.long), 4, 7).keys("cpu") is None
    got = Visible(PAD, 4, 7).keys("cpu")
    assert got.shape == (2, 1, 7, 1)
    assert torch.equal(got[:, 0, :, 0], PAD[:, 2:].bool())
    windowed = Visible(PAD, 4, 7, window=2).keys("cpu")  # a cache stores every key its padding keeps, windows or not
    assert torch.equal(windowed, got)
    four = by_loop(4, 7, True, 2, PAD)  # a window of 2 over 3 past keys: keys 0–1 seen by no query
    got = Visible(four, 4, 7).keys("cpu")
    assert got.shape == (2, 1, 7, 1)
    assert torch.equal(got[:, 0, :, 0], four.any(dim=-2)[:, 0])
    assert not bool(got[0, 0, 0, 0]) and bool(got[0, 0, 6, 0])


def test_key_end_rounds_up_where_the_mask_is_built_here():
    """Causal with no mask or a padding mask: after the last row's own key, rounded up to KEY_ALIGN; a 4-D mask or
    non-causal attention: every key."""
    k_len = 3 * KEY_ALIGN
    assert Visible(None, k_len, k_len).key_end((0, 10)) == KEY_ALIGN
    assert Visible(torch.ones(1, k_len), k_len, k_len).key_end((0, KEY_ALIGN + 1)) == 2 * KEY_ALIGN
    assert Visible(None, k_len, k_len).key_end((0, k_len)) == k_len
    assert Visible(None, k_len, k_len, causal=False).key_end((0, 10)) == k_len
    assert Visible(torch.ones(1, 1, k_len, k_len, dtype=torch.bool), k_len, k_len).key_end((0, 10)) == k_len
