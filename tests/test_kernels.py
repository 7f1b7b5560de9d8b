"""The kernels switch (diffquant/kernels) and the Triton kernels against the torch path, under the contract written
in diffquant/kernels/__init__.py.

The Triton kernels run here in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 is set by conftest.py before
any test module is imported (Triton decorates its own standard functions when triton.language is first imported, which
torch or torchao may do while other modules are collected), and again here for a run of this file alone. References are independent computations written here (float64 sums,
bincount, full sorts) or the torch path, never the kernel compared with itself; tensors are small and tiles large
(about 12 ms per program instance in the interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"

import importlib.metadata  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from diffquant import kernels  # noqa: E402
from diffquant.errors import DiffquantError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _triton_version() -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in importlib.metadata.version("triton").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return ()


pytestmark = pytest.mark.skipif(_triton_version() < (3, 8), reason="the kernels' tests run in the interpreter of "
                                "Triton >= 3.8 (pip install 'diffquant[test]' on Linux; a CUDA torch may pin an older one)")


def test_choices_resolve_by_device(monkeypatch):
    pytest.importorskip("triton")
    assert kernels.resolve("auto", "cpu") == "torch"  # auto: Triton on CUDA tensors only, also under the interpreter
    assert kernels.resolve("torch", "cpu") == "torch"
    assert kernels.resolve("triton", "cpu") == "triton"  # the interpreter is on (this module)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(DiffquantError, match="runs on CUDA tensors, not on cpu"):
        kernels.resolve("triton", "cpu")
    with pytest.raises(DiffquantError, match="unknown kernels 'cuda'; choose one of: auto, triton, torch"):
        kernels.resolve("cuda", "cpu")
    with kernels.chosen("triton"):
        assert kernels.current() == "triton"
        with kernels.chosen(None):
            assert kernels.current() == "triton"
    assert kernels.current() == "auto"


@pytest.mark.slow
def test_diffquant_works_without_triton():
    """Triton hidden (an import of it fails): `import diffquant` and a profile work, "auto" takes torch, and asking
    for "triton" is one clear error."""
    code = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch
import diffquant as dq
from diffquant.errors import DiffquantError
from diffquant.models.presets import PRESETS, build
model = build(PRESETS["micro"], "baseline", seed=0)
prof = dq.profile(model, torch.randint(0, 512, (2, 40)), kernels="auto")
print(prof.provenance["kernels"], prof.sites["layers.0.hidden"].summary(full=False)["kernels"])
try:
    dq.profile(model, torch.randint(0, 512, (2, 40)), kernels="triton")
except DiffquantError as e:
    print("refused:", e)
print("triton" in sys.modules and sys.modules["triton"] is not None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "{'asked': 'auto', 'path': 'torch'} torch"
    assert lines[1] == "refused: kernels='triton' needs Triton, which does not import here: pip install 'diffquant[gpu]'"
    assert lines[2] == "False"


def test_every_profiling_command_takes_kernels(tmp_path, capsys):
    from diffquant.cli import build_parser, main

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command in ("profile", "sweep", "train"):
        flag = next(a for a in sub[command]._actions if "--kernels" in a.option_strings)
        assert flag.default == "auto" and tuple(flag.choices) == kernels.CHOICES, command
    (tmp_path / "t.txt").write_text("In the beginning was the word.\n" * 400)
    argv = ["profile", "--model", "micro:baseline", "--data", str(tmp_path / "t.txt"), "--tokens", "128", "--seq-len",
            "64", "--no-plots", "--no-sinks"]
    assert main([*argv, "--out", str(tmp_path / "p"), "--kernels", "torch"]) == 0
    import json

    model = json.loads((tmp_path / "p" / "stats.json").read_text())["models"][0]
    assert model["provenance"]["kernels"] == {"asked": "torch", "path": "torch"}
    assert {s["kernels"] for s in model["sites"].values()} == {"torch"}
    os.environ.pop("TRITON_INTERPRET")
    try:
        capsys.readouterr()
        assert main([*argv, "--out", str(tmp_path / "q"), "--kernels", "triton"]) == 2
    finally:
        os.environ["TRITON_INTERPRET"] = "1"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kernels='triton'" in err


# ---------------------------------------------------------------- the fused site kernel (kernels/site.py)

LOGIT_DIMS = ("batch", "head", "q_pos", "k_pos")
WEIGHT_DIMS = ("out_channel", "in_channel")


def _heavy(shape, seed, dtype=torch.float32):
    """Gaussian values with an outlier column and a large mean offset in one row (a mutated centring shows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3 + 0.7
    x[..., 5] *= 40
    x.view(-1, shape[-1])[1] += 250.0
    return x.to(dtype)


def _both(updates, dims, k=40, threshold=6.0):
    """SiteStats fed the same updates ((x, valid, block) each) on each path."""
    from diffquant.stats.site_stats import SiteStats

    out = {}
    for path in ("torch", "triton"):
        s = SiteStats(dims, k=k, outlier_threshold=threshold, kernels=path)
        for x, valid, block in updates:
            s.update(x, valid, block=block)
        s._fold()
        assert (s._kernel is not None) == (path == "triton")  # that path really ran (`path` alone names the choice)
        out[path] = s
    return out["torch"], out["triton"]


def assert_exact_but_moments(a, b):
    """Integers, maxima, top-k (values, coordinates, token ids, order) and the per-pass ∞-norm: the same bits."""
    assert torch.equal(a.hist.counts, b.hist.counts)
    assert int(a.nonfinite) == int(b.nonfinite) and int(a.positions) == int(b.positions)
    for name in ("channel_absmax", "position_absmax", "channel_hits"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None and y is None) or torch.equal(x, y), name
    assert torch.equal(a.topk._abs, b.topk._abs) and torch.equal(a.topk._values, b.topk._values)
    assert torch.equal(a.topk._coords, b.topk._coords)
    assert a.passes == b.passes and torch.equal(a.pass_inf, b.pass_inf)
    assert a.path == "torch" and b.path == "triton"
    for name, dtype in (("channel_absmax", torch.float32), ("channel_hits", torch.int64)):
        assert getattr(b, name) is None or getattr(b, name).dtype == dtype, name


def reference_moments(values: torch.Tensor) -> dict:
    """Count, mean and Σ(x − μ)^p, Σ|x − μ|^p for p = 2..4 of the values, in float64 (numpy's pairwise sums)."""
    v = values.double().numpy()
    mu = v.mean()
    d = v - mu
    return {"n": v.size, "mean": mu, **{f"m{p}": (d**p).sum() for p in (2, 3, 4)},
            **{f"abs{p}": (abs(d) ** p).sum() for p in (2, 3, 4)}}


def assert_contract_moments(m, values: torch.Tensor):
    """|ΔM_p| ≤ 1e-6·Σ|x − μ|^p for p = 2..4, kurtosis and std within 1e-6 relative (diffquant/kernels)."""
    ref = reference_moments(values)
    assert float(m.n) == ref["n"]
    for p in (2, 3, 4):
        assert abs(float(getattr(m, f"m{p}")) - ref[f"m{p}"]) <= 1e-6 * ref[f"abs{p}"], p
    s = m.summary()
    std, kurt = (ref["m2"] / ref["n"]) ** 0.5, ref["m4"] / ref["n"] / (ref["m2"] / ref["n"]) ** 2
    assert s["std"] == pytest.approx(std, rel=1e-6) and s["kurtosis"] == pytest.approx(kurt, rel=1e-6)
    assert s["mean"] == pytest.approx(ref["mean"], rel=1e-6, abs=1e-9 * std)


def test_site_kernel_token_site_with_padding_and_nonfinite_values():
    """A padded [batch, pos, channel] batch holding inf, -inf and NaN (some under the padding): every integer, maximum
    and the top-k equal the torch path's; moments within the contract of the values counted."""
    x = _heavy((4, 24, 96), 1)
    x[1, 2, 3], x[2, 3, 4], x[3, 9, 0], x[0, 1, 7] = float("inf"), float("nan"), float("-inf"), float("nan")
    valid = torch.ones(4, 24, 1, dtype=torch.bool)
    valid[0, :5] = False  # left padding: x[0, 1, 7] is masked
    a, b = _both([(x, valid, None), (x * -2, None, None)], ("batch", "pos", "channel"))
    assert_exact_but_moments(a, b)
    assert int(b.nonfinite) == 3 + 4 and int(b.positions) == 4 * 24 - 5 + 4 * 24
    keep = torch.cat([x[valid.expand_as(x) & x.isfinite()], (x * -2)[(x * -2).isfinite()]])
    assert_contract_moments(b.moments, keep)
    assert int(b.hist.counts.sum()) == keep.numel()


def test_site_kernel_rows_and_columns_with_nothing_counted():
    """A channel all NaN, a position masked in every sequence, a row whose one finite value is its only one counted,
    seven channels (a chunk of eight: one lane past the last): what has no counted value has maximum 0, a row of one
    counted value is a position, and nothing is written past the last channel (a sentinel after the maxima)."""
    from diffquant.stats.site_stats import SiteStats

    x = _heavy((2, 5, 7), 3)
    x[:, :, 3] = float("nan")
    x[0, 1, 1:] = float("nan")
    valid = torch.ones(2, 5, 1, dtype=torch.bool)
    valid[:, 4] = False
    a, b = _both([(x, valid, None)], ("batch", "pos", "channel"))
    assert_exact_but_moments(a, b)
    assert float(b.channel_absmax[3]) == 0.0 and float(b.position_absmax[4]) == 0.0
    assert int(b.positions) == 2 * 4
    s = SiteStats(("batch", "pos", "channel"), k=40, kernels="triton")
    after = torch.zeros(8)
    after[7] = -1.0  # its bits are a negative int32: an atomic max of a 0 past the end would overwrite it
    s.channel_absmax = after[:7]
    s.update(x, valid)
    assert float(after[7]) == -1.0 and torch.equal(s.channel_absmax, b.channel_absmax)


def test_site_kernel_logits_weights_and_bf16():
    """A causal block of logits (head and query maxima from the row maxima), a weight (channel dim first) and a bf16
    activation read in its own dtype: equal to the torch path, moments within the contract."""
    x = _heavy((2, 3, 40, 72), 2)
    valid = (torch.arange(72)[None, :] <= torch.arange(30, 70)[:, None])[None, None]
    a, b = _both([(x, valid, None)], LOGIT_DIMS)
    assert_exact_but_moments(a, b)
    assert_contract_moments(b.moments, x[valid.expand_as(x)])
    w = _heavy((48, 80), 3)
    a, b = _both([(w, None, None)], WEIGHT_DIMS)
    assert_exact_but_moments(a, b)
    assert_contract_moments(b.moments, w.flatten())
    h = _heavy((3, 20, 64), 4, torch.bfloat16)
    a, b = _both([(h, None, None)], ("batch", "pos", "channel"))
    assert_exact_but_moments(a, b)
    assert_contract_moments(b.moments, h.float().flatten())


def test_site_kernel_logits_of_a_padded_batch():
    """Logits [batch, head, q, k] with a causal and padding mask that differs between sequences ([batch, 1, q, k]:
    the mask's batch stride is not 0): each row reads its own sequence's mask."""
    x = _heavy((3, 2, 12, 12), 5)
    causal = torch.arange(12)[None, :] <= torch.arange(12)[:, None]
    valid = causal.expand(3, 1, 12, 12).clone()
    valid[1, :, :, :4] = False  # left padding of 4 in sequence 1, of 7 in sequence 2
    valid[2, :, :, :7] = False
    x[1, :, :, :4] = 500.0  # padded logits far out: read with another sequence's mask they would count
    x[2, :, :, :7] = -400.0
    a, b = _both([(x, valid, None)], LOGIT_DIMS)
    assert_exact_but_moments(a, b)
    assert_contract_moments(b.moments, x[valid.expand_as(x)])
    assert float(b.topk.abs[0]) < 400.0


def test_site_kernel_scalar_site_and_a_pickle_without_its_kernel():
    """A zero-dim site (a scalar such as a loss) on both paths, and one value three times (spread 0: a tile centred
    off its single value would leave a rounding residue, a negative one making the std complex); a pickled site (a
    saved profile) leaves the kernel and its device buffers behind and counts on as the original."""
    import pickle

    from diffquant.stats.site_stats import SiteStats

    a, b = _both([(torch.tensor(3.5), None, None), (torch.tensor(-7.25), None, None)], ())
    assert_exact_but_moments(a, b)
    assert b.summary()["absmax"] == 7.25 and b.summary()["count"] == 2
    for v in (1.2345678, 0.8007462):  # one value per update, not exact in float32 halves: each update's M₂ is 0
        one = SiteStats((), kernels="triton")
        for _ in range(3):
            one.update(torch.tensor(v))
        assert one.summary()["std"] == 0.0 and one.summary()["kurtosis"] is None
    a, b = _both([(torch.tensor([0.5, -4.0, 2.0]), None, None)], ("channel",))  # one dim: not reshaped to one value
    assert_exact_but_moments(a, b)
    assert b.summary()["channel_absmax"] == [0.5, 4.0, 2.0]
    copy = pickle.loads(pickle.dumps(b))
    assert copy._kernel is None and copy.summary() == b.summary()


def _perturbed(value, scale):
    if isinstance(value, list):
        return value[:-1] if value else [1.0]
    if isinstance(value, dict):
        return {**value, "extra": 1.0}
    return value + 1 if isinstance(value, int) else value * (1 + scale)


@pytest.mark.parametrize("key", ["count", "nonfinite", "absmax", "top", "topk", "quantiles", "channel_absmax",
                                 "channel_hit_fraction", "std", "kurtosis"])
def test_the_contract_check_reports_each_statistic_it_compares(monkeypatch, key):
    """The check "auto" trusts before choosing Triton must see a Triton path that differs in any one statistic it
    compares (each altered alone in the Triton side's summary), and pass a difference within the contract (std and
    kurtosis within 1e-6 relative)."""
    from diffquant.stats import site_stats

    real = site_stats.SiteStats.summary
    scale = {"key": 1e-5}

    def summary(self, full=True):
        s = real(self, full)
        if self.path == "triton":
            s[key] = _perturbed(s[key], scale["key"])
        return s

    monkeypatch.setattr(site_stats.SiteStats, "summary", summary)
    message = site_stats.contract_check("cpu")
    assert message is not None and message.startswith(key + " "), message
    if key in ("std", "kurtosis"):
        scale["key"] = 5e-7
        assert site_stats.contract_check("cpu") is None


def test_the_contract_check_sees_a_triton_path_that_ignores_the_mask(monkeypatch):
    """A fault only in the masked update (the Triton side counting every value whatever the mask says) is caught:
    the check must feed its sample under its mask, not only whole."""
    from diffquant.stats import site_stats

    real = site_stats.SiteStats.update

    def update(self, x, valid=None, *args, **kwargs):
        return real(self, x, None if self.kernels == "triton" else valid, *args, **kwargs)

    monkeypatch.setattr(site_stats.SiteStats, "update", update)
    assert site_stats.contract_check("cpu") == "count differs from torch's"


def test_the_contract_check_passes_a_difference_at_its_tolerance_exactly(monkeypatch):
    """1e-6 relative is allowed, equality included: kurtosis 1e6 against 1e6 + 1 (a difference of exactly
    1e-6 · 1e6 in floats) passes, 1e6 + 2 does not."""
    from diffquant.stats import site_stats

    real = site_stats.SiteStats.summary
    triton = {"kurtosis": 1e6 + 1}

    def summary(self, full=True):
        s = real(self, full)
        s["kurtosis"] = triton["kurtosis"] if self.path == "triton" else 1e6
        return s

    monkeypatch.setattr(site_stats.SiteStats, "summary", summary)
    assert abs(1e6 + 1 - 1e6) == 1e-6 * 1e6
    assert site_stats.contract_check("cpu") is None
    triton["kurtosis"] = 1e6 + 2
    assert site_stats.contract_check("cpu") == "kurtosis 1000002.0 against torch's 1000000.0"


def test_the_contract_sample_holds_what_the_check_relies_on():
    """The same sample on every call; a tie of more than 16 values at the top of the finite |x| (inside the check's
    top-24); exactly one inf, one NaN and one subnormal, the inf where the mask leaves it out and the NaN where the
    mask keeps it (the masked update meets both); a mask that keeps most
    positions and leaves some out in every sequence; blocks that cut x into two unequal parts."""
    from diffquant.stats.site_stats import contract_sample

    x, valid, blocks = contract_sample()
    again = contract_sample()
    assert torch.equal(x.nan_to_num(), again[0].nan_to_num()) and torch.equal(valid, again[1])
    finite = x[x.isfinite()].abs()
    top = finite.topk(24).values
    assert int((top == top[0]).sum()) > 16 and float(top[0]) > float(finite.topk(21).values[-1])
    assert int(x.isposinf().sum()) == 1 and int(x.isnan().sum()) == 1
    tiny = x[(x != 0) & (x.abs() < torch.finfo(torch.float32).tiny)]
    assert tiny.numel() == 1
    inf, nan = x.isposinf().nonzero()[0], x.isnan().nonzero()[0]
    assert not bool(valid[inf[0], inf[1], 0]) and bool(valid[nan[0], nan[1], 0])
    kept = valid[..., 0].sum(dim=1)
    assert bool((kept < x.shape[1]).all()) and int(kept.sum()) > x.shape[0] * x.shape[1] // 2
    assert [b.shape[1] for b in blocks] == [20, 17] and torch.equal(torch.cat(blocks, 1).nan_to_num(), x.nan_to_num())


def test_a_merge_or_copy_of_unused_statistics_keeps_the_kernels_asked_for():
    """A rank that saw nothing yet, merged or copied (gathering), then fed: it still takes the path it was asked
    for, not the process's default choice."""
    from diffquant.stats.site_stats import SiteStats

    dims = ("batch", "pos", "channel")
    x = torch.randn(2, 3, 8)
    for made in (lambda: SiteStats(dims, kernels="triton").merge(SiteStats(dims, kernels="triton")),
                 lambda: SiteStats(dims, kernels="triton").to("cpu")):
        s = made()
        s.update(x)
        assert s.path == "triton" and s._kernel is not None


def test_site_kernel_subnormals_and_zeros():
    """Subnormal magnitudes keep their own histogram bins and maxima (|x| from the bit pattern, not float arithmetic,
    which a GPU may flush to zero), and ±0 lands in bin 0 as on the torch path."""
    x = torch.full((2, 8, 32), 1e-40)
    x[0, :, ::2] = -3e-39
    x[1, 3] = -0.0
    x[1, 4, 5] = 2.5
    a, b = _both([(x, None, None)], ("batch", "pos", "channel"))
    assert_exact_but_moments(a, b)
    from diffquant.stats.histogram import magnitude_bins

    assert int(b.hist.counts[int(magnitude_bins(torch.tensor([3e-39])))]) == 8 * 16


def test_site_kernel_topk_ties_past_sixteen():
    """40 values tie at the largest |x| (both signs) across rows, k = 25: which tied entries are kept, and their
    order, equal the torch path's (one search and a stable merge on both)."""
    x = _heavy((3, 16, 64), 5) * 0.01
    g = torch.Generator().manual_seed(6)
    where = torch.randperm(x.numel(), generator=g)[:40]
    x.view(-1)[where] = torch.where(torch.arange(40) % 2 == 0, 9.0, -9.0)
    a, b = _both([(x, None, None), (x.flip(0), None, None)], ("batch", "pos", "channel"), k=25)
    assert_exact_but_moments(a, b)
    assert b.topk.values.abs().eq(9.0).all()


def test_site_kernel_is_deterministic_and_blocks_equal_the_whole():
    """Two runs give the same bits; query blocks of one call give the whole tensor's integers and maxima exactly and
    its moments within the contract (one pass of the per-pass statistics either way)."""
    from diffquant.stats.site_stats import SiteStats
    from diffquant.taps.context import Block

    x = _heavy((2, 2, 48, 48), 7)
    causal = (torch.arange(48)[None, :] <= torch.arange(48)[:, None])[None, None]
    runs = []
    for _ in range(2):
        s = SiteStats(LOGIT_DIMS, k=30, kernels="triton")
        s.update(x, causal)
        s._fold()
        runs.append(s)
    for key in ("n", "mean", "m2", "m3", "m4"):
        assert torch.equal(getattr(runs[0].moments, key), getattr(runs[1].moments, key)), key
    blocked = SiteStats(LOGIT_DIMS, k=30, kernels="triton")
    for r0 in range(0, 48, 16):
        blocked.update(x[:, :, r0:r0 + 16], causal[:, :, r0:r0 + 16], block=Block(r0, r0 + 16, 48, 48, r0 + 1))
    blocked._fold()
    whole = runs[0]
    assert torch.equal(whole.hist.counts, blocked.hist.counts) and whole.passes == blocked.passes == 1
    assert torch.equal(whole.channel_absmax, blocked.channel_absmax)
    assert torch.equal(whole.position_absmax, blocked.position_absmax)
    assert torch.equal(whole.topk._abs, blocked.topk._abs) and torch.equal(whole.topk._coords, blocked.topk._coords)
    assert_contract_moments(blocked.moments, x[causal.expand_as(x)])
    assert whole.summary()["pass_kurtosis_max"] == pytest.approx(blocked.summary()["pass_kurtosis_max"], rel=1e-6)


def test_site_kernel_merges_chunks_and_programs_in_the_contract():
    """Rows wider than a chunk and more rows than a program takes (several chunks per program, several programs),
    their means far apart: each chunk's central sums moved to the pooled mean (a mutated merge fails here)."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(40, 6000, generator=g) * torch.linspace(0.5, 4, 6000) + torch.linspace(-30, 90, 40)[:, None]
    x[:, 4096:] += 200.0  # the second chunk of each row far from the first
    x[7, 4500] = -900.0
    a, b = _both([(x, None, None)], WEIGHT_DIMS)
    assert_exact_but_moments(a, b)
    assert_contract_moments(b.moments, x.flatten())


def test_site_kernel_merges_a_side_of_a_single_value():
    """One row one column wider than a chunk (its second chunk holds one value), and one whose mask leaves a single
    value in its first chunk: Pébay's merge with a count of 1 on either side, the means far apart (a merge that
    divided that side's sum by 2, or dropped the mean's difference for it, fails here)."""
    g = torch.Generator().manual_seed(12)
    wide = torch.randn(1, 4097, generator=g) + 5.0
    wide[0, 4096] = 900.0
    a, b = _both([(wide, None, None)], WEIGHT_DIMS)
    assert_exact_but_moments(a, b)
    assert_contract_moments(b.moments, wide.flatten())
    x = torch.randn(1, 6000, generator=g) - 40.0
    x[0, 7] = 700.0
    valid = torch.ones(1, 6000, dtype=torch.bool)
    valid[0, :4096] = False
    valid[0, 7] = True  # the first chunk counts this value alone
    a, b = _both([(x, valid, None)], WEIGHT_DIMS)
    assert_exact_but_moments(a, b)
    assert_contract_moments(b.moments, x[valid])


def _central(values: list[float]) -> list[float]:
    """[count, sum, M2, M3, M4, max |x|] of plain values (float64, written out)."""
    v = torch.tensor(values, dtype=torch.float64)
    if not len(values):
        return [0.0] * 6
    d = v - v.sum() / len(values)
    return [float(len(values)), float(v.sum()), float((d ** 2).sum()), float((d ** 3).sum()), float((d ** 4).sum()),
            float(v.abs().max())]


@pytest.mark.parametrize("groups", [[[7.5], [], [1.0, 2.0, 4.0, -3.0, 0.5]], [[7.5]]], ids=["three", "one"])
def test_site_kernel_pools_exactly_its_programs(groups):
    """The pooling kernel on its own: the programs' [count, sum, M2, M3, M4, max] rows (one of a single value, one
    empty, one of five; or one program of one value) inside a buffer with far values before and after them, pooled to
    the moments of all their values together, as written out here."""
    from diffquant.kernels.site import POOL_BLOCK, STATS, _pool_kernel

    junk = [[1e6, 1e9, 1e9, 1e9, 1e9, 1e9]] * 2
    buf = torch.tensor(junk + [_central(g) for g in groups] + junk, dtype=torch.float64).flatten()
    stats = buf[2 * STATS:(2 + len(groups)) * STATS]  # a view: the kernel gets a pointer into the middle
    out = torch.full((STATS,), float("nan"), dtype=torch.float64)
    _pool_kernel[(1,)](stats, out, len(groups), BLOCK=POOL_BLOCK)
    want = torch.tensor(_central([v for g in groups for v in g]), dtype=torch.float64)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("mean", [1000.0, 1e6])
def test_site_kernel_moments_of_a_large_mean(mean):
    """Values whose mean is 1,000 (or 10⁶) standard deviations from 0: the float32 mean each path centres on is off by
    up to half its last bit, so both move their sums to the exact mean (without that, M₃ is off by ~6e-5 of Σ|x − μ|³
    at 1,000). At 10⁶ that half bit is 0.03 standard deviations: each term of the move (δ·e₁, δ²·e₁, δ³·e₁, n·δ⁴ …)
    is then above the contract's tolerance, so a wrong coefficient in any of them fails."""
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(9)) + mean
    a, b = _both([(x, None, None)], WEIGHT_DIMS)
    assert_exact_but_moments(a, b)
    assert_contract_moments(a.moments, x.flatten())
    assert_contract_moments(b.moments, x.flatten())


