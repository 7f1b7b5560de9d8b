"""The README's generated results and the benchmark's operator breakdown: figures come from the files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import assert_detectable  # noqa: E402
from conftest import load_script_module as _module  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent




def test_benchmark_ranges_over_the_last_full_runs(tmp_path, monkeypatch):
    rr = _module("docs/readme_results.py", "readme_results_under_test")
    (tmp_path / "benchmarks").mkdir()
    runs = [{"quick": False, "sweep": {"ratio_vs_four_plain": r, "ratio_vs_four_plain_compiled": 1.0}}
            for r in (9.0, 1.4, 1.6, 1.5)] + [{"quick": True, "sweep": {"ratio_vs_four_plain": 7.0}}]
    (tmp_path / "benchmarks/history-cpu.jsonl").write_text("".join(json.dumps(r) + "\n" for r in runs))
    (tmp_path / "benchmarks/results-cpu.json").write_text(json.dumps(
        {"threads": 2, "preset": "tiny", "batch": [8, 256], "rounds": 7,
         "sweep": {"ratio_vs_four_plain": 1.5, "ratio_vs_four_plain_compiled": 1.0}}))
    monkeypatch.setattr(rr, "ROOT", tmp_path)
    text = "\n".join(rr.benchmark_part())
    # the last three full runs (1.4, 1.6, 1.5): the oldest (9.0) and the quick run (7.0) are left out
    assert "1.50× (1.40–1.60× over 3 runs) eager" in text
    assert "1.00× (1.00–1.00× over 3 runs) compiled" in text


def test_profile_ops_shares_come_from_the_trace():
    torch = pytest.importorskip("torch")
    bench = _module("benchmarks/run.py", "bench_under_test")
    from diffquant.models.presets import PRESETS, build_pair

    torch.manual_seed(0)
    model = build_pair(PRESETS["micro"])[0].eval()
    ids = torch.randint(0, PRESETS["micro"].vocab, (2, 32))
    ops = bench.bench_profile_ops(model, ids, rounds=2)
    assert ops["stats_s"] > 0 and ops["plain_s"] > 0  # which is larger is a timing, measured by the benchmark
    assert ops["extra_s"] == pytest.approx(ops["stats_s"] - ops["plain_s"])
    shares = ops["extra_share_by_op"]
    assert shares and all(k.startswith("aten::") and 0 < v <= 1 for k, v in shares.items())
    assert sum(shares.values()) <= 1 + 1e-3
    # the statistics' own operators appear, a plain forward's matmul does not grow
    assert {"aten::topk", "aten::bincount"} & set(shares)
    assert ops["extra_calls_per_forward"].get("aten::mm", 0) == 0



def test_gpu_breakdown_runs_here_and_renders(tmp_path, monkeypatch):
    """The per-kernel breakdown gpu_check.sh asks for on a GPU (token sites and attention logits; device times read
    0 on CPU), run here on the real path, then rendered into the results page's GPU part beside the committed run."""
    torch = pytest.importorskip("torch")
    bench = _module("benchmarks/run.py", "bench_under_test_gpu")
    rr = _module("docs/readme_results.py", "readme_results_under_test_gpu")
    from diffquant.models.presets import PRESETS, build_pair

    torch.manual_seed(0)
    model = build_pair(PRESETS["micro"])[0].eval()
    ops = bench.bench_profile_ops(model, torch.randint(0, PRESETS["micro"].vocab, (2, 32)), rounds=1,
                                  per_kernel=True)
    for label in ("cuda_token_sites", "cuda_attn_logits"):
        assert ops[label]["extra_cpu_ms"] > 0 and ops[label]["extra_device_ms"] == 0
    n = bench.bench_launches(model, torch.randint(0, PRESETS["micro"].vocab, (2, 32)))
    assert n["token_sites"] > n["plain"] > 0 and n["token_sites_sites"] == 2 * 5 + 1  # 2 layers x 5 points, final
    assert n["per_token_site_update"] == (n["token_sites"] - n["plain"]) / n["token_sites_sites"]
    d_ops = bench.bench_diff_ops("micro", "cpu", 2, 32, rounds=1)
    assert d_ops["diff_ms"] > 0 and "device_diff_ms" not in d_ops
    d_ops.update(device_baseline_ms=1.0, device_diff_ms=1.5, device_grew_ms_per_forward={"aten::cat": 0.25})
    root = rr.ROOT
    (tmp_path / "benchmarks").mkdir()
    results = json.loads((root / "benchmarks/results-cuda.json").read_text())
    ops["cuda_token_sites"]["extra_device_ms_by_op"] = {"aten::index_add_": 1.25}
    ops["cuda_token_sites"]["extra_calls_per_forward"] = {"aten::index_add_": 41}
    (tmp_path / "benchmarks/results-cuda.json").write_text(json.dumps({**results, "profile_ops": ops, "diff_ops": d_ops}))
    (tmp_path / "benchmarks/gpu_check.json").write_text((root / "benchmarks/gpu_check.json").read_text())
    monkeypatch.setattr(rr, "ROOT", tmp_path)
    text = "\n".join(rr.gpu_part())
    assert "index_add_ 1.25 ms (41 calls)" in text and "DIFF 1.5 ms, baseline 1.0 ms): cat +0.25 ms" in text
    assert f"{results['profiler']['hidden_and_linear_inputs_ratio']:.2f}×" in text


