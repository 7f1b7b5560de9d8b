"""SiteStats' numbers against plain numpy, on the paths the profiler takes that the wider tests in test_stats.py
leave to a self-comparison: low-precision input, a pass of constant or small values, query blocks of one attention
call (positions offset, one pass, folds waiting for the call's last block), merges with an empty or a non-finite
shard, a copy and a pickle that count on, and every rounded or named field of the summary (issue 50's mutation
run of site_stats.py left these alive)."""

import pickle

import numpy as np
import pytest
import torch
from scipy import stats as sps

from diffquant.stats import site_stats
from diffquant.stats.site_stats import SiteStats
from diffquant.taps.context import Block

TOKEN = ("batch", "pos", "channel")
LOGITS = ("batch", "head", "q_pos", "k_pos")


def _kurt(x) -> float:
    x = np.asarray(x, dtype=np.float64).ravel()
    return 0.0 if x.var() == 0 else float(sps.kurtosis(x, fisher=False))


def test_bfloat16_input_is_summed_in_float32_about_its_own_mean():
    """A bf16 activation far from zero: the mean taken in bf16 (the mutant that skips the float32 cast) is off by
    its rounding, ~1e-2 at 300, and with it every moment."""
    g = torch.Generator().manual_seed(31)
    x = (torch.randn(3, 7, 16, generator=g) * 2 + 300).bfloat16()
    s = SiteStats(TOKEN)
    s.update(x)
    out = s.summary()
    ref = x.double().numpy().ravel()
    assert out["count"] == ref.size
    assert out["mean"] == pytest.approx(ref.mean(), rel=1e-9)
    assert out["std"] == pytest.approx(ref.std(), rel=1e-5)
    assert out["kurtosis"] == pytest.approx(_kurt(ref), rel=1e-5)
    assert out["absmax"] == float(np.abs(ref).max())


def test_constant_and_small_passes_have_kurtosis_zero_and_their_own_infinity_norm():
    """Per-pass statistics where they are easy to get wrong: a constant pass (variance 0: kurtosis 0, not NaN and
    not 1), a pass whose ∞-norm is below 1 (a floor at 1 would show), and folds of several pending passes into
    sums that already hold earlier ones (summary folds, then more passes, then summary again)."""
    g = torch.Generator().manual_seed(32)
    passes = [torch.full((2, 3, 4), 2.0), torch.randn(2, 3, 4, generator=g) * 0.1, torch.randn(2, 3, 4, generator=g),
              torch.randn(2, 3, 4, generator=g) * 0.2, torch.full((2, 3, 4), -0.5)]
    s = SiteStats(TOKEN)
    for i, x in enumerate(passes):
        s.update(x, row_offset=2 * i)
        if i == 2:
            s.summary()  # three passes folded at once, then two more onto them
    out = s.summary()
    kurt = [_kurt(x.numpy()) for x in passes]
    inf = [float(x.abs().max()) for x in passes]
    assert kurt[0] == 0.0 and kurt[-1] == 0.0 and max(inf[1], inf[3]) < 1
    assert out["passes"] == 5
    assert out["pass_kurtosis_mean"] == pytest.approx(np.mean(kurt), rel=1e-6)
    assert out["pass_kurtosis_max"] == pytest.approx(max(kurt), rel=1e-6)
    assert out["pass_infnorm_mean"] == pytest.approx(np.mean(inf), rel=1e-7)
    assert out["pass_infnorm_max"] == max(inf)
    every = torch.cat(passes, dim=0).numpy()
    assert out["channel_absmax"] == [round(float(v), 6) for v in np.abs(every).max(axis=(0, 1))]
    assert out["position_absmax"] == [round(float(v), 6) for v in np.abs(every).max(axis=(0, 2))]


def test_small_magnitudes_keep_their_channel_and_position_maxima():
    """Every |x| below 1 (maxima floored at 1 would read 1.0), on a site with channels along the last dim and on a
    one-dimensional site (its channel maxima are the values themselves, not one number)."""
    g = torch.Generator().manual_seed(33)
    x = torch.rand(2, 5, 3, generator=g) * 0.9 - 0.45
    s = SiteStats(TOKEN)
    s.update(x)
    out = s.summary()
    a = np.abs(x.numpy())
    assert out["channel_absmax"] == [round(float(v), 6) for v in a.max(axis=(0, 1))]
    assert out["position_absmax"] == [round(float(v), 6) for v in a.max(axis=(0, 2))]
    v = torch.tensor([0.25, -0.75, 0.5, -0.125])
    one = SiteStats(("channel",))
    one.update(v)
    assert one.summary()["channel_absmax"] == [0.25, 0.75, 0.5, 0.125]


