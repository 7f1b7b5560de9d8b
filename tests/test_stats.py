import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from diffquant.stats.histogram import NBINS, RESOLUTION, AbsHistogram, bin_edges, bin_value, magnitude_bins
from diffquant.stats.moments import Moments
from diffquant.stats.site_stats import SiteStats
from diffquant.stats import site_stats


def _heavy(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x[..., 3] *= 40  # an outlier channel
    return x


def test_moments_match_scipy():
    x = _heavy((4, 50, 16))
    s = Moments.of(x, None).summary()
    ref = x.double().numpy().ravel()
    assert s["count"] == ref.size
    assert s["mean"] == pytest.approx(ref.mean(), rel=1e-6, abs=1e-9)  # float32 row sums, float64 across rows
    assert s["std"] == pytest.approx(ref.std(), rel=1e-7)
    assert s["kurtosis"] == pytest.approx(sps.kurtosis(ref, fisher=False), rel=1e-6)


def test_gaussian_kurtosis_is_three():
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(1))
    assert Moments.of(x, None).summary()["kurtosis"] == pytest.approx(3.0, abs=0.05)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.floats(-100, 100))
def test_moments_merge_equals_one_pass(sizes, shift):
    g = torch.Generator().manual_seed(len(sizes))
    parts = [torch.randn(n, generator=g) * 3 + shift for n in sizes]
    merged = Moments()
    for p in parts:
        merged = merged.merge(Moments.of(p, None))
    each = [Moments.of(p, None) for p in parts]
    sums = {k: torch.stack([getattr(m, k) for m in each]) for k in ("n", "mean", "m2", "m3", "m4")}
    pooled = Moments.pool(sums["n"], sums["n"] * sums["mean"], sums["m2"], sums["m3"], sums["m4"])
    ref = torch.cat(parts).double().numpy()
    d = ref - ref.mean()
    slack = 12 * (d**2).sum() * np.abs(ref).max() * 2.0**-23  # float32 differences: 3·d²·(x's rounding), four times
    for m in (merged, pooled):  # the third central power sum too: merges and folds feed it into the fourth
        assert float(m.m3) == pytest.approx((d**3).sum(), rel=1e-5, abs=slack)
    for s in (merged.summary(), pooled.summary()):
        assert s["count"] == ref.size
        assert s["mean"] == pytest.approx(ref.mean(), rel=1e-6, abs=1e-9)
        if ref.size > 1 and ref.std() > 0:
            assert s["std"] == pytest.approx(ref.std(), rel=1e-5)
            assert s["kurtosis"] == pytest.approx(sps.kurtosis(ref, fisher=False), rel=1e-4)


def test_masked_moments_ignore_masked_values():
    x = torch.randn(10, 10)
    mask = torch.rand(10, 10) > 0.5
    x_bad = torch.where(mask, x, 1e6)
    s = Moments.of(x_bad, mask).summary()
    ref = x[mask].double().numpy()
    assert s["count"] == ref.size
    assert s["kurtosis"] == pytest.approx(sps.kurtosis(ref, fisher=False), rel=1e-6)


@pytest.mark.parametrize("dist", ["normal", "lognormal", "heavy"])
def test_histogram_quantiles_within_half_a_percent(dist):
    g = torch.Generator().manual_seed(3)
    x = {"normal": torch.randn(200_000, generator=g),
         "lognormal": torch.exp(4 * torch.randn(200_000, generator=g)),
         "heavy": _heavy((2000, 100)).ravel()}[dist]
    h = AbsHistogram()
    h.add(x)
    qs = [0.5, 0.9, 0.99, 0.999, 0.9999]
    got = h.quantiles(qs)
    ref = torch.quantile(x.abs().double(), torch.tensor(qs, dtype=torch.float64))
    for g_, r in zip(got, ref.tolist()):
        assert abs(g_ - r) / r <= RESOLUTION