def test_headnorm_finding_says_what_the_results_say(tmp_path, monkeypatch):
    """The README sentence from a hand-made results file, in magnitudes: DIFF's λ; each metric where DIFF − Transformer
    is a Holm difference with its factor (exp of the log difference); a top-1/median beside its ∞-norm (not detected:
    with what could have been) and the component contrasts, never "back to the Transformer's level" from a
    non-detection; DIFF without norm's smaller ∞-norms; what the cost tests could detect (MDE × pooled SD), with no
    means of the skewed costs; the eps the arms had; the Transformer's ratio said to be a ratio."""
    import math
    import shutil

    rr = _module("docs/readme_results.py", "readme_results_under_test_hn")
    (tmp_path / "docs/headnorm").mkdir(parents=True)
    shutil.copy(rr.ROOT / "docs/headnorm/plan.yaml", tmp_path / "docs/headnorm/plan.yaml")
    names = ["DIFF − Transformer", "head norm − Transformer", "DIFF without norm − Transformer", "DIFF − head norm",
             "DIFF without norm − DIFF"]
    logs = {("down_in_ratio", 0): math.log(0.1), ("down_in_ratio", 1): math.log(0.125),
            ("down_in_ratio", 4): math.log(8.0), ("down_in_ratio", 2): math.log(1.1),
            ("down_in_inf_norm", 0): math.log(1.25), ("down_in_inf_norm", 2): math.log(0.66),
            ("attn_in_kurtosis", 0): math.log(0.9)}
    found = {("down_in_ratio", 0), ("down_in_ratio", 1), ("down_in_ratio", 4), ("down_in_inf_norm", 2),
             ("attn_in_kurtosis", 0)}
    rows = [{"contrast": c, "metric": m, "transform": "raw" if m.endswith("cost") else "log", "n": 5, "mde_sd": 4.0,
             "sd": 3.0 if m.endswith("cost") else 0.1, "diff": logs.get((m, i), 0.0),
             "p_holm": 0.01 if (m, i) in found else 0.9, "p_tost_holm": 0.001 if m == "attn_in_kurtosis" else 0.9,
             "verdict": f"no difference detected (n = 5, minimum detectable effect 4.00 SD = ×{math.exp(0.4):.3g})"}
            for i, c in enumerate(names)
            for m in ("down_in_ratio", "down_in_inf_norm", "attn_in_kurtosis", "w8a8_static_cost", "w4a4_static_cost")]
    dec = {"down_in_ratio": "the head norm", "attn_in_kurtosis": "neither alone (no component …)",
           "down_in_inf_norm": "no DIFF − Transformer difference detected"}
    cost = lambda mean: {"w8a8_static_cost": {"mean": mean}, "w4a4_static_cost": {"mean": 2 * mean}}  # noqa: E731
    doc = {"decomposition": dec, "tests": rows, "family_size": 25,
           "lambda": {"diff": [-0.5, 0.25], "diff-nonorm": [0.7, 0.9]}, "rate_sensitive": ["attn_in_kurtosis"],
           "scale": {"baseline": {"parameters": 1000, "train_tokens": 2000}, "diff": {"parameters": 1010}},
           "aggregate": {"baseline": {**cost(6.0), "sink_rate": {"mean": 0.0}, "hidden_ratio": {"mean": 16.2}},
                         "diff": cost(0.5)}}
    (tmp_path / "docs/headnorm/results.json").write_text(json.dumps(doc))
    monkeypatch.setattr(rr, "ROOT", tmp_path)
    text = rr._headnorm_finding()[0]
    assert "mini preset: 1,000 / 1,010 parameters, 2,000 Bigram-Backcopy tokens each, 5 seeds per arm" in text
    assert "rms_norm_eps 1e-06 in the Transformer arms and 1e-05 in DIFF's" in text
    assert "DIFF's learned λ ended at -0.50…0.25, below λ_init" in text
    assert "the q/k/v input kurtosis ×0.9 (inside the plan's equivalence margin; the other sign at lr 0.001" in text
    assert ("the down_proj input top-1 / median ×0.1 — through its median: its ∞-norm ×1.25, no difference detected "
            "(minimum detectable ×1.49), so not smaller outliers; the Transformer with the head norm moves the ratio "
            "alike (×0.125), DIFF without the norm against DIFF ×8 and against the Transformer ×1.1, no difference "
            "detected (minimum detectable ×1.49)") in text
    assert "back to the Transformer's level" not in text and "carried by" not in text
    assert "DIFF without its norm kept λ at 0.70…0.90 and had smaller ∞-norms than the Transformer, the paper's " \
           "direction: down_proj input ×0.66, Holm p 0.01" in text
    assert "(only 12 / 12 percentage points or more were detectable)" in text and "6.0%" not in text
    assert "hidden top-1/median 16 (a ratio a large median pulls down)" in text