def _logits(seed: int, queries: int = 8, keys: int = 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, queries, keys, generator=g) + 1.5  # a mean away from 0: a pooled sum scaled wrong shows


@pytest.mark.parametrize("keys", [10, 4])  # more keys than queries, and fewer (a block may end at the key count)
def test_query_blocks_of_one_call_are_one_pass_at_their_own_positions(keys):
    """A blocked attention call (query blocks starting at 0, 1 and 5 of 8 queries over 10 keys) after 63 unblocked
    calls: the pending sums reach the fold threshold (64) inside the call, which must wait for its last block, so
    the three blocks make one pass; positions are offset by each block's start; token ids reach the top-k through
    the call's query count. All against numpy on the whole calls."""
    calls = [_logits(100 + i, keys=keys) for i in range(64)]
    ids = torch.arange(8).reshape(1, 8) + 1000
    s = SiteStats(LOGITS, k=5)
    for i, x in enumerate(calls[:-1]):
        s.update(x, input_ids=ids, row_offset=i)
    x = calls[-1]
    x[0, 1, 6, keys - 1] = 40.0  # the largest value, in the last call's last block
    for start, end in ((0, 1), (1, 4), (4, 8)):
        s.update(x[:, :, start:end], input_ids=ids, row_offset=63, block=Block(start, end, 8, keys))
    out = s.summary()
    every = np.stack([c.numpy() for c in calls]).reshape(64, -1).astype(np.float64)
    assert out["passes"] == 64 and out["count"] == every.size
    assert out["mean"] == pytest.approx(every.mean(), rel=1e-7)
    assert out["kurtosis"] == pytest.approx(_kurt(every), rel=1e-6)
    kurt = [_kurt(c) for c in every]
    assert out["pass_kurtosis_mean"] == pytest.approx(np.mean(kurt), rel=1e-6)
    assert out["pass_kurtosis_max"] == pytest.approx(max(kurt), rel=1e-6)
    assert out["pass_infnorm_mean"] == pytest.approx(np.abs(every).max(axis=1).mean(), rel=1e-7)
    stacked = np.stack([c.numpy()[0] for c in calls])  # [call, head, q, k]
    assert out["position_absmax"] == [round(float(v), 6) for v in np.abs(stacked).max(axis=(0, 1, 3))]
    assert out["channel_absmax"] == [round(float(v), 6) for v in np.abs(stacked).max(axis=(0, 2, 3))]
    top = out["topk"][0]
    assert top["value"] == 40.0 and (top["batch"], top["head"], top["q_pos"], top["k_pos"]) == (63, 1, 6, keys - 1)
    assert top["token_id"] == 1006  # ids[0, 6]: read at the call's query, not the block's


def test_a_blocked_update_does_not_write_to_the_activation():
    """With a mask and `dense` columns (a causal block: every query sees the first `dense` keys), the masked
    columns are zeroed in a copy, never in the caller's tensor."""
    x = _logits(7)
    valid = torch.ones(1, 1, 8, 10, dtype=torch.bool).tril(diagonal=2)
    before = x.clone()
    s = SiteStats(LOGITS)
    s.update(x, valid, block=Block(0, 8, 8, 10, dense=3))
    assert torch.equal(x, before)
    ref = x[valid.expand_as(x)].double().numpy()
    assert s.summary()["count"] == ref.size and s.summary()["mean"] == pytest.approx(ref.mean(), rel=1e-7)


def _shard_data():
    g = torch.Generator().manual_seed(34)
    a = torch.randn(2, 5, 4, generator=g) * 3
    b = torch.randn(3, 4, 4, generator=g) * 3
    b[1, 2, 0], b[2, 0, 3] = float("inf"), float("nan")
    valid = torch.ones(2, 5, 1, dtype=torch.bool)
    valid[0, :2] = False
    return a, valid, b


