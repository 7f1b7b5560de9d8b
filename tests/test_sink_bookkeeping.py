"""The sink statistics' bookkeeping against plain Python: model-wide rates from per-layer dicts written by hand,
the strict thresholds, query blocks of a call with more keys than queries, sequences whose ratio is undefined,
the running maximum over calls and shards (a tie keeps the first), and profiles pickled before the sums stayed on
the device. Each test names the mutation of stats/sinks.py it was written to catch (issue 50)."""

import pickle

import numpy as np
import pytest
import torch

from diffquant.stats import sinks as sinks_module
from diffquant.stats.sinks import LayerSinks, differential_share, model_sink_rates, norm_ratio
from diffquant.taps.context import Block


def test_model_sink_rates_of_softmax_layers_counted_by_hand():
    """Layers given out of order; layer 1 recorded no attention (no sink count, no shares) and layer 0 no massive
    ratio: the rates count only what each layer holds."""
    layers = {
        2: {"sink": {"heads": 4, "sinks": 3}, "share": [0.9, 0.8, 0.7, 0.1], "massive_ratio": 12.5, "value_ratio": 3.0},
        0: {"sink": {"heads": 4, "sinks": 0}, "share": [0.1, 0.2, 0.0, 0.05], "massive_ratio": None, "value_ratio": 0.75},
        1: {"massive_ratio": 40.0},
    }
    rates = model_sink_rates(layers)
    assert rates == pytest.approx({
        "sink_rate": 3 / 8, "sink_unit": "attention head", "sink_heads": 8,
        "first_share_mean": (0.9 + 0.8 + 0.7 + 0.1 + 0.1 + 0.2 + 0.0 + 0.05) / 8,
        "massive_ratio_max": 40.0, "value_ratio_min": 0.75})
    assert model_sink_rates({0: {}}) == {"massive_ratio_max": None, "value_ratio_min": None}


def test_model_sink_rates_of_differential_layers_counted_by_hand():
    """Layer 0's shares are undefined (λ near 1), layer 2 holds a count without an `undefined` field and without
    the A1/A2 maps' own counts: sink rate 3 of 5 defined heads, A1 3 of 4 maps, A2 1 of 4, λ in layer order."""
    layers = {
        1: {"lambda": 0.5, "sink": {"heads": 2, "sinks": 1, "undefined": 0}, "share": [0.9, -0.4],
            "sink_A1": {"heads": 2, "sinks": 2}, "sink_A2": {"heads": 2, "sinks": 0},
            "massive_ratio": 7.0, "value_ratio": 2.0},
        0: {"lambda": 0.97, "sink": {"heads": 2, "sinks": 0, "undefined": 2}, "share": [None, None],
            "sink_A1": {"heads": 2, "sinks": 1}, "sink_A2": {"heads": 2, "sinks": 1},
            "massive_ratio": 9.0, "value_ratio": 1.5},
        2: {"lambda": -0.2, "sink": {"heads": 3, "sinks": 2}, "share": [0.5, 0.4, 0.1]},
    }
    rates = model_sink_rates(layers)
    assert rates.pop("lambda") == [0.97, 0.5, -0.2]
    assert rates == pytest.approx({
        "sink_rate": 3 / 5, "sink_unit": "differential head (share of A1 − λ·A2 on token 0)", "sink_heads": 5,
        "first_share_mean": (0.9 - 0.4 + 0.5 + 0.4 + 0.1) / 5, "sink_heads_undefined": 2,
        "sink_rate_A1": 3 / 4, "sink_rate_A2": 1 / 4, "massive_ratio_max": 9.0, "value_ratio_min": 1.5})
    only_map = model_sink_rates({0: layers[2]})  # no layer recorded its A1/A2 maps' counts
    assert only_map["sink_rate_A1"] is None and only_map["sink_rate_A2"] is None


def test_the_share_is_undefined_at_the_guard_itself(monkeypatch):
    """1 − λ ≤ the guard, equality included (a guard exact in binary, so 1 − λ can equal it); the reasons read in
    full, since they are written into the profile."""
    assert differential_share([0.2], None) == (None, "λ was not observed")
    monkeypatch.setattr(sinks_module, "LAMBDA_GUARD", 0.0625)
    assert differential_share([0.25], 0.9375)[0] is None
    assert differential_share([0.25], 0.875) == ([2.0], None)
    monkeypatch.undo()
    assert differential_share([0.2], 0.97)[1] == (
        "1 − λ = 0.03 ≤ 0.05: the differential map's rows sum to about 0 or less, so a share of them is undefined "
        "(with λ > 1 a negative mass over a negative sum would read as a large share)")