def test_emergence_text_says_when_no_setting_reached_the_regime(tmp_path, monkeypatch):
    rr = _module("docs/readme_results.py", "readme_results_under_test")
    (tmp_path / "docs/emergence").mkdir(parents=True)
    found = {"a": {"hidden_ratio": 20.0, "sink_rate": 0.0, "extrapolated_tokens": 4e7, "train_tokens": 8e6},
             "b": {"hidden_ratio": 30.0, "sink_rate": 0.1, "extrapolated_tokens": None, "train_tokens": 2e6}}
    search = {"criterion": {"hidden_ratio": 100, "sink_rate": 0.5}, "results": found}
    (tmp_path / "docs/emergence/search.json").write_text(json.dumps(search))
    (tmp_path / "docs/emergence/results.json").write_text(json.dumps({"setting": "a"}))
    monkeypatch.setattr(rr, "ROOT", tmp_path)
    text = "\n".join(rr.emergence_part())
    assert "0 of 2 settings reached the regime" in text
    assert "`a` (its worst layer's hidden top-1/median extrapolates to 100 at about 40M tokens, 5× what was trained)" in text
    found["b"]["sink_rate"] = 0.6
    (tmp_path / "docs/emergence/search.json").write_text(json.dumps(search))
    text = "\n".join(rr.emergence_part())
    assert "1 of 2 settings reached the regime" in text and "None did" not in text


