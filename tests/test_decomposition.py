"""The second decomposition (issue 49): its plan is emergence's setting with every eps matched, its family's size
and power are as stated, and the quick run goes end to end with every p-value recomputed by scipy (the cost floor
applied in the test), every cell's checkpoint kept and remeasured to the same numbers, and cells of another plan
refused."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats

from diffquant.stats.intervals import holm, minimum_detectable_effect

ROOT = Path(__file__).resolve().parent.parent


def test_plan_is_emergences_setting_with_eps_matched_and_the_family_as_stated():
    from diffquant.models.presets import get_preset
    from experiments.decomposition import cells, family_size, load_plan
    from experiments.emergence import SEARCH

    plan = load_plan(ROOT / "docs/decomposition/plan.yaml")
    setting = SEARCH[plan["setting"]["name"]]
    for key, value in plan["setting"]["train"].items():
        if key in setting:
            assert setting[key] == value, key
    assert plan["lr"] == setting["lr"]
    assert family_size(plan) == 24 and len(cells(plan)) == 25
    assert f"{minimum_detectable_effect(len(plan['seeds']), 24):.2f}" in plan["test"]
    spec = get_preset(plan["setting"]["train"]["preset"])
    assert {spec.config(a).rms_norm_eps for a in plan["arms"]} == {1e-5}
    roles = {c["role"]: (c["a"], c["b"]) for c in plan["contrasts"]}
    assert roles["total"] == ("diff-gain", "baseline") and roles["unfreeze"] == ("diff-frozen", "diff-gain")
    assert set(plan["labels"]) == set(plan["arms"])


@pytest.mark.slow
def test_quick_run_end_to_end_with_tests_recomputed_and_checkpoints_remeasured(tmp_path):
    from diffquant.errors import DiffquantError
    from experiments.decomposition import load_plan, main

    out = tmp_path / "dec"
    doc = main(["--quick", "--out", str(out)])
    plan = load_plan(ROOT / "docs/decomposition/plan.yaml", quick=True)
    cells = {(c["arm"], c["seed"]): c for c in map(lambda p: json.loads(p.read_text()), (out / "cells").rglob("*.json"))}
    assert len(cells) == 10 and all(c["plan_sha256"] == plan["sha256"] for c in cells.values())
    floor = {m["key"]: m.get("floor") for m in plan["metrics"]}
    rows = [r for r in doc["tests"] if not r.get("constant")]
    assert rows
    ps = []
    for r in rows:
        get = lambda arm: [cells[(arm, s)][r["metric"]] for s in plan["seeds"]]  # noqa: E731
        a, b = get(r["a"]), get(r["b"])
        if r["transform"] == "log":
            a, b = np.log(a), np.log(b)
        elif r["transform"] == "logcost":
            a, b = np.log(np.maximum(a, floor[r["metric"]])), np.log(np.maximum(b, floor[r["metric"]]))
        p = scipy.stats.ttest_ind(a, b, equal_var=False).pvalue
        assert r["p"] == pytest.approx(p, rel=1e-9)
        ps.append(p)
    assert [r["p_holm"] for r in rows] == pytest.approx(holm(ps), rel=1e-9)
    # DIFF kept differential: λ is λ_init in every layer; DIFF's own λ moved
    frozen = cells[("diff-frozen", 0)]["lambda"]
    assert frozen == pytest.approx([0.8 - 0.6 * math.exp(-0.3 * i) for i in range(len(frozen))], abs=1e-6)
    assert cells[("diff-gain", 0)]["lambda"] != pytest.approx(frozen, abs=1e-4)
    # every checkpoint is kept, and measuring it again gives the cell's numbers
    assert all((out / "checkpoints" / arm / f"s{seed}" / "model.safetensors").is_file() for arm, seed in cells)
    from experiments.decomposition import data, remeasure

    remeasure(plan, out, "cpu", *data(plan, out / "runs" / "data"), only=[("diff-gain", 1)])
    again = json.loads((out / "remeasured/diff-gain/s1.json").read_text())
    for key in ("loss", "down_in_inf_norm", "attn_out_inf_norm", "w8a8_static_cost", "a4_down_in_output_error"):
        assert again[key] == cells[("diff-gain", 1)][key], key
    assert "not a result" in (out / "results.md").read_text()
    report = main(["--quick", "--out", str(out), "--report-only"])
    assert [r.get("p") for r in report["tests"]] == [r.get("p") for r in doc["tests"]]
    path = out / "cells/diff-gain/s0.json"
    path.write_text(json.dumps({**cells[("diff-gain", 0)], "plan_sha256": "0" * 64}))
    with pytest.raises(DiffquantError, match="another plan"):
        main(["--quick", "--out", str(out), "--report-only"])
    path.unlink()
    with pytest.raises(DiffquantError, match=r"1 cells are not in .*\(diff-gain s0\)"):
        main(["--quick", "--out", str(out), "--report-only"])


def test_gpu_jobs_come_most_wanted_first_and_fit_the_budget():
    from experiments.decomposition import GPU_LONG, GPU_SEEDS, fit_jobs, gpu_jobs, load_plan

    plan = load_plan(ROOT / "docs/decomposition/plan.yaml")
    jobs = gpu_jobs(plan)
    assert jobs[:2] == [("baseline", 0, 8_000_000), ("diff-gain", 0, 8_000_000)]
    assert len(jobs) == len(plan["arms"]) * GPU_SEEDS + 2 * GPU_LONG[1] and jobs[-1][2] == GPU_LONG[0]
    # 12 workers at 1.2M tokens/s together: each 8M-token job takes 80 s of a worker plus 10 s of overhead
    assert fit_jobs(jobs, 300.0, 1.2e6, 12) == jobs[:300 * 12 // 90]  # 40 of the 60 main runs
    # 600 s: all 60 main runs (5,400 worker-seconds of 7,200), then 40M-token runs at 410 s each: 4 more
    assert fit_jobs(jobs, 600.0, 1.2e6, 12) == jobs[:64]
    assert fit_jobs(jobs, 0.0, 1.2e6, 12) == []


@pytest.mark.slow
def test_gpu_mode_on_cpu_trains_what_fits_and_keeps_every_checkpoint(tmp_path):
    from diffquant.models.load import load_model
    from experiments.decomposition import gpu_jobs, load_plan, main

    doc = main(["--quick", "--gpu", "--device", "cpu", "--minutes", "6", "--workers", "2", "--out", str(tmp_path)])
    plan = load_plan(ROOT / "docs/decomposition/plan.yaml", quick=True)
    assert doc["tokens_per_s_one"] > 0 and doc["tokens_per_s_together"] > 0
    assert doc["planned"] == [list(j) for j in gpu_jobs(plan)[:len(doc["planned"])]] and doc["planned"]
    assert sorted(map(tuple, ((d["arm"], d["seed"], d["tokens"]) for d in doc["done"]))) == \
        sorted(map(tuple, doc["planned"]))
    for d in doc["done"]:
        model, _ = load_model(d["checkpoint"])
        assert type(model).__name__.lower().startswith(("llama", "diff", "headnorm"))


def test_eps_swap_largest_change_and_the_costs_geometric_mean_by_hand():
    """The eps swap's largest change in any one cell (an ∞-norm's |swapped/trained − 1|, a cost's |swapped −
    trained|), whatever arm holds it; the geometric mean floors each cost as the tests do."""
    from experiments.decomposition import eps_largest, geometric_mean

    per_arm = {"a": [{"down_in_inf_norm": 100.0, "w8a8_static_cost": 2.0,
                      "eps_swap": {"down_in_inf_norm": 100.5, "w8a8_static_cost": 1.75, "loss": 9.0}}],
               "b": [{"attn_out_inf_norm": 4.0, "w8a8_static_cost": 0.5,
                      "eps_swap": {"attn_out_inf_norm": 3.9, "w8a8_static_cost": 0.5, "missing_cost": 1.0}},
                     {"w8a8_static_cost": 1.0}]}
    got = eps_largest(per_arm)
    assert got["inf_norm"] == pytest.approx(0.025) and got["cost"] == pytest.approx(0.25)
    assert geometric_mean([1.0, 4.0, 0.001], 0.02) == pytest.approx((1.0 * 4.0 * 0.02) ** (1 / 3))