def test_site_kernel_moments_of_a_mean_halfway_between_two_float32_values():
    """10⁶ + 0, 1/16 or 2/16 (float32's step at 10⁶ is 1/16) in counts that put the exact mean at 10⁶ + 1/32, halfway
    between two float32 values: the centre each path takes is off by a whole standard deviation's order (δ = 1/32
    against a spread of 0.04), and every term of the move to the exact mean, M₂ to M₄, is far above the contract's
    tolerance. Every sum here is exact in float64."""
    x = torch.cat([torch.zeros(20480), torch.full((8192,), 1 / 16), torch.full((4096,), 2 / 16)]) + 1e6
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(13))].reshape(64, 512)
    assert x.double().mean().item() == 1e6 + 1 / 32
    a, b = _both([(x, None, None)], WEIGHT_DIMS)
    assert_exact_but_moments(a, b)
    assert_contract_moments(a.moments, x.flatten())
    assert_contract_moments(b.moments, x.flatten())


# ---------------------------------------------------------------- compiled for a GPU (no GPU needed)

COMPILED = ["_site_kernel", "_pool_kernel", "_flash_kernel", "_rows_kernel", "_absmax_kernel", "_flash_kernel"]
COMPILE_CHECK = """
import itertools, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from diffquant.kernels import flash, site

specs = [(site._site_kernel, dict(x_ptr=x, mask_ptr="*i8", stats_ptr="*fp64", rowmax_ptr="*fp32", hist_ptr="*i64",
                                  colmax_ptr="*i32", hits_ptr="*i64", nonfinite_ptr="*i64", positions_ptr="*i64",
                                  R="i32", W="i32", D1="i32", D2="i32", ms0="i32", ms1="i32", ms2="i32", ms3="i32",
                                  threshold_bits="i32"),
          dict(MASKED=masked, COLMAX=colmax, HITS=colmax, BR=8, BW=512, CHUNKS=3))
         for x, masked, colmax in (("*fp32", True, True),)]
specs.append((site._pool_kernel, dict(stats_ptr="*fp64", out_ptr="*fp64", P="i32"), dict(BLOCK=site.POOL_BLOCK)))
strides = {name: "i32" for name in ("sqb", "sqh", "sqm", "skb", "skh", "skn", "smb", "smm", "smn")}
sizes = dict(H="i32", Q="i32", K="i32", D="i32")
for x, mask, stats in (("*fp32", 0, True), ("*bf16", 2, False)):
    common = dict(CAUSAL=mask == 0, MASK=mask, BF16_LOGITS=x == "*bf16", PRECISION="ieee" if x == "*fp32" else "tf32",
                  WIDEN=False, BM=64, BN=64, DP=64)
    specs.append((flash._flash_kernel,
                  dict(q_ptr=x, k_ptr=x, v_ptr=x, out_ptr="*fp32", mask_ptr="*i8", stats_ptr="*fp64", rowmax_ptr="*fp32",
                       hist_ptr="*i64", nonfinite_ptr="*i64", first_ptr="*i32", mass_ptr="*fp32", logits_ptr="*fp32",
                       qscale_ptr="*fp32", **strides, svb="i32", svh="i32", svn="i32", sob="i32", som="i32", soh="i32",
                       **sizes, DV="i32", kv_div="i32", v_div="i32", v_mod="i32", offset="i32", scale="fp32",
                       qmax="fp32"),
                  dict(common, STATS=stats, QUANT=stats, STATS_QUANTIZED=stats, WRITE_LOGITS=False, DVP=128)))
    if x == "*bf16":
        continue  # the rows and range kernels' tiles are the flash kernel's
    specs.append((flash._rows_kernel,
                  dict(q_ptr=x, k_ptr=x, mask_ptr="*i8", sel_ptr="*i64", values_ptr="*fp32", ok_ptr="*i8",
                       qscale_ptr="*fp32", **strides, **sizes, kv_div="i32", offset="i32", scale="fp32", qmax="fp32"),
                  dict(common, QUANT=True)))
    specs.append((flash._absmax_kernel,
                  dict(q_ptr=x, k_ptr=x, mask_ptr="*i8", rowmax_ptr="*fp32", **strides, **sizes, kv_div="i32",
                       offset="i32", scale="fp32"), common))
done = []
for fn, signature, constexprs in specs:
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    compiled = compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    done.append((fn.__name__, len(compiled.asm["cubin"]) > 0))
print(json.dumps(done))
"""