def test_fair_kv_columns_mark_only_holm_differences(tmp_path, monkeypatch):
    """The fair comparison's KV-cache columns in the README: mean ± t as the aggregate says, a design marked only
    where its Holm-adjusted test against DIFF is below 0.05, in the direction of design − DIFF."""
    rr = _module("docs/readme_results.py", "readme_results_under_test")
    agg = lambda m: {k: {"mean": m, "half": m / 10} for k in rr.FAIR_KV}  # noqa: E731
    tests = [{"family": "planned", "metric": "kv4_cost", "design": "baseline", "diff": 2.0, "p_holm": 0.2,
              "verdict": "no difference detected (n = 5)"},
             {"family": "secondary", "metric": "kv4_cost", "design": "baseline", "diff": 2.0, "p_holm": 0.01,
              "verdict": "design higher than DIFF"},
             {"family": "secondary", "metric": "kivi2_cost", "design": "baseline", "diff": 1.0, "p_holm": 0.2,
              "verdict": "no difference detected (n = 5)"}]
    doc = {"aggregate": {"baseline": agg(4.0), "diff": agg(2.0)}, "tests": tests, "rates": {
        "baseline": {"chosen": 1e-3}, "diff": {"chosen": 3e-3}}, "per_seed": {"baseline": [{}] * 5, "diff": [{}] * 5},
        "plan": {"tokens_per_model": 1000}, "experiment": {"eval_sequences": 64}}
    (tmp_path / "docs/rivals/fair-guo").mkdir(parents=True)
    (tmp_path / "docs/rivals/fair-guo/results.json").write_text(json.dumps(doc))
    monkeypatch.setattr(rr, "ROOT", tmp_path)
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
            for ln in "\n".join(rr.fair_kv_part()).splitlines() if ln.startswith("| ") and "design" not in ln}
    rows = {k: v for k, v in rows.items() if k in ("Transformer", "DIFF")}
    assert rows["Transformer"] == ["0.001", "4.00 ± 0.40 (higher than DIFF)", "4.00 ± 0.40", "4.00 ± 0.40", "4.00 ± 0.40"]
    assert rows["DIFF"] == ["0.003", "2.00 ± 0.20", "2.00 ± 0.20", "2.00 ± 0.20", "2.00 ± 0.20"]
    # the planned family (one correction over every metric) does not keep the mark, and the text says so
    assert "these marks do not survive: Transformer on KV cache int4." in "\n".join(rr.fair_kv_part())


def test_update_between_markers(tmp_path, capsys):
    from diffquant.report.tables import update_between_markers

    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- b -->\nold\n<!-- e -->\nrest\n")
    assert update_between_markers(readme, "<!-- b -->", "<!-- e -->", "new", True, "x") == 1
    assert update_between_markers(readme, "<!-- b -->", "<!-- e -->", "new", False, "x") == 0
    assert readme.read_text() == "intro\n<!-- b -->\nnew\n<!-- e -->\nrest\n"
    assert update_between_markers(readme, "<!-- b -->", "<!-- e -->", "new", True, "x") == 0
    assert update_between_markers(readme, "<!-- c -->", "<!-- e -->", "new", False, "x") == 2
    assert capsys.readouterr().err.strip() == "README.md has no <!-- c --> ... <!-- e --> markers"


