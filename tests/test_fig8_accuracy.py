"""Accuracy versus bit-width: exact multiple-choice scoring, the task-selection rule, McNemar in sweeps, and
the accuracy figure."""

import json
from pathlib import Path

import pytest
import torch

from diffquant.evaluate import multiple_choice
from diffquant.task_selection import judge, majority_rate, select


class CharTok:
    """One id per character, so continuation tokens are easy to count by hand."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 512 for c in text]}


EXAMPLES = [
    {"input": "ab", "target_scores": {"c": 1, "dddd": 0}},
    {"input": "the king", "target_scores": {"of": 0, "is": 1, "was here": 0}},
    {"input": "xy", "target_scores": {"zz": 0, "q": 0, "rr": 1, "s": 0}},
    {"input": "a b c d", "target_scores": {"e": 1, "ff": 0}},
    {"input": "hello", "target_scores": {"w": 0, "x": 1}},
    {"input": "pqrs", "target_scores": {"tu": 1, "vw": 0, "xyz": 0}},
]


def _by_hand(model, examples):
    """Each (input, choice) run alone, unbatched: summed log P(" " + choice | input), argmax for acc, the same
    divided by the choice's characters for acc_norm."""
    tok = CharTok()
    preds, preds_norm = [], []
    for ex in examples:
        ctx = tok(ex["input"])["input_ids"]
        lls = []
        for choice in ex["target_scores"]:
            cont = tok(" " + choice)["input_ids"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ctx + cont])).logits[0].double(), -1)
            lls.append(sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont)))
        preds.append(max(range(len(lls)), key=lls.__getitem__))
        norm = [v / len(c) for v, c in zip(lls, ex["target_scores"])]
        preds_norm.append(max(range(len(norm)), key=norm.__getitem__))
    gold = [max(range(len(e["target_scores"])), key=lambda i, e=e: list(e["target_scores"].values())[i])
            for e in examples]
    return preds, [int(p == g) for p, g in zip(preds, gold)], [int(p == g) for p, g in zip(preds_norm, gold)]


@pytest.mark.parametrize("scheme", ["fp", "logits-int4"])
@pytest.mark.parametrize("batch_tokens", [1, 4096])
def test_batched_scoring_equals_one_sequence_at_a_time(micro_pair, scheme, batch_tokens):
    """Batches hold sequences of one length only (no padding), so even a per-tensor dynamic quantizer of the
    attention logits scores each sequence as it would alone."""
    from diffquant.quant.numerics.scheme import get_scheme, attach_scheme

    model = micro_pair[1]
    handle = attach_scheme(model, get_scheme(scheme))
    try:
        r = multiple_choice(model, CharTok(), EXAMPLES, batch_tokens=batch_tokens)
        preds, correct, correct_norm = _by_hand(model, EXAMPLES)
    finally:
        handle.remove()
    assert r["predicted"] == preds
    assert r["correct"] == correct and r["correct_norm"] == correct_norm
    assert r["acc"] == sum(correct) / 6 and r["acc_norm"] == sum(correct_norm) / 6
    assert r["chance"] == pytest.approx((1 / 2 + 1 / 3 + 1 / 4 + 1 / 2 + 1 / 2 + 1 / 3) / 6)


def test_selection_rule_against_scipy():
    from scipy.stats import binomtest

    for k, n, chance in [(120, 300, 1 / 3), (116, 300, 1 / 3), (170, 300, 0.5), (165, 300, 0.5), (60, 300, 0.25),
                         (299, 299, 0.5)]:
        lo = binomtest(k, n).proportion_ci(0.95, "wilson").low
        got = judge([1] * k + [0] * (n - k), chance)
        assert got["passed"] == (n >= 300 and lo > chance), (k, n)
        assert got["acc_ci95"][0] == pytest.approx(lo, abs=1e-12)
    assert judge([1] * 300, 0.5)["reason"] == "interval above chance"
    assert judge([0] * 300, 0.5)["reason"] == "interval below chance"
    assert judge([1] * 299, 0.5)["reason"] == "only 299 examples (< 300)"  # perfect, yet too few


def test_selection_on_synthetic_tasks_with_known_answers(tmp_path, micro_pair):
    """A task labelled with the model's own choice (accuracy 1) passes; one labelled with a choice it never
    picks (accuracy 0) does not; selection stops at the first pass."""
    model, tok = micro_pair[0], CharTok()
    words = ["ab", "cd", "efg", "hi", "jkl"]
    examples = [{"input": f"{w} {v}", "target_scores": {"x" + w: 0, "y" + v: 0}} for w in words for v in words] * 12
    predicted = multiple_choice(model, tok, examples)["predicted"]
    files = {}
    for name, gold in (("right", predicted), ("wrong", [1 - p for p in predicted])):
        rows = [{"input": e["input"], "target_scores": {c: int(i == g) for i, c in enumerate(e["target_scores"])}}
                for e, g in zip(examples, gold)]
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = select(model, tok, [str(files["wrong"]), str(files["right"]), str(files["wrong"])], limit=300,
                    stop_after=1)
    assert [r["passed"] for r in record] == [False, True]  # the third candidate is never scored
    assert record[0]["acc"] == 0.0 and record[0]["reason"] == "interval below chance"
    assert record[1]["acc"] == 1.0 and record[1]["examples"] == 300 and record[1]["chance"] == 0.5