def test_histogram_bins_are_float32_bits_rounded_to_16():
    x = torch.tensor([0.0, -0.0, 1e-42, 1e-30, -0.3, 1.0, 6.0, -1e4, 3.4e38, 1.0 + 2**-8, 1.0 + 2**-8 - 2**-20],
                     dtype=torch.float32)
    u = x.numpy().view(np.uint32).astype(np.int64) & 0x7FFFFFFF  # numpy's reading of the same bits
    ref = (u + 0x8000) >> 16
    assert magnitude_bins(x).tolist() == ref.tolist()
    assert magnitude_bins(x)[-2:].tolist() == [0x3F81, 0x3F80]  # half a bin above 1.0 rounds up, just below it down
    assert magnitude_bins(torch.tensor([float("inf"), float("nan")])).tolist()[0] >= NBINS - 1
    lo, hi = bin_edges(magnitude_bins(x).long())
    a = x.abs().double()
    assert bool(((lo <= a) & (a < hi) | (a == hi)).all())  # every |x| in its bin (the last one is closed)
    v = bin_value(magnitude_bins(x).long())
    normal = a >= torch.finfo(torch.float32).tiny  # subnormals have fewer significant bits (1e-42: bin 0, read as 0)
    assert bool(((v - a).abs() <= a * RESOLUTION)[normal].all())  # the reported value within the stated resolution
    top = torch.tensor([torch.finfo(torch.float32).max])  # rounds to the pattern of inf: the last finite bin
    assert int(magnitude_bins(top)) == NBINS - 1 and float(bin_value(torch.tensor(NBINS - 1))) == float(top)
    h = AbsHistogram()
    h.add(torch.cat([top, torch.tensor([float("inf")])]))
    assert int(h.counts.sum()) == 1 and h.quantiles([1.0]) == [float(top)]


def test_bf16_median_is_the_median_of_the_bf16_values():
    """bf16 values sit at their bins' centres: the histogram's quantiles are those of the values themselves
    (torch.quantile's linear convention), where truncated bins reported each bin's midpoint, 0.4% high."""
    g = torch.Generator().manual_seed(5)
    for n in (10_001, 10_000):  # odd: one middle value; even: the mean of two
        x = (torch.randn(n, generator=g) * 2.5).bfloat16().float()
        h = AbsHistogram()
        h.add(x)
        qs = [0.5, 0.9, 0.99, 0.999]
        ref = torch.quantile(x.abs().double(), torch.tensor(qs, dtype=torch.float64)).tolist()
        assert h.quantiles(qs) == pytest.approx(ref, rel=1e-12)
        # the same statistics through a profile's SiteStats (the in-place hot-path binning)
        s = SiteStats(("batch", "pos", "channel"))
        s.update(x.reshape(1, -1, 1))
        assert s.summary(full=False)["quantiles"]["median"] == pytest.approx(ref[0], rel=1e-12)


def test_histogram_zero_empty_masked_and_nonfinite():
    h = AbsHistogram()
    assert h.quantiles([0.5]) == [None]
    h.add(torch.zeros(10))
    assert h.quantiles([0.5]) == [0.0]
    h = AbsHistogram()
    x = torch.tensor([1.0, 2.0, 1000.0, float("inf"), float("nan"), -float("inf")])
    h.add(x, torch.tensor([True, True, False, True, True, True]))
    assert int(h.counts.sum()) == 2  # masked and non-finite values are not counted
    assert h.quantiles([0.0, 1.0]) == pytest.approx([1.0, 2.0], rel=0.004)


def test_scalar_site():
    s = SiteStats(())
    for v in (0.25, -0.5, 0.75):
        s.update(torch.tensor(v))
    out = s.summary()
    assert out["count"] == 3 and out["absmax"] == 0.75 and out["mean"] == pytest.approx(1 / 6)
    assert [t["value"] for t in out["topk"]] == [0.75, -0.5, 0.25]


def test_site_stats_topk_locations_and_channels():
    x = torch.randn(3, 7, 8)
    x[2, 5, 6] = -50.0
    x[0, 1, 2] = 30.0
    ids = torch.arange(21).reshape(3, 7)
    s = SiteStats(("batch", "pos", "channel"), k=5)
    s.update(x, input_ids=ids, row_offset=10)
    top = s.top_entries()
    assert top[0] == {"value": -50.0, "batch": 12, "pos": 5, "channel": 6, "token_id": 19}
    assert top[1] == {"value": 30.0, "batch": 10, "pos": 1, "channel": 2, "token_id": 1}
    ref = x.abs().reshape(-1).sort(descending=True).values[:5]
    assert torch.equal(s.topk.abs, ref)
    torch.testing.assert_close(s.channel_absmax, x.abs().amax(dim=(0, 1)))
    torch.testing.assert_close(s.position_absmax, x.abs().amax(dim=(0, 2)))


def test_nonfinite_counted_and_excluded():
    x = torch.randn(4, 6, 8)
    x[0, 0, 0] = float("inf")
    x[1, 2, 3] = float("nan")
    x[2, 2, 2] = float("-inf")
    s = SiteStats(("batch", "pos", "channel"))
    s.update(x)
    out = s.summary()
    finite = x[torch.isfinite(x)].double().numpy()
    assert out["nonfinite"] == 3
    assert out["count"] == finite.size
    assert out["kurtosis"] == pytest.approx(sps.kurtosis(finite, fisher=False), rel=1e-6)
    assert out["absmax"] == pytest.approx(np.abs(finite).max())
    assert all(np.isfinite(v) for v in out["quantiles"].values())


