"""Tiny offline models (width 64, 2 layers) built in fixtures."""

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # two workers on two cores: one thread each
    # and so the programs the tests start (the command line, experiments, torchrun ranks, gpu_check's steps): two
    # OpenMP threads each beside the other worker would oversubscribe the cores, and OpenMP's waiting threads spin
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# The longest tests, longest first (`pytest --durations` on 2 cores, 2026-12-07, under load from other work).
LONGEST = ("test_the_python_block_runs_verbatim", "test_notebook_runs", "test_simulation_matches_transformers_quanto_cache",
           "test_the_readme_commands_run_with_small_token_counts",
           "test_experiments_quick", "test_gpu_check_kernel_steps_run_on_cpu", "test_demo_quick",
           "test_gpu_check_runs_end_to_end_on_cpu", "test_sigterm_during_training_then_resume",
           "test_gpu_recipe_quick_runs_offline", "test_pair_mode_on_a_trained_pair",
           "test_torchrun_ranks_merge_to_the_one_process_report", "test_kernels_compile_for_cuda",
           "test_sigterm_during_sweep_then_resume", "test_experiments_run_as_modules",
           "test_lm_eval_adapter_agrees_with_own_scoring", "test_rerun_keeps_measured_conditions",
           "test_gpu_mode_on_cpu_trains_what_fits_and_keeps_every_checkpoint",
           "test_quick_run_end_to_end_with_tests_recomputed_and_checkpoints_remeasured")


def pytest_collection_modifyitems(items):
    """The longest tests first, then the other slow ones, then the rest. xdist's load scheduling hands each worker its
    next tests from the front of this list, two at a time (`--maxschedchunk 2` in pyproject.toml: by default the first
    worker got the first quarter of the list in one chunk, every long test with it, and ran them one after the other
    while the second worker sat idle), so the long end-to-end runs spread over both workers from the start and the
    many short tests fill the gaps.
    """
    def order(item):
        name = item.name.split("[")[0]
        return (LONGEST.index(name) if name in LONGEST else len(LONGEST), item.get_closest_marker("slow") is None)

    items.sort(key=order)


if not torch.cuda.is_available():
    # Triton's interpreter runs the kernels' tests (tests/test_kernels.py) on CPU tensors. Triton reads the variable when
    # it decorates a kernel, its own standard functions (tl.zeros, tl.sum) included, which it does when anything first
    # imports triton.language (torch and torchao may): so it is set here, before any test module is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def micro_pair():
    from diffquant.models.presets import PRESETS, build_pair

    return build_pair(PRESETS["micro"], seed=0)


