import json

import pytest
import torch

from diffquant import DiffquantError
from diffquant.cli import main
from diffquant.evaluate import language_modeling, multiple_choice
from diffquant.sweeps import Cell, build_cells, parse_bits


def test_cells_and_bits():
    assert parse_bits("16,8,6,4") == [16, 8, 6, 4]
    for bad in ("0", "1", "33", "four", ""):
        with pytest.raises(DiffquantError):
            parse_bits(bad)
    cells = build_cells(["a", "b"], ["attn_logits"], [16, 4], ["tensor", "head"], [8, 4], 4, {"a": 2, "b": 2})
    assert len(cells) == 2 * (2 * 2 + 4 + 2)
    assert Cell("a", "act", bits=16).scheme().is_identity
    assert Cell("a", "layer", bits=4, layer=1).scheme().activations[0][0] == "layers.1.attn_logits"
    with pytest.raises(DiffquantError):
        build_cells(["a"], ["attn_logits"], [4], ["rows"], None, None, {})


def test_sweep_rows_hold_their_stage_seconds(tmp_path, micro_pair, capsys):
    """Each quantized cell's row (cells.jsonl and results.json) holds quantize_'s steps and its evaluation in
    `stage_seconds`, within the cell's `seconds`; a printed line per cell names them."""
    from diffquant.sweeps import Evaluator, run_cells

    g = torch.Generator().manual_seed(0)
    evalset, calib = torch.randint(3, 512, (2, 16), generator=g), torch.randint(3, 512, (4, 16), generator=g)
    cells = [Cell("T", "act"), Cell("T", "wa", "linear", 16, "token", 4, weights="gptq")]
    rows = run_cells({"T": (micro_pair[0], None)}, cells, {"T": Evaluator(["ppl"], evalset, None, "", {})}, tmp_path,
                     progress=True, calibration={"T": calib})
    stages = rows[1]["stage_seconds"]
    assert list(stages) == ["solver gptq", "attach", "static scales", "evaluate"]
    assert all(v >= 0 for v in stages.values()) and sum(stages.values()) <= rows[1]["seconds"]
    lines = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert lines[1]["stage_seconds"] == stages and "evaluate" in lines[0]["stage_seconds"]
    assert "T W4A16 + gptq: solver gptq " in capsys.readouterr().out
    assert "stage_seconds" not in (tmp_path / "results.csv").read_text()  # a nested value: in the JSON only


def test_language_modeling_matches_hand_computation(micro_pair):
    model = micro_pair[0]
    ids = torch.randint(0, 512, (3, 10))
    r = language_modeling(model, ids, batch_size=2)
    with torch.no_grad():
        logits = model(ids).logits[:, :-1]
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), ids[:, 1:].reshape(-1))
    assert r["loss"] == pytest.approx(float(ref), rel=1e-5)
    assert r["tokens"] == 27