def test_majority_rate():
    ex = [{"input": "q", "target_scores": {"Yes": 1, "No": 0}}] * 3 + [{"input": "q", "target_scores": {"Yes": 0, "No": 1}}]
    assert majority_rate(ex) == 0.75


def test_sweep_mcnemar_against_scipy():
    from scipy.stats import binomtest

    from diffquant.sweeps import _flat, versus_float

    fp = {"t_correct": [1] * 40 + [0] * 20 + [1] * 10 + [0] * 30, "t_correct_norm": [1, 0] * 50}
    q = {"t_correct": [1] * 40 + [1] * 4 + [0] * 16 + [0] * 10 + [0] * 30, "t_correct_norm": [1, 0] * 50}
    d = versus_float(fp, q)  # 4 gained, 10 lost
    assert (d["t_acc_gained"], d["t_acc_lost"]) == (4, 10)
    assert d["t_acc_delta"] == pytest.approx(-6 / 100)
    assert d["t_acc_mcnemar_p"] == pytest.approx(binomtest(4, 14, 0.5).pvalue, rel=1e-12)
    assert d["t_acc_norm_mcnemar_p"] == 1.0 and d["t_acc_norm_delta"] == 0.0
    row = _flat({"key": "k", "model": "m", "metrics": {**q, "t_acc": 0.44, "per_sequence_loss": [1.0]}})
    assert row == {"key": "k", "model": "m", "t_acc": 0.44}  # per-example outcomes stay in cells.jsonl


def test_scheme_cells_and_accuracy_figure(tmp_path, drawn):
    from diffquant.report.sweep_plots import plot_sweep
    from diffquant.sweeps import build_cells

    cells = build_cells(["m"], ["attn_logits"], [16, 8, 4], ["tensor", "head"], None, None, {}, schemes=["w4a16"])
    assert [c.kind for c in cells].count("scheme") == 1 and cells[-1].scheme().name == "w4a16"
    with pytest.raises(Exception):
        build_cells(["m"], ["attn_logits"], [8], ["tensor"], None, None, {}, schemes=["w5a5-nonsense"])

    def row(kind, bits, gran, scheme, acc):
        return {"model": "m", "kind": kind, "site": "attn_logits", "bits": bits, "granularity": gran,
                "scheme": scheme, "mitigate": "none", "t_acc": acc, "t_acc_ci95": [acc - 0.05, acc + 0.05],
                "t_chance": 0.5, "t_examples": 300, "t_acc_mcnemar_p": 0.01}

    rows = [row("act", 16, "tensor", "fp", 0.7), row("act", 8, "tensor", "q8", 0.69), row("act", 4, "tensor", "q4", 0.6),
            row("act", 8, "head", "h8", 0.7), row("scheme", 16, "tensor", "w4a16", 0.66)]
    (tmp_path / "layer_kurtosis.json").write_text(json.dumps(
        {"tokens": 512, "models": {"m": {"attn_logits": [{"layer": 0, "kurtosis": 4.0}, {"layer": 1, "kurtosis": 9.0}],
                                         "hidden": [{"layer": 0, "kurtosis": 30.0}, {"layer": 1, "kurtosis": 300.0}]}}}))
    written = plot_sweep(rows, tmp_path)
    assert tmp_path / "accuracy_vs_bits.png" in written
    # read back: accuracy in % per bit width (16 = the float row), each line's band the rows' Wilson interval, the
    # whole-model scheme as a bar after them, a star where McNemar's p < 0.05, the kurtosis panel from its file
    acc_ax, kurt_ax = drawn["accuracy_vs_bits"].axes
    assert " ".join(acc_ax.get_title().split()) == "m: t (300 examples)" and acc_ax.get_ylabel() == "accuracy (%)"
    assert [t.get_text() for t in acc_ax.get_xticklabels()] == ["16 (fp)", "8", "4", "w4a16"]
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in acc_ax.get_lines()}
    assert lines["attn_logits per tensor"] == ([0, 1, 2], pytest.approx([70.0, 69.0, 60.0]))
    assert lines["attn_logits per head"] == ([0, 1], pytest.approx([70.0, 70.0]))
    assert lines["chance (50.0%)"][1] == [50.0, 50.0]
    band = acc_ax.collections[0].get_paths()[0].vertices  # fill_between of the first line (per head): lower, upper
    assert sorted({round(float(y), 6) for y in band[:, 1]}) == pytest.approx([65.0, 75.0])
    (scheme_bar,) = [c for c in acc_ax.containers]
    assert list(scheme_bar.lines[0].get_ydata()) == pytest.approx([66.0])
    assert [end for seg in scheme_bar.lines[2][0].get_segments() for end in (seg[0][1], seg[1][1])] == \
        pytest.approx([61.0, 71.0])
    stars = [(t.get_text(), t.xy) for t in acc_ax.texts]
    assert all(text == "*" for text, _ in stars)  # every row's p is 0.01: a star on each point (fp on both lines)
    assert sorted((round(x, 6), round(y, 6)) for _, (x, y) in stars) == \
        [(0, 75.0), (0, 75.0), (1, 74.0), (1, 75.0), (2, 65.0), (3.5, 71.0)]
    kurt = {line.get_label(): list(line.get_ydata()) for line in kurt_ax.get_lines()}
    assert kurt["attention logits"] == [4.0, 9.0] and kurt["hidden states"] == [30.0, 300.0]
    assert " ".join(kurt_ax.get_title().split()) == "m: kurtosis per layer (float, 512 tokens)"


