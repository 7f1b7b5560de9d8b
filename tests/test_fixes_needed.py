"""experiments/fixes_needed.py's summary on hand-made costs: means and t-intervals over seeds, the share recovered,
and DIFF − baseline Welch tests with Holm's adjustment, each recomputed here with scipy."""

import numpy as np
import pytest
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


@pytest.mark.slow
def test_pair_mode_on_a_trained_pair(tmp_path, load_script):
    """`--pair`: the layout `emergence --only regime --setting NAME` trains (<runs>/<pair>/s<seed>/<design>), two
    seeds of a micro pair trained here in seconds. Each model's float loss equals plain-torch cross-entropy on the
    same held-out windows, and the summary's costs are the means of the per-model ones; the demo pair is
    emergence's DEMO setting, the one `--setting demo` trains."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    emergence = load_script("experiments/emergence.py", "emergence_for_pair_test")
    fx = load_script("experiments/fixes_needed.py", "fixes_needed_pair_under_test")
    assert fx.PAIRS["demo"] == emergence.DEMO == dict(preset="tiny", corpus="kjv", seq_len=256, batch_size=16, lr=3e-3,
                                                      weight_decay=0.1, tokens=600_000)
    (name, setting), = emergence.QUICK.items()
    emergence.main(["--quick", "--only", "regime", "--setting", name, "--archs", "baseline", "diff", "--schemes",
                    "logits-int4", "w8a8", "--out", str(tmp_path / "rivals")])
    runs = tmp_path / "rivals" / "runs"
    fx.PAIRS[name] = setting
    fx.main(["--pair", name, "--runs", str(runs), "--out", str(tmp_path / "fixes")])
    doc = json.loads((tmp_path / "fixes" / "results.json").read_text())
    assert sorted(doc["models"]) == ["baseline/s0", "baseline/s1", "diff/s0", "diff/s1"]
    folder = runs / name / "s1"
    seqs = emergence.held_out(emergence.config(setting, 0, ["baseline", "diff"]), runs / name / "s0", 64)
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
    assert f"`{name}` pair" in text and "not chosen by a sweep" in text


def test_fixes_are_read_inside_the_fair_comparisons_grown_family(load_script):
    """With the fair comparison's results beside it, the fixes table's tests join the fair comparison's planned tests
    and added contrasts in one family (Holm over all, by hand here, p-values by scipy); that family governs the
    verdicts, the table's own Holm is labelled exploratory, a "no difference detected" states its detectable effect
    (checked independently), a tied rate is flagged on the rows, and the head-norm observation gives the Welch p
    recomputed here."""
    import re

    from conftest import assert_detectable

    fx = load_script("experiments/fixes_needed.py", "fixes_needed_family_under_test")
    fr = load_script("experiments/fair_rivals.py", "fair_rivals_family_under_test")
    rng = np.random.default_rng(3)
    models = {}
    for design, shift in (("baseline", 0.12), ("diff", 0.05)):
        for seed in range(5):
            cells = {s: {f: {"delta": float(shift / (j + 1) + rng.normal(0, 0.01))} for j, f in enumerate(fx.FIXES)}
                     for s in fx.SCHEMES}
            models[f"{design}/lr0.001/s{seed}"] = {"design": design, "seed": seed, "cells": cells}
    doc = {"models": models, "designs": ["baseline", "diff"], "experiment": "guo", "rates": {"baseline": 1e-3,
           "diff": 1e-3}, "tokens_per_model": 1000, "eval_sequences": 4, "seq_len": 8, "calibration_sequences": 2,
           "rate_margins": {"diff": {"runner_up": 3e-3, "margin": 0.0008, "loss_se": 0.0107}}}
    doc["summary"] = fx.summarise(fx.chosen_models(doc), doc["designs"])
    w4 = {d: [float(v) for v in rng.normal(m, 1.0, 5)] for d, m in (("baseline", 11.0), ("diff", 5.0),
                                                                      ("baseline-headnorm", 6.0))}
    fair = {"experiment": {"schemes": ["w4a4-static"]},
            "per_seed": {d: [{"w4a4_static_cost": v, "loss": 2.8 + 0.01 * i} for i, v in enumerate(vs)]
                         for d, vs in w4.items()},
            "rates": {"diff": {"losses": {"0.001": 2.8119, "0.003": 2.8127}, "chosen": 0.001, "loss_se": 0.0107}},
            "sweep_metrics": {"diff": {"0.001": {"w4a4_static_cost": 5.07}, "0.003": {"w4a4_static_cost": 9.39}},
                              "baseline": {"0.001": {"w4a4_static_cost": 11.6}, "0.003": {"w4a4_static_cost": 7.89}}}}
    fair = fr.analyse(fair, doc)
    raw = {("fair", r["family"], r["design"], r["reference"], r["metric"]): r["p"] for r in fair["tests"]
           if r["family"] in ("planned", "added") and r["p"] is not None}
    for r in fair["tests"]:
        if r["p"] is not None:
            a = [c[r["metric"]] for c in fair["per_seed"][r["design"]]]
            b = [c[r["metric"]] for c in fair["per_seed"][r["reference"]]]
            assert r["p"] == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    fixes = {("fixes", t["scheme"], t["fix"]): t for t in doc["summary"]["tests"]}
    raw.update({k: t["p"] for k, t in fixes.items()})
    order, running, grown = sorted(raw, key=raw.get), 0.0, {}
    for i, key in enumerate(order):
        running = max(running, min(1.0, (len(raw) - i) * raw[key]))
        grown[key] = running
    assert fair["grown"]["tests"] == len(raw) and fair["grown"]["fixes"] == len(fixes)
    for key, t in fixes.items():
        assert t["p_holm_grown"] == pytest.approx(grown[key])
    text = fx.render(doc, fair)
    assert "Holm over that grown family governs the verdicts" in text and "this table's rows: exploratory" in text
    lines = {tuple(c.strip() for c in ln.split("|")[1:3]): [c.strip() for c in ln.split("|")[1:-1]]
             for ln in text.splitlines() if ln.startswith("| w")}
    row = lines[("w4a4-static", "smoothquant:search")]
    t = fixes[("fixes", "w4a4-static", "smoothquant:search")]
    if t["p_holm_grown"] >= 0.05:
        m = re.fullmatch(r"no difference detected \(n = 5; detectable ([\d.]+) SD = ([\d.e-]+) nats\)", row[-1])
        assert m, row[-1]
        costs = {d: [mm["cells"]["w4a4-static"]["smoothquant:search"]["delta"] for mm in models.values()
                     if mm["design"] == d] for d in ("diff", "baseline")}
        assert_detectable(m.group(1), m.group(2), costs["diff"], costs["baseline"], tests=len(raw))
    else:
        assert row[-1] in ("DIFF costs less", "DIFF costs more")
    assert lines[("w4a4-static", "none")][6] == "DIFF 5.07 at its chosen 0.001, 9.39 at 0.003 (Δppl %)"
    p = stats.ttest_ind(w4["baseline-headnorm"], w4["baseline"], equal_var=False).pvalue
    assert f"(Welch p {p:.2g} against the Transformer; Holm p" in text and "Read as an observation" in text
    assert "0.001: DIFF 5.07 vs Transformer 11.6; 0.003: DIFF 9.39 vs Transformer 7.89" in text
