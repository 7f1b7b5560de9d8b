"""The paper's Figure 8 on a real model: zero-shot multiple-choice accuracy of SmolLM2-135M-Instruct
(dequantized from Q4_1) as the attention logits go from 16 to 8, 6 and 4 bits (dynamic absmax, per tensor and
per head), beside W8A8 with static activations and W4A16, on tasks the float model can do at all.

    python -m experiments.fig8_real_model [--quick] [--out docs/fig8_real]

1. Task selection (float only, before any quantized run): the candidates below are scored in order until
   one passes the rule of diffquant/task_selection.py; every candidate tried is recorded.
2. The sweep, through the command a user would type (printed and stored in results.json):
   `diffquant sweep --model M --eval mc:TASK --mc-limit N --bits 16,8,6,4 --granularity tensor,head
   --schemes w8a8-static,w4a16 --kurtosis-tokens T --out DIR`; its cells are resumable and
   `diffquant plot DIR` redraws the figure from them.
3. results.json / results.md: the rule, the candidates, and per cell the accuracy with its Wilson interval
   and the paired change from float with the exact McNemar test over the same examples.

--quick runs the same path in seconds on a random micro model with two synthetic tasks whose answers are
known: one labelled with the model's own preferred choice (accuracy 100%: passes), one labelled at random.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Candidates, fixed before any run: BIG-bench multiple-choice tasks in English with at least 300 examples,
# one per task family, in increasing order of the tokens a float pass over 300 examples costs with the
# SmolLM2 tokenizer (sum over choices of input + choice): 7.1K, 8.1K, 9.3K, 14.7K, 17.1K, 17.2K. The CPU
# budget (2 shared cores) allows six; the sweep runs on the first that passes.
CANDIDATES = ["sports_understanding", "strategyqa", "cs_algorithms/valid_parentheses", "metaphor_boolean",
              "implicatures", "hyperbaton"]


@dataclass
class Settings:
    model: str = "smollm2-135m"  # SmolLM2-135M-Instruct, a Q4_1 GGUF dequantized to fp32
    candidates: list[str] = field(default_factory=lambda: list(CANDIDATES))
    examples: int = 300  # per task: the rule's minimum, sampled with `seed` (CPU: 2 shared cores)
    seed: int = 0
    stop_after: int = 1  # tasks that pass before selection stops (each costs a whole sweep)
    bits: str = "16,8,6,4"  # the paper's x axis
    granularity: str = "tensor,head"  # the paper does not say which; both are drawn
    schemes: str = "w8a8-static,w4a16"  # whole-model references (static scales calibrated on KJV's training split)
    data: str = "kjv"  # corpus for calibration and the kurtosis profile (held-out split)
    kurtosis_tokens: int = 2048
    seq_len: int = 256
    tokens: int = 16384  # held-out tokens the sweep command prepares for perplexity (unused by mc-only evals)
    threads: int = 1  # on a loaded 2-core machine one thread does ~4x more work per CPU second than two


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None, help="default docs/fig8_real (runs/fig8_real_quick with --quick)")
    p.add_argument("--report-only", action="store_true",
                   help="write results.json/.md from the saved selection and cells without running a model "
                        "(an unfinished sweep lists its missing cells; rerun without this flag to resume it)")
    a = p.parse_args(argv)
    out = Path(a.out or ("runs/fig8_real_quick" if a.quick else "docs/fig8_real"))
    run(quick_settings(out) if a.quick else Settings(), out, a.report_only)


def quick_settings(out: Path) -> Settings:
    """A random micro Llama, a tokenizer trained on a tiny corpus, and two synthetic tasks whose answers are
    known (see the module docstring)."""
    import diffquant as dq
    from diffquant.lab import PRESETS, build_model, train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = ["king", "land", "city", "house", "field", "moon", "river", "stone", "bread", "light"]
    text = "\n".join(f"the {rng.choice(words)} of the {rng.choice(words)} is {rng.choice(words)}." for _ in range(3000))
    (out / "corpus.txt").write_text(text)
    tok = train_tokenizer(text, 300)
    model = build_model(PRESETS["micro"], "baseline", 0)
    model.save_pretrained(out / "micro")
    tok.save_pretrained(out / "micro")
    examples = [{"input": f"the {rng.choice(words)} of the", "target_scores": dict.fromkeys(rng.sample(words, 3), 0)}
                for _ in range(300)]
    predicted = dq.multiple_choice(model, tok, examples)["predicted"]
    tasks = {}
    for name in ("known", "random"):
        rows = []
        for e, pick in zip(examples, predicted):
            gold = pick if name == "known" else rng.randrange(3)
            rows.append({"input": e["input"], "target_scores": {c: int(i == gold) for i, c in enumerate(e["target_scores"])}})
        tasks[name] = out / f"{name}.jsonl"
        tasks[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Settings(model=str(out / "micro"), candidates=[str(tasks["random"]), str(tasks["known"])],
                    data=str(out / "corpus.txt"), kurtosis_tokens=256, seq_len=32, tokens=1024)


def run(s: Settings, out: Path, report_only: bool = False) -> dict:
    import torch

    import diffquant as dq
    from diffquant.lab import (TASK_RULE, atomic_write_json, atomic_write_text, command_line, select_task, start_run,
                               task_label)

    torch.set_num_threads(s.threads)
    if not report_only:  # a report-only pass keeps the settings and environment of the runs that measured
        out = start_run(out, s, "cpu")
    t0, cpu0 = time.perf_counter(), time.process_time()
    selection_path = out / "selection.json"
    if selection_path.exists():  # fixed once made: a rerun never re-selects
        selection = json.loads(selection_path.read_text())
    elif report_only:
        raise SystemExit(f"{selection_path} does not exist: nothing to report")
    else:
        model, tok = dq.load(s.model, device="cpu")
        record = select_task(model, tok, s.candidates, s.examples, s.seed, stop_after=s.stop_after, progress=True)
        selection = {"rule": TASK_RULE, "examples_per_task": s.examples, "seed": s.seed, "candidates": s.candidates,
                     "tried": record, "chosen": [r["task"] for r in record if r["passed"]]}
        atomic_write_json(selection_path, selection)
        del model
    result = {"model": s.model, "settings": asdict(s), "selection": selection, "commands": [], "tables": {}}
    for task in selection["chosen"]:
        folder = out / ("sweep" if len(selection["chosen"]) == 1 else f"sweep-{Path(task).stem}")
        args = ["sweep", "--model", s.model, "--eval", f"mc:{task}", "--mc-limit", str(s.examples), "--bits", s.bits,
                "--granularity", s.granularity, "--schemes", s.schemes, "--kurtosis-tokens", str(s.kurtosis_tokens),
                "--data", s.data, "--seq-len", str(s.seq_len), "--eval-tokens", str(s.tokens), "--out", str(folder)]
        result["commands"].append("diffquant " + " ".join(args))
        if (folder / "cells.jsonl").exists():
            args.append("--resume")
        if not report_only and command_line(args) != 0:
            raise SystemExit(f"the sweep on {task} failed")
        if not (folder / "results.json").exists():
            continue
        rows = json.loads((folder / "results.json").read_text())["rows"]
        fp = next(r for r in rows if r["scheme"] == "fp")
        picked = next(r for r in selection["tried"] if r["task"] == task)
        label = task_label(task)
        if fp[f"{label}_acc"] != picked["acc"]:
            raise SystemExit(f"{task}: the sweep's float accuracy {fp[f'{label}_acc']} differs from selection's "
                             f"{picked['acc']} on the same examples")
        result["tables"][task] = table_rows(rows, label)
        result.setdefault("missing", {})[task] = [w for w in expected_settings(s) if w not in
                                                  {r["setting"] for r in result["tables"][task]}]
        result["figure"] = str(folder / "accuracy_vs_bits.png")
    before = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    spent = 0.0 if report_only else 1.0  # a report-only pass measures nothing: its seconds are not the results'
    result["cpu_seconds"] = before.get("cpu_seconds", 0.0) + spent * (time.process_time() - cpu0)  # every invocation
    result["wall_seconds"] = before.get("wall_seconds", 0.0) + spent * (time.perf_counter() - t0)
    atomic_write_json(out / "results.json", result)
    atomic_write_text(out / "results.md", markdown_report(result))
    print(markdown_report(result))
    return result


def expected_settings(s: Settings) -> list[str]:
    """The settings a finished sweep holds, named as `table_rows` names them."""
    bits = [b for b in s.bits.split(",") if b != "16"]
    return ["float (fp32, not quantized)", *[f"attn_logits int{b} per {g}" for g in s.granularity.split(",") for b in bits],
            *s.schemes.split(",")]


def table_rows(rows: list[dict], label: str) -> list[dict]:
    """Per cell: what was quantized, accuracy with its Wilson interval, the paired change from float and the
    exact McNemar test."""
    acc = f"{label}_acc"
    out = []
    for r in rows:
        if r["scheme"] == "fp" and out:
            continue  # the 16-bit point of each granularity is the float model (fp32 here), listed once
        what = ("float (fp32, not quantized)" if r["scheme"] == "fp" else r["scheme"] if r["kind"] == "scheme"
                else f"{r['site']} int{r['bits']} per {r['granularity']}")
        out.append({"setting": what, "kind": r["kind"], "bits": r["bits"], "granularity": r["granularity"],
                    "acc": r[acc], "acc_ci95": r[f"{acc}_ci95"], "acc_norm": r[f"{label}_acc_norm"],
                    "delta": r.get(f"{acc}_delta"), "gained": r.get(f"{acc}_gained"), "lost": r.get(f"{acc}_lost"),
                    "mcnemar_p": r.get(f"{acc}_mcnemar_p"), "examples": r[f"{label}_examples"],
                    "chance": r[f"{label}_chance"], "seconds": r["seconds"]})
    return out


def markdown_report(result: dict) -> str:
    from diffquant.lab import markdown

    sel = result["selection"]
    pct = lambda v: f"{100 * v:.1f}"  # noqa: E731
    lines = [f"### Figure 8 on a real model: {result['model']} (`python -m experiments.fig8_real_model`)", "",
             "Model: SmolLM2-135M-Instruct, dequantized from Q4_1 to fp32 (zoo name `smollm2-135m`), zero-shot, "
             "no chat template." if result["model"] == "smollm2-135m" else f"Model: {result['model']}.", "",
             "#### Task selection (float model only, before any quantized run)", "", f"Rule: {sel['rule']}", "",
             f"{sel['examples_per_task']} examples per task, sampled with seed {sel['seed']}. Candidates in order: "
             + ", ".join(f"`{c}`" for c in sel["candidates"]) + " (scored until one passed).", "",
             markdown(["task", "n", "acc %", "95% Wilson", "chance %", "majority %", "acc_norm %", "passes", "why"],
                      [[f"`{r['task']}`", r["examples"], pct(r["acc"]),
                        f"[{pct(r['acc_ci95'][0])}, {pct(r['acc_ci95'][1])}]", pct(r["chance"]), pct(r["majority"]),
                        pct(r["acc_norm"]), "yes" if r["passed"] else "no", r["reason"]] for r in sel["tried"]]),
             "", "majority: the accuracy of always answering the most common correct choice (a constant guesser).", ""]
    for r in sel["tried"]:
        if r["passed"] and r["acc_ci95"][0] <= r["majority"]:
            lines += [f"Caveat on `{r['task']}`: its interval [{pct(r['acc_ci95'][0])}, {pct(r['acc_ci95'][1])}] "
                      f"excludes chance ({pct(r['chance'])}%) but not the majority-answer rate ({pct(r['majority'])}%), "
                      "so the float model is not shown to do better than always giving the most common answer; "
                      "the rule, fixed in advance, asks only for chance.", ""]
    if not sel["chosen"]:
        near = max(sel["tried"], key=lambda r: r["margin"])
        lines += [f"No candidate passed; the nearest was `{near['task']}` at {pct(near['acc'])}% "
                  f"[{pct(near['acc_ci95'][0])}, {pct(near['acc_ci95'][1])}] against chance {pct(near['chance'])}%. "
                  "No sweep was run.", ""]
        return "\n".join(lines)
    for task, rows in result["tables"].items():
        lines += [f"#### Accuracy versus bit-width on `{task}`", "",
                  f"{rows[0]['examples']} examples; chance {pct(rows[0]['chance'])}%. acc: the choice with the "
                  "largest summed log-likelihood (lm-eval's acc). Δ: paired change from float on the same examples "
                  "(gained/lost: examples the setting gets right/wrong that float got wrong/right), p: exact "
                  "two-sided McNemar test.", "",
                  markdown(["setting", "acc %", "95% Wilson", "Δ pts", "gained / lost", "McNemar p", "acc_norm %"],
                           [[r["setting"], pct(r["acc"]), f"[{pct(r['acc_ci95'][0])}, {pct(r['acc_ci95'][1])}]",
                             "-" if r["delta"] is None else f"{100 * r['delta']:+.1f}",
                             "-" if r["gained"] is None else f"{r['gained']} / {r['lost']}",
                             "-" if r["mcnemar_p"] is None else f"{r['mcnemar_p']:.3g}", pct(r["acc_norm"])]
                            for r in rows]), "", f"Figure: `{result['figure']}`.", "",
                  what_it_shows(result["model"], next((r for r in sel["tried"] if r["task"] == task), None), rows), ""]
        if result.get("missing", {}).get(task):
            lines += [f"**Unfinished**: no result yet for {', '.join(result['missing'][task])}; the command below "
                      "resumes the sweep.", ""]
    lines += ["Regenerate (add `--resume` to continue a sweep from its saved cells; `diffquant plot FOLDER` redraws "
              "the figure from them):", ""]
    lines += [f"    {c}" for c in result["commands"]]
    lines += ["", f"CPU time {result['cpu_seconds'] / 60:.1f} min, wall {result['wall_seconds'] / 60:.1f} min, summed over "
                  "the invocations that made these results (one thread, nice 10, on a 2-core machine shared with "
                  "other work).", ""]
    return "\n".join(lines)


def what_it_shows(model: str, picked: dict | None, rows: list[dict]) -> str:
    """What the figure can and cannot say, beside it: the model is not a DIFF model, whether the float model beats
    the majority answer (exact two-sided binomial test of its correct count against the majority rate), and
    whether acc_norm ever leaves the majority rate."""
    from scipy.stats import binomtest

    kind = ("SmolLM2-135M-Instruct is a softmax Transformer: no DIFF model is involved, so this figure shows how one "
            "Transformer's accuracy moves with the bits, not the paper's DIFF-against-Transformer comparison."
            if model == "smollm2-135m" else f"{model}: the figure is one model's accuracy against the bits.")
    if not picked or picked.get("majority") is None:
        return kind
    n, k, major = picked["examples"], picked["correct"], picked["majority"]
    test = binomtest(k, n, major)
    norm = {r["acc_norm"] for r in rows}
    same = (f" acc_norm (length-normalised) is {100 * major:.1f}% in all {len(rows)} settings, exactly the "
            "majority-answer rate: what a scorer that picks the same option on every example gives (the per-example "
            "acc_norm choices are not stored, so which option it picks is not checked here)."
            if norm == {major} else "")
    return (f"{kind} The float model's {k}/{n} ({100 * k / n:.1f}%) beats chance ({100 * picked['chance']:.1f}%) but "
            f"is not shown to beat always giving the most common answer ({100 * major:.1f}%: exact binomial test "
            f"against {major:.3f}, two-sided p {test.pvalue:.2f})" + (", so the differences between settings are "
            "changes in a model not shown to do better than a constant answer." if test.pvalue >= 0.05 else ".") + same)


if __name__ == "__main__":
    main()