def test_row_after_a_cut_line_survives(tmp_path):
    """A sweep interrupted mid-write leaves a cut last line; the next row appended must stay readable."""
    from diffquant.sweeps import append_row, load_done

    (tmp_path / "cells.jsonl").write_text('{"key": "a", "x": 1}\n{"key": "b", "x"')
    append_row(tmp_path, {"key": "c", "x": 3})
    assert sorted(load_done(tmp_path)) == ["a", "c"]


@pytest.mark.slow
def test_fig8_real_model_quick(tmp_path):
    """The experiment end to end on a micro model: the known-answer task is chosen, the random one is not,
    every setting of the sweep is reported, and `diffquant plot` redraws the figure from the saved cells."""
    from conftest import load_script_module

    from diffquant.cli import main

    mod = load_script_module("experiments/fig8_real_model.py", "fig8_real_model_under_test")
    mod.main(["--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["selection"]["chosen"] == [str(tmp_path / "known.jsonl")]
    assert [r["passed"] for r in result["selection"]["tried"]] == [False, True]
    rows = result["tables"][str(tmp_path / "known.jsonl")]
    assert [r["setting"] for r in rows] == mod.expected_settings(mod.quick_settings(tmp_path / "again"))
    assert rows[0]["acc"] == 1.0 and not result["missing"][str(tmp_path / "known.jsonl")]
    (tmp_path / "sweep" / "accuracy_vs_bits.png").unlink()
    assert main(["plot", str(tmp_path / "sweep")]) == 0
    assert (tmp_path / "sweep" / "accuracy_vs_bits.png").exists()


def test_summary_table_names_the_interval_it_shows():
    from diffquant.sweeps import summary_table

    base = {"model": "m", "kind": "act", "site": "attn_logits", "granularity": "tensor", "mitigate": "none"}
    acc = [{**base, "bits": 16, "scheme": "fp", "t_acc": 0.6, "t_acc_ci95": [0.5, 0.7], "t_examples": 300},
           {**base, "bits": 4, "scheme": "q", "t_acc": 0.55, "t_acc_ci95": [0.45, 0.65], "t_examples": 300,
            "t_acc_delta": -0.05, "t_acc_mcnemar_p": 0.0312}]
    text = summary_table(acc)
    assert "Wilson" in text and "55.0% [45.0, 65.0] (-5.0 pts, McNemar p = 0.031)" in text
    ppl = [{**base, "bits": 16, "scheme": "fp", "ppl": 10.0, "ppl_ci95": [9.0, 11.0], "loss_se": 0.05, "tokens": 512}]
    assert "interval over sequences" in summary_table(ppl) and "Wilson" not in summary_table(ppl)


def test_the_figure_says_no_diff_model_and_whether_the_task_beats_the_majority_answer():
    """Beside the figure: SmolLM2 is no DIFF model; the float model's correct count against the majority rate by an
    exact two-sided binomial test (here by hand: the sum of the Binomial(n, majority) probabilities no larger than
    that of the observed count), and acc_norm pinned at the majority rate in every setting is said."""
    import math

    from conftest import load_script_module

    mod = load_script_module("experiments/fig8_real_model.py", "fig8_real_model_note_under_test")
    root = Path(__file__).resolve().parent.parent
    committed = json.loads((root / "docs/fig8_real/results.json").read_text())
    task = committed["selection"]["chosen"][0]
    picked = next(r for r in committed["selection"]["tried"] if r["task"] == task)
    rows = committed["tables"][task]
    n, k, q = picked["examples"], picked["correct"], picked["majority"]
    pmf = [math.comb(n, i) * q ** i * (1 - q) ** (n - i) for i in range(n + 1)]
    p = min(1.0, sum(v for v in pmf if v <= pmf[k] * (1 + 1e-7)))
    text = mod.what_it_shows("smollm2-135m", picked, rows)
    assert "no DIFF model is involved" in text
    assert f"{k}/{n}" in text and f"two-sided p {p:.2f})" in text and f"{p:.2f}" == "0.45"
    assert "not shown to beat always giving the most common answer" in text
    assert {r["acc_norm"] for r in rows} == {q} and f"acc_norm (length-normalised) is {100 * q:.1f}% in all 9" in text
    md = (root / "docs/fig8_real/results.md").read_text()
    assert text in md and md.index("Figure: `") < md.index(text)