def test_designs_against_diff_say_which_way_after_holm(tmp_path):
    from scipy.stats import ttest_ind

    rr = _module("docs/readme_results.py", "readme_results_under_test")

    def agg(values):
        return {"values": values}

    results = {"seeds": [0, 1, 2], "sink_definition": "share", "aggregate": {
        "Transformer": {"hidden_ratio": agg([30.0, 31.0, 32.0]), "sink_rate": agg([0.1, 0.2, 0.15])},
        "DIFF": {"hidden_ratio": agg([20.0, 21.0, 19.0]), "sink_rate": agg([0.1, 0.2, 0.1])},
        "Gated": {"hidden_ratio": agg([10.0, 11.0, 12.0]), "sink_rate": agg([0.1, 0.2, 0.1])}}}

    def rows_of(text):
        return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in text.splitlines()
                if line.startswith("| ") and "design" not in line}

    text = "\n".join(rr.against_diff(results))
    rows = rows_of(text)
    # Holm over the table's four tests, by hand: p-values sorted ascending times 4, 3, 2, 1, running maximum, cap 1
    p = {(d, k): ttest_ind(results["aggregate"][d][k]["values"], results["aggregate"]["DIFF"][k]["values"],
                           equal_var=False).pvalue if d != "Gated" or k != "sink_rate" else 1.0
         for d in ("Transformer", "Gated") for k in ("hidden_ratio", "sink_rate")}
    order = sorted(p, key=p.get)
    adjusted, running = {}, 0.0
    for i, key in enumerate(order):
        running = max(running, min(1.0, (4 - i) * p[key]))
        adjusted[key] = running
    assert rows["Transformer"][0] == f"higher (p {adjusted[('Transformer', 'hidden_ratio')]:.2g})"
    assert rows["Gated"][0] == f"lower (p {adjusted[('Gated', 'hidden_ratio')]:.2g})"
    # no difference detected: n, the effect the test could detect at 80% power (checked independently), the p
    m = re.fullmatch(r"no difference detected \(n = 3, detectable ([\d.]+) SD = ([\d.e-]+), p (.+)\)", rows["Transformer"][1])
    assert m and m.group(3) == f"{adjusted[('Transformer', 'sink_rate')]:.2g}"
    assert_detectable(m.group(1), m.group(2), results["aggregate"]["Transformer"]["sink_rate"]["values"],
                      results["aggregate"]["DIFF"]["sink_rate"]["values"], tests=4)
    assert rows["Gated"][1].startswith("no difference detected (n = 3, detectable") and rows["Gated"][1].endswith(
        ", p 1)") and "DIFF" not in rows
    assert "adjusted over the table's 4 tests" in text and "≈" not in text
    # results measured before DIFF's sink rate was per differential head: the pooled number is no verdict
    del results["sink_definition"]
    text = "\n".join(rr.against_diff(results))
    assert all(len(r) == 1 for r in rows_of(text).values()) and "old definition that pools A1 and A2" in text
    assert rr.against_diff(None) == [] and rr.against_diff({"aggregate": {}}) == []


def test_fixes_table_says_its_family_against_the_fair_comparisons(tmp_path, monkeypatch):
    """Under the fixes table, the README says how many tests the planned family of the fair comparison holds (its
    untestable rows left out), so "detected here, not there" is explained by the two corrections."""
    rr = _module("docs/readme_results.py", "readme_results_family_under_test")
    (tmp_path / "docs/regime").mkdir(parents=True)
    (tmp_path / "docs/regime/results.json").write_text("{}")
    (tmp_path / "docs/regime/results.md").write_text("# title\nverdict\n")
    (tmp_path / "docs/rivals/fair-guo/fixes").mkdir(parents=True)
    (tmp_path / "docs/rivals/fair-guo/fixes/results.md").write_text("| fixes |\n")
    tests = [{"family": "planned", "p_holm": 0.5}, {"family": "planned", "p_holm": 0.01},
             {"family": "planned", "p_holm": None}, {"family": "primary", "p_holm": 0.2}]
    (tmp_path / "docs/rivals/fair-guo/results.json").write_text(json.dumps({"tests": tests}))
    monkeypatch.setattr(rr, "ROOT", tmp_path)
    text = "\n".join(rr.regime_part())
    assert "| fixes |" in text and "planned family holds 2 tests" in text


