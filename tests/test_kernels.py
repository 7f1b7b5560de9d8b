"""The kernels switch (diffquant/kernels) and the Triton kernels against the torch path, under the contract written
in diffquant/kernels/__init__.py.

The Triton kernels run here in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 is set before anything imports
Triton (this module is the only test module that imports it; an xdist worker that runs other modules after this one
keeps the variable, which only Triton reads). References are independent computations written here (float64 sums,
bincount, full sorts) or the torch path, never the kernel compared with itself; tensors are small and tiles large
(about 12 ms per program instance in the interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from diffquant import kernels  # noqa: E402
from diffquant.errors import DiffquantError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def test_site_kernel_moments_of_a_large_mean():
    """Values whose mean is 1,000 standard deviations from 0: the float32 mean each tile centres on is off by up to
    half its last bit, so its sums are moved to the exact mean (without that, M₃ is off by ~6e-5 of Σ|x − μ|³)."""
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(9)) + 1000.0
    a, b = _both([(x, None, None)], WEIGHT_DIMS)
    assert_exact_but_moments(a, b)
    assert_contract_moments(b.moments, x.flatten())


# ---------------------------------------------------------------- compiled for a GPU (no GPU needed)

COMPILED = ["_site_kernel"] * 2 + ["_pool_kernel"]  # the launches COMPILE_CHECK compiles
COMPILE_CHECK = """
import itertools, json, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from diffquant.kernels import site

specs = [(site._site_kernel, dict(x_ptr=x, mask_ptr="*i8", stats_ptr="*fp64", rowmax_ptr="*fp32", hist_ptr="*i64",
                                  colmax_ptr="*i32", hits_ptr="*i64", nonfinite_ptr="*i64", positions_ptr="*i64",
                                  R="i32", W="i32", D1="i32", D2="i32", ms0="i32", ms1="i32", ms2="i32", ms3="i32",
                                  threshold_bits="i32"),
          dict(MASKED=masked, COLMAX=colmax, HITS=colmax, BR=8, BW=512, CHUNKS=3))
         for x, masked, colmax in (("*fp32", True, True), ("*bf16", False, False))]
specs.append((site._pool_kernel, dict(stats_ptr="*fp64", out_ptr="*fp64", P="i32"), dict(BLOCK=site.POOL_BLOCK)))
done = []
for fn, signature, constexprs in specs:
    signature = {**signature, **{k: "constexpr" for k in constexprs}}
    compiled = compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    done.append((fn.__name__, len(compiled.asm["cubin"]) > 0))
print(json.dumps(done))
"""


@pytest.mark.slow
def test_kernels_compile_for_cuda():
    """Every kernel, in its variants (the most and the least it computes), compiles to a cubin for sm_90 with the Triton here
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
        for key in ("mean", "std", "kurtosis", "pass_kurtosis_mean", "pass_kurtosis_max"):
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