def _first_key_reference(probs: np.ndarray, valid: np.ndarray, keys: int, queries: int):
    """Per head, the sum over counted queries of the mass on the query's first valid key; the count. Query q's own
    key is q + keys − queries; a query whose first valid key is its own, or with none, is not counted."""
    total, n = np.zeros(probs.shape[1]), 0
    for b in range(probs.shape[0]):
        for q in range(queries):
            visible = np.flatnonzero(valid[b, q])
            if len(visible) == 0 or visible[0] == q + keys - queries:
                continue
            total += probs[b, :, q, visible[0]]
            n += 1
    return total, n


@pytest.mark.parametrize("masked", [True, False])
def test_first_key_mass_over_query_blocks_of_a_call_with_past_keys(masked):
    """A call of 7 queries over 10 keys (3 earlier keys, as with a cache), cut into blocks of rows whose keys end at
    the block's last visible one, fed to `add_mass` with their `Block`: the sums equal the whole call's, computed
    row by row in numpy. The mask is per head (broadcastable to the probabilities), with left padding; unmasked,
    every row counts, the first too (its own key is key 3, not key 0)."""
    g = torch.Generator().manual_seed(11)
    b, h, q, k = 2, 4, 7, 10
    probs = torch.softmax(torch.randn(b, h, q, k, generator=g), -1)
    causal = torch.arange(k)[None, :] <= torch.arange(q)[:, None] + (k - q)
    valid = causal[None, None].expand(b, h, q, k).clone()
    valid[1, :, :, :5] = False  # row 1: five padded keys, so its queries 0 and 1 see nothing, query 2 only itself
    one = LayerSinks()
    for start, end in ((0, 3), (3, 5), (5, 7)):
        cut = end + (k - q)  # the block's last visible key + 1
        block = Block(start, end, q, k, dense=start + (k - q) + 1)
        one.add_mass("probs", probs[:, :, start:end, :cut], valid[:, :, start:end, :cut] if masked else None, block)
    ref_valid = valid[:, 0].numpy() if masked else np.ones((b, q, k), dtype=bool)
    ref, n = _first_key_reference(probs.numpy(), ref_valid, k, q)
    assert n == (b * q if not masked else q + (q - 3))
    assert float(one.queries["probs"]) == n and one.queries["probs"].dtype == torch.float64
    np.testing.assert_allclose(one.mass["probs"].numpy(), ref, rtol=1e-6)


def test_an_unmasked_call_without_past_keys_leaves_out_its_first_query():
    probs = torch.softmax(torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(2)), -1)
    one = LayerSinks()
    one.add_mass("probs", probs[:, :, :2], None, Block(0, 2, 5, 5))
    one.add_mass("probs", probs[:, :, 2:], None, Block(2, 5, 5, 5))
    assert float(one.queries["probs"]) == 2 * 4
    np.testing.assert_allclose(one.mass["probs"].numpy(), probs[:, :, 1:, 0].sum(dim=(0, 2)).numpy(), rtol=1e-6)


def test_norm_ratio_of_small_norms_beside_padding():
    """Norms far below 1 (a median of ~1e-3) beside padded positions: the maximum is found among valid tokens
    only and the ratio divides by the true median; a sequence with exactly two valid tokens has a ratio, one
    with a single valid token none, whatever the other sequences hold."""
    x = 1e-3 * torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(5))
    valid = torch.ones(3, 6, dtype=torch.bool)
    valid[0, :2] = False
    valid[1, :4] = False  # two valid tokens
    valid[2, :5] = False  # one
    r, pos = norm_ratio(x, valid, first_only=False)
    n = np.linalg.norm(x.numpy(), axis=-1)
    for row in (0, 1):
        ok = np.flatnonzero(valid[row].numpy())
        assert int(pos[row]) == ok[n[row, ok].argmax()]
        assert float(r[row]) == pytest.approx(n[row, ok].max() / np.median(n[row, ok]), rel=1e-5)
    assert bool(r[2].isnan())
    zero = torch.zeros(1, 6, 4)  # all valid tokens zero: the maximum is the first valid position, not padding
    _, at = norm_ratio(zero, valid[:1], first_only=False)
    assert int(at[0]) == 2


