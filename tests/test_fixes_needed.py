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
