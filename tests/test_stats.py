import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from diffquant.stats import LogHistogram, Moments, SiteStats


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
    ref = torch.cat(parts).double().numpy()
    s = merged.summary()
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
def test_histogram_quantiles_within_one_percent(dist):
    g = torch.Generator().manual_seed(3)
    x = {"normal": torch.randn(200_000, generator=g),
         "lognormal": torch.exp(4 * torch.randn(200_000, generator=g)),
         "heavy": _heavy((2000, 100)).ravel()}[dist]
    h = LogHistogram()
    a = x.abs()
    h.add(a, None)
    qs = [0.5, 0.9, 0.99, 0.999, 0.9999]
    got = h.quantiles(qs)
    ref = torch.quantile(a.double(), torch.tensor(qs, dtype=torch.float64))
    for g_, r in zip(got, ref.tolist()):
        assert abs(g_ - r) / r <= 0.01


def test_histogram_zero_and_empty():
    h = LogHistogram()
    assert h.quantiles([0.5]) == [None]
    h.add(torch.zeros(10), None)
    assert h.quantiles([0.5]) == [0.0]


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
    import torch.distributed as dist

    from diffquant.stats.distributed import merge_across_ranks

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = _heavy((4, 6, 16), seed=9)
    s = SiteStats(("batch", "pos", "channel"), k=10)
    s.update(x[rank * 2:(rank + 1) * 2], row_offset=rank * 2)
    merged = merge_across_ranks({"site": s})
    if rank == 0:
        torch.save(merged["site"].summary(), path)
    dist.destroy_process_group()


def test_merge_across_two_gloo_ranks(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = tmp_path / "merged.pt"
    mp.spawn(_rank_worker, args=(2, str(path), port), nprocs=2, join=True)
    merged = torch.load(path)
    one = SiteStats(("batch", "pos", "channel"), k=10)
    one.update(_heavy((4, 6, 16), seed=9))
    ref = one.summary()
    assert merged["count"] == ref["count"] and merged["topk"] == ref["topk"]
    assert merged["kurtosis"] == pytest.approx(ref["kurtosis"], rel=1e-6)


@pytest.mark.slow
def test_compiled_statistics_equal_eager():
    x = _heavy((4, 32, 64), seed=11)
    ids = torch.randint(0, 100, (4, 32))
    eager, fused = SiteStats(("batch", "pos", "channel")), SiteStats(("batch", "pos", "channel"), compile=True)
    for s in (eager, fused):
        s.update(x, input_ids=ids)
        s.update(x * 2, input_ids=ids)
    a, b = eager.summary(), fused.summary()
    assert fused.compile  # it really compiled here (it falls back to eager only where compilation fails)
    assert a["topk"] == b["topk"] and a["count"] == b["count"] and a["channel_absmax"] == b["channel_absmax"]
    assert a["kurtosis"] == pytest.approx(b["kurtosis"], rel=1e-6)
    assert a["quantiles"] == pytest.approx(b["quantiles"], rel=0.01)
    assert a["channel_hit_fraction"] == b["channel_hit_fraction"]