def test_a_merge_counts_non_finite_values_positions_and_hits_of_both_shards_and_counts_on():
    """Two shards (padding in one, inf and NaN in the other) merged, then both the merge and a single process fed
    one more batch: non-finite count, valid positions, LLM.int8 hit fractions at the default threshold 6 and the
    path that computed them equal numpy's on everything (a merge that lost the threshold, or subtracted a count,
    would show only once it counts on)."""
    a, valid, b = _shard_data()
    c = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(35)) * 4
    left, right = SiteStats(TOKEN), SiteStats(TOKEN)
    left.update(a, valid)
    right.update(b, row_offset=2)
    merged = left.merge(right)
    merged.update(c, row_offset=5)
    out = merged.summary()
    finite_b = np.isfinite(b.numpy())
    positions = int(valid.sum()) + 3 * 4 + 6
    hits = ((np.abs(a.numpy()) >= 6) & valid.numpy()).sum(axis=(0, 1)) + \
        ((np.abs(np.nan_to_num(b.numpy(), nan=0.0, posinf=0.0)) >= 6) & finite_b).sum(axis=(0, 1)) + \
        (np.abs(c.numpy()) >= 6).sum(axis=(0, 1))
    assert hits.sum() > 0 and out["nonfinite"] == 2 and out["kernels"] == "torch"
    assert out["channel_hit_fraction"] == [round(h / positions, 6) for h in hits.tolist()]
    counted = np.concatenate([a.numpy()[valid.numpy().repeat(4, -1)], b.numpy()[finite_b], c.numpy().ravel()])
    counted = counted.astype(np.float64)
    assert out["count"] == counted.size and out["mean"] == pytest.approx(counted.mean(), rel=1e-7)
    assert out["passes"] == 3


def test_a_merge_with_an_empty_shard_keeps_everything_of_the_other():
    """A rank that saw nothing (no channel maxima, no hits yet) merged on either side."""
    a, valid, _ = _shard_data()
    full = SiteStats(TOKEN)
    full.update(a, valid)
    want = full.summary()
    for merged in (SiteStats(TOKEN).merge(full), full.merge(SiteStats(TOKEN))):
        got = merged.summary()
        assert got["channel_absmax"] == want["channel_absmax"] and got["position_absmax"] == want["position_absmax"]
        assert got["channel_hit_fraction"] == want["channel_hit_fraction"] and got["count"] == want["count"]
        assert got["kernels"] == "torch"


def test_the_paths_that_computed_statistics_are_named_once_each():
    assert site_stats._paths("torch", None) == "torch"
    assert site_stats._paths("torch+triton", "torch") == "torch+triton"
    assert site_stats._paths("triton", "torch") == "torch+triton"
    assert site_stats._paths(None, None) is None


def test_a_copy_and_a_pickle_count_on_as_the_original():
    """`to` (gathering across ranks) and pickling (a saved profile) keep the threshold, the path and every sum:
    fed the same batch afterwards, each equals the original fed it too."""
    a, valid, b = _shard_data()
    s = SiteStats(TOKEN, outlier_threshold=2.5)
    s.update(a, valid)
    copies = [s.to("cpu"), pickle.loads(pickle.dumps(s))]
    for t in (s, *copies):
        t.update(b, row_offset=2)
    want = s.summary()
    finite = np.isfinite(b.numpy())  # the reference: numpy over both batches (b holds inf and NaN)
    hits = ((np.abs(a.numpy()) >= 2.5) & valid.numpy()).sum(axis=(0, 1)) + \
        ((np.abs(np.nan_to_num(b.numpy(), nan=0.0, posinf=0.0)) >= 2.5) & finite).sum(axis=(0, 1))
    assert hits.min() > 0 and want["nonfinite"] == 2
    assert want["channel_hit_fraction"] == [round(h / (int(valid.sum()) + 12), 6) for h in hits.tolist()]
    for t in copies:
        got = t.summary()
        assert got == want


def test_state_tensors_live_on_the_given_device_in_exact_types():
    """Counts in int64 and per-pass sums in float64, on the device asked for (meta: no memory), before any update."""
    s = SiteStats(TOKEN, device="meta")
    for name in ("positions", "nonfinite"):
        t = getattr(s, name)
        assert (t.device.type, t.dtype, t.shape) == ("meta", torch.int64, ()), name
    for name in ("pass_kurt", "pass_inf"):
        t = getattr(s, name)
        assert (t.device.type, t.dtype, t.shape) == ("meta", torch.float64, (2,)), name
    assert s.moments.n.device.type == "meta" and s.hist.counts.device.type == "meta"
    assert s.topk._abs.device.type == "meta" and s.topk._coords.device.type == "meta"