@pytest.fixture(scope="session")
def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="session")
def bloom():
    """A causal LM whose attention does not go through AttentionInterface."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    return BloomForCausalLM(BloomConfig(vocab_size=512, hidden_size=64, n_layer=2, n_head=4)).eval()


@pytest.fixture(params=["llama", "diffllama", "qwen2"])
def any_model(request, micro_pair, qwen2):
    return {"llama": micro_pair[0], "diffllama": micro_pair[1], "qwen2": qwen2}[request.param]


def set_attn(model, name):
    model.set_attn_implementation(name)
    return model


def load_script_module(path: str, name: str):
    """A fresh copy of the experiments/, benchmarks/ or docs/ module at `path` (from the repository root), named
    `name` so that a test may change its settings without touching other tests' copy; in sys.modules (dataclasses
    look their module up there). Its own imports (`from experiments.pairs import ...`) resolve from the repository
    root, which pytest puts on sys.path (pyproject's `pythonpath`), as `python -m experiments.NAME` does."""
    import importlib.util
    import sys
    from pathlib import Path

    file = Path(__file__).resolve().parent.parent / path
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def drawn(monkeypatch):
    """Every matplotlib figure saved while a test runs, by file stem ("metric_vs_bits"): a spy on Figure.savefig that
    records the figure and calls matplotlib's own savefig, so the test reads back what was drawn (titles, axis
    labels, the plotted data) instead of only finding a PNG."""
    from pathlib import Path

    from matplotlib.figure import Figure

    figures = {}
    savefig = Figure.savefig

    def spy(self, fname, *args, **kwargs):
        figures[Path(fname).name.lstrip(".").split(".")[0]] = self
        return savefig(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return figures


@pytest.fixture
def load_script():
    return load_script_module


@pytest.fixture(scope="session")
def quanto_kernels():
    """optimum-quanto with its own kernels, never a stand-in (a replaced kernel once hid a crash of
    `--backend quanto-w4`). On CPU `quanto::unpack` is quanto's C++ extension (unpack.cpp and a pybind module),
    compiled with -O3 by torch.utils.cpp_extension at first use into quanto's package folder: about 55 s on a
    fresh 2-core machine, once per environment (cached after; xdist workers wait for one build). quanto's
    pure-torch `unpack` is only its fallback for devices without an extension. Yields the extension."""
    pytest.importorskip("optimum.quanto")
    import optimum.quanto  # noqa: F401  (defines quanto::unpack)
    from optimum.quanto.library.extensions import get_extension

    assert "inactive" not in torch._C._dispatch_dump("quanto::unpack"), "quanto::unpack is replaced"
    return get_extension("quanto_cpp")


def offline_prefix() -> list[str] | None:
    """A command prefix that runs a program with networking cut (a fresh network namespace, in a user namespace so
    no root is needed), or None where this machine does not permit it."""
    import shutil
    import subprocess

    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode != 0:
        return None
    return [unshare, "-rn"]


def assert_detectable(sd_text: str, units_text: str | None, a, b, tests: int, power: float = 0.8) -> None:
    """A "detectable X SD = Y" statement checked by an independent computation: the two-sided power of the pooled
    two-sample t-test at Holm's first step over `tests` (both tails of scipy's noncentral t, df = 2n − 2) crosses
    `power` within the rounding of the stated SD, and Y is that SD times the pooled standard deviation of a and b
    (numpy), within the rounding of both."""
    import math

    import numpy as np
    from scipy.stats import nct, t

    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n = min(len(a), len(b))
    df = 2 * n - 2
    crit = t.ppf(1 - 0.05 / tests / 2, df)

    def power_at(d):
        nc = d * math.sqrt(n / 2)
        return nct.sf(crit, df, nc) + nct.cdf(-crit, df, nc)

    sd = float(sd_text)
    half = 0.5 * 10 ** -(len(sd_text.split(".")[1]) if "." in sd_text else 0)
    assert power_at(sd - half) < power < power_at(sd + half), f"{sd_text} SD is not the {power:.0%}-power effect"
    if units_text is not None:
        pooled = math.sqrt(((len(a) - 1) * a.var(ddof=1) + (len(b) - 1) * b.var(ddof=1)) / (len(a) + len(b) - 2))
        units = float(units_text)
        assert (sd - half) * pooled * (1 - 5e-3) <= units <= (sd + half) * pooled * (1 + 5e-3), \
            f"{units_text} is not {sd_text} SD × the pooled SD {pooled:.4g}"


def holm_by_hand(ps: dict) -> dict:
    """Holm's adjustment written out, independent of the code under test: sort ascending, multiply the i-th smallest
    by m − i, running maximum, cap at 1."""
    out, running = {}, 0.0
    for i, key in enumerate(sorted(ps, key=ps.get)):
        running = max(running, min(1.0, (len(ps) - i) * ps[key]))
        out[key] = running
    return out


def write_micro_diff_checkpoint(root):
    """A micro DIFF model (2 layers, width 128) with a tokenizer trained on a small corpus: root/m and root/c.txt."""
    from diffquant.data.tokens import train_tokenizer
    from diffquant.models.presets import ModelSpec, build_pair

    text = "\n".join(f"and {w} went unto the {v} of {u}." for w, v, u in
                     zip(["he", "she", "they"] * 300, ["house", "city", "field", "land"] * 225, ["god", "men"] * 450))
    (root / "c.txt").write_text(text)
    _, diff = build_pair(ModelSpec("q", hidden=128, layers=2, heads=4, ffn=256, vocab=512, seq_len=64))
    diff.save_pretrained(root / "m")
    train_tokenizer(text, 400).save_pretrained(root / "m")
    return root