def test_valid_mask_excludes_positions():
    x = torch.randn(2, 2, 5, 5)
    valid = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    x_masked = x.masked_fill(~valid, 1000.0)
    s = SiteStats(("batch", "head", "q_pos", "k_pos"))
    s.update(x_masked, valid)
    assert s.summary()["count"] == 2 * 2 * 15
    assert s.summary()["absmax"] == pytest.approx(float(x.masked_select(valid.expand_as(x)).abs().max()))


@pytest.mark.parametrize("threshold", [6.0, 0.5, 1e-30])  # > 0: left-out values are zeros
def test_channel_hits_count_values_at_or_above_the_threshold(threshold):
    # LLM.int8 hits per channel: |x| >= t at valid positions, counted by hand in numpy; values exactly at 6, just
    # below it, signed zeros and a huge value, a padded position, and an inf (left out, so the checked path runs)
    below = float(np.nextafter(np.float32(6.0), np.float32(0.0)))
    x = torch.tensor([[[6.0, -6.0, below, -below], [7.0, 0.0, -0.0, 1e30], [5.0, -8.0, 6.0, 0.5]],
                      [[-0.0, 6.5, -below, 6.0], [100.0, 100.0, 100.0, 100.0], [float("inf"), 1.0, -6.0, 2.0]]])
    valid = torch.tensor([[True, True, True], [True, False, True]])[..., None]
    s = SiteStats(("batch", "pos", "channel"), outlier_threshold=threshold)
    s.update(x, valid)
    a, ok = np.abs(x.numpy()), valid.numpy() & np.isfinite(x.numpy())
    assert s.channel_hits.dtype == torch.int64
    assert s.channel_hits.tolist() == ((a >= threshold) & ok).sum(axis=(0, 1)).tolist()
    assert int(s.positions) == 5


@pytest.mark.parametrize("k", [3, 100])  # 3: only the rows with the largest maxima are searched
def test_masked_topk_and_nonfinite(k):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2, 8, 8, generator=g)
    valid = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    x = x.masked_fill(~valid, 1e4)  # large values outside the mask must not show
    x[0, 1, 2, 7] = float("nan")  # masked out: not counted
    x[1, 0, 5, 3] = float("inf")  # inside the mask: counted as non-finite
    s = SiteStats(("batch", "head", "q_pos", "k_pos"), k=k)
    s.update(x, valid)
    out = s.summary()
    full = valid.expand_as(x)
    keep = full & torch.isfinite(x)
    assert out["nonfinite"] == 1 and out["count"] == int(keep.sum())
    ref = x[keep].abs().sort(descending=True).values[:k]
    assert [abs(t["value"]) for t in out["topk"]] == ref.tolist()
    for t in out["topk"]:
        assert x[t["batch"], t["head"], t["q_pos"], t["k_pos"]] == t["value"] and t["k_pos"] <= t["q_pos"]
    assert out["kurtosis"] == pytest.approx(sps.kurtosis(x[keep].double().numpy(), fisher=False), rel=1e-6)


def test_many_updates_fold_exactly():
    x = _heavy((150, 4, 16), seed=7) + 2.0
    s = SiteStats(("batch", "pos", "channel"), k=10)
    for i in range(150):  # more than one fold of pending per-update sums
        s.update(x[i:i + 1], row_offset=i)
    out = s.summary(full=False)
    ref = x.double().numpy().ravel()
    assert out["count"] == ref.size and out["passes"] == 150
    assert out["mean"] == pytest.approx(ref.mean(), rel=1e-6)
    assert out["kurtosis"] == pytest.approx(sps.kurtosis(ref, fisher=False), rel=1e-6)
    per_pass = [sps.kurtosis(x[i].double().numpy().ravel(), fisher=False) for i in range(150)]
    assert out["pass_kurtosis_mean"] == pytest.approx(np.mean(per_pass), rel=1e-6)
    assert out["pass_kurtosis_max"] == pytest.approx(np.max(per_pass), rel=1e-6)
    assert out["pass_infnorm_max"] == pytest.approx(float(x.abs().max()))


def test_shards_merge_equals_one_pass():
    x = _heavy((8, 12, 16), seed=5)
    ids = torch.randint(0, 100, (8, 12))
    one = SiteStats(("batch", "pos", "channel"), k=20)
    one.update(x, input_ids=ids)
    shards = []
    for i in range(0, 8, 2):
        s = SiteStats(("batch", "pos", "channel"), k=20)
        s.update(x[i:i + 2], input_ids=ids[i:i + 2], row_offset=i)
        shards.append(s)
    merged = shards[0]
    for s in shards[1:]:
        merged = merged.merge(s)
    a, b = one.summary(), merged.summary()
    assert a["count"] == b["count"] and a["topk"] == b["topk"] and a["quantiles"] == b["quantiles"]
    assert a["channel_absmax"] == b["channel_absmax"] and a["position_absmax"] == b["position_absmax"]
    # per-element powers are float32 (sums float64): agreement to float32 rounding
    ref = sps.kurtosis(x.double().numpy().ravel(), fisher=False)
    assert a["kurtosis"] == pytest.approx(ref, rel=1e-6) and b["kurtosis"] == pytest.approx(ref, rel=1e-6)
    assert b["passes"] == 4