def test_times_beside_a_readme_block_come_from_the_commands_log(load_script):
    """Each README block's generated line lists its commands that took a minute or more in the fresh-clone run, in
    the block's order, with their load and the commit each ran at; a command the log does not hold as passed, or a
    short one, is left out; a substituted model is named; a run in progress says so."""
    rr = load_script("docs/readme_results.py", "readme_results_times")
    readme = ("```bash\npip install -e . && diffquant demo   # the demo\ndiffquant sites\n"
              "diffquant sweep --model smollm2-135m --sites attn_logits --bits 16,8 \\\n  --out runs/sweep\n"
              "diffquant profile --model path/to/your/model --out p\ndiffquant train --preset tiny\n```\n"
              "<!-- times:x:begin -->\n\n<!-- times:x:end -->\n")
    sweep = "diffquant sweep --model smollm2-135m --sites attn_logits --bits 16,8 --out runs/sweep"
    log = {"commit": "0123456789abcdef", "machine": {"cores": 2, "cpu": "CPU Z"}, "finished": True,
           "commands": [{"command": "pip install -e . && diffquant demo", "run": "pip install -e . && diffquant demo",
                         "rc": 0, "seconds": 1722.0, "load_start": 0.5, "load_end": 2.25, "commit": "0123456789ab"},
                        {"command": "diffquant sites", "run": "diffquant sites", "rc": 0, "seconds": 59.9,
                         "load_start": 1, "load_end": 1, "commit": "0123456789ab"},
                        {"command": sweep, "run": sweep, "rc": 0, "seconds": 75.0, "load_start": 1.0, "load_end": 3.0,
                         "commit": "fedcba987654"},
                        {"command": "diffquant profile --model path/to/your/model --out p",
                         "run": "diffquant profile --model smollm2-135m --out p", "rc": 0, "seconds": 200.0,
                         "load_start": 2, "load_end": 2, "commit": "0123456789ab"},
                        {"command": "diffquant train --preset tiny", "run": "diffquant train --preset tiny", "rc": 1,
                         "seconds": 500.0, "load_start": 1, "load_end": 1, "commit": "0123456789ab"}]}
    line = rr.times_part("x", readme, log)
    assert line == ("*Time from a fresh clone and an empty cache on 2 cores (CPU Z), commit 0123456, fedcba9 "
                    "([log](docs/readme_commands/log.md)): `pip install -e . && diffquant demo` 28.7 min "
                    "(load 0.5 → 2.25); `diffquant sweep …` 75 s (load 1 → 3); `diffquant profile …` (on smollm2-135m) "
                    "3.3 min (load 2 → 2).*")
    assert ", a run not yet complete)" in rr.times_part("x", readme, {**log, "finished": False})
    warm = {**log, "commands": [{**r, "reused_clone": True} if r["command"] == sweep else r for r in log["commands"]]}
    assert "`diffquant sweep …` (rerun in that clone: installed, caches warm) 75 s" in rr.times_part("x", readme, warm)
    assert rr.times_part("y", readme, log) == "" and rr.times_part("x", readme, {**log, "commands": []}) == ""
    assert rr.times_part("x", "no block\n<!-- times:x:begin -->\n\n<!-- times:x:end -->\n", log) == ""


def test_the_demo_finding_reads_each_designs_top1_from_table5(load_script):
    """The README's demo sentence names each design's largest value from the Table 5 rows, not swapped."""
    rr = load_script("docs/readme_results.py", "readme_results_top1")
    table5 = [["Transformer", "attention logits", 46.48, 1], ["DIFF", "attention logits", 50.33, 1],
              ["Transformer", "hidden states", 114.5, 1], ["DIFF", "hidden states", 139.14, 1]]
    assert rr.top1_pair(table5) == ("hidden states DIFF 139.1 vs Transformer 114.5, "
                                    "attention logits DIFF 50.3 vs Transformer 46.5")