def test_the_default_keeps_the_top_100_and_names_the_ranks_it_reports():
    """The profiler's default k = 100: 150 distinct values keep exactly the 100 largest; the summary's ranks are
    top1, 2, 3, 10 and 100, each the value at that rank."""
    x = (torch.randperm(150).float() + 1).reshape(1, 150, 1) * torch.tensor([1.0, -1.0]).repeat(75).reshape(1, 150, 1)
    s = SiteStats(TOKEN)
    s.update(x)
    out = s.summary()
    ranked = np.sort(np.abs(x.numpy().ravel()))[::-1]
    assert len(out["topk"]) == 100 and s.k == 100
    assert out["top"] == {f"top{r}": float(ranked[r - 1]) for r in (1, 2, 3, 10, 100)}


def test_token_id_zero_is_reported():
    x = torch.zeros(1, 4, 2)
    x[0, 2, 1] = 9.0
    s = SiteStats(TOKEN, k=1)
    s.update(x, input_ids=torch.tensor([[5, 7, 0, 3]]))
    assert s.summary()["topk"] == [{"value": 9.0, "batch": 0, "pos": 2, "channel": 1, "token_id": 0}]


def test_one_position_gives_hit_fractions_over_one_and_fields_rounded_to_six_places():
    x = torch.tensor([[[7.1234567, 0.3333333, -6.5, 1.0]]])  # one position: fractions are 0 or 1 of it
    s = SiteStats(TOKEN)
    s.update(x)
    out = s.summary()
    assert out["channel_hit_fraction"] == [1.0, 0.0, 1.0, 0.0]
    assert out["channel_absmax"] == [round(float(v), 6) for v in x.abs().reshape(-1).tolist()]
    assert out["position_absmax"] == [round(float(x.abs().max()), 6)] != [float(x.abs().max())]
    two = SiteStats(TOKEN, outlier_threshold=0.3)
    two.update(torch.tensor([[[0.1, 0.5, 0.2]], [[0.4, 0.1, 0.2]], [[0.35, 0.9, 0.1]]]))
    assert two.summary()["channel_hit_fraction"] == [round(2 / 3, 6), round(2 / 3, 6), 0.0]


def test_the_spread_histogram_keeps_float32s_largest_magnitudes_in_the_last_bin(monkeypatch):
    """Where reading back is not free (a GPU), left-out values keep their own bins with weight 0 and NaN's
    patterns are clamped into the last bin: a finite value in that last bin (|x| near float32's maximum) must
    stay counted there, as the CPU path counts it."""
    x = torch.tensor([[[3.4e38, 1.0, float("nan"), -2.0]]])
    got = {}
    for free in (frozenset({"cpu"}), frozenset()):
        monkeypatch.setattr(site_stats, "FREE_READS", free)
        s = SiteStats(TOKEN)
        s.update(x)
        got[free] = s.hist.counts.clone()
    last = site_stats.NBINS - 1
    assert torch.equal(got[frozenset()], got[frozenset({"cpu"})])
    assert int(got[frozenset()][last]) == 1 and int(got[frozenset()].sum()) == 3


def _kernel_update(s: SiteStats, x, valid, ids, row_offset):
    """What the tapped attention's flash kernel hands `update_from_kernel`, computed here in float64 from x."""
    counted = valid.expand_as(x) & torch.isfinite(x)
    v = x[counted].double()
    d = v - v.mean()
    rowmax = torch.where(counted, x.abs(), 0.0).amax(dim=-1)
    entry = torch.stack([torch.tensor(float(v.numel()), dtype=torch.float64), v.sum(), (d**2).sum(), (d**3).sum(),
                         (d**4).sum(), rowmax.max().double()])
    # as the kernel hands them: the rows' values and their `valid` mask (the top-k leaves non-finite values out)
    rows_x, rows_ok = x.reshape(-1, x.shape[-1]), valid.expand_as(x).reshape(-1, x.shape[-1])
    s.update_from_kernel(entry, rowmax, x.shape, lambda rows: (rows_x[rows], rows_ok[rows]), ids, row_offset)