def _rank_worker(rank, world, path, port):
    """One torchrun-like rank: the environment torchrun sets, then diffquant's own process-group calls."""
    import os

    import torch.distributed as dist

    from diffquant.stats.distributed import barrier, finish_distributed, gather_merge, init_distributed, \
        merge_across_ranks, rank_world
    from diffquant.stats.sinks import LayerSinks

    os.environ.update({"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    init_distributed()
    seen = rank_world()
    x = _heavy((4, 6, 16), seed=9)
    s = SiteStats(("batch", "pos", "channel"), k=10)
    s.update(x[rank * 2:(rank + 1) * 2], row_offset=rank * 2)
    merged = merge_across_ranks({"site": s})
    lone = merge_across_ranks({"site": s} if rank == 0 else {})  # rank 1 holds no site: it gets rank 0's, on the CPU
    sinks = {}
    if rank == 0:  # rank 1 ran no batch of this layer: it holds no key, and adds nothing
        sinks[0] = LayerSinks()
        sinks[0].add_hidden(x, None)
    layer = gather_merge(sinks)
    barrier()
    finish_distributed()
    if rank == 0:
        torch.save({"summary": merged["site"].summary(), "rank_world": seen, "sinks": layer[0].summary(diff=False),
                    "initialized_after": dist.is_initialized()}, path)
    else:
        torch.save({"lone": lone["site"].summary(), "device": str(lone["site"].nonfinite.device)}, path + ".1")


def test_merge_across_two_gloo_ranks(tmp_path):
    """Two processes joined as torchrun joins them (init_distributed from its environment variables): the merged
    statistics equal one process fed every batch; a site or layer only rank 0 saw is rank 0's alone (on the CPU for a
    rank that held none); the group is gone after finish_distributed."""
    import socket

    import torch.multiprocessing as mp

    from diffquant.stats.sinks import LayerSinks

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = tmp_path / "merged.pt"
    mp.spawn(_rank_worker, args=(2, str(path), port), nprocs=2, join=True)
    got = torch.load(path)
    merged = got["summary"]
    one = SiteStats(("batch", "pos", "channel"), k=10)
    x = _heavy((4, 6, 16), seed=9)
    one.update(x)
    ref = one.summary()
    assert merged["count"] == ref["count"] and merged["topk"] == ref["topk"]
    assert merged["kurtosis"] == pytest.approx(ref["kurtosis"], rel=1e-6)
    assert got["rank_world"] == (0, 2) and got["initialized_after"] is False
    alone = LayerSinks()
    alone.add_hidden(x, None)
    assert got["sinks"] == alone.summary(diff=False)
    lone = torch.load(str(path) + ".1")
    first = SiteStats(("batch", "pos", "channel"), k=10)
    first.update(x[:2])
    assert lone["lone"] == first.summary() and lone["device"] == "cpu"


def test_outside_torchrun_the_process_group_calls_do_nothing(monkeypatch):
    import torch.distributed as dist

    from diffquant.stats.distributed import barrier, finish_distributed, gather_merge, init_distributed, \
        merge_across_ranks, rank_world

    for world in (None, "1"):  # torchrun's variable unset (a plain `python`), or a world of one
        if world is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", world)
        init_distributed()
        barrier()
        assert not dist.is_initialized() and rank_world() == (0, 1)
    stats = {"site": SiteStats(("batch", "pos", "channel"))}
    assert merge_across_ranks(stats) is stats and gather_merge(stats) is stats
    finish_distributed()
    assert not dist.is_initialized()


def test_ranks_merge_in_rank_order_over_every_key():
    """Three ranks' dicts as all_gather_object returns them: rank 1 ran no batch, sites `a` and `c` were seen by
    one rank each; `b` by ranks 0 and 2 merges as one process fed rank 0's batches then rank 2's (the top-k's tie
    at the largest value keeps rank 0's row, which comes first)."""
    from diffquant.stats.distributed import merge_in_rank_order

    x = _heavy((6, 5, 16), seed=13)
    x[4, 2, 3] = x[0, 1, 3] = 500.0  # a tie at the top, in rank 0's rows and in rank 2's

    def fed(rows):
        s = SiteStats(("batch", "pos", "channel"), k=4)
        for r in rows:
            s.update(x[r:r + 1], row_offset=r)
        return s

    parts = [{"a": fed([0]), "b": fed([0, 1])}, {}, {"b": fed([4, 5]), "c": fed([3])}]
    merged = merge_in_rank_order(parts)
    assert sorted(merged) == ["a", "b", "c"]
    assert merged["a"].summary() == fed([0]).summary() and merged["c"].summary() == fed([3]).summary()
    got, ref = merged["b"].summary(), fed([0, 1, 4, 5]).summary()
    assert got["topk"] == ref["topk"] and got["count"] == ref["count"] and got["quantiles"] == ref["quantiles"]
    assert got["topk"][:2] == [{"value": 500.0, "batch": 0, "pos": 1, "channel": 3},
                               {"value": 500.0, "batch": 4, "pos": 2, "channel": 3}]
    assert got["kurtosis"] == pytest.approx(ref["kurtosis"], rel=1e-9)


@pytest.mark.slow
def test_compiled_statistics_equal_eager():
    x = _heavy((4, 32, 64), seed=11)
    x[1, 2, 3] = float("nan")  # the second update takes the checked (masked) path
    ids = torch.randint(0, 100, (4, 32))
    logits = _heavy((2, 4, 16, 16), seed=12)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()[None, None]
    cases = [(("batch", "pos", "channel"), [(x.nan_to_num(), None), (x * 2, None)]),
             (("batch", "head", "q_pos", "k_pos"), [(logits, causal), (logits * 3, causal)])]
    for dims, updates in cases:
        eager, fused = SiteStats(dims), SiteStats(dims, compile=True)
        for s in (eager, fused):
            for t, valid in updates:
                s.update(t, valid, input_ids=ids if valid is None else None)
        a, b = eager.summary(), fused.summary()
        assert not site_stats._COMPILED_PASSES.failed  # it really compiled here
        assert a["topk"] == b["topk"] and a["count"] == b["count"] and a["nonfinite"] == b["nonfinite"]
        assert a["channel_absmax"] == b["channel_absmax"] and a["position_absmax"] == b["position_absmax"]
        assert a["kurtosis"] == pytest.approx(b["kurtosis"], rel=1e-6)
        assert a["quantiles"] == b["quantiles"]
        assert a.get("channel_hit_fraction") == b.get("channel_hit_fraction")


def test_intervals_match_scipy_and_numpy():
    from diffquant.stats.intervals import fmt_pm, paired, standard_error, t_interval

    vals = [1.0, 2.0, 4.0, 7.5]
    lo, hi = sps.t.interval(0.95, len(vals) - 1, loc=np.mean(vals), scale=sps.sem(vals))
    t = t_interval(vals)
    assert t["mean"] == pytest.approx(np.mean(vals)) and t["half"] == pytest.approx((hi - lo) / 2, rel=1e-12)
    assert t_interval([3.0])["half"] is None and t_interval([])["mean"] is None
    assert standard_error(vals) == pytest.approx(np.std(vals, ddof=1) / np.sqrt(len(vals)))
    a, b = [1.0, 2.0, 3.0, 5.0], [1.5, 2.1, 3.9, 5.2]
    d = np.subtract(b, a)
    p = paired(a, b)
    assert p["mean"] == pytest.approx(d.mean()) and p["se"] == pytest.approx(sps.sem(d))
    t95 = sps.t.ppf(0.975, len(d) - 1)  # paired intervals are t-intervals over the n sequences
    assert p["ci95"] == pytest.approx([d.mean() - t95 * sps.sem(d), d.mean() + t95 * sps.sem(d)])
    assert fmt_pm(74.1234, 1.234) == "74.1 ± 1.2" and fmt_pm(0.012345, 0.0021) == "0.0123 ± 0.0021"
    assert fmt_pm(-0.000253, 0.016525) == "-0.0003 ± 0.0165" and fmt_pm(0.0, 0.0) == "0.000 ± 0.000"


def test_language_modeling_interval_over_sequences(micro_pair):
    import torch

    from diffquant.evaluate import language_modeling
    model = micro_pair[0]
    ids = torch.randint(0, 512, (5, 12), generator=torch.Generator().manual_seed(3))
    r = language_modeling(model, ids, batch_size=2)
    with torch.no_grad():
        logits = model(ids).logits[:, :-1]
    per = [float(torch.nn.functional.cross_entropy(logits[i], ids[i, 1:])) for i in range(5)]
    assert r["per_sequence_loss"] == pytest.approx(per, rel=1e-5)
    assert r["loss_se"] == pytest.approx(sps.sem(per), rel=1e-4)
    t95 = sps.t.ppf(0.975, len(per) - 1)  # perplexity's interval: exp of the loss's t-interval
    assert r["ppl_ci95"] == pytest.approx([np.exp(np.mean(per) - t95 * sps.sem(per)),
                                           np.exp(np.mean(per) + t95 * sps.sem(per))], rel=1e-4)
    assert r["tokens"] == 5 * 11 and r["sequences"] == 5


def test_welch_against_a_hand_computation():
    from diffquant.stats.intervals import welch

    a, b = [10.0, 11.0, 12.0], [1.0, 2.0, 4.0]
    va, vb = np.var(a, ddof=1) / 3, np.var(b, ddof=1) / 3
    t = (np.mean(a) - np.mean(b)) / np.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / 2 + vb ** 2 / 2)  # Welch–Satterthwaite
    w = welch(a, b)
    assert w["p"] == pytest.approx(2 * sps.t.sf(abs(t), df), rel=1e-9) and w["sign"] == 1
    assert welch(b, a)["sign"] == -1 and welch(b, a)["diff"] == pytest.approx(-w["diff"])
    assert welch([1.0, 2.0, 3.0], [1.1, 2.2, 2.9])["sign"] == 0  # no difference detected
    assert welch([1.0], [2.0, 3.0]) is None and welch([0.0, 0.0], [0.0, 0.0])["sign"] == 0


def test_every_quantile_key_is_torch_quantile_at_the_probability_its_name_states():
    """Each key of the summary's quantiles against torch.quantile of |x| at the probability written in its name
    (the table is spelled here, not read from site_stats), on bfloat16-representable values, where the histogram is
    exact. The values spread over decades, so the four probabilities give four different numbers."""
    named = {"median": 0.5, "p99": 0.99, "p99.9": 0.999, "p99.99": 0.9999}
    g = torch.Generator().manual_seed(21)
    x = (torch.exp(2 * torch.randn(3, 4000, 8, generator=g)) * torch.randn(3, 4000, 8, generator=g).sign())
    x = x.bfloat16().float()
    s = SiteStats(("batch", "pos", "channel"))
    s.update(x[:2])
    s.update(x[2:])
    got = s.summary(full=False)["quantiles"]
    ref = {k: float(torch.quantile(x.abs().double().flatten(), p)) for k, p in named.items()}
    assert len(set(ref.values())) == 4 and set(got) == set(named)
    for key in named:
        assert got[key] == pytest.approx(ref[key], rel=1e-12), key


def test_channel_hit_fraction_is_hits_over_the_valid_positions():
    """LLM.int8's per-channel fraction: positions with |x| >= t over the positions counted (valid tokens of every
    update), both counted here in numpy, over two updates, one with padding. Never over the values counted (a
    position holds several channels)."""
    g = torch.Generator().manual_seed(22)
    a, b = torch.randn(2, 5, 4, generator=g) * 3, torch.randn(3, 4, 4, generator=g) * 3
    valid = torch.ones(2, 5, 1, dtype=torch.bool)
    valid[1, :2] = False  # left padding
    s = SiteStats(("batch", "pos", "channel"), outlier_threshold=2.5)
    s.update(a, valid)
    s.update(b)
    hits = ((np.abs(a.numpy()) >= 2.5) & valid.numpy()).sum(axis=(0, 1)) + (np.abs(b.numpy()) >= 2.5).sum(axis=(0, 1))
    positions = int(valid.sum()) + 3 * 4
    assert positions == 20 and hits.max() > 0
    assert s.summary()["channel_hit_fraction"] == [round(h / positions, 6) for h in hits.tolist()]


def test_per_pass_statistics_merge_over_two_shards():
    """Two shards fed disjoint halves of the forward passes (one update each pass), merged: the per-pass kurtosis
    and ∞-norm (mean and maximum over passes) equal one process fed everything and a plain numpy computation. The
    largest ∞-norm and kurtosis sit in the second shard, so a merge that kept the first shard's would show."""
    g = torch.Generator().manual_seed(23)
    passes = [torch.randn(2, 6, 16, generator=g) * (1 + i) for i in range(6)]
    passes[4][1, 2, 3] = -90.0  # the largest |x| and the most peaked pass
    one = SiteStats(("batch", "pos", "channel"))
    shards = [SiteStats(("batch", "pos", "channel")), SiteStats(("batch", "pos", "channel"))]
    for i, x in enumerate(passes):
        one.update(x, row_offset=2 * i)
        shards[i >= 3].update(x, row_offset=2 * i)
    merged = shards[0].merge(shards[1]).summary(full=False)
    kurt = [sps.kurtosis(x.double().numpy().ravel(), fisher=False) for x in passes]
    inf = [float(x.abs().max()) for x in passes]
    for out in (merged, one.summary(full=False)):
        assert out["passes"] == 6
        assert out["pass_kurtosis_mean"] == pytest.approx(np.mean(kurt), rel=1e-6)
        assert out["pass_kurtosis_max"] == pytest.approx(max(kurt), rel=1e-6)
        assert out["pass_infnorm_mean"] == pytest.approx(np.mean(inf), rel=1e-12)
        assert out["pass_infnorm_max"] == 90.0


def test_topk_rank_beyond_what_was_seen_and_of_zeros():
    """rank(r) is the r-th largest |x| seen: 0.0 where the values were zeros (a real value), None past the values
    seen (three offered with k = 100) and for left-out entries (masked values kept while fewer than k were valid)."""
    from diffquant.stats.topk import TopK

    top = TopK(100, 1)
    top.add(torch.tensor([0.0, -0.0, 0.0]), None, ("channel",))
    assert [top.rank(r) for r in (1, 3, 4, 100)] == [0.0, 0.0, None, None]
    masked = TopK(4, 1)
    masked.add(torch.tensor([2.0, -5.0, 1.0, 7.0]), torch.tensor([True, True, False, False]), ("channel",))
    assert [masked.rank(r) for r in (1, 2, 3, 4, 5)] == [5.0, 2.0, None, None, None]


def test_topk_reads_profiles_pickled_before_its_entries_were_private():
    """Profiles saved before the kept entries became `_abs`, `_values`, `_coords` (and held only valid entries) load
    with their entries: a TopK pickled under the old attribute names reads back the same values and coordinates."""
    import pickle

    from diffquant.stats.topk import TopK

    top = TopK(3, 3)
    top.add(torch.tensor([[[1.0, -9.0], [4.0, 0.5]]]), None, ("batch", "pos", "channel"), row_offset=2)
    old = TopK.__new__(TopK)
    old.__dict__.update({"k": 3, "abs": top.abs.clone(), "values": top.values.clone(), "coords": top.coords.clone()})
    back = pickle.loads(pickle.dumps(old))
    assert back.k == 3 and back.values.tolist() == [-9.0, 4.0, 1.0] and back.abs.tolist() == [9.0, 4.0, 1.0]
    assert back.coords.tolist() == [[2, 0, 1, -1], [2, 1, 0, -1], [2, 0, 0, -1]]
    assert back.rank(1) == 9.0 and back.rank(4) is None


def test_moments_of_nothing_and_of_a_constant():
    """No values: count 0 and no mean, std or kurtosis. A constant: its mean, std 0 and no kurtosis (0/0), also
    after merging it with nothing, in either order."""
    assert Moments().summary() == {"count": 0, "mean": None, "std": None, "kurtosis": None}
    const = Moments.of(torch.full((2, 5), -2.5), None)
    for m in (const, Moments().merge(const), const.merge(Moments())):
        assert m.summary() == {"count": 10, "mean": -2.5, "std": 0.0, "kurtosis": None}


def test_histogram_sparse_lists_the_counted_bins():
    """The non-empty bins by index (numpy's reading of the float32 bits, rounded to 16), with their counts."""
    x = torch.tensor([1.0, -1.0, 3.0, 0.0, 1e-3, float("nan")])
    h = AbsHistogram()
    h.add(x)
    u = np.abs(x[:5].numpy()).view(np.uint32).astype(np.int64)
    bins, counts = np.unique((u + 0x8000) >> 16, return_counts=True)
    assert h.sparse() == {"format": "float32-round16", "bins": {str(b): int(c) for b, c in zip(bins, counts)}}


def test_histogram_bin_edges_are_the_rounding_boundaries():
    """Bin i holds the bit patterns [(i << 16) − 2^15, (i << 16) + 2^15): its edges read by numpy from those bits,
    consecutive bins sharing an edge, the last one ending at float32's largest value; abs_magnitude_bins (not in place)
    gives magnitude_bins' bins and leaves its input alone."""
    from diffquant.stats.histogram import abs_magnitude_bins

    i = np.array([1, 0x3F80, 0x3F81, 0x4000, NBINS - 2], dtype=np.int64)
    lo, hi = bin_edges(torch.tensor(i))
    assert lo.tolist() == ((i << 16) - 0x8000).astype(np.uint32).view(np.float32).astype(np.float64).tolist()
    assert hi.tolist() == ((i << 16) + 0x8000).astype(np.uint32).view(np.float32).astype(np.float64).tolist()
    assert bin_edges(torch.tensor(i + 1))[0].tolist() == hi.tolist()
    assert bin_edges(torch.tensor([NBINS - 1]))[1].tolist() == [float(torch.finfo(torch.float32).max)]
    x = torch.tensor([0.0, 1e-30, 0.3, 1.0 + 2**-8, 6.0, 1e4, 3e38])
    kept = x.clone()
    assert abs_magnitude_bins(x).tolist() == magnitude_bins(x).tolist() and torch.equal(x, kept)


def test_histogram_counts_past_float32s_exact_integers():
    """A bin's count stays exact past 2^24 (where a float32 count would stop adding ones): 2^24 + 3 zeros."""
    h = AbsHistogram()
    h.add_bins(torch.zeros(1, dtype=torch.int64).expand(2**24 + 3))
    assert int(h.counts[0]) == 2**24 + 3 and int(h.counts.sum()) == 2**24 + 3


def test_moments_of_a_mean_halfway_between_two_float32_values():
    """10⁶ + 0, 1/16 or 2/16 (float32's step at 10⁶ is 1/16) in counts that put the exact mean at 10⁶ + 1/32: the
    float32 centre the torch path takes is off by δ of the spread's order, so every term of the move of M₂..M₄ to
    the exact mean (moments.shift_central) is far above float64 rounding. Every sum here is exact in float64."""
    x = torch.cat([torch.zeros(20480), torch.full((8192,), 1 / 16), torch.full((4096,), 2 / 16)]) + 1e6
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(13))]
    s = SiteStats(("out", "in"), kernels="torch")
    x = x.reshape(64, 512)
    s.update(x)
    s._fold()
    d = x.double().flatten() - (1e6 + 1 / 32)
    assert float(s.moments.mean) == 1e6 + 1 / 32
    for p, got in ((2, s.moments.m2), (3, s.moments.m3), (4, s.moments.m4)):
        assert float(got) == pytest.approx(float((d ** p).sum()), rel=1e-9, abs=1e-9 * float((d.abs() ** p).sum()))


