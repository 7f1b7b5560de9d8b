"""experiments/fixes_needed.py's summary on hand-made costs: means and t-intervals over seeds, the share recovered,
and DIFF − baseline Welch tests with Holm's adjustment, each recomputed here with scipy."""

import numpy as np
from scipy import stats


def test_summary_against_scipy(load_script):
    fx = load_script("experiments/fixes_needed.py", "fixes_needed_under_test")
    rng = np.random.default_rng(0)
    models, costs = {}, {}
    for design, shift in (("baseline", 0.3), ("diff", 0.1)):
        for seed in range(4):
            cells = {s: {f: {"delta": float(shift * (k + 1) / (j + 1) + rng.normal(0, 0.01))}
                         for j, f in enumerate(fx.FIXES)} for k, s in enumerate(fx.SCHEMES)}
            models[f"{design}/s{seed}"] = {"design": design, "seed": seed, "cells": cells}
            for s in fx.SCHEMES:
                for f in fx.FIXES:
                    costs.setdefault((design, s, f), []).append(cells[s][f]["delta"])
    out = fx.summarise(models, ["baseline", "diff"])
    s, f = "w4a4-static", "quarot"
    c = np.array(costs[("baseline", s, f)])
    got = out["per_design"]["baseline"][s][f]["cost"]
    assert np.isclose(got["mean"], c.mean())
    assert np.isclose(got["half"], stats.t.ppf(0.975, 3) * c.std(ddof=1) / 2)
    rec = 1 - c / np.array(costs[("baseline", s, "none")])
    assert np.isclose(out["per_design"]["baseline"][s][f]["recovered"]["mean"], rec.mean())
    ps = [stats.ttest_ind(costs[("diff", sc, fi)], costs[("baseline", sc, fi)], equal_var=False).pvalue
          for sc in fx.SCHEMES for fi in fx.FIXES]
    order = np.argsort(ps)
    holm = np.empty(len(ps))
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        holm[i] = running
    assert np.allclose([t["p"] for t in out["tests"]], ps)
    assert np.allclose([t["p_holm"] for t in out["tests"]], holm)
    t = out["tests"][0]
    assert np.isclose(t["diff"], np.mean(costs[("diff", t["scheme"], t["fix"])])
                      - np.mean(costs[("baseline", t["scheme"], t["fix"])]))
    assert fx.verdict({**t, "p_holm": 0.2}) == "no difference detected (n = 4)"


def test_pair_mode_on_a_trained_pair(tmp_path, load_script):
    """`--pair`: rivals.py's layout (<runs>/<pair>/s<seed>/<design>), two seeds of a micro pair trained here in
    seconds. Each model's float loss equals plain-torch cross-entropy on the same held-out windows, and the summary's
    costs are the means of the per-model ones; the demo setting is rivals.py's own."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    rivals = load_script("experiments/rivals.py", "rivals_for_pair_test")
    emergence = load_script("experiments/emergence.py", "emergence_for_pair_test")
    fx = load_script("experiments/fixes_needed.py", "fixes_needed_pair_under_test")
    assert fx.PAIRS["demo"] == rivals.DEMO
    rivals.main(["--quick", "--out", str(tmp_path / "rivals"), "--archs", "baseline", "diff"])
    runs = tmp_path / "rivals" / "runs" / "rivals"
    fx.PAIRS["quick"] = next(iter(emergence.QUICK.values()))
    fx.main(["--pair", "quick", "--runs", str(runs), "--out", str(tmp_path / "fixes")])
    doc = json.loads((tmp_path / "fixes" / "results.json").read_text())
    assert sorted(doc["models"]) == ["baseline/s0", "baseline/s1", "diff/s0", "diff/s1"]
    folder = runs / "quick" / "s1"
    seqs = emergence.held_out(emergence.config(fx.PAIRS["quick"], 0, ["baseline", "diff"]), runs / "quick" / "s0", 64)
    model = AutoModelForCausalLM.from_pretrained(folder / "diff").eval()
    with torch.no_grad():
        logits = model(seqs).logits[:, :-1].float()
    per_seq = torch.nn.functional.cross_entropy(logits.transpose(1, 2), seqs[:, 1:], reduction="none").mean(1)
    assert abs(float(per_seq.mean()) - doc["models"]["diff/s1"]["float_loss"]) < 1e-5
    for design in ("baseline", "diff"):
        cost = doc["summary"]["per_design"][design]["w4a4-static"]["none"]["cost"]
        want = [doc["models"][f"{design}/s{s}"]["cells"]["w4a4-static"]["none"]["delta"] for s in (0, 1)]
        assert abs(cost["mean"] - sum(want) / 2) < 1e-12
    text = (tmp_path / "fixes" / "results.md").read_text()
    assert "`quick` pair" in text and "not chosen by a sweep" in text
