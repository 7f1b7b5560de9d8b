"""The fair-comparison runner (experiments/fair_rivals.py) and its GPU script: Holm's adjustment by hand, the
plan's arithmetic, rate choice, matched-loss reading on hand-built curves, and the whole pipeline end to end
on micro settings, resumed without retraining, and offline (networking disabled)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_detectable, holm_by_hand
from diffquant.errors import DiffquantError
from diffquant.stats.intervals import holm_adjust
from experiments import fair_rivals as fr

ROOT = Path(__file__).resolve().parents[1]


def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04; running max 0.02, 0.03, 0.06, 0.06
    got = holm_adjust([0.01, 0.04, 0.03, 0.005])
    assert got == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm_adjust([0.5, None, 0.9]) == [1.0, None, 1.0]  # 2 tests: 2·0.5 = 1, then max(1, 0.9) = 1
    assert holm_adjust([0.02, 0.3]) == pytest.approx([0.04, 0.3])
    assert holm_adjust([]) == []


def test_plan_fits_training_tracking_measurement_and_checkpoints_in_the_budget():
    e = fr.Experiment("t", dict(batch_size=4, seq_len=10, save_every=100), tokens=10**9, lrs=(1, 2, 3),
                      seeds=(0, 1, 2, 3, 4), designs=("a", "b"), track_points=3)
    costs = {"tokens_per_s": {"a": 1000.0, "b": 500.0}, "snapshot_s": 2.0, "measure_s": 10.0, "save_s": 4.0}
    plan = fr.make_plan(e, budget_hours=1.0, costs=costs)
    # 2 designs × (3 rates + 4 more seeds) = 14 runs, 7 a design. Fixed: 14 × (5 snapshots × 2 s + 10 s + a last
    # checkpoint 4 s) = 336 s. Per token: 7 × (1/1000 + 1/500) s of training, and 14 × 4 s every 100 steps of 40
    # tokens = 0.014 s: 0.035 s. (3600 − 336) / 0.035 = 93257.1 tokens → whole 40-token steps: 93240
    assert plan["runs"] == 14
    assert plan["tokens_per_model"] == 93240 and plan["cut"] and plan["steps"] == 2331
    est = plan["estimate_s"]
    assert est["training"] == pytest.approx(7 * 93240 * (1 / 1000 + 1 / 500))
    assert est["tracking"] == 140 and est["measurement"] == 140
    assert est["checkpoints"] == pytest.approx(14 * 4 * (1 + 2331 / 100))
    assert sum(est.values()) == pytest.approx(3600, abs=0.035 * 40)  # the budget, to within one step
    assert "about 60.0 min (training" in fr.describe_plan(plan)
    small = fr.make_plan(fr.Experiment("t", dict(batch_size=4, seq_len=10), tokens=400, lrs=(1, 2, 3),
                                       designs=("a",)), 1.0, costs)
    assert small["tokens_per_model"] == 400 and not small["cut"]
    with pytest.raises(DiffquantError, match="6.0 min do not fit 14 runs: their tracking, measurement and checkpoints "
                                             "alone take 5.6 min"):
        fr.make_plan(e, budget_hours=0.1, costs={**costs, "tokens_per_s": {"a": 1.0, "b": 1.0}})


def test_workers_go_to_their_own_gpu():
    from experiments.pairs import worker_device

    assert [worker_device(k, 2) for k in range(4)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert worker_device(3, 8) == "cuda:3" and worker_device(0, 1) == "cuda:0"
    assert worker_device(5, 0) == "cpu"


def test_each_design_gets_its_own_best_rate():
    sweep = {"a": {1e-3: {"loss": 2.0}, 3e-3: {"loss": 1.5}, 1e-2: {"loss": 1.7}},
             "b": {1e-3: {"loss": 1.2}, 3e-3: {"loss": 1.3}, 1e-2: {"loss": 9.0}}}
    rates = fr.choose_rates(sweep)
    assert rates["a"]["chosen"] == 3e-3 and rates["b"]["chosen"] == 1e-3
    assert rates["b"]["losses"] == {"0.001": 1.2, "0.003": 1.3, "0.01": 9.0}


def _curve(losses, sinks):
    return [{"step": i, "tokens": 100 * i, "loss": l, "model": {"sink_rate": s}} for i, (l, s) in enumerate(zip(losses, sinks))]


def test_matched_loss_reads_the_first_point_at_or_below_the_worst_final_loss():
    per = {"fast": [{"curve": _curve([3.0, 2.0, 1.0], [0.0, 0.5, 1.0])}, {"curve": _curve([3.0, 1.4, 1.0], [0.0, 0.25, 1.0])}],
           "slow": [{"curve": _curve([3.0, 2.5, 1.5], [0.0, 0.0, 0.1])}, {"curve": _curve([3.0, 2.5, 1.5], [0.0, 0.0, 0.3])}]}
    ml = fr.matched_loss(per)
    assert ml["target_loss"] == 1.5  # the worse design's mean final loss
    fast = ml["designs"]["fast"]
    assert fast["reached"] == 2 and fast["tokens"]["values"] == [200, 100]
    assert fast["sink_rate"]["mean"] == pytest.approx((1.0 + 0.25) / 2)
    assert ml["designs"]["slow"]["sink_rate"]["mean"] == pytest.approx(0.2)


def test_tests_against_diff_are_holm_adjusted_within_each_family():
    """Holm within a family, checked against scipy's Welch and a hand-written Holm; a metric with one value in
    every run is reported as constant and is not a test (it leaves the family's size alone)."""
    from scipy.stats import ttest_ind

    per = {"diff": [{"m": 1.0, "k": 0.0, "q": 5.0}, {"m": 1.1, "k": 0.0, "q": 5.2}, {"m": 0.9, "k": 0.0, "q": 4.9}],
           "x": [{"m": 2.0, "k": 0.0, "q": 9.0}, {"m": 2.2, "k": 0.0, "q": 9.1}, {"m": 1.9, "k": 0.0, "q": 8.8}],
           "y": [{"m": 1.0, "k": 0.0, "q": 5.1}, {"m": 1.2, "k": 0.0, "q": 5.0}, {"m": 0.95, "k": 0.0, "q": 4.8}]}
    rows = fr.tests_against(per, {"primary": ["m"], "secondary": ["k", "q"]})
    for family, metric in (("primary", "m"), ("secondary", "q")):
        block = [r for r in rows if r["family"] == family and r["metric"] == metric]
        ref = [c[metric] for c in per["diff"]]
        p = {r["design"]: ttest_ind([c[metric] for c in per[r["design"]]], ref, equal_var=False).pvalue for r in block}
        lo, hi = sorted(p.values())
        want = {d: (2 * lo if v == lo else max(2 * lo, hi)) for d, v in p.items()}  # Holm over the family's 2 tests
        for r in block:
            assert r["p"] == pytest.approx(p[r["design"]])
            assert r["p_holm"] == pytest.approx(min(1.0, want[r["design"]]))
    verdicts = {(r["metric"], r["design"]): r["verdict"] for r in rows}
    assert verdicts[("m", "x")] == "design higher than DIFF"
    m = re.fullmatch(r"no difference detected \(n = 3; detectable ([\d.]+) SD = ([\d.e-]+)\)", verdicts[("m", "y")])
    assert m, verdicts[("m", "y")]
    assert_detectable(m.group(1), m.group(2), [c["m"] for c in per["y"]], [c["m"] for c in per["diff"]], tests=2)
    assert verdicts[("k", "x")] == "constant (no test)"
    assert fr.families(["loss", "w4a4_static_cost", "hidden_top1", "hidden_ratio"]) == {
        "planned": ["loss", "w4a4_static_cost", "hidden_top1", "hidden_ratio"],
        "primary": ["w4a4_static_cost"], "secondary": ["loss", "hidden_ratio", "logit_ratio"]}



def test_ablations_against_parents_and_the_transformer_in_the_grown_family():
    """Every ablation is also tested against its parent and against the Transformer (family "added"); those tests and
    the fixes table's join the planned ones in one grown family, Holm over all of it (by hand here, p-values by
    scipy); the added rows are judged by it, the planned rows keep their own family's Holm and carry the grown one."""
    import numpy as np
    from scipy.stats import ttest_ind

    from diffquant.report.style import display

    rng = np.random.default_rng(1)
    shift = {"diff": 0.0, "baseline": 3.0, "baseline-headnorm": 0.5, "diff-gain": 0.2, "gated": 2.0, "gated-nobias": 2.1}
    per = {d: [{"m": float(v + rng.normal(0, 0.3)), "q": float(rng.normal(0, 1))} for _ in range(4)]
           for d, v in shift.items()}
    fixes = [{"scheme": "w4a4-static", "fix": "none", "p": 0.003}, {"scheme": "w4a4-static", "fix": "rotate", "p": 0.4},
             {"scheme": "w8a8-static", "fix": "none", "p": None}]
    rows = fr.tests_against(per, {"planned": ["m", "q"]}, fixes=fixes)
    added = {(r["design"], r["reference"], r["metric"]): r for r in rows if r["family"] == "added"}
    assert {(d, ref) for d, ref, _ in added} == set(fr.ADDED)
    raw = {(r["family"], r["design"], r["reference"], r["metric"]):
           ttest_ind([c[r["metric"]] for c in per[r["design"]]], [c[r["metric"]] for c in per[r["reference"]]],
                     equal_var=False).pvalue for r in rows}
    raw.update({("fixes", f["scheme"], f["fix"], ""): f["p"] for f in fixes if f["p"] is not None})
    grown = holm_by_hand(raw)
    planned = holm_by_hand({k: v for k, v in raw.items() if k[0] == "planned"})
    for r in rows:
        key = (r["family"], r["design"], r["reference"], r["metric"])
        assert r["p"] == pytest.approx(raw[key]) and r["p_holm_grown"] == pytest.approx(grown[key])
        assert r["p_holm"] == pytest.approx(planned[key] if r["family"] == "planned" else grown[key])
        word = "higher" if r["diff"] > 0 else "lower"
        want = f"design {word} than {display(r['reference'])}" if r["p_holm"] < 0.05 else "no difference detected"
        assert r["verdict"].startswith(want), (key, r["verdict"])
    assert fixes[0]["p_holm_grown"] == pytest.approx(grown[("fixes", "w4a4-static", "none", "")])
    assert "p_holm_grown" not in fixes[2]
    assert added[("baseline-headnorm", "baseline", "m")]["verdict"] == "design lower than Transformer"
    assert len(raw) == 2 * 5 + 2 * 4 + 2  # planned: 5 designs × 2 metrics; added: 4 contrasts × 2; fixes: 2


def test_every_verdict_on_a_tied_rate_says_so():
    """A design whose chosen rate won by less than one standard error: every verdict involving it (planned first)
    carries its seed-0 values at the chosen rate and at the runner-up; a design that won clearly carries none."""
    doc = {"rates": {"diff": {"losses": {"0.001": 2.8119, "0.003": 2.8127, "0.0003": 2.99}, "chosen": 0.001,
                              "loss_se": 0.0107},
                     "baseline": {"losses": {"0.001": 2.79, "0.003": 2.96}, "chosen": 0.001, "loss_se": 0.01}},
           "sweep_metrics": {"diff": {"0.001": {"hidden_top1": 9.12}, "0.003": {"hidden_top1": 60.7}},
                             "baseline": {"0.001": {"hidden_top1": 4.0}, "0.003": {"hidden_top1": 16.0}}}}
    assert fr.tie_values(doc, "diff", "hidden_top1") == "DIFF 9.12 at its chosen 0.001, 60.7 at 0.003"
    assert fr.tie_values(doc, "baseline", "hidden_top1") is None
    assert "not in the files" in fr.tie_values(doc, "diff", "loss")
    row = {"family": "planned", "metric": "hidden_top1", "design": "baseline", "reference": "diff", "diff": -5.0,
           "p": 1e-4, "p_holm": 0.01, "n": 5, "n_ref": 5, "mde_sd": 4.4, "mde": 2.0}
    parts, _ = fr._findings(doc, [row], "planned", say_quiet=True)
    assert parts == ["hidden-state top-1: DIFF higher than Transformer [on learning-rate ties; seed 0 at the chosen "
                     "rate and the runner-up: DIFF 9.12 at its chosen 0.001, 60.7 at 0.003]"]


def test_kv_cache_granularity_is_said_per_design_and_the_matched_preset_gives_equal_scales():
    """The guo preset: DIFF caches 2 KV heads of 128 channels, a softmax design 1 of 256. Per token and KV head
    (kv4) DIFF gets 2 key and 2 value scales where the Transformer gets 1; kv4-g128 gives both 2. The counts the
    report states are checked against the scales diffquant's quantizer actually computes on cache-shaped tensors."""
    import torch

    from diffquant.quant.numerics.math import dynamic_qparams
    from diffquant.quant.numerics.scheme import get_scheme
    from diffquant.taps.sites import CACHE

    doc = {"experiment": {"train": {"preset": "guo"}, "schemes": ["kv4", "kivi2"]},
           "per_seed": {"baseline": [], "diff": []}}
    shapes = fr.kv_heads(doc)
    assert shapes == {"baseline": (1, 256), "diff": (2, 128)}
    pos = 16
    for name, want in (("kv4", {"baseline": (1, 1), "diff": (2, 2)}), ("kv4-g128", {"baseline": (2, 2), "diff": (2, 2)})):
        configs = dict((p.rsplit(".", 1)[-1], c) for p, c in get_scheme(name).activations)
        for design, (heads, width) in shapes.items():
            counted = []
            for point in ("k_cache", "v_cache"):
                c = configs[point]
                scale, _ = dynamic_qparams(torch.randn(1, heads, pos, width), c.format, c.granularity, CACHE)
                counted.append(scale.numel() // pos)
            assert tuple(counted) == want[design] == fr.cache_scales(name, heads, width), (name, design)
    from diffquant.models.presets import build, get_preset
    from diffquant.quant.numerics.scheme import attach_scheme

    torch.manual_seed(0)
    ids = torch.randint(0, 66, (1, 40))
    for design in shapes:  # the matched preset runs on both caches and changes the output
        model = build(get_preset("guo"), design, vocab=66, seq_len=257).eval()
        with torch.no_grad():
            fp = model(ids).logits
            handle = attach_scheme(model, get_scheme("kv4-g128"))
            try:
                q = model(ids).logits
            finally:
                handle.remove()
        assert torch.isfinite(q).all() and not torch.equal(fp, q)
    text = fr.kv_granularity(doc)
    assert "kv4 quantize per token and KV head" in text and "not at matched granularity" in text
    assert "DIFF: 2 KV heads of 128 channels, so 2 key and 2 value" in text
    assert "kv4-g128 (2 key and 2 value scales per token and layer for every design)" in text


def test_standing_reads_only_the_holm_adjusted_tests():
    """Hand-made tests: design − DIFF > 0 at adjusted p < 0.05 puts DIFF below that design, < 0 above it; an
    unadjusted p below 0.05 with an adjusted one above it is "no difference detected", with its detectable effect.
    The planned family leads; the added contrasts follow (judged in the grown family), then the exploratory reading,
    a secondary metric said only where a difference exists, else named; rate ties are said next to every verdict
    they touch (seed-0 values at both rates); the copy-position loss is said to be missing; the scale is said."""
    def row(metric, design, diff, p, p_holm, family="primary", reference="diff"):
        return {"family": family, "metric": metric, "design": design, "reference": reference, "diff": diff, "p": p,
                "p_holm": p_holm, "n": 5, "n_ref": 5, "mde_sd": 4.4, "mde": 0.25, "verdict": "x"}

    seeds = [{"sink_rate": 0.0, "massive_ratio": 1.5, "hidden_ratio": 9.0}] * 5
    doc = {"per_seed": {"diff": seeds, "baseline": seeds, "gated": seeds, "sink": [{"sink_rate": 0.1,
                                                                                  "massive_ratio": 2.25,
                                                                                  "hidden_ratio": 12.5}] * 5},
           "plan": {"tokens_per_model": 1000}, "grown": {"planned": 2, "added": 1, "fixes": 0, "tests": 3},
           "experiment": {"train": {"preset": "guo"}, "schemes": ["w4a4-static"]},
           "rates": {"diff": {"losses": {"0.001": 2.8119, "0.003": 2.8127}, "chosen": 0.001, "loss_se": 0.0107},
                     "baseline": {"losses": {"0.001": 2.79, "0.003": 2.96}, "chosen": 0.001, "loss_se": 0.01}},
           "sweep_metrics": {"diff": {"0.001": {"w4a4_static_cost": 5.07}, "0.003": {"w4a4_static_cost": 9.39}},
                             "baseline": {"0.001": {"massive_ratio": 3.5}}},
           "tests": [row("hidden_top1", "baseline", -5.0, 0.0001, 0.004, "planned"),
                     row("w4a4_static_cost", "baseline", +0.05, 0.001, 0.2, "planned"),
                     row("w4a4_static_cost", "gated", -3.0, 0.0001, 0.0003, "added", "baseline"),
                     row("w4a4_static_cost", "baseline", +0.05, 0.001, 0.01),
                     row("w4a4_static_cost", "gated", -0.02, 0.002, 0.03),
                     row("w4a4_static_cost", "sink", +0.03, 0.01, 0.2),
                     row("loss", "baseline", +0.01, 0.3, 1.0, "secondary"),
                     row("loss", "gated", -0.1, 0.04, 0.5, "secondary"),
                     row("hidden_ratio", "baseline", -2.0, 0.0001, 0.002, "secondary"),
                     row("hidden_ratio", "sink", 0.1, 0.5, 1.0, "secondary"),
                     {**row("sink_rate", "baseline", 0.0, None, None, "secondary"), "verdict": "constant (no test)"}]}
    doc["tests"][0]["p_holm_grown"] = 0.01
    text = fr.standing(doc)
    paragraphs = text.split("\n\n")
    assert paragraphs[0].startswith("Where DIFF stands") and "no equivalence margin was stated" in paragraphs[0]
    m = re.search(r"one family of 2 tests, Holm over all of them\): hidden-state top-1: DIFF higher than "
                  r"Transformer \[on learning-rate ties; seed 0 at the chosen rate and the runner-up: DIFF \(its "
                  r"seed-0 values at both rates are not in the files\)\]; no difference detected \(n = 5; detectable "
                  r"([\d.]+) SD\) on every other metric",
                  paragraphs[0])
    assert m, paragraphs[0]
    assert_detectable(m.group(1), None, [0.0] * 5, [1.0] * 5, tests=2)  # n = 5 per design, 2 tests
    assert paragraphs[1].startswith("Added after the audit") and "grew from the 2 planned tests by these 1 to 3" in \
        paragraphs[1] and "1 of the 1 planned verdicts above survive it" in paragraphs[1]
    assert "Gated against Transformer: lower on W4A4 static per-tensor: Δppl % (Holm p 0.0003)" in paragraphs[1]
    assert "primary family of 3 tests" in paragraphs[2] and "secondary family of 4" in paragraphs[2]
    assert "W4A4 static per-tensor: Δppl %: DIFF lower than Transformer; higher than Gated; no difference detected " \
           "against the other 1 (n = 5; detectable 4.4 SD = 0.25) [on learning-rate ties; seed 0 at the chosen rate " \
           "and the runner-up: DIFF 5.07 at its chosen 0.001, 9.39 at 0.003]" in text
    assert "hidden top-1 / median: DIFF higher than Transformer; no difference detected against the other 1" in text
    assert "on the other secondary metrics: held-out loss (nats)." in text
    assert "best two rates of DIFF (by 0.0008 nats, standard error 0.0107)" in text and "Transformer (by" not in text
    assert "copy positions" in paragraphs[3] and "not reported" in paragraphs[3]
    assert "hidden top-1/median (pooled over layers) is at most 12.5 and the sink rate at most 0.10 over all 20 runs" \
           in text and "max‖h‖/median‖h‖ at most 2.25" in text and "diffquant.stats.outlier_regime" in text
    assert text.endswith("not tested (one value in every run): sink rate.")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One quick comparison, run once for the module: as the GPU preset runs it (`--minutes`) with networking cut
    where this machine permits it (into OUT/runs), else in-process."""
    from conftest import offline_prefix

    out = tmp_path_factory.mktemp("fair")
    prefix = offline_prefix()
    if prefix is not None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
        r = subprocess.run([*prefix, sys.executable, "-m", "experiments.fair_rivals", "--quick", "--minutes", "8",
                            "--out", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "training tokens/s measured per design: about" in r.stdout  # the estimate, printed before training
        return out, json.loads((out / "results.json").read_text()), True
    return out, fr.main(["--quick", "--out", str(out)]), False


def test_quick_pipeline_end_to_end(quick_run):
    out, doc, _ = quick_run
    e = fr.EXPERIMENTS["quick"]
    assert json.loads((out / "sweep.json").read_text())["rates"].keys() == set(e.designs)
    assert set(doc["aggregate"]) == set(e.designs)
    for design, agg in doc["aggregate"].items():
        assert agg["loss"]["n"] == len(e.seeds)
        assert agg["w8a8_static_cost"]["n"] == len(e.seeds) and agg["logits_int4_cost"]["n"] == len(e.seeds)
        assert agg["kv4_sink1_cost"]["n"] == len(e.seeds)
    assert (out / "results.md").read_text().count("Holm") >= 1
    cells = sorted((out / "cells").rglob("s*.json"))
    # the sweep's cells, plus the other seeds at each design's chosen rate (its first seed is the sweep's cell)
    assert len(cells) == len(e.designs) * len(e.lrs) + len(e.designs) * (len(e.seeds) - 1)


def test_quick_resume_redoes_nothing(quick_run):
    out, _, _ = quick_run
    before = {p: p.stat().st_mtime_ns for p in (out / "runs").rglob("*") if p.is_file() and "data" not in p.parts}
    fr.main(["--quick", "--out", str(out)])
    after = {p: p.stat().st_mtime_ns for p in before}
    assert before == after  # no checkpoint or cell rewritten


def test_a_later_session_without_checkpoints_redoes_nothing(quick_run, tmp_path):
    """OUT is committed, RUNS is not: with only OUT's plan and cells, a fresh checkout trains nothing."""
    out, doc, _ = quick_run
    fresh = tmp_path / "out"
    shutil.copytree(out / "cells", fresh / "cells")
    shutil.copy(out / "plan.json", fresh / "plan.json")
    again = fr.main(["--quick", "--out", str(fresh), "--runs", str(tmp_path / "runs")])
    trained = [p for p in (tmp_path / "runs").rglob("*") if p.is_file() and "data" not in p.parts]
    assert trained == []
    assert again["aggregate"] == doc["aggregate"] and again["rates"] == doc["rates"]


def test_a_cell_missing_a_scheme_is_measured_again_in_full(quick_run, tmp_path):
    """A cell measured before a scheme joined the experiment is not aggregated with fewer seeds: it is trained
    again from its resumed checkpoint and measured in full, keeping what it said before under "previous"; the
    others are read as they are. (Training resumes from the finished checkpoint, so the loss is the same.)"""
    out, doc, _ = quick_run
    fresh = tmp_path / "out"
    shutil.copytree(out / "cells", fresh / "cells")
    shutil.copy(out / "plan.json", fresh / "plan.json")
    shutil.copytree(out / "runs", tmp_path / "runs")
    e = fr.EXPERIMENTS["quick"]
    design = e.designs[0]
    path = fresh / "cells" / design / f"lr{doc['rates'][design]['chosen']:g}" / "s0.json"
    cell = json.loads(path.read_text())
    del cell["kv4_sink1_cost"], cell["kv4_sink1_cost_ci95"]
    path.write_text(json.dumps(cell))
    others = {p: p.stat().st_mtime_ns for p in (fresh / "cells").rglob("s*.json") if p != path}
    again = fr.main(["--quick", "--out", str(fresh), "--runs", str(tmp_path / "runs")])
    redone = json.loads(path.read_text())
    assert "kv4_sink1_cost" in redone and redone["previous"]["loss"] == cell["loss"]
    assert abs(redone["loss"] - cell["loss"]) < 1e-6
    assert again["aggregate"][design]["kv4_sink1_cost"]["n"] == len(e.seeds)
    assert all(p.stat().st_mtime_ns == t for p, t in others.items())


def test_gpu_script_runs_offline(quick_run):
    out, _, offline = quick_run
    if not offline:
        pytest.skip("unshare -rn is not permitted here (needs user and network namespaces); the GPU script's offline "
                    "run is not checked on this machine")
    assert (out / "results.json").is_file() and (out / "sweep.json").is_file()


def test_workers_share_the_cells_without_meeting(tmp_path):
    """--worker 0/2 trains the sweep's cells 0, 2, 4 and stops (the sweep is incomplete); 1/2 trains 1, 3, 5 and
    the second seed of the second design (place 7), then stops; a plain run trains place 6 and writes the
    results. No cell is trained twice."""
    out = tmp_path / "out"
    args = ["--quick", "--out", str(out)]
    e = fr.EXPERIMENTS["quick"]
    assert fr.main(args + ["--worker", "0/2"]) is None
    cells = lambda: sorted(str(p.relative_to(out / "cells")) for p in (out / "cells").rglob("s*.json"))  # noqa: E731
    sweep = [f"{d}/lr{lr:g}/s0.json" for d in e.designs for lr in e.lrs]
    assert cells() == sorted(sweep[0::2])
    assert fr.main(args + ["--worker", "1/2"]) is None
    rates = json.loads((out / "sweep.json").read_text())["rates"]
    second = f"{e.designs[1]}/lr{rates[e.designs[1]]['chosen']:g}/s1.json"
    assert cells() == sorted(sweep + [second])
    stamps = {p: p.stat().st_mtime_ns for p in (out / "cells").rglob("s*.json")}
    doc = fr.main(args)
    assert doc is not None and set(doc["aggregate"]) == set(e.designs)
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())  # nothing retrained
    with pytest.raises(DiffquantError, match="K/N"):
        fr.main(args + ["--worker", "2/2"])


def test_kivi_recent_window_shares_by_closed_form():
    """KIVI-2 on the 257-token windows, 128 recent positions: the one-forward simulation keeps the sequence's last
    128 positions for every query (positions 129..256; the real quantizer's span, tested in test_kv_cache), so the
    causal pairs reading a quantized key are Σ_{q<129}(q + 1) + 128·129; a decoding cache (each query's 128 most
    recent kept) quantizes Σ_{j=1}^{129} j of them. All pairs: 257·258/2."""
    got = fr.recent_window_shares(257, 128)
    pairs = 257 * 258 // 2
    assert got["pairs"] == pairs == 33153
    assert got["entries"] == pytest.approx(128 / 257)
    assert got["prefill_pairs"] == pytest.approx((129 * 130 // 2 + 128 * 129) / pairs)  # 75.1%
    assert got["decode_pairs"] == pytest.approx((129 * 130 // 2) / pairs)  # 25.3%
    short = fr.recent_window_shares(100, 128)  # the window covers the whole sequence: nothing is quantized
    assert short["entries"] == 1.0 and short["prefill_pairs"] == short["decode_pairs"] == 0.0