def _equal_norms(t: int, c: int) -> torch.Tensor:
    """t tokens of the same vector: every norm equal, so max / median is exactly 1."""
    return torch.arange(1.0, c + 1.0).expand(t, c).clone()


def test_a_ratio_of_exactly_one_is_the_largest_when_nothing_else_is_defined():
    """Row 0 holds one valid token (no ratio), row 1 equal norms (ratio 1.0): the mean and the maximum are row 1's,
    with no contribution from the undefined row; a batch with no defined ratio records nothing."""
    h = torch.stack([torch.randn(5, 3, generator=torch.Generator().manual_seed(6)), _equal_norms(5, 3)])
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[0, :4] = False
    s = LayerSinks()
    s.add_hidden(h, valid)
    s.add_values(h, valid)
    out = s.summary(diff=False)
    assert out["massive_ratio"] == 1.0 and out["value_ratio"] == 1.0
    assert out["massive_max"] == {"ratio": 1.0, "row": 1, "position": 0, "channel": 2,
                                  "norm": pytest.approx(float(torch.arange(1.0, 4.0).norm()))}
    none = LayerSinks()
    none.add_hidden(h[:1], valid[:1])
    none.add_values(h[:1], valid[:1])
    out = none.summary(diff=False)
    assert out["massive_max"] is None and out["massive_ratio"] is None and out["value_ratio"] is None


def _peaked(peak: float, seed: int) -> torch.Tensor:
    """Two sequences of 6 tokens; sequence 1's token 4 scaled by `peak` (its ratio is the batch's largest)."""
    h = torch.randn(2, 6, 5, generator=torch.Generator().manual_seed(seed)).abs() + 1.0
    h[1, 4] *= peak
    return h


def test_the_largest_massive_activation_over_calls_keeps_the_first_of_equal_ratios():
    """Calls in order: a peak at row 1 (no offset given: rows count from 0), the same batch again at offset 10
    (a tie: the first stays), then a smaller peak at offset 20, whose row numbers exceed the first ratio."""
    big, small = _peaked(4.0, 7), _peaked(1.5, 8)
    n = np.linalg.norm(big.numpy(), axis=-1)
    ratio = n[1].max() / np.median(n[1])
    assert 2.0 < ratio < 20 and np.linalg.norm(small[1].numpy(), axis=-1).max() < ratio * np.median(
        np.linalg.norm(small[1].numpy(), axis=-1))
    s = LayerSinks()
    s.add_hidden(big, None)
    s.add_hidden(big, None, row_offset=10)
    s.add_hidden(small, None, row_offset=20)
    best = s.massive_max
    assert (best["row"], best["position"]) == (1, 4) and best["ratio"] == pytest.approx(ratio, rel=1e-6)


def _with(**fields) -> LayerSinks:
    s = LayerSinks()
    for key, value in fields.items():
        setattr(s, key, value)
    return s


def test_merge_of_shards_holding_different_parts():
    """One shard holds the differential map and λ, the other neither; one holds value ratios, the other none; a
    tie of the largest massive activation keeps the first shard's; a second shard whose row numbers exceed the
    first's ratio, and whose ratio exceeds the first's row, does not win with a smaller ratio."""
    t = lambda *v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    a = _with(mass={"probs": t(1.0, 2.0)}, queries={"probs": t(4.0)}, massive=t(5.0, 1.0),
              _massive_max=t(5.0, 0.0, 3.0, 1.0, 2.5))
    b = _with(mass={"probs": t(0.5, 0.5), "map": t(0.25, 0.75)}, queries={"probs": t(2.0), "map": t(2.0)},
              _lam=t(0.4)[0], value=t(3.0, 2.0), massive=t(2.0, 1.0), _massive_max=t(2.0, 30.0, 1.0, 0.0, 1.5))
    for first, second in ((a, b), (b, a)):
        m = first.merge(second)
        np.testing.assert_array_equal(m.mass["probs"].numpy(), [1.5, 2.5])
        np.testing.assert_array_equal(m.mass["map"].numpy(), [0.25, 0.75])
        assert float(m.queries["map"]) == 2.0 and m.lam == 0.4
        assert m.value.tolist() == [3.0, 2.0] and m.massive.tolist() == [7.0, 2.0]
        assert m.massive_max == {"ratio": 5.0, "row": 0, "position": 3, "channel": 1, "norm": 2.5}
    tie = _with(_massive_max=t(5.0, 9.0, 0.0, 0.0, 1.0))
    assert a.merge(tie).massive_max["row"] == 0 and tie.merge(a).massive_max["row"] == 9
    empty = LayerSinks().merge(LayerSinks())
    assert empty.massive_max is None and empty.value is None and empty.mass == {}