@pytest.mark.parametrize("k", [3, 8, 60])  # fewer rows than k (the k rows of largest maxima), as many, and more
def test_updates_from_the_flash_kernel_equal_the_torch_path(k):
    """`update_from_kernel` (the Triton flash path's entry) fed two causal calls, the second holding inf and NaN
    where they are visible and its largest channel maximum below the first's: maxima, top-k with batch offsets and
    token ids, and the moments equal the torch path fed the same calls; the path names both after a torch update."""
    g = torch.Generator().manual_seed(36)
    calls = [torch.randn(1, 2, 4, 6, generator=g) * 3, torch.randn(1, 2, 4, 6, generator=g)]
    calls[0][0, 1, 3, 5] = -35.0  # head 1's maximum, in the first call
    calls[0][0, 0, 0, 0] = 35.0  # a tie with it in another row, earlier in the tensor
    calls[1][0, 0, 3, 1], calls[1][0, 1, 2, 0] = float("inf"), float("nan")
    calls[1][0, 0, 2, 2] = 30.0  # head 0's maximum, in the second call (batch 1 once offset)
    calls[1][0, 1, 0, 0] = 29.0  # below head 1's maximum of the first call
    valid = (torch.arange(6)[None, :] <= torch.arange(2, 6)[:, None])[None, None]
    ids = torch.tensor([[11, 0, 13, 14]])
    flash, ref = SiteStats(LOGITS, k=k), SiteStats(LOGITS, k=k)
    for i, x in enumerate(calls):
        _kernel_update(flash, x, valid, ids, i)
        ref.update(x, valid, input_ids=ids, row_offset=i)
    a, b = flash.summary(), ref.summary()
    assert a["kernels"] == "triton" and b["kernels"] == "torch"
    for key in ("topk", "channel_absmax", "position_absmax", "count", "passes", "pass_infnorm_max", "absmax"):
        assert a[key] == b[key], key
    assert a["mean"] == pytest.approx(b["mean"], abs=1e-6 * b["std"])
    assert a["kurtosis"] == pytest.approx(b["kurtosis"], rel=1e-6)
    assert {e["batch"] for e in a["topk"]} == {0, 1} and all("token_id" in e for e in a["topk"])
    assert k != 60 or any(e["token_id"] == 0 for e in a["topk"])
    assert all(np.isfinite(e["value"]) for e in a["topk"])
    _kernel_update(ref, calls[0], valid, ids, 2)
    assert ref.summary()["kernels"] == "torch+triton"


def test_one_counted_value_has_no_spread():
    """A mask that leaves one value: std 0, no kurtosis, a pass kurtosis of 0 (the mean is that value exactly; a
    mean taken as half of it leaves float32 rounding in M₂ that shows as std 1e-5 and kurtosis 1e8)."""
    s = SiteStats(TOKEN)
    valid = torch.zeros(1, 3, 1, dtype=torch.bool)
    valid[0, 1] = True
    s.update(torch.tensor([[[5.0], [0.1], [-2.0]]]), valid)
    out = s.summary()
    assert out["count"] == 1 and out["mean"] == pytest.approx(0.1, rel=1e-7)
    assert out["std"] == 0.0 and out["pass_kurtosis_mean"] == 0.0 and out["pass_kurtosis_max"] == 0.0


@pytest.mark.parametrize("seed", range(4))
def test_flash_updates_keep_the_same_tied_entries_when_the_rows_number_k(seed):
    """Integer logits (many ties) in 9 rows with k = 9: the flash path's top-k keeps the same tied entries, with
    their signs and coordinates, as the torch path (the branch that offers every row)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (1, 1, 9, 4), generator=g).float()
    valid = torch.ones(1, 1, 9, 4, dtype=torch.bool)
    flash, ref = SiteStats(LOGITS, k=9), SiteStats(LOGITS, k=9)
    _kernel_update(flash, x, valid, None, 0)
    ref.update(x, valid)
    assert flash.summary()["topk"] == ref.summary()["topk"]


def test_flash_entries_waiting_do_not_split_a_later_blocked_call():
    """63 updates from the flash kernel wait to be folded; a blocked call of three query blocks then reaches 64
    entries at its first block, and must still fold only after its last: 64 passes."""
    x = _logits(5)
    valid = torch.ones(1, 1, 8, 10, dtype=torch.bool)
    s = SiteStats(LOGITS)
    for i in range(63):
        _kernel_update(s, _logits(200 + i), valid, None, i)
    for start, end in ((0, 1), (1, 5), (5, 8)):
        s.update(x[:, :, start:end], row_offset=63, block=Block(start, end, 8, 10))
    every = np.stack([_logits(200 + i).numpy() for i in range(63)] + [x.numpy()]).reshape(64, -1).astype(np.float64)
    out = s.summary()
    assert out["passes"] == 64
    assert out["pass_kurtosis_mean"] == pytest.approx(np.mean([_kurt(c) for c in every]), rel=1e-6)


def _tensors(obj, path="stats", seen=None):
    """Every tensor an object of diffquant's holds, with where it sits (attributes, dicts, lists), walked here
    rather than through the code under test."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}[{k!r}]", seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]", seen)
    elif type(obj).__module__.startswith("diffquant") and hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            yield from _tensors(v, f"{path}.{k}", seen)


