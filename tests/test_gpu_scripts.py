"""The GPU scripts run where the GPU machine runs them: with no network (experiments/gpu_recipe.py --quick under a
cut network; the fair comparison's offline `--minutes` run is in test_fair_rivals), printing their estimate first and refusing a plan that
will not fit; and benchmarks/gpu_check.sh end to end on CPU (--cpu-smoke)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_script_module, offline_prefix
from diffquant.errors import DiffquantError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_recipe_quick_runs_offline(tmp_path):
    prefix = offline_prefix()
    if prefix is None:
        pytest.skip("unshare -rn is not permitted here (needs user and network namespaces)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([*prefix, sys.executable, "-m", "experiments.gpu_recipe", "--quick", "--out",
                        str(tmp_path)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    first = r.stdout.index("gpu_recipe (micro, 8,192 tokens per model, cpu): estimated ")
    assert first < r.stdout.index("| model |")  # the estimate comes before anything long
    for f in ("settings.json", "environment.json", "estimate.json", "timing.json", "profile/table5.md",
              "fig8/results.json", "emergence/emergence.png", "pairs/micro-synth_bb_vocab_32-8192-s0-track/emergence.json"):
        assert (tmp_path / f).is_file(), f
    assert json.loads((tmp_path / "settings.json").read_text())["corpus"].startswith("synth:bb")
    estimate = json.loads((tmp_path / "estimate.json").read_text())["seconds"]
    assert set(estimate) == {"training", "checkpoints", "held-out losses", "tracking", "profile", "sweep"}


def test_gpu_recipe_refuses_a_plan_that_does_not_fit(tmp_path, capsys):
    recipe = load_script_module("experiments/gpu_recipe.py", "gpu_recipe_under_test")
    with pytest.raises(DiffquantError, match=r"would take about [\d.]+ min, more than the 0.0 allowed: lower "
                                             r"--train-tokens \(about 0 fit\) or allow more --minutes"):
        recipe.main(["--quick", "--minutes", "0.001", "--out", str(tmp_path)])
    assert "estimated" in capsys.readouterr().out
    assert not (tmp_path / "pairs").exists()  # nothing trained


def _gpu_check_smoke(tmp_path, *steps):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work"), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-smoke", "--steps", *steps],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_cpu(tmp_path):
    """benchmarks/gpu_check.sh --cpu-smoke: every prerequisite checked in one line each, then every step (the
    benchmark section, the bf16 profile against fp32, a real backend's kernel, the GPU recipe's first seconds) ok,
    and one JSON summary. (The Triton kernels' steps: the next test, so that the two run side by side.)"""
    r = _gpu_check_smoke(tmp_path, "benchmarks", "bf16_profile", "backend", "recipe")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert summary["ok"] and summary["mode"] == "cpu-smoke"
    assert {line.split()[1] for line in summary["prerequisites"]} >= {"torch", "transformers", "diffquant", "cpu"}
    steps = summary["steps"]
    assert {k: v["status"] for k, v in steps.items()} == dict.fromkeys(("benchmarks", "bf16_profile", "backend",
                                                                        "recipe"), "ok")
    assert (tmp_path / "out" / steps["benchmarks"]["file"]).is_file()
    bf16 = steps["bf16_profile"]
    assert bf16["bf16_nonfinite"] == 0 and bf16["worst_relative_difference"]["median"]["rel"] < 0.02
    assert steps["backend"]["sqnr_db"] > 20 and steps["backend"]["weight"] != "Parameter"  # a real low-bit weight
    assert steps["recipe"]["estimate_line"].startswith("gpu_recipe (micro")


@pytest.mark.slow
def test_gpu_check_kernel_steps_run_on_cpu(tmp_path):
    """The Triton kernels' steps (benchmarks/kernels_check.py) under the interpreter: each ok, the contract held where
    a step checks it, and the summary written after each step."""
    pytest.importorskip("triton")
    r = _gpu_check_smoke(tmp_path, "kernels")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    steps = summary["steps"]
    assert {k: v["status"] for k, v in steps.items()} == dict.fromkeys(
        ("index_add", "site_kernel", "flash", "forward", "kernel_time", "diff_attention"), "ok")
    assert all(case["contract"]["ok"] and case["contract"]["deterministic"]
               for name, case in steps["site_kernel"].items() if isinstance(case, dict) and "contract" in case)
    assert steps["flash"]["float32"]["contract"]["exact"] == dict.fromkeys(("histogram", "nonfinite", "maxima", "topk"), True)
    assert set(steps["forward"]["float32"]["times_s"]) == {"plain", "tokens_torch", "logits_torch", "tokens_triton",
                                                           "logits_triton"}
    assert steps["index_add"]["values"] == 2 * 2 * 64 * 64


def test_gpu_check_says_what_is_missing(tmp_path):
    """Without a GPU and without --cpu-smoke: one line says so, and nothing runs."""
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU is here")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 1
    assert "MISSING cuda: torch sees no GPU; run with --cpu-smoke on a machine without one" in r.stdout
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["steps"] == {} and not summary["ok"]
