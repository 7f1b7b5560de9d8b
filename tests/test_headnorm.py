"""The head-norm decomposition (issue 42): its plan is emergence's setting, its statistics (TOST, minimum
detectable effect, copy positions, the loss there) equal independent computations, and the quick run goes end
to end with every p-value recomputed by scipy."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch

from diffquant.stats.intervals import holm, minimum_detectable_effect, tost

ROOT = Path(__file__).resolve().parent.parent


def test_plan_is_emergences_setting_and_the_family_is_as_stated():
    from experiments.emergence import SEARCH, config
    from experiments.headnorm import cells, family_size, load_plan

    plan = load_plan(ROOT / "docs/headnorm/plan.yaml")
    setting = plan["setting"]
    emergence = config(SEARCH[setting["name"]])  # emergence's TrainConfig for this setting (its tracking included)
    for key, value in setting["train"].items():
        assert getattr(emergence, key) == value, key
    assert plan["lr"] == SEARCH[setting["name"]]["lr"]
    assert family_size(plan) == 120 and len(cells(plan)) == 24
    assert f"{minimum_detectable_effect(5, 120):.2f}" in plan["test"]  # the stated power is the computed one


def test_tost_is_two_one_sided_welch_tests():
    rng = np.random.default_rng(0)
    a, b = list(rng.normal(0.1, 1, 6)), list(rng.normal(0.0, 2, 5))
    for margin in (0.5, 2.0, 5.0):
        got = tost(a, b, margin)
        shifted = [x + margin for x in a]  # H0: a − b ≤ −margin, i.e. (a + margin) − b ≤ 0
        p_low = scipy.stats.ttest_ind(shifted, b, equal_var=False, alternative="greater").pvalue
        p_high = scipy.stats.ttest_ind([x - margin for x in a], b, equal_var=False, alternative="less").pvalue
        assert got["p"] == pytest.approx(max(p_low, p_high), rel=1e-9)
        ci = scipy.stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.90)
        assert got["ci90"] == pytest.approx([ci.low, ci.high], rel=1e-9)
        assert (got["p"] < 0.05) == (-margin < ci.low and ci.high < margin)


def test_minimum_detectable_effect_has_the_power_it_claims():
    """Simulated: at the returned effect, the pooled t-test at α / m rejects in 80% of draws."""
    n, m = 5, 24
    d = minimum_detectable_effect(n, m)
    rng = np.random.default_rng(1)
    a = rng.normal(d, 1, (20000, n))
    b = rng.normal(0, 1, (20000, n))
    p = scipy.stats.ttest_ind(a, b, axis=1).pvalue
    assert (p < 0.05 / m).mean() == pytest.approx(0.8, abs=0.015)
    assert minimum_detectable_effect(5, 105) == pytest.approx(4.38, abs=0.01)  # the audit's 4.4 SD


def test_copy_targets_by_hand():
    from diffquant.data.synthetic import Chain, copy_targets, parse, sequences

    spec = parse("synth:bb:vocab=16,triggers=3")
    ids = torch.from_numpy(sequences(spec, "validation", 20, 40))
    got = copy_targets(ids, spec)
    triggers = set(Chain(spec).triggers.tolist())
    want = torch.zeros(20, 39, dtype=torch.bool)
    for i in range(20):
        for t in range(2, 40):
            want[i, t - 1] = int(ids[i, t - 1]) in triggers and int(ids[i, t - 2]) != spec.bos
    assert torch.equal(got, want) and want.any()
    # every copy target equals the token two places before it (the task's rule)
    rows, cols = got.nonzero(as_tuple=True)
    assert torch.equal(ids[rows, cols + 1], ids[rows, cols - 1])
    assert not copy_targets(ids, parse("synth:markov:vocab=16")).any()


def test_loss_at_positions_equals_a_direct_computation(micro_pair):
    import diffquant as dq

    model = micro_pair[1]
    ids = torch.randint(0, 512, (5, 17), generator=torch.Generator().manual_seed(3))
    pick = torch.rand(5, 16, generator=torch.Generator().manual_seed(4)) < 0.3
    got = dq.perplexity(model, ids, batch_size=2, positions=pick)  # the API's path to evaluate.language_modeling
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[:, :-1].double(), -1)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    assert got["positions_tokens"] == int(pick.sum())
    assert got["positions_loss"] == pytest.approx(float(nll[pick].mean()), rel=1e-5)
    from diffquant.errors import DiffquantError

    with pytest.raises(DiffquantError, match="positions must be"):
        dq.perplexity(model, ids, positions=pick[:, :3])


@pytest.mark.slow
def test_quick_run_end_to_end_with_tests_recomputed(tmp_path):
    from experiments.headnorm import load_plan, main

    doc = main(["--quick", "--out", str(tmp_path / "hn")])
    plan = load_plan(ROOT / "docs/headnorm/plan.yaml", quick=True)
    cells = {(c["arm"], c["lr"], c["seed"]): c for c in map(lambda p: json.loads(p.read_text()),
                                                            (tmp_path / "hn/cells").rglob("*.json"))}
    assert len(cells) == 12 and all(c["plan_sha256"] == plan["sha256"] for c in cells.values())
    rows = [r for r in doc["tests"] if not r.get("constant")]
    ps = []
    for r in rows:
        get = lambda arm: [cells[(arm, plan["lr"], s)][r["metric"]] for s in plan["seeds"]]  # noqa: E731
        a, b = get(r["a"]), get(r["b"])
        if r["transform"] == "log":
            a, b = np.log(a), np.log(b)
        p = scipy.stats.ttest_ind(a, b, equal_var=False).pvalue
        assert r["p"] == pytest.approx(p, rel=1e-9)
        ps.append(p)
    assert [r["p_holm"] for r in rows] == pytest.approx(holm(ps), rel=1e-9)
    # the copy loss and the rest recombine into the overall loss
    c = cells[("diff", plan["lr"], 0)]
    assert (c["copy_loss"] * c["copy_tokens"] + c["noncopy_loss"] * (c["tokens"] - c["copy_tokens"])) / c["tokens"] \
        == pytest.approx(c["loss"], rel=1e-9)
    assert "not a result" in (tmp_path / "hn/results.md").read_text()
    again = main(["--quick", "--out", str(tmp_path / "hn"), "--report-only"])  # from the cells alone, the same
    assert [r.get("p") for r in again["tests"]] == [r.get("p") for r in doc["tests"]]
    # a cell measured under another plan is refused, never mixed in
    path = tmp_path / "hn/cells/diff/lr0.003/s0.json"
    path.write_text(json.dumps({**c, "plan_sha256": "0" * 64}))
    from diffquant.errors import DiffquantError

    with pytest.raises(DiffquantError, match="another plan"):
        main(["--quick", "--out", str(tmp_path / "hn")])
    path.unlink()
    with pytest.raises(DiffquantError, match=r"1 cells at lr 0.003 are not in .*\(diff s0\)"):
        main(["--quick", "--out", str(tmp_path / "hn"), "--report-only"])
    assert math.isfinite(doc["aggregate"]["diff"]["loss"]["mean"])


def test_rate_sensitivity_flags_the_verdicts_whose_contrasts_flip():
    """The plan's rule: a metric's verdict is flagged when DIFF − Transformer, or the contrast of the part it is
    credited to, has the other sign at the sensitivity rate (seed 0); metrics without a verdict are never flagged."""
    from experiments.headnorm import load_plan, rate_sensitive

    plan = load_plan(ROOT / "docs/headnorm/plan.yaml")
    total, norm, dmap = (c["name"] for c in plan["contrasts"][:3])
    doc = {"decomposition": {"a": "the head norm", "b": "the differential map", "c": "the head norm",
                             "d": "no DIFF − Transformer difference detected", "e": "both (…)"},
           "sensitivity": [{"contrast": norm, "metric": "a", "same_sign": False},  # a's part flips: flagged
                           {"contrast": norm, "metric": "b", "same_sign": False},  # not b's part: not flagged
                           {"contrast": total, "metric": "c", "same_sign": True},
                           {"contrast": total, "metric": "d", "same_sign": False},  # no verdict to flag
                           {"contrast": dmap, "metric": "e", "same_sign": False}]}  # one of both's parts flips
    assert rate_sensitive(plan, doc) == ["a", "e"]