def _off(obj, device: str) -> list[str]:
    return [p for p, t in _tensors(obj) if t.device.type != device]


def test_to_and_merge_leave_every_sum_on_the_target_device():
    """`to` (the profiler's way back to the activations' device after gathering on CPU) and `merge` onto statistics
    that live elsewhere put every tensor, the per-channel and per-position maxima and hit counts included, where the
    result lives. The meta device stands in for a GPU: it holds shapes only, so a tensor left on the CPU shows."""
    from diffquant.stats.sinks import LayerSinks

    ids = torch.randint(0, 50, (2, 6))
    cpu = SiteStats(("batch", "pos", "channel"), k=4)
    cpu.update(torch.randn(2, 6, 8) * 4, input_ids=ids)
    assert cpu.channel_hits is not None and cpu.position_absmax is not None
    moved = cpu.to("meta")
    assert _off(moved, "meta") == [] and len(list(_tensors(moved))) == len(list(_tensors(cpu)))
    logits = [SiteStats(("batch", "head", "q_pos", "k_pos"), k=4) for _ in range(2)]  # no channel hits at all
    for s in logits:
        s.update(torch.randn(1, 2, 4, 4))
    both = logits[0].merge(logits[1])
    assert both.channel_hits is None and len(list(_tensors(both))) == len(list(_tensors(logits[0])))
    empty = SiteStats(("batch", "pos", "channel"), k=4, device="meta")
    assert _off(empty.merge(cpu), "meta") == []
    fed = SiteStats(("batch", "pos", "channel"), k=4, device="meta")
    fed.update(torch.randn(2, 6, 8, device="meta"), input_ids=ids.to("meta"))
    assert _off(fed, "meta") == [] and _off(fed.merge(cpu), "meta") == []
    sinks = LayerSinks()
    sinks.add_hidden(torch.randn(2, 5, 4), None)
    sinks.add_values(torch.randn(2, 5, 4), None)
    sinks.add_lambda(torch.tensor(0.3))
    sinks.add_mass("probs", torch.softmax(torch.randn(2, 3, 5, 5), -1), None)
    moved = sinks.to("meta")
    assert _off(moved, "meta") == [] and len(list(_tensors(moved))) == len(list(_tensors(sinks)))
    other = LayerSinks()  # no massive maximum: comparing two would read their values, which meta does not hold
    other.add_values(torch.randn(2, 5, 4), None)
    other.add_mass("probs", torch.softmax(torch.randn(2, 3, 5, 5), -1), None)
    assert _off(moved.merge(other), "meta") == []


@pytest.mark.parametrize("masked", [False, True])
def test_first_key_masses_are_summed_on_the_device_of_the_probabilities(masked):
    from diffquant.stats.sinks import first_key_mass

    probs = torch.rand(2, 3, 5, 5, device="meta")
    valid = torch.ones(2, 1, 5, 5, dtype=torch.bool, device="meta").tril() if masked else None
    assert _off(first_key_mass(probs, valid), "meta") == []


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_one_updates_passes_make_nothing_off_the_activations_device(check, masked):
    """Every tensor of one update's passes (counts, sums, maxima, bins, hit counts) is made where the activations
    are: on a GPU a tensor made on the CPU would be a host allocation and a copy per update. Meta stands in."""
    x = torch.randn(2, 6, 8, device="meta")
    valid = torch.ones(2, 6, 1, dtype=torch.bool, device="meta") if masked else None
    out = site_stats._passes(x, valid, check, 2, 1, 6.0)
    assert _off(out, "meta") == [] and len(list(_tensors(out))) >= 10
