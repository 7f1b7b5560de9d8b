"""How much post-training fixing does each model need? SmoothQuant, rotation and clipping against no fix, at
each bit-width, on SmolLM2-135M-Instruct (Q4_1 → fp32) and on the matched pairs (the demo pair, and the pair of the setting
the emergence search chose, labelled by that setting's name: it is in the outlier regime
(diffquant.stats.outlier_regime) only where the search says it was reached), seed 0 of each.

    python -m experiments.mitigations [--quick] [--models smollm2 demo regime] [--out docs/mitigations]

Per model × scheme × fix: held-out perplexity with its 95% interval (exp of the loss's t-interval over
sequences) and the paired change from the float model (95% paired t-interval), and (optional, --mc, models trained on text) BIG-bench multiple-choice accuracy. Each
model is evaluated on the held-out split of its own corpus (KJV for SmolLM2 and the demo pair, the synthetic
corpus for the search's pair) and every fix is calibrated on that corpus's training split (16 windows), never
on the evaluation text. Settings fixed before any run: the paper's
α = 0.5 for SmoothQuant, QuaRot's randomised Hadamard (seed 0), MSE range search for clipping.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import diffquant as dq
from diffquant.lab import atomic_write_json, atomic_write_text, display

SCHEMES = ("w8a8-static", "w6a6", "w4a8", "w4a4", "logits-int4")
FIXES = ("none", "smoothquant:0.5", "rotate", "clip:mse")
EVAL_TOKENS, SEQ = 8192, 256  # SEQ: the windows of a pretrained model (a trained pair uses its own)


def models_to_run(which, runs: Path, quick: bool) -> dict[str, tuple[str, object]]:
    """{label: (model source, its training run's TrainConfig and folder, or None)}: SmolLM2 from the zoo, the
    pairs from the emergence experiment's runs (RUNS/rivals/demo for the demo pair, RUNS/emergence/<setting> for the
    search's), trained here with the same settings when missing."""
    from experiments.emergence import DEMO, config, regime_setting

    from diffquant.lab import TrainConfig, train_pair

    out = {}
    if "smollm2" in which:
        out[display("smollm2-135m")] = ("smollm2-135m", None)
    settings = {"demo": ("demo", DEMO)}
    if "regime" in which:
        settings["regime"] = regime_setting(Path("docs/emergence/search.json"))
    for key in ("demo", "regime"):
        if key not in which:
            continue
        name, overrides = settings[key]
        if quick:
            overrides = {**overrides, "preset": "micro", "tokens": 8 * 4 * 64, "batch_size": 4, "seq_len": 64}
        folder = (runs / "rivals" if key == "demo" else runs / "emergence") / name / "s0"
        cfg = config(overrides, 0, ("baseline", "diff")) if key == "regime" else TrainConfig(
            **{**overrides, "archs": ("baseline", "diff"), "eval_every": 10**9, "save_every": 200, "track": True,
               "track_points": 16})
        train_pair(cfg, folder, resume=(folder / "train_config.json").exists(), progress=False)
        label = "demo" if key == "demo" else name  # never "regime": the search may not have reached one
        out[f"Transformer ({label})"] = (str(folder / "baseline"), (cfg, folder))
        out[f"DIFF ({label})"] = (str(folder / "diff"), (cfg, folder))
    return out


def held_out_and_calibration(tok, run, tokens: int):
    """(evaluation windows, 16 calibration windows, corpus name, its validation text or None) for one model:
    a trained pair uses its own run's corpus, tokenizer and window length (a synthetic corpus has no text to
    score multiple-choice tasks on); a pretrained model uses KJV with its own tokenizer. Calibration windows
    always come from the training split, never from the evaluation text."""
    from dataclasses import asdict, replace

    from diffquant.lab import TrainConfig, encode, is_synthetic, load_text, prepare_data, sequences, split_corpus

    if run is None:
        train_text, val = split_corpus(load_text("kjv")[0])
        return (sequences(encode(tok, val), SEQ, tokens), sequences(encode(tok, train_text[:200_000]), SEQ, 16 * SEQ),
                "kjv", val)
    cfg, folder = run
    data = prepare_data(TrainConfig(**{**asdict(replace(cfg, eval_tokens=tokens)), "archs": tuple(cfg.archs)}), folder)
    val = None if is_synthetic(cfg.corpus) else split_corpus(load_text(cfg.corpus)[0])[1]
    return data.val, data.train[:16], cfg.corpus, val


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--models", nargs="+", default=["smollm2", "demo", "regime"], choices=["smollm2", "demo", "regime"])
    p.add_argument("--mc", default=None, help="a BIG-bench task for multiple-choice accuracy (e.g. hyperbaton)")
    p.add_argument("--out", default="docs/mitigations")
    p.add_argument("--runs", default="runs")
    a = p.parse_args(argv)
    from diffquant.lab import Cell, Evaluator, load_task, run_cells, start_run

    out = start_run(a.out, vars(a), "cpu")
    which = ["demo", "regime"] if a.quick else a.models
    sources = models_to_run(which, out / "runs" if a.quick else Path(a.runs), a.quick)
    mc = {a.mc: load_task(a.mc, 200)} if a.mc else {}
    tokens = 1024 if a.quick else EVAL_TOKENS
    schemes, fixes = (("w8a8-static", "logits-int4"), ("none", "smoothquant:0.5")) if a.quick else (SCHEMES, FIXES)
    rows, data_used = [], {}
    for label, (source, run) in sources.items():
        model, tok = dq.load(source, device="cpu")
        seqs, calib, corpus, val = held_out_and_calibration(tok, run, tokens)
        evals = ["ppl"] + ([f"mc:{a.mc}"] if a.mc and val is not None else [])
        evaluator = Evaluator(evals, seqs, tok, val or "", mc if val is not None else {})
        data_used[label] = {"corpus": corpus, "sequences": len(seqs), "seq_len": seqs.shape[1],
                            "predicted_tokens": len(seqs) * (seqs.shape[1] - 1)}
        cells = [Cell(label, "act", "attn_logits")] + [
            Cell(label, "scheme", scheme, mitigate=fix) for scheme in schemes for fix in fixes]
        folder = out / "cells" / label.replace(" ", "_").replace("(", "").replace(")", "")
        folder.mkdir(parents=True, exist_ok=True)
        rows += run_cells({label: (model, tok)}, cells, {label: evaluator}, folder, progress=False,
                          calibration={label: calib})
        del model
    doc = {"rows": rows, "eval_tokens": tokens, "schemes": schemes, "fixes": fixes,
           "sources": {k: v[0] for k, v in sources.items()}, "data": data_used}
    atomic_write_json(out / "results.json", doc)
    atomic_write_text(out / "results.md", render(doc))
    _plot(rows, out)
    print((out / "results.md").read_text())


def caveat(row: dict, source: str) -> str:
    """What a result on a zoo model needs said beside it: weight quantization of SmolLM2-135M-Instruct starts
    from weights already on a 4-bit grid."""
    from diffquant.lab import zoo_entry

    entry = zoo_entry(source)
    if entry is None or not entry.weight_caveat or row["kind"] != "scheme" or not dq.scheme(row["site"]).weights:
        return ""
    return entry.weight_caveat


def render(doc: dict) -> str:
    """results.md from results.json: perplexity [exp of the loss's 95% t-interval] per model × scheme × fix, the
    paired change from float, and the caveat of weight-quantization rows on a model whose weights were quantized."""
    from diffquant.lab import cell_text, markdown

    rows, sources = doc["rows"], doc["sources"]
    table = [r for r in rows if r["kind"] == "act"] + [r for r in rows if r["kind"] == "scheme"]
    body = [[display(r["model"]), "float" if r["kind"] == "act" else r["site"],
             "-" if r["kind"] == "act" else r["mitigate"], cell_text(r, "ppl"), caveat(r, sources[r["model"]])]
            for r in table]
    caveated = sorted({display(r["model"]) for r, line in zip(table, body) if line[-1]})
    clean = (f" On {', '.join(caveated)} the clean measurements are the schemes that leave the weights alone "
             f"(logits-int4); its weight-quantization rows start from weights that were already quantized."
             if caveated else "")
    held = "; ".join(f"{display(label)}: {d['corpus']}, {d['predicted_tokens']:,} tokens ({d['sequences']} × "
                     f"{d['seq_len']})" for label, d in doc["data"].items())
    return ("Perplexity of each model on the held-out split of its own corpus (" + held + "); brackets: the "
            "exponential of the loss's 95% t-interval over sequences; parentheses: change from the model's float "
            "perplexity with its 95% paired t-interval. Fixes calibrated on 16 training windows of the same corpus; "
            "seed 0. The caveat column marks weight quantization of a model whose weights were already quantized."
            + clean + "\n\n" + markdown(["model", "scheme", "fix", "perplexity", "caveat"], body))


def _plot(rows: list[dict], out: Path) -> None:
    from diffquant.lab import color, pyplot, save_figure

    scheme_rows = [r for r in rows if r["kind"] == "scheme" and r.get("ppl_change_pct") is not None]
    if not scheme_rows:
        return
    plt = pyplot()
    models = list(dict.fromkeys(r["model"] for r in scheme_rows))
    schemes = list(dict.fromkeys(r["site"] for r in scheme_rows))
    fixes = list(dict.fromkeys(r["mitigate"] for r in scheme_rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.8), squeeze=False, layout="constrained")
    width = 0.8 / len(fixes)
    for ax, model in zip(axes[0], models):
        for k, fix in enumerate(fixes):
            pts = [next((r for r in scheme_rows if r["model"] == model and r["site"] == s and r["mitigate"] == fix), None)
                   for s in schemes]
            ys = [max(p["ppl_change_pct"], 0.01) if p else float("nan") for p in pts]
            lo = [y - max(p["ppl_change_pct_ci95"][0], 0.01) if p and p.get("ppl_change_pct_ci95") else 0
                  for p, y in zip(pts, ys)]  # the paired 95% interval; the log axis floors it at 0.01%
            hi = [max(p["ppl_change_pct_ci95"][1], 0.01) - y if p and p.get("ppl_change_pct_ci95") else 0
                  for p, y in zip(pts, ys)]
            ax.bar([i + k * width for i in range(len(schemes))], ys, width, label=fix,
                   color=[f"C{k}"] * len(schemes), edgecolor=color(model),
                   yerr=[[max(v, 0) for v in lo], [max(v, 0) for v in hi]], capsize=2, ecolor="0.3")
        ax.set_xticks([i + width * (len(fixes) - 1) / 2 for i in range(len(schemes))], schemes, rotation=30, fontsize=8)
        ax.set(yscale="log", title=display(model), ylabel="perplexity change from float (%)")
        ax.legend(fontsize=7)
    fig.suptitle("Perplexity change from each model's float perplexity, with its 95% paired t-interval "
                 "(changes ≤ 0 drawn at 0.01%)", fontsize=9)
    save_figure(fig, out, "mitigations")


if __name__ == "__main__":
    main()