@pytest.mark.slow
def test_kernels_compile_for_cuda():
    """Every kernel (the flash kernel with float32 and bfloat16 inputs) compiles to a cubin for sm_90 with the Triton here
    (its own ptxas; no GPU needed): the interpreter accepts programs the compiler refuses (loop-carried types, scalar
    shapes), so this is the check that the kernels build where they run. In a fresh process without TRITON_INTERPRET,
    which makes @triton.jit give interpreted functions."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, TRITON_DEFAULT_FP_FUSION="1")
    out = subprocess.run([sys.executable, "-c", COMPILE_CHECK], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    done = json.loads(out.stdout.splitlines()[-1])
    assert len(done) == len(COMPILED) and all(ok for _, ok in done)


def _profiles(arch, sites, kernels_list=("torch", "triton"), ids=None, **kwargs):
    from diffquant.models.presets import PRESETS, build
    from diffquant.profiler import profile_model

    model = build(PRESETS["micro"], arch, seed=4)
    if ids is None:
        ids = torch.randint(0, 512, (2, 72), generator=torch.Generator().manual_seed(5))
    return [profile_model(model, ids, sites, batch_size=2, progress=False, k=30, kernels=k, **kwargs)
            for k in kernels_list]


def assert_profiles_agree(a, b, moments_rel=1e-6):
    """Two profiles of the same model and tokens: every site's integers, maxima and top-k the same, moments within the
    contract's relative bounds (std, kurtosis, per-pass kurtosis)."""
    assert set(a.sites) == set(b.sites)
    for name in a.sites:
        x, y = a.sites[name].summary(), b.sites[name].summary()
        assert y.pop("mean") == pytest.approx(x.pop("mean"), abs=moments_rel * x["std"]), name  # a mean near 0: in σ
        for key in ("std", "kurtosis", "pass_kurtosis_mean", "pass_kurtosis_max"):
            assert y.pop(key) == pytest.approx(x.pop(key), rel=moments_rel, abs=1e-9), (name, key)
        x.pop("kernels"), y.pop("kernels")
        assert x == y, name


