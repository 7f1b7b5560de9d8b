"""How results are reported: one perplexity interval (exp of the loss's t-interval), paired t-intervals, Holm's
correction over a table's tests, the words for a test that finds nothing, and the zoo model's honest name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats as sps


def test_perplexity_interval_is_the_exponential_of_the_loss_t_interval():
    from diffquant.stats.intervals import fmt_interval, ppl_interval

    losses = [4.1, 4.6, 4.3, 4.9, 4.4]
    lo, hi = sps.t.interval(0.95, len(losses) - 1, loc=np.mean(losses), scale=sps.sem(losses))
    ci = ppl_interval(float(np.mean(losses)), float(sps.sem(losses)), len(losses))
    assert ci == pytest.approx([np.exp(lo), np.exp(hi)], rel=1e-12)
    assert ppl_interval(4.0, None, 5) is None and ppl_interval(4.0, 0.1, 1) is None
    assert fmt_interval(84.0837, [78.0594, 90.573]) == "84.08 [78.06, 90.57]"
    assert fmt_interval(7937.2, [6987.4, 9016.6]) == "7937 [6987, 9017]"
    assert fmt_interval(None, None) == "-"


def test_paired_interval_uses_t_with_n_minus_1_degrees_of_freedom():
    from diffquant.stats.intervals import paired

    a, b = [1.0, 2.0, 3.0, 5.0, 4.0], [1.5, 2.1, 3.9, 5.2, 4.1]
    d = np.subtract(b, a)
    lo, hi = sps.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=sps.sem(d))
    assert paired(a, b)["ci95"] == pytest.approx([lo, hi], rel=1e-12)
    assert paired([1.0], [2.0])["ci95"] is None


def test_holm_against_a_hand_worked_example():
    from diffquant.stats.intervals import holm

    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04; running maximum makes the last 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02], rel=1e-12)
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1
    assert holm([0.2]) == [0.2] and holm([]) == []
    # ties keep their order-independent value
    assert holm([0.01, 0.01, 0.2]) == pytest.approx([0.03, 0.03, 0.2])


def test_verdict_words():
    from diffquant.stats.intervals import verdict

    assert verdict(1.5, 0.004, 3) == "higher (p 0.004)" and verdict(-1.5, 0.0123, 3) == "lower (p 0.012)"
    assert verdict(1.5, 0.06, 3) == "no difference detected (n = 3, p 0.06)"
    assert verdict(0.0, 0.0, 3).startswith("no difference detected")


def test_sweep_cell_text_writes_one_perplexity_interval():
    from diffquant.stats.intervals import paired, ppl_interval
    from diffquant.sweeps import cell_text, versus_float

    fp = [4.2, 4.5, 4.4, 4.7, 4.3, 4.6]
    q = [x + dx for x, dx in zip(fp, (0.02, 0.03, 0.01, 0.05, 0.02, 0.04))]
    loss, se, n = float(np.mean(q)), float(sps.sem(q)), len(q)
    row = {"ppl": math.exp(loss), "ppl_ci95": ppl_interval(loss, se, n), "loss_se": se, "sequences": n,
           **versus_float({"per_sequence_loss": fp}, {"per_sequence_loss": q})}
    lo, hi = sps.t.interval(0.95, n - 1, loc=loss, scale=se)
    d = np.subtract(q, fp)
    dlo, dhi = sps.t.interval(0.95, n - 1, loc=d.mean(), scale=sps.sem(d))
    assert row["ppl_change_pct_ci95"] == pytest.approx([100 * math.expm1(dlo), 100 * math.expm1(dhi)], rel=1e-9)
    assert paired(fp, q)["n"] == n
    text = cell_text(row, "ppl")
    assert text == (f"{math.exp(loss):.2f} [{math.exp(lo):.2f}, {math.exp(hi):.2f}] "
                    f"(+{100 * math.expm1(d.mean()):.1f}% [+{100 * math.expm1(dlo):.1f}, +{100 * math.expm1(dhi):.1f}])")
    assert "±" not in text
    acc = {"next_token_acc": 0.25, "next_token_acc_se": 0.01, "sequences": 6}
    assert cell_text(acc, "next_token_acc") == f"0.2500 ± {sps.t.ppf(0.975, 5) * 0.01:.4f}"


def test_the_zoo_model_is_named_honestly_and_keeps_its_alias():
    from diffquant.models.zoo import ALIASES, zoo_entry
    from diffquant.report.style import color, display

    name = "SmolLM2-135M-Instruct (Q4_1 → fp32)"
    assert display("smollm2-135m") == name and display("SmolLM2-135M") == name  # the alias, and older files' label
    assert display("SmolLM2-135M (demo)") == f"{name} (demo)" and display("baseline") == "Transformer"
    assert ALIASES["smollm2-135m"] == "smollm2-135m" and zoo_entry("smollm2-135m-instruct").name == "smollm2-135m"
    assert "4-bit grid" in zoo_entry("smollm2-135m").weight_caveat and color(name) == "#7f7f7f"


def test_weight_rows_on_the_zoo_model_carry_the_caveat():
    from experiments import mitigations

    row = {"kind": "scheme", "site": "w4a8"}
    assert "4-bit grid" in mitigations.caveat(row, "smollm2-135m")
    assert mitigations.caveat({"kind": "scheme", "site": "logits-int4"}, "smollm2-135m") == ""  # no weights touched
    assert mitigations.caveat(row, "runs/rivals/demo/s0/diff") == ""
    assert mitigations.caveat({"kind": "act", "site": "attn_logits"}, "smollm2-135m") == ""