def _rows(first: float, q: int, heads: int = 2) -> torch.Tensor:
    """[1, heads, q, q] causal probabilities: rows 1.. put `first` on key 0, the rest on the query itself."""
    p = torch.zeros(1, heads, q, q)
    p[0, :, 0, 0] = 1.0
    for i in range(1, q):
        p[0, :, i, 0], p[0, :, i, i] = first, 1.0 - first
    return p


def test_a_mass_equal_to_epsilon_is_not_a_sink():
    """Masses exact in binary: 4 queries of 0.25 average exactly to 0.25, and with ε = 0.25 no head, map or
    differential head (share 0.125 / (1 − 0.5)) is a sink; a layer of one counted query has that query's mass;
    a softmax layer's share is its first-key mass."""
    soft = LayerSinks()
    soft.add_mass("probs", _rows(0.25, 5), None)
    out = soft.summary(diff=False, epsilon=0.25)
    assert out["first_mass"] == [0.25, 0.25] and out["share"] == [0.25, 0.25]
    assert out["sink"] == {"heads": 2, "sinks": 0}
    diff = LayerSinks()
    diff.add_lambda(torch.tensor(0.5))
    diff.add_mass("probs", _rows(0.25, 5, heads=4), None)
    diff.add_mass("map", _rows(0.125, 5), None)
    out = diff.summary(diff=True, epsilon=0.25)
    assert out["share"] == [0.25, 0.25]
    assert out["sink"]["sinks"] == out["sink_A1"]["sinks"] == out["sink_A2"]["sinks"] == 0
    one = LayerSinks()
    one.add_mass("probs", _rows(0.75, 2), None)
    assert one.summary(diff=False)["first_mass"] == [0.75, 0.75]
    assert one.summary(diff=False)["sink"]["sinks"] == 2
    soft.add_mass("map", _rows(0.75, 5), None)  # whatever else was recorded, diff=False reads softmax heads
    assert soft.summary(diff=False, epsilon=0.25)["share"] == [0.25, 0.25]


def _old_pickle(state: dict) -> bytes:
    """A LayerSinks pickled by the class before its sums stayed on the device (commit 80ffe61's parent): λ a
    float, value and massive [sum, count] lists, the largest massive activation a dict."""
    old = LayerSinks.__new__(LayerSinks)
    old.__dict__.update(state)
    return pickle.dumps(old)


def test_a_profile_pickled_in_the_old_format_loads_with_its_numbers():
    mass = {"probs": torch.tensor([1.5, 0.5], dtype=torch.float64)}
    queries = {"probs": torch.tensor(5.0, dtype=torch.float64)}
    best = {"ratio": 12.1, "row": 7, "position": 3, "channel": 11, "norm": 4.1}
    loaded = pickle.loads(_old_pickle({"mass": mass, "queries": queries, "lam": 0.1, "value": [6.1, 4],
                                       "massive": [30.1, 3], "massive_max": best}))
    assert loaded.lam == 0.1
    out = loaded.summary(diff=False)
    assert out["first_mass"] == [0.3, 0.1] and out["value_ratio"] == 6.1 / 4 and out["massive_ratio"] == 30.1 / 3
    assert out["massive_max"] == best
    merged = loaded.merge(loaded)
    assert merged.value.tolist() == [12.2, 8.0] and merged.massive_max == best and merged.lam == 0.1
    empty = pickle.loads(_old_pickle({"mass": {}, "queries": {}, "lam": None, "value": [0.0, 0], "massive": [0.0, 0],
                                      "massive_max": None}))
    out = empty.summary(diff=False)
    assert empty.lam is None and out["massive_max"] is None and out["value_ratio"] is None
    again = pickle.loads(pickle.dumps(loaded))  # today's format round-trips as it is
    assert again.summary(diff=False) == loaded.summary(diff=False) and again.lam == 0.1