@pytest.mark.parametrize("arch", ["baseline", "diff"])
def test_profile_with_triton_site_kernels_equals_torch(arch):
    """A whole profile of token sites (hidden states, Linear inputs with LLM.int8 hits) with the fused site kernel:
    the same statistics as the torch path; the report says which path computed each site."""
    sites = ["*.hidden", "*.attn_in", "*.mlp_in", "*.down_in"]
    torch_prof, triton_prof = _profiles(arch, sites)
    assert_profiles_agree(torch_prof, triton_prof)
    assert triton_prof.provenance["kernels"] == {"asked": "triton", "path": "triton"}
    assert {s.path for s in triton_prof.sites.values()} == {"triton"}


# ---------------------------------------------------------------- the interim eager fix (torch path off the CPU)


def test_masked_logits_never_reach_a_histogram_bin_off_the_cpu(monkeypatch):
    """On the accelerators' path (forced here on CPU) a masked or non-finite logit is added with weight 0 in the bin of
    its own |x|, not sent to bin 0 and subtracted (on a GPU, every masked value an atomic add to one address): bin 0
    receives only values that round to it, and the counts equal those of the CPU path and of a bincount of the
    visible finite values."""
    from diffquant.stats import site_stats
    from diffquant.stats.histogram import NBINS, AbsHistogram, magnitude_bins
    from diffquant.stats.site_stats import SiteStats

    x = _heavy((2, 3, 32, 64), 10)
    x[0, 1, 2, 3], x[1, 2, 30, 60] = float("nan"), float("inf")  # visible; masked
    valid = (torch.arange(64)[None, :] <= torch.arange(32, 64)[:, None])[None, None]
    seen = []
    add_bins = AbsHistogram.add_bins

    def spy(self, bins, zeros_left_out=None, counted=None):
        seen.append((bins.reshape(-1).clone(), None if counted is None else counted.reshape(-1).clone()))
        return add_bins(self, bins, zeros_left_out, counted)

    monkeypatch.setattr(AbsHistogram, "add_bins", spy)
    counts = {}
    for free_reads in (frozenset({"cpu"}), frozenset()):
        monkeypatch.setattr(site_stats, "FREE_READS", free_reads)
        s = SiteStats(LOGIT_DIMS, kernels="torch")
        s.update(x, valid)
        counts[free_reads] = s.hist.counts
    keep = valid.expand_as(x) & x.isfinite()
    ref = torch.bincount(magnitude_bins(x[keep]).long(), minlength=NBINS)
    assert torch.equal(counts[frozenset()], ref) and torch.equal(counts[frozenset({"cpu"})], ref)
    bins, counted = seen[-1]
    assert torch.equal(counted, keep.reshape(-1))
    left_out = ~keep.reshape(-1)
    rounds_to_zero = magnitude_bins(x).reshape(-1) == 0
    assert int((bins[left_out] == 0).sum()) == int((rounds_to_zero & left_out).sum()) < 10