class CharTok:
    """A tokenizer with one id per character, to hand-check multiple-choice scoring."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % 512 for c in text]}


def test_multiple_choice_acc_and_acc_norm(micro_pair):
    model = micro_pair[1]
    tok = CharTok()
    ex = [{"input": "ab", "target_scores": {"c": 1, "dddd": 0}}]
    r = multiple_choice(model, tok, ex)

    def ll(ctx, cont):
        ids = torch.tensor([tok(ctx + cont)["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0], -1)
        n = len(ctx)
        return sum(float(logp[n - 1 + i, t]) for i, t in enumerate(tok(cont)["input_ids"]))

    a, b = ll("ab", " c"), ll("ab", " dddd")
    assert r["acc"] == float(a > b)
    assert r["acc_norm"] == float(a / 1 > b / 4)
    r = multiple_choice(model, tok, ex * 3 + [{"input": "ab", "target_scores": {"c": 0, "dddd": 1}}])
    p = r["acc"]
    assert r["acc_se"] == pytest.approx((p * (1 - p) / 3) ** 0.5)  # sample SE of four 0/1 outcomes


@pytest.mark.slow
def test_sweep_cli_resumes(tmp_path, micro_pair, capsys, drawn):
    from diffquant.data.tokens import train_tokenizer

    text = "\n".join(f"the {w} of the {v} is good and {u}." for w, v, u in
                     zip(["king", "man", "son"] * 300, ["land", "city", "house", "field"] * 225, ["old", "new"] * 450))
    corpus = tmp_path / "c.txt"
    corpus.write_text(text)
    tok = train_tokenizer(text, 300)
    for model in micro_pair:
        model.save_pretrained(tmp_path / model.config.model_type)
        tok.save_pretrained(tmp_path / model.config.model_type)
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"input": f"the {w} of the", "target_scores": {"land": 1, "moon": 0}}) + "\n"
                            for w in ("king", "man", "son")))
    out = tmp_path / "sweep"
    args = ["sweep", "--model", f"T={tmp_path / 'llama'}", "--model", f"D={tmp_path / 'diffllama'}", "--data",
            str(corpus), "--eval-tokens", "256", "--seq-len", "32", "--bits", "16,8,4", "--granularity", "tensor,head",
            "--eval", f"ppl,mc:{task}", "--wa-grid", "8,4", "--per-layer", "4", "--out", str(out)]
    assert main(args) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert len(rows) == 2 * (3 * 2 + 4 + 2)
    assert all("ppl" in r and "task_acc" in r for r in rows)
    for name in ("metric_vs_bits.png", "wa_grid.png", "layer_sensitivity.png", "results.csv"):
        assert (out / name).exists()
    # the perplexity panels drawn are the CSV's numbers: per (site, granularity) a line per model over the bit widths,
    # 16 being the model's float row, and each point's bar its perplexity interval
    import csv

    table = [r for r in csv.DictReader((out / "results.csv").open()) if r["kind"] == "act"]
    panels = sorted({(r["site"], r["granularity"]) for r in table})
    widths = sorted({int(r["bits"]) for r in table}, reverse=True)
    for ax, (site, gran) in zip(drawn["metric_vs_bits"].axes, panels):  # the first row of panels: perplexity
        tokens = {int(r["tokens"]) for r in table if r["site"] == site and r["granularity"] == gran}
        assert len(tokens) == 1  # every cell of a panel scored on the same held-out tokens, stated in its title
        assert " ".join(ax.get_title().split()) == f"{site}, per {gran} ({tokens.pop():,} tokens)"
        assert ax.get_ylabel() == "perplexity"
        assert sorted(c.get_label() for c in ax.containers) == ["D", "T"]
        for container in ax.containers:
            mine = {int(r["bits"]): r for r in table if r["model"] == container.get_label()
                    and (int(r["bits"]) == 16 or (r["site"], r["granularity"]) == (site, gran))}
            assert list(container.lines[0].get_ydata()) == [float(mine[b]["ppl"]) for b in widths]
            ci = [json.loads(mine[b]["ppl_ci95"]) for b in widths]
            bars = [end for seg in container.lines[2][0].get_segments() for end in (seg[0][1], seg[1][1])]
            assert bars == pytest.approx([end for lo_hi in ci for end in lo_hi], rel=1e-12)
    fp = {r["model"]: r["ppl"] for r in rows if r["scheme"] == "fp"}
    assert all(r["ppl"] == fp[r["model"]] for r in rows if r["bits"] == 16 and r["kind"] == "act")
    # the paired change from float, against numpy on the per-sequence losses kept in cells.jsonl
    import numpy as np
    import scipy.stats

    cells = {json.loads(line)["key"]: json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()}
    for r in rows:
        if r["scheme"] == "fp":
            continue
        q = np.array(cells[r["key"]]["metrics"]["per_sequence_loss"])
        f = np.array(next(c for c in cells.values() if c["model"] == r["model"] and c["scheme"] == "fp")
                     ["metrics"]["per_sequence_loss"])
        d = q - f
        half = scipy.stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))  # paired t-interval
        assert r["delta_loss"] == pytest.approx(d.mean(), abs=1e-9)
        assert r["delta_loss_ci95"] == pytest.approx([d.mean() - half, d.mean() + half], abs=1e-9)
        assert r["ppl_change_pct"] == pytest.approx(100 * (np.exp(d.mean()) - 1), rel=1e-9)
        assert r["tokens"] == 8 * 31 and r["task_examples"] == 3
        assert "per_sequence_loss" not in r
    assert main(args) == 2 and "already holds a sweep" in capsys.readouterr().err
    lines = (out / "cells.jsonl").read_text().splitlines()
    (out / "cells.jsonl").write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])  # interrupted mid-write
    assert main([*args, "--resume"]) == 0
    again = json.loads((out / "results.json").read_text())["rows"]
    assert [r["key"] for r in again] == [r["key"] for r in rows]
    assert [r["ppl"] for r in again] == [r["ppl"] for r in rows]  # deterministic on CPU
    assert main(["plot", str(out)]) == 0


@pytest.mark.slow
def test_lm_eval_adapter_agrees_with_own_scoring(tmp_path, micro_pair):
    pytest.importorskip("lm_eval")
    from diffquant.data.tokens import train_tokenizer
    from diffquant.lm_eval_adapter import evaluate, write_local_task
    from diffquant.quant.numerics.scheme import get_scheme

    text = " ".join(f"the {w} of the {v}" for w, v in zip(["king", "man", "son"] * 50, ["land", "city", "sea"] * 50))
    tok = train_tokenizer(text, 300)
    examples = [{"input": f"the {w} of the", "target_scores": {"land": 1, "city": 0, "sea": 0}}
                for w in ("king", "man", "son", "king man")]
    folder = write_local_task(examples, tmp_path / "tasks")
    model = micro_pair[1]
    for scheme in ("fp", "logits-int4"):
        res = evaluate(model, tok, ["diffquant_local"], get_scheme(scheme), folder)["diffquant_local"]
        from diffquant.quant.numerics.scheme import attach_scheme

        handle = attach_scheme(model, get_scheme(scheme))
        ours = multiple_choice(model, tok, examples)
        handle.remove()
        assert res["acc"] == pytest.approx(ours["acc"]) and res["acc_norm"] == pytest.approx(ours["acc_norm"])


@pytest.mark.slow
def test_compiled_sweep_equals_eager(tmp_path, micro_pair):
    """`sweep --compile` (fused fake quantizers) gives the same metrics as the eager sweep."""
    from diffquant.sweeps import Evaluator, run_cells

    model = micro_pair[1]
    seqs = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    cells = build_cells(["D"], ["attn_logits", "hidden"], [8, 4], ["tensor"], None, None, {})
    runs = []
    for compile in (False, True):
        out = tmp_path / f"compile-{compile}"
        out.mkdir()
        evaluator = Evaluator(["ppl"], seqs, None, "", {})
        runs.append(run_cells({"D": (model, None)}, cells, {"D": evaluator}, out, progress=False, compile=compile))
    assert len({r["loss"] for r in runs[0] if r["bits"] != 16}) == 4  # each cell really quantized something
    assert [r["loss"] for r in runs[0]] == [r["loss"] for r in runs[1]]