def test_topk_leaves_non_finite_values_out_only_when_asked():
    """TopK.add and add_rows written out: with finite=True inf and NaN are left out (the Triton path counts them
    apart), by default they are kept (the torch path's mask leaves them out before); masked values never enter;
    coordinates (batch, pos, channel, token id) at the default offsets of 0; two empty TopKs merge to an empty one."""
    from diffquant.stats.topk import TopK

    dims = ("batch", "pos", "channel")
    x = torch.tensor([[[1.0, float("inf"), -5.0, float("nan")], [2.0, -3.0, 7.0, 0.5]]])
    ok = torch.ones(1, 2, 4, dtype=torch.bool)
    ok[0, 1, 2] = False  # the 7.0
    ids = torch.tensor([[11, 12]])
    t = TopK(5, 3)
    t.add(x, ok, dims, ids, finite=True)
    assert t.values.tolist() == [-5.0, -3.0, 2.0, 1.0, 0.5]
    assert t.coords.tolist() == [[0, 0, 2, 11], [0, 1, 1, 12], [0, 1, 0, 12], [0, 0, 0, 11], [0, 1, 3, 12]]
    kept, no_nan = TopK(2, 3), x.clone()
    no_nan[0, 0, 3] = 0.25
    kept.add(no_nan, ok, dims, ids)
    assert kept.values.tolist() == [float("inf"), -5.0]
    rows = TopK(3, 3)
    rows.add_rows(torch.tensor([1]), torch.tensor([[2.0, -3.0, float("inf"), 0.5]]), None, x.shape, dims, ids,
                  finite=True)
    assert rows.values.tolist() == [-3.0, 2.0, 0.5]
    assert rows.coords.tolist() == [[0, 1, 1, 12], [0, 1, 0, 12], [0, 1, 3, 12]]
    empty = TopK(4, 3).merge(TopK(4, 3))
    assert empty.abs.numel() == 0 and empty.coords.shape == (0, 4)