# ---------------------------------------------------------------- attention logits inside flash attention (kernels/flash.py)


def _qkv(batch, heads, kv_heads, q_len, k_len, d, seed, dtype=torch.float32, dv=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, d, generator=g) * 2
    k = torch.randn(batch, kv_heads, k_len, d, generator=g)
    k[:, :, 0] *= 6  # a key every query sees, much larger: a sink and large logits
    v = torch.randn(batch, kv_heads, k_len, dv or d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _explicit(q, k, v, visible, scale, v_heads=None):
    """Logits, probabilities and output written out as the explicit attention computes them (taps/attention.py):
    matmul then scale in the inputs' dtype, an fp32 softmax over the visible keys, probabilities in the inputs' dtype,
    rows with no visible key all zero."""
    heads = q.shape[1]
    kk = k.repeat_interleave(heads // k.shape[1], 1)
    vv = v.repeat_interleave(heads // v.shape[1], 1) if v_heads is None else v[:, v_heads]
    logits = torch.matmul(q, kk.transpose(2, 3)).mul_(scale)
    probs = torch.softmax(logits.float().masked_fill(~visible, float("-inf")), dim=-1)
    probs = probs.masked_fill(~visible.any(-1, keepdim=True), 0.0).to(q.dtype)
    return logits.float(), probs, torch.matmul(probs, vv)


def assert_close_logits(got, want, dtype):
    """The kernel's logits against torch's (another summation order): fp32 within 1e-6 of the largest, bf16 within
    one bfloat16 step (their float32 sums may round to neighbouring bfloat16 values)."""
    if dtype == torch.float32:
        assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())
    else:
        assert bool(((got - want).abs() <= 2**-7 * want.abs() + 1e-30).all())


def _flash_site(q, k, v, masking, visible, scale, ids, k_top=20, **kwargs):
    """The flash kernel with statistics into a SiteStats, and the torch path's SiteStats of the kernel's own logits
    (written out) given as one tensor: (flash stats, reference stats, the kernel's result)."""
    from diffquant.kernels import flash
    from diffquant.stats.site_stats import SiteStats

    s = SiteStats(LOGIT_DIMS, k=k_top)
    r = flash.attention(q, k, v, masking, scale, hist=s.hist.counts, nonfinite=s.nonfinite, write_logits=True,
                        **kwargs)
    shape = torch.Size((q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    s.update_from_kernel(r.entry, r.rowmax, shape,
                         lambda rows: flash.logit_rows(q, k, masking, scale, rows, kwargs.get("quant")), ids)
    s._fold()
    ref = SiteStats(LOGIT_DIMS, k=k_top, kernels="torch")
    ref.update(r.logits, visible, ids)
    ref._fold()
    return s, ref, r


def test_flash_logit_statistics_of_a_few_rows_with_the_default_device_elsewhere():
    """Fewer logit rows than the top-k holds: every row is fetched again for the top-k, by indices made on the
    logits' device. With torch's default device set to meta (inputs on the CPU) the statistics are the same."""
    from diffquant.kernels import flash
    from diffquant.kernels.flash import Masking
    from diffquant.stats.site_stats import SiteStats

    q, k, v = _qkv(1, 2, 2, 3, 3, 8, 5)
    ids = torch.randint(0, 500, (1, 3), generator=torch.Generator().manual_seed(6))

    def stats():
        s = SiteStats(LOGIT_DIMS, k=20, device="cpu")
        r = flash.attention(q, k, v, Masking(True), 0.25, v_div=1, v_mod=2, hist=s.hist.counts, nonfinite=s.nonfinite)
        s.update_from_kernel(r.entry, r.rowmax, torch.Size((1, 2, 3, 3)),
                             lambda rows: flash.logit_rows(q, k, Masking(True), 0.25, rows, None), ids)
        return s.summary()

    want = stats()
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        got = stats()
    finally:
        torch.set_default_device(before)
    assert got == want and want["count"] == 2 * 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_logit_statistics_gqa_causal(dtype):
    """GQA (4 query heads on 2 KV heads), causal, 72 queries over 72 keys (tiles of 64: a window that is not a multiple
    of the tile). The kernel's logits are the explicit attention's (fp32: ieee dot; bf16: rounded where torch rounds),
    its statistics of the visible logits are the torch path's of those logits (integers, maxima, top-k with token ids
    exact; moments within the contract), the first-key masses and the output are the explicit attention's."""
    from diffquant.kernels.flash import Masking

    q, k, v = _qkv(2, 4, 2, 72, 72, 16, 11, dtype)
    ids = torch.randint(0, 500, (2, 72), generator=torch.Generator().manual_seed(12))
    visible = torch.ones(72, 72, dtype=torch.bool).tril()[None, None]
    s, ref, r = _flash_site(q, k, v, Masking(True), visible, 0.25, ids, v_div=2, v_mod=2)
    assert_exact_but_moments(ref, s)
    assert_contract_moments(s.moments, r.logits[visible.expand_as(r.logits)])
    assert int(s.hist.counts.sum()) == 2 * 4 * 72 * 73 // 2  # visible logits only
    logits, probs, out = _explicit(q, k, v, visible, 0.25)
    seen = visible.expand_as(logits)
    assert_close_logits(r.logits[seen], logits[seen], dtype)
    assert torch.equal(r.first, torch.zeros_like(r.first))
    # fp32: within 1e-5 relative, the exp of the interpreter's numpy and torch's differing by an ulp or two (it depends
    # on the CPU's vector units) summed over up to 72 keys; a wrong key or row is off by orders of magnitude more
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(r.mass.to(dtype).float(), probs[..., 0].float(), rtol=tol, atol=tol * 1e-3)
    assert torch.allclose(r.out.transpose(1, 2).float(), out.float(), rtol=tol, atol=tol)


def _nan_padded(t: torch.Tensor, extra: int = 4) -> torch.Tensor:
    """t as a view into a buffer whose last dim is `extra` wider, the extra filled with NaN: a lane read past the
    head width meets a NaN (the interpreter reads whatever memory follows; this makes it poison)."""
    big = torch.full((*t.shape[:-1], t.shape[-1] + extra), float("nan"), dtype=t.dtype)
    big[..., :t.shape[-1]] = t
    return big[..., :t.shape[-1]]


@pytest.mark.parametrize("causal", [True, False], ids=["past-keys", "no-mask"])
def test_flash_past_keys_and_attention_without_a_mask(causal):
    """5 queries after 65 past keys (causal, bottom-right aligned: query i sees keys up to i + 65), or 7 queries over
    70 keys with no mask at all; 70 keys fill one tile of 64 and part of a second, and a head width of 12 pads to 16
    with NaN just past each row of q, k and v (`_nan_padded`): logits, statistics, first-key masses and output against
    the explicit attention."""
    from diffquant.kernels.flash import Masking

    q_len, k_len = (5, 70) if causal else (7, 70)
    q, k, v = (_nan_padded(t) for t in _qkv(1, 2, 2, q_len, k_len, 12, 21))
    rows = torch.arange(q_len)[:, None] + (k_len - q_len if causal else k_len)
    visible = (torch.arange(k_len)[None, :] <= rows)[None, None]
    s, ref, r = _flash_site(q, k, v, Masking(causal), visible, 0.25, None, v_div=1, v_mod=2)
    assert_exact_but_moments(ref, s)
    assert int(s.hist.counts.sum()) == int(visible.sum()) * 2 and int(s.nonfinite) == 0
    logits, probs, out = _explicit(q, k, v, visible, 0.25)
    seen = visible.expand_as(logits)
    assert_close_logits(r.logits[seen], logits[seen], torch.float32)
    assert torch.allclose(r.mass.float(), probs[..., 0].float(), rtol=1e-5, atol=1e-8)
    assert torch.allclose(r.out.transpose(1, 2), out, rtol=1e-5, atol=1e-5)
    from diffquant.kernels import flash  # the range kernel (a dynamic quantizer's first pass) over the same tiles

    absmax = flash.row_absmax(q, k, Masking(causal), 0.25)
    assert torch.equal(absmax, r.logits.abs().masked_fill(~seen, 0.0).amax(-1))


def test_flash_logit_statistics_of_a_query_that_sees_no_key():
    """A full mask under which query 2 (of 3, over 5 keys) sees no key and query 0 only three: the row maximum of the
    empty row is 0 (the torch path's), its output and first-key mass 0; the others as the explicit attention's."""
    from diffquant.kernels.flash import FULL_MASK, Masking

    q, k, v = _qkv(1, 2, 2, 3, 5, 16, 31)
    visible = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    visible[0, 0, 2] = False
    visible[0, 0, 0, 3:] = False
    s, ref, r = _flash_site(q, k, v, Masking(False, FULL_MASK, visible.view(torch.int8)), visible, 0.25, None,
                            v_div=1, v_mod=2)
    assert_exact_but_moments(ref, s)
    assert float(s.position_absmax[2]) == 0.0 and not r.out[:, 2].any() and not r.mass[..., 2].any()
    _, probs, out = _explicit(q, k, v, visible, 0.25)
    assert torch.allclose(r.out.transpose(1, 2), out, rtol=1e-5, atol=1e-6)
    assert torch.allclose(r.mass.float(), probs[..., 0].float(), rtol=1e-5, atol=1e-8)


def test_flash_row_absmax_leaves_inf_out():
    """The range kernel's row maxima are of the finite visible logits: a key holding inf gives ±inf logits in every row,
    which a dynamic scale must not span."""
    from diffquant.kernels import flash
    from diffquant.kernels.flash import Masking

    q, k, _ = _qkv(1, 2, 2, 4, 4, 16, 41)
    k[0, :, 2, 0] = float("inf")
    visible = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    logits = (q @ k.transpose(2, 3)) * 0.25
    want = logits.abs().masked_fill(~(visible & logits.isfinite()), 0.0).amax(-1)
    got = flash.row_absmax(q, k, Masking(True), 0.25)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_flash_bf16_logits_round_ties_to_even():
    """bfloat16 logits exactly halfway between two bfloat16 values (1 + 2⁻⁸ and 1 + 3·2⁻⁸): rounded to the even one
    (1 and 1 + 2⁻⁶), as torch rounds its bfloat16 matmul."""
    from diffquant.kernels.flash import Masking

    q = torch.zeros(1, 1, 16, 16)
    k = torch.zeros(1, 1, 16, 16)
    q[..., 0], q[..., 1] = 1.0, 2.0**-8
    q[0, 0, 1::2, 1] = 3 * 2.0**-8
    k[..., 0], k[..., 1] = 1.0, 1.0
    q, k = q.bfloat16(), k.bfloat16()
    visible = torch.ones(16, 16, dtype=torch.bool).tril()[None, None]
    _, _, r = _flash_site(q, k, k, Masking(True), visible, 1.0, None, v_div=1, v_mod=1)
    want = torch.matmul(q, k.transpose(2, 3)).float()
    assert sorted(set(want[visible].tolist())) == [1.0, 1.015625]
    assert torch.equal(r.logits[visible], want[visible])


@pytest.mark.parametrize("kind", ["key", "full"])
def test_flash_logit_statistics_padded_batch(kind):
    """Left padding, as flash-attention's [batch, key] mask (with causality) or a 4-D mask (SDPA's boolean mask): the
    padded keys are invisible, a fully padded query row attends nothing (output 0, no first key), and nothing masked
    reaches a statistic."""
    from diffquant.kernels.flash import FULL_MASK, KEY_MASK, Masking

    q, k, v = _qkv(2, 2, 2, 100, 100, 16, 13)
    keys = torch.ones(2, 100, dtype=torch.bool)
    keys[1, :70] = False  # its rows 70.. see nothing in their first tile of keys (0-63)
    causal = torch.ones(100, 100, dtype=torch.bool).tril()
    visible = causal[None, None] & keys[:, None, None, :]
    if kind == "key":
        masking = Masking(True, KEY_MASK, keys.to(torch.int8))
    else:
        masking = Masking(False, FULL_MASK, visible.view(torch.int8))
    s, ref, r = _flash_site(q, k, v, masking, visible, 0.25, None, v_div=1, v_mod=2)
    assert_exact_but_moments(ref, s)
    assert_contract_moments(s.moments, r.logits[visible.expand_as(r.logits)])
    assert int(s.hist.counts.sum()) == int(visible.expand(2, 2, 100, 100).sum())
    logits, probs, out = _explicit(q, k, v, visible, 0.25)
    assert torch.equal(r.first[1, 0], torch.where(torch.arange(100) >= 70, 70, 100).int())  # rows 0-69: no key
    assert torch.allclose(r.out.transpose(1, 2), out, rtol=1e-5, atol=1e-6)
    assert bool((r.out[1, :70] == 0).all())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in the interpreter: inf - inf
def test_flash_nonfinite_logits_are_counted_apart():
    """inf in one key: its logits are ±inf or NaN; they are counted as non-finite, enter no other statistic, and the
    torch path of the same logits agrees."""
    from diffquant.kernels.flash import Masking

    q, k, v = _qkv(1, 2, 2, 24, 24, 16, 14)
    k[0, 1, 5, 3] = float("inf")
    visible = torch.ones(24, 24, dtype=torch.bool).tril()[None, None]
    s, ref, r = _flash_site(q, k, v, Masking(True), visible, 0.25, None, v_div=1, v_mod=2)
    assert_exact_but_moments(ref, s)
    assert int(s.nonfinite) == 24 - 5
    finite = r.logits[visible.expand_as(r.logits)]
    assert_contract_moments(s.moments, finite[finite.isfinite()])


def test_flash_diff_paired_values_and_masses():
    """DIFF's layout: 4 maps on 4 KV heads, paired values [V1 | V2] of width 2d read by maps j and j + 2: the output
    of each map is its probabilities times its paired value (the explicit attention's), over 3 query tiles."""
    from diffquant.kernels.flash import Masking

    q, k, _ = _qkv(1, 4, 4, 150, 150, 16, 15)
    vpair = torch.randn(1, 2, 150, 32, generator=torch.Generator().manual_seed(16))
    visible = torch.ones(150, 150, dtype=torch.bool).tril()[None, None]
    s, ref, r = _flash_site(q, k, vpair, Masking(True), visible, 0.25, None, k_top=5, v_div=1, v_mod=2,
                            out_dtype=torch.float32)
    assert_exact_but_moments(ref, s)
    _, probs, out = _explicit(q, k, vpair, visible, 0.25, v_heads=[0, 1, 0, 1])
    assert torch.allclose(r.out.transpose(1, 2), out, rtol=1e-5, atol=1e-6)
    assert torch.allclose(r.mass, probs[..., 0], rtol=1e-5, atol=1e-9)  # as in the GQA test: exp's ulps over 150 keys


def assert_numbers_close(a, b, rel, where=""):
    """Two report trees (dicts, lists, numbers) equal in structure, every number within `rel` (exact for integers)."""
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            assert_numbers_close(a[key], b[key], rel, f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_numbers_close(x, y, rel, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert b == pytest.approx(a, rel=rel, abs=2e-6), where  # some are rounded to 6 places
    else:
        assert a == b, where


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["baseline", "diff"])
def test_profile_with_flash_attention_equals_the_explicit_path(arch):
    """A whole profile (attention logits, hidden states, the sink metrics; DIFF: both maps, the differential map and λ)
    with kernels="triton": the flash kernel serves every layer's logits and sinks, and the report equals the explicit
    path's, within the float32 rounding that a differently summed attention output carries into later layers."""
    sites = ["*.attn_logits", "*.hidden"]
    explicit, fused = _profiles(arch, sites, sinks=True)
    assert {s.path for name, s in fused.sites.items() if "attn_logits" in name} == {"triton"}
    summary = lambda p: {name: {k: v for k, v in s.summary().items() if k != "kernels"}  # noqa: E731
                         for name, s in p.sites.items()}
    a, b = summary(explicit), summary(fused)
    for name in a:  # quantiles read bins: a value that moves by one rounding may cross a bin's edge
        a[name].pop("quantiles"), b[name].pop("quantiles")
    assert_numbers_close(a, b, rel=1e-5)
    assert_numbers_close(explicit.sink_summary(), fused.sink_summary(), rel=1e-5)
    counts = lambda p: sum(int(s.hist.counts.sum()) for n, s in p.sites.items() if "logits" in n)  # noqa: E731
    assert counts(explicit) == counts(fused)


def _tapped_run(model, ids, mask, choice, k=10):
    """The model run with logit-statistics and sink observers on every layer, under `choice` of kernels: (output
    logits, {site: summary}, {layer: sink summary})."""
    from diffquant.profiler import SinkObserver, StatsObserver
    from diffquant.stats.sinks import LayerSinks
    from diffquant.taps import Batch, site_table, tapped

    table = site_table(model)
    stats = {s.name: StatsObserver(k) for s in table if s.kind == "attn_logits"}
    sinks = {s.layer: LayerSinks() for s in table if s.kind == "attn_probs"}
    taps = {name: [o] for name, o in stats.items()}
    for s in table:
        if s.kind in ("attn_probs", "attn_map", "lambda") and s.layer is not None:
            taps.setdefault(s.name, []).append(SinkObserver(sinks[s.layer], s.kind))
    batch = Batch(input_ids=ids, attention_mask=mask)
    with kernels.chosen(choice), tapped(model, taps, batch), torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=False).logits
    diff = model.config.model_type == "diffllama"
    return (out, {n: {k: v for k, v in o.stats.summary().items() if k not in ("kernels", "quantiles")}
                  for n, o in stats.items()}, {i: s.summary(diff) for i, s in sinks.items()},
            {o.stats.path for o in stats.values()})


@pytest.mark.parametrize("arch", ["baseline", "diff"])
def test_flash_path_on_a_padded_batch(arch):
    """A left-padded batch (transformers passes a 4-D mask): the flash path's output at real tokens, its logit
    statistics and sink metrics equal the explicit path's."""
    from diffquant.models.presets import PRESETS, build

    model = build(PRESETS["micro"], arch, seed=4).eval()
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(17))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0
    a, b = _tapped_run(model, ids, mask, "torch"), _tapped_run(model, ids, mask, "triton")
    assert a[3] == {"torch"} and b[3] == {"triton"}
    real = mask.bool()
    assert torch.allclose(a[0][real], b[0][real], rtol=1e-5, atol=1e-6)
    assert_numbers_close(a[1], b[1], rel=1e-5)
    assert_numbers_close(a[2], b[2], rel=1e-5)


def test_flash_path_gqa_model_and_causality(qwen2):
    """Qwen2 with 4 query heads on 2 KV heads: the flash path equals the explicit one, and it is causal (a changed
    last token changes no earlier output: transformers passes no mask for plainly causal input)."""
    ids = torch.randint(0, 512, (1, 70), generator=torch.Generator().manual_seed(18))
    a, b = _tapped_run(qwen2, ids, None, "torch"), _tapped_run(qwen2, ids, None, "triton")
    assert b[3] == {"triton"}
    assert torch.allclose(a[0], b[0], rtol=1e-5, atol=1e-6)
    assert_numbers_close(a[1], b[1], rel=1e-5)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 512
    c = _tapped_run(qwen2, changed, None, "triton")
    assert torch.equal(c[0][:, :-1], b[0][:, :-1]) and not torch.equal(c[0][:, -1], b[0][:, -1])


# ---------------------------------------------------------------- quantized logits in the flash kernel (step 4)

GRANULARITIES = ["tensor", "head", "token"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_flash_quantized_logits_equal_fake_quant(granularity, dtype):
    """int4 dynamic absmax per tensor (of a sequence), per head, per token: the logits the kernel's softmax reads are
    quant/numerics/math.py's `dynamic_fake_quantize` of the kernel's own logits (ranges over the visible ones; masked ones kept),
    bit for bit, and its output is the explicit softmax of them times V."""
    from diffquant.kernels import flash
    from diffquant.quant.numerics import math as Q
    from diffquant.quant.numerics.granularity import parse_granularity
    from diffquant.quant.numerics.scheme import int_config
    from diffquant.quant.numerics.fake import FakeQuant

    q, k, v = _qkv(2, 4, 2, 72, 72, 16, 19, dtype)
    keys = torch.ones(2, 72, dtype=torch.bool)
    keys[1, :5] = False
    visible = torch.ones(72, 72, dtype=torch.bool).tril()[None, None] & keys[:, None, None, :]
    masking = flash.Masking(True, flash.KEY_MASK, keys.to(torch.int8))
    config = int_config(4, parse_granularity(granularity))
    raw = flash.attention(q, k, v, masking, 0.25, v_div=2, v_mod=2, write_logits=True).logits
    absmax = flash.row_absmax(q, k, masking, 0.25)
    assert torch.equal(absmax, torch.where(visible, raw.abs(), 0.0).amax(-1))
    quant = flash.Quant(FakeQuant(config).kernel_scales()(absmax), config.format.qmax)
    r = flash.attention(q, k, v, masking, 0.25, v_div=2, v_mod=2, quant=quant, write_logits=True)
    logits = raw.to(dtype)  # what the explicit path's taps see (bf16 logits in a bf16 model)
    want = Q.dynamic_fake_quantize(logits, config.format, config.granularity, LOGIT_DIMS, visible)
    want = Q.keep_masked(want, logits, visible).float()
    assert torch.equal(r.logits[visible.expand_as(want)], want[visible.expand_as(want)])
    assert len(torch.unique(want[0, 0, 40][visible[0, 0, 40]])) <= 15  # int4: 15 codes per scale
    probs = torch.softmax(want.masked_fill(~visible, float("-inf")), -1).masked_fill(~visible.any(-1, True), 0)
    out = torch.matmul(probs.to(dtype), v.repeat_interleave(2, 1)).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(r.out.transpose(1, 2).float(), out, rtol=tol, atol=tol)


@pytest.mark.parametrize("after", [False, True])
def test_flash_statistics_before_or_after_the_quantizer(after):
    """Statistics observed before the quantizer see the logits as computed; after it, the quantized ones (the taps'
    order, as in the explicit path); the top-k's recomputed rows are quantized alike."""
    from diffquant.kernels import flash
    from diffquant.quant.numerics.scheme import int_config
    from diffquant.quant.numerics.granularity import PerToken
    from diffquant.quant.numerics.fake import FakeQuant

    q, k, v = _qkv(1, 2, 2, 40, 40, 16, 20)
    visible = torch.ones(40, 40, dtype=torch.bool).tril()[None, None]
    config = int_config(3, PerToken())
    scales = FakeQuant(config).kernel_scales()  # the quantizer's own answer to the kernel (quant/numerics/fake.py)
    quant = flash.Quant(scales(flash.row_absmax(q, k, flash.Masking(True), 0.25)), config.format.qmax, after)
    s, ref, r = _flash_site(q, k, v, flash.Masking(True), visible, 0.25, None, v_div=1, v_mod=2, quant=quant)
    if after:  # the written logits are the quantized ones the statistics saw: `_flash_site`'s reference is exact
        assert_exact_but_moments(ref, s)
        assert len(torch.unique(r.logits[0, 0, 30, :31])) <= 7  # int3: 7 codes per row
    else:
        raw = flash.attention(q, k, v, flash.Masking(True), 0.25, v_div=1, v_mod=2, write_logits=True).logits
        from diffquant.stats.site_stats import SiteStats

        plain = SiteStats(LOGIT_DIMS, k=20, kernels="torch")
        plain.update(raw, visible)
        plain._fold()
        assert_exact_but_moments(plain, s)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["baseline", "diff"])
def test_logit_sweep_scheme_through_the_flash_kernel(arch):
    """The sweep's int4 logit schemes (quant/numerics/scheme.py, attached as the sweep attaches them) on micro models: with the
    Triton path the model's output equals the explicit fake-quant path's (the logits' rounding codes agree, so the
    outputs differ by float32 summation order only)."""
    from diffquant.models.presets import PRESETS, build
    from diffquant.quant.numerics.scheme import QuantScheme, attach_scheme, int_config
    from diffquant.quant.numerics.granularity import parse_granularity

    model = build(PRESETS["micro"], arch, seed=4).eval()
    ids = torch.randint(0, 512, (1, 72), generator=torch.Generator().manual_seed(21))
    for granularity in GRANULARITIES:
        scheme = QuantScheme(f"logits-int4-{granularity}",
                             (("*.attn_logits", int_config(4, parse_granularity(granularity))),))
        outs = []
        for choice in ("torch", "triton"):
            attachment = attach_scheme(model, scheme)
            try:
                with kernels.chosen(choice), torch.no_grad():
                    outs.append(model(ids, use_cache=False).logits)
            finally:
                attachment.remove()
        assert torch.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-5), granularity


@pytest.mark.parametrize("observer_first", [True, False])
def test_logit_statistics_and_quantizer_in_either_order(observer_first):
    """A statistics observer and an int4 per-head quantizer on the same logits, in either order: through the flash
    kernel the observer sees what it sees on the explicit path (the logits as computed, or quantized)."""
    from diffquant.models.presets import PRESETS, build
    from diffquant.profiler import StatsObserver
    from diffquant.quant.numerics.fake import FakeQuant
    from diffquant.quant.numerics.granularity import PerHead
    from diffquant.quant.numerics.scheme import int_config
    from diffquant.taps import Batch, tapped

    model = build(PRESETS["micro"], "baseline", seed=4).eval()
    ids = torch.randint(0, 512, (2, 72), generator=torch.Generator().manual_seed(22))
    summaries, outs = [], []
    for choice in ("torch", "triton"):
        observer = StatsObserver(k=10)
        pair = [observer, FakeQuant(int_config(4, PerHead()))]
        with kernels.chosen(choice), tapped(model, {"layers.0.attn_logits": pair if observer_first else pair[::-1]},
                                             Batch(input_ids=ids)), torch.no_grad():
            outs.append(model(ids, use_cache=False).logits)
        assert observer.stats.path == choice
        summaries.append({k: v for k, v in observer.stats.summary().items() if k not in ("kernels", "quantiles")})
    assert_numbers_close(summaries[0], summaries[1], rel=1e-5)
    assert torch.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    assert (len(summaries[1]["channel_absmax"]) == 4) and (summaries[1]["count"] == 2 * 4 * 72 * 73 // 2)


def test_auto_checks_the_kernel_on_its_device_first_and_keeps_to_torch_where_it_fails(monkeypatch, capsys):
    """The contract check "auto" runs once per device before choosing Triton passes here (the interpreter); where it
    fails, "auto" takes torch and says why once, and an explicit "triton" is not second-guessed."""
    import torch

    from diffquant import kernels
    from diffquant.stats.site_stats import contract_check

    assert contract_check("cpu") is None and kernels._checks == [contract_check]
    monkeypatch.setattr(kernels, "_verified", {})
    monkeypatch.setattr(kernels, "_checks", [lambda device: "std 1.0 against torch's 2.0"])
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    cuda = torch.device("cuda", 0)
    assert kernels.resolve("auto", cuda) == "torch" and kernels.resolve("auto", cuda) == "torch"
    assert capsys.readouterr().err.count("failed its check on cuda:0 (std 1.0 against torch's 2.0)") == 1
    assert kernels.resolve("triton", cuda) == "triton"