def test_decomposition_finding_says_what_the_results_say(monkeypatch):
    """The README sentence of the second decomposition from a hand-made results file of the committed plan: a Holm
    difference with its factor, an equivalence only by TOST with its margin, a non-detection with what could have been
    detected both ways, the costs as geometric means with the seeds' range, the plan's attribution beside both
    single-part contrasts with its caveat, the λ contrasts in full, λ per arm (the frozen arm said to be λ_init), the
    eps swap's largest effect in any cell, and the scale; a results file of another plan says nothing."""
    import math

    rr = _module("docs/readme_results.py", "readme_results_under_test_dec")
    from experiments.decomposition import load_plan

    plan = load_plan(rr.ROOT / "docs/decomposition/plan.yaml")
    contrasts = [c["name"] for c in plan["contrasts"]]
    keys = [m["key"] for m in plan["metrics"]]
    special = {(contrasts[0], "down_in_inf_norm"): {"diff": math.log(0.5), "p_holm": 0.004},
               (contrasts[0], "attn_out_inf_norm"): {"diff": math.log(1.1), "p_tost_holm": 0.02},
               (contrasts[1], "down_in_inf_norm"): {"diff": math.log(0.6), "p_holm": 0.03},
               (contrasts[2], "w8a8_static_cost"): {"constant": True}}
    rows = []
    for c in contrasts:
        for m in plan["metrics"]:
            row = {"contrast": c, "metric": m["key"], "transform": m["transform"], "margin": m["margin"], "n": 5,
                   "mde_sd": 3.5, "sd": 0.2, "diff": math.log(0.9), "p_holm": 0.5, "p_tost_holm": 0.4}
            rows.append({**row, **special.get((c, m["key"]), {})})
    dec = {k: "no DIFF − Transformer difference detected" for k in keys}
    dec["down_in_inf_norm"] = "the differential map"
    scale = {a: {"parameters": 1000 + i, "train_tokens": 4000, "rms_norm_eps": 1e-5} for i, a in enumerate(plan["arms"])}
    costs = {"w8a8_static_cost": {"values": [1.0, 4.0, 0.01]}, "a8_static_down_in_cost": {"values": [1.25, 4.0, 0.01]},
             "a8_down_in_zero_share": {"mean": 0.99}}
    doc = {"plan_sha256": plan["sha256"], "tests": rows, "decomposition": dec, "family_size": 23, "scale": scale,
           "aggregate": {a: costs for a in plan["arms"]},
           "lambda": {"diff-gain": [-0.25, 0.5], "diff-nonorm": [0.7, 0.9], "diff-frozen": [0.2, 0.47]},
           "eps_swap_largest": {"inf_norm": 0.0002, "cost": 0.05}}
    text = rr._decomposition_finding(doc)[0]
    assert ("(mini preset: 1,000 parameters in the Transformer, 1,001 in DIFF, 4,000 Bigram-Backcopy tokens each, "
            "5 seeds per arm, rms_norm_eps 1e-05 in every arm, checkpoints kept; Welch over seeds, Holm over 23 tests; "
            "the paper's models: 3B parameters, 350B tokens)") in text
    gm = f"{math.exp((math.log(1.0) + math.log(4.0) + math.log(0.02)) / 3):.3g}"  # the 0.01 floored at 0.02
    assert ("DIFF − Transformer: o_proj input ∞-norm ×1.1 (equivalent within ×1.25, TOST Holm p 0.02); "
            "down_proj input ∞-norm ×0.5 (Holm p 0.004); static A8 cost at the down_proj input alone ×0.9 "
            f"(no difference detected, minimum detectable ×{math.exp(-0.7):.3g} or ×{math.exp(0.7):.3g})") in text
    assert "static W8A8 cost ×0.9 (no difference detected" in text
    assert f"(geometric means over seeds: Transformer {gm}% (0.01–4), DIFF {gm}% (0.01–4))" in text
    assert ("The plan's verdict (one single-part arm differs as DIFF does, the other is not detected): the down_proj "
            "input ∞-norm to the differential map (DIFF without norm − Transformer: down_proj input ∞-norm ×0.6 (Holm p "
            "0.03); Transformer + DIFF's norm − Transformer: down_proj input ∞-norm ×0.9 (no difference detected") in text
    assert "The non-detections do not exclude the other part." in text
    assert "DIFF, λ frozen − Transformer: o_proj input ∞-norm ×0.9 (no difference" in text
    assert "DIFF, λ frozen − DIFF: o_proj input ∞-norm ×0.9" in text
    assert "The remaining 10 tests: DIFF without norm − Transformer, o_proj input ∞-norm ×0.9 (no difference" in text
    assert "Transformer + DIFF's norm − Transformer, static W8A8 cost constant" in text
    assert ("The static W8A8 cost here is the down_proj input's: it and the static A8 cost at that input alone differ "
            "by at most 0.25 percentage points (25% of the smaller) in any cell.") in text
    assert ("λ at the end of training (every layer and seed): DIFF -0.25…0.50, DIFF without norm 0.70…0.90, DIFF, λ "
            "frozen 0.20…0.47 (λ_init, frozen by design)") in text
    assert "moves an ∞-norm by at most 0.02% and a cost by at most 0.05 percentage points in any cell" in text
    assert rr._decomposition_finding({**doc, "plan_sha256": "0" * 64}) == []