def test_topk_row_search_of_a_query_block():
    """`add` with row maxima (the search of the k rows with the largest maxima: 2 of 3 here) on a block of query rows
    2..5 of 6 (pos_offset 2, pos_total 6): inf left out with finite=True, positions offset, token ids read at the global
    position; the same through add_rows, which the flash path calls."""
    from diffquant.stats.topk import TopK

    dims = ("batch", "head", "q_pos", "k_pos")
    x = torch.tensor([[[[1.0, float("inf"), -4.0], [0.5, 3.0, 0.25], [0.1, 0.2, -0.3]]]])
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    rowmax = torch.tensor([[[4.0, 3.0, 0.3]]])  # of the finite values, as the caller's must be
    want_values, want_coords = [-4.0, 3.0], [[0, 0, 2, 2, 12], [0, 0, 3, 1, 13]]
    t = TopK(2, 4)
    t.add(x, None, dims, ids, rowmax=rowmax, pos_offset=2, pos_total=6, finite=True)
    assert t.values.tolist() == want_values and t.coords.tolist() == want_coords
    r = TopK(2, 4)
    r.add_rows(torch.tensor([0, 1]), x.reshape(3, 3)[:2], None, x.shape, dims, ids, pos_offset=2, pos_total=6,
               finite=True)
    assert r.values.tolist() == want_values and r.coords.tolist() == want_coords
