"""`diffquant demo`: the whole story on one machine, offline.

Fetch KJV, train (or reuse) the tiny matched pair, profile both (Table 5 analog), sweep attention-logit
bits 16/8/6/4 and a W × A grid, profile SmolLM2-135M-Instruct (dequantized from Q4_1), and write a report folder.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from diffquant.errors import DiffquantError
from diffquant.paths import atomic_write_json, atomic_write_text, cache_dir, folder_lock
from diffquant.report.style import display


@dataclass(frozen=True)
class DemoConfig:
    preset: str = "tiny"
    corpus: str = "kjv"
    train_tokens: int = 600_000  # per model: ~3 min each on a quiet 2-core CPU
    eval_tokens: int = 16_384  # ONE held-out slice: the training table, the sweeps and the W x A grid all use it
    profile_tokens: int = 32_768
    sweep_bits: tuple[int, ...] = (16, 8, 6, 4)
    granularities: tuple[str, ...] = ("tensor", "head")
    wa_bits: tuple[int, ...] = (8, 6, 4)
    smollm_tokens: int = 4096
    track_points: int = 12
    seed: int = 0


QUICK = DemoConfig(train_tokens=30_000, eval_tokens=1024, profile_tokens=2048, granularities=("tensor",),
                   wa_bits=(8, 4), smollm_tokens=256)
PAPER_SCALE = "3B parameters, 350B training tokens"
SEQ = 256
# Seconds each step took in the committed runs (docs/demo/summary.json, docs/demo-quick/summary.json: 2 CPU cores,
# an empty cache, other work on the machine; `python -m docs.readme_results --run-demo / --run-quick` measures them
# again, and a test keeps these equal to those files), for the plan the demo prints before it starts.
STEP_SECONDS = {"full": {"train": 423, "profile": 18, "sweep": 58, "smollm2": 43, "load": 2.2},
                "quick": {"train": 341, "profile": 23, "sweep": 60, "smollm2": 64, "load": 2.4}}


def plan_lines(cfg: DemoConfig, quick: bool) -> list[str]:
    """What the demo will do, step by step, with the minutes each step took in the committed run."""
    m = {k: v / 60 for k, v in STEP_SECONDS["quick" if quick else "full"].items() if k != "load"}
    load = STEP_SECONDS["quick" if quick else "full"]["load"]
    return [f"diffquant demo{' --quick' if quick else ''}: about {sum(m.values()):.0f} min on 2 CPU cores from an empty "
            f"cache, measured with other work running (load average {load:g}); a quiet machine, a warm cache or a "
            "GPU is faster",
            f"  [1/5] train a {cfg.preset} DIFF / Transformer pair on {cfg.train_tokens:,} {cfg.corpus} tokens each, "
            f"tracking outliers at {cfg.track_points} points   ~{m['train']:.1f} min",
            f"  [2/5] profile both on {cfg.profile_tokens:,} held-out tokens (Table 5 analog, sinks)   ~{m['profile']:.1f} min",
            f"  [3/5] sweep attention-logit bits {'/'.join(map(str, cfg.sweep_bits))} and a W × A grid "
            f"{'/'.join(map(str, cfg.wa_bits))}   ~{m['sweep']:.1f} min",
            f"  [4/5] profile SmolLM2-135M-Instruct on {cfg.smollm_tokens:,} tokens   ~{m['smollm2']:.1f} min",
            "  [5/5] write the report"]


def _eps(checkpoint: Path) -> float:
    """The RMSNorm eps a trained model of the pair has (its config.json): reports say it beside the pair."""
    return json.loads((checkpoint / "config.json").read_text())["rms_norm_eps"]


def _models_digest(tcfg) -> str:
    """8 hex digits of the pair's model configs: a cached pair is reused only while the preset builds the same
    models (a changed default, such as rms_norm_eps, trains a new pair instead of reusing a stale one)."""
    import hashlib
    import json

    from diffquant.models.presets import get_preset

    spec = get_preset(tcfg.preset)
    configs = {}
    for arch in tcfg.archs:
        c = spec.config(arch).to_dict()
        configs[arch] = {k: v for k, v in c.items() if k not in ("transformers_version", "architectures")}
    return hashlib.sha256(json.dumps(configs, sort_keys=True, default=str).encode()).hexdigest()[:8]


def _pair(cfg: DemoConfig, cache: str | None, device: str) -> tuple[Path, dict]:
    from diffquant.training import TrainConfig, train_pair

    tcfg = TrainConfig(preset=cfg.preset, corpus=cfg.corpus, tokens=cfg.train_tokens, seed=cfg.seed,
                       eval_every=max(50, cfg.train_tokens // (16 * SEQ * 4)), save_every=100,
                       eval_tokens=cfg.eval_tokens, track=True, track_points=cfg.track_points)
    folder = cache_dir(cache) / "demo" / (f"{cfg.preset}-{cfg.corpus}-{cfg.train_tokens}-e{cfg.eval_tokens}"
                                          f"-t{cfg.track_points}-s{cfg.seed}-m{_models_digest(tcfg)}")
    with folder_lock(folder):  # a second demo at once (another shell, a test worker) waits, then resumes it done
        results = train_pair(tcfg, folder, device, resume=(folder / "train_config.json").exists(), cache=cache)
    return folder, results


def sweep_step(cfg: DemoConfig, models: dict, evalset, val: str, out: Path, force: bool) -> list[dict]:
    """The logit bit sweep and the W x A grid of the pair into `out`, resumed from its cells.jsonl, or, with
    `force`, computed again: a forced demo never reuses another run's cells."""
    from diffquant.report.sweep_plots import plot_sweep
    from diffquant.sweeps import Evaluator, build_cells, run_cells, write_results

    evaluators = {label: Evaluator(["ppl"], evalset, tok, val, {}) for label, (_, tok) in models.items()}
    cells = build_cells(list(models), ["attn_logits"], list(cfg.sweep_bits), list(cfg.granularities),
                        list(cfg.wa_bits), None, {})
    if force:
        shutil.rmtree(out, ignore_errors=True)
    out.mkdir(exist_ok=True)
    rows = run_cells(models, cells, evaluators, out)
    write_results(out, rows)
    plot_sweep(rows, out)
    return rows


def run_demo(cfg: DemoConfig, out: Path, cache: str | None = None, force: bool = False) -> dict:
    from diffquant.data.corpora import load_text, split
    from diffquant.data.tokens import encode, sequences
    from diffquant.models.load import load_model, load_pair
    from diffquant.commands.common import prepare_out
    from diffquant.profiler import profile_model
    from diffquant.report.emergence_plots import plot_emergence
    from diffquant.report.profile_report import profile_json, sink_rows, table5_rows, write_report

    out = prepare_out(out, force, "report.md")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    timings = {}
    print(f"[1/5] corpus {cfg.corpus} and the {cfg.preset} matched pair ({cfg.train_tokens:,} training tokens each, "
          f"tracked at {cfg.track_points} points)")
    pair_dir, train = _pair(cfg, cache, device)
    timings["train"] = time.perf_counter() - t0
    emergence = json.loads((pair_dir / "emergence.json").read_text())
    (out / "emergence").mkdir(exist_ok=True)
    atomic_write_json(out / "emergence" / "emergence.json", emergence)
    plot_emergence(emergence, out / "emergence")
    text, _ = load_text(cfg.corpus, cache)
    _, val = split(text)
    models = load_pair(pair_dir, device)
    tokenizer = models["DIFF"][1]
    val_ids = encode(tokenizer, val)
    evalset = sequences(val_ids, SEQ, cfg.eval_tokens)  # = the training run's validation windows

    print(f"[2/5] profiling both models on {cfg.profile_tokens:,} held-out tokens")
    t = time.perf_counter()
    seqs = sequences(val_ids, SEQ, cfg.profile_tokens)
    profiles = [profile_model(m, seqs, label=label, sinks=True) for label, (m, _) in models.items()]
    for p in profiles:
        p.provenance.update({"data": cfg.corpus, "split": "validation", "dtype": "fp32", "device": device})
    write_report(profiles, out / "profile")
    timings["profile"] = time.perf_counter() - t

    print(f"[3/5] attention-logit bit sweep and W x A grid on the {evalset.numel():,}-token evaluation slice")
    t = time.perf_counter()
    rows = sweep_step(cfg, models, evalset, val, out / "sweep", force)
    timings["sweep"] = time.perf_counter() - t

    print(f"[4/5] profiling {display('smollm2-135m')} on {cfg.smollm_tokens:,} tokens")
    t = time.perf_counter()
    smol, smol_tok = load_model("smollm2-135m", cache=cache, device=device)
    smol_prof = profile_model(smol, sequences(encode(smol_tok, val), SEQ, cfg.smollm_tokens), label=display("smollm2-135m"),
                              sinks=True)
    smol_prof.provenance.update({"data": cfg.corpus, "split": "validation", "dtype": "fp32", "device": device})
    write_report([smol_prof], out / "smollm2")
    del smol
    timings["smollm2"] = time.perf_counter() - t

    print("[5/5] writing the report")
    timings["total"] = time.perf_counter() - t0
    fp = {r["model"]: r for r in rows if r["scheme"] == "fp"}
    summary = {"config": asdict(cfg), "pair_checkpoints": str(pair_dir),
               "eval": {"tokens": next(iter(fp.values()))["tokens"], "sequences": len(evalset), "seq_len": SEQ,
                        "slice": f"the first {len(evalset)} windows of {SEQ} tokens of the {cfg.corpus} validation split"},
               "train": {display(a): {"parameters": m["parameters"], "tokens": cfg.train_tokens,
                                      "tokens_per_s": m["tokens_per_s"], "loss": fp[display(a)]["loss"],
                                      "loss_se": fp[display(a)]["loss_se"], "ppl": fp[display(a)]["ppl"],
                                      "ppl_ci95": fp[display(a)]["ppl_ci95"],
                                      "accuracy": fp[display(a)]["next_token_acc"],
                                      "accuracy_se": fp[display(a)]["next_token_acc_se"],
                                      "final_val_loss": m["final_val"]["loss"],
                                      "rms_norm_eps": _eps(pair_dir / a)}
                         for a, m in train["models"].items()},
               "unigram_entropy": train["data"]["unigram_entropy"], "table5": table5_rows(profiles),
               "profile_tokens": profiles[0].provenance["tokens"],
               "sinks": sink_rows([profile_json(p) for p in profiles]),
               "emergence_final": {label: pts[-1]["model"] for label, pts in emergence["models"].items()},
               "smollm2_table5": table5_rows([smol_prof]), "smollm2_sinks": sink_rows([profile_json(smol_prof)]),
               "smollm2_tokens": smol_prof.provenance["tokens"], "sweep": rows, "seconds": timings,
               "next": next_commands(pair_dir)}
    atomic_write_json(out / "summary.json", summary)
    atomic_write_text(out / "report.md", render_report(summary))
    return summary


def next_commands(pair_dir: Path) -> list[str]:
    b, d = pair_dir / "baseline", pair_dir / "diff"
    return [f"diffquant sweep --model Transformer={b} --model DIFF={d} --bits 16,8,6,4 --granularity tensor,head,token "
            "--out runs/sweep",
            f"diffquant profile --model Transformer={b} --model DIFF={d} --tokens 49152 --out runs/profile",
            f"diffquant quantize --model {d} --scheme w8a8-static --out runs/diff-w8a8"]


def _verdict(rows: list[list]) -> list[str]:
    """The Table 5 rows side by side, stated as one run's values, never as an ordering: the demo trains one seed,
    and its largest values move with float rounding in training (the same run on 1 or 2 CPU threads gave DIFF an
    attention-logit top-1 of 41.6 or 47.3), so a direction read off them would not be a finding."""
    by = {(r[0], r[1]): r for r in rows}
    lines = []
    for kind in ("attention logits", "hidden states"):
        d, b = by.get(("DIFF", kind)), by.get(("Transformer", kind))
        if not d or not b:
            continue
        lines.append(f"- {kind}: DIFF top-1 {d[2]:.4g} vs Transformer {b[2]:.4g} (ratio {d[2] / b[2]:.2f}); kurtosis "
                     f"{d[8]:.3g} vs {b[8]:.3g}. One training run: which is larger is not established (the same run "
                     "on another thread count or CPU moves the top-1 by several units).")
    return lines


def training_rows(s: dict) -> list[list]:
    """One row per model: loss and accuracy ± their 95% t-interval over the evaluation sequences, perplexity with
    the exponential of the loss interval."""
    from diffquant.stats.intervals import fmt_interval, fmt_pm, half95

    n = s["eval"]["sequences"]
    return [[label, m["parameters"], m["tokens"], fmt_pm(m["loss"], half95(m["loss_se"], n), 4),
             fmt_interval(m["ppl"], m["ppl_ci95"], 4), fmt_pm(m["accuracy"], half95(m["accuracy_se"], n), 3),
             f"{m['tokens_per_s']:,.0f}"] for label, m in s["train"].items()]


TRAINING_HEADER = ["model", "parameters", "training tokens", "held-out loss (nats)", "perplexity [95%]",
                   "next-token accuracy", "training tokens/s"]


def named_rows(rows: list[list]) -> list[list]:
    """Table rows whose first cell is a model label, with the label as reports name it (older summaries wrote
    the zoo model as "SmolLM2-135M")."""
    return [[display(r[0]), *r[1:]] for r in rows]


def wa_rows(rows: list[dict]) -> list[list]:
    from diffquant.sweeps import cell_text

    return [[r["model"], r["wbits"], r["bits"], cell_text(r, "ppl")] for r in rows if r["kind"] == "wa"]


ONE_SEED = ("One training seed: an ordering of the two models' costs here is one draw of the training noise, not a "
            "property of the designs; `python -m experiments.emergence --only regime --setting demo` repeats this setting "
            "over three seeds.")


def render_report(s: dict, seed_note: str = ONE_SEED) -> str:
    """report.md from summary.json; `seed_note` says what one seed can and cannot show (docs/readme_results.py
    passes one that reconciles the demo with the three-seed comparison of the same setting)."""
    from diffquant.report.profile_report import KIND_TITLE, PAPER_TABLE5, SINK_HEADER, TABLE5_HEADER
    from diffquant.report.tables import markdown
    from diffquant.sweeps import summary_table

    cfg, ev = s["config"], s["eval"]
    params = s["train"]["DIFF"]["parameters"]
    lines = [
        "# diffquant demo report", "",
        f"Scale of this run: a matched pair of {params / 1e6:.1f}M parameters trained on {cfg['train_tokens']:,} "
        f"tokens of {cfg['corpus']} each; the paper's models have {PAPER_SCALE}. The paper's effect belongs to models "
        "trained at scale: read these numbers as a measurement of small models, not as a test of the paper.", "",
        f"Every perplexity and accuracy below is measured on one held-out slice, {ev['slice']} "
        f"({ev['tokens']:,} predicted tokens); loss and accuracy ± their 95% t-interval over its {ev['sequences']} "
        "sequences, perplexity with the exponential of the loss interval in brackets, and changes from 16-bit paired "
        "over the same sequences (95% t-interval). One seed.", "",
        "## Training", "",
        markdown(TRAINING_HEADER, training_rows(s)),
        f"Unigram entropy of the training tokens: {s['unigram_entropy']:.3f} nats (a model that learned nothing "
        "beyond token frequencies has this loss).", "",
        "## Outliers as they emerge during training", "",
        "Both models profiled on 8 held-out sequences at log-spaced points of training (`diffquant train --track`).", "",
        "![emergence](emergence/emergence.png)", "",
        f"## Largest activations (Table 5 analog, {s['profile_tokens']:,} held-out tokens)", "",
        markdown(TABLE5_HEADER, s["table5"]),
        *_verdict(s["table5"]), "",
        "Paper (Table 5):", "",
        markdown(["model", "activation", "top-1", "top-2", "top-3", "top-10", "top-100", "median"],
                 [[m, KIND_TITLE[k], *v] for (m, k), v in PAPER_TABLE5.items()]),
        "![top-1 and median by layer](profile/absmax_vs_layer.png)", "",
        "![kurtosis by layer](profile/kurtosis_vs_layer.png)", "",
        "![distribution of |x|](profile/histograms.png)", "",
        "## Attention sinks and massive activations", "",
        markdown(SINK_HEADER, s["sinks"]),
        "![sinks by layer](profile/sinks_vs_layer.png)", "",
        "## Attention logits quantized (Figure 8 analog)", "",
        "Dynamic absmax quantization of the attention logits only (scales per tensor or per head of each sequence); "
        "perplexity on the evaluation slice (lower is better). The paper reports zero-shot HellaSwag on 3B models: "
        "DIFF 66.2 → 58.8 and Transformer 63.4 → 33.9 from 16 to 4 bits.", "",
        summary_table(s["sweep"]),
        seed_note, "",
        "![metric vs bits](sweep/metric_vs_bits.png)", "",
        "## Weights × activations", "",
        "Per-channel weights and per-token Linear inputs at W/A bits; perplexity [exp of the loss's 95% t-interval], "
        "and in parentheses the paired change from the float model.", "",
        markdown(["model", "W bits", "A bits", "perplexity"], wa_rows(s["sweep"])),
        "![W x A grid](sweep/wa_grid.png)", "",
        f"## A pretrained model: {display('smollm2-135m')} ({s['smollm2_tokens']:,} tokens)", "",
        markdown(TABLE5_HEADER, named_rows(s["smollm2_table5"])),
        markdown(SINK_HEADER, named_rows(s["smollm2_sinks"])),
        "SmolLM2-135M-Instruct ships as a Q4_1 GGUF, dequantized to fp32 on load: its activations are those of the "
        "model as shipped, and its weights already sit on a 4-bit grid (groups of 32), so weight-quantization results "
        "on it are not those of the original bf16 weights.", "",
        "![SmolLM2 top-1 and median by layer](smollm2/absmax_vs_layer.png)", "",
        "![SmolLM2 sinks by layer](smollm2/sinks_vs_layer.png)", "",
        "## Next", "",
        f"The trained pair is in `{s['pair_checkpoints']}` (`baseline/` and `diff/`). Go on with:", "",
        "```bash", *s["next"], "```", "",
        "## Time", "",
        markdown(["step", "seconds"], [[k, v] for k, v in s["seconds"].items()]),
    ]
    return "\n".join(lines) + "\n"


def run_cli(args) -> None:
    from diffquant.report.profile_report import TABLE5_HEADER
    from diffquant.report.tables import markdown
    from diffquant.sweeps import summary_table

    cfg = QUICK if args.quick else DemoConfig()
    out = Path(args.out)
    if (out / "report.md").exists() and not args.force:
        raise DiffquantError(f"{out} already holds a report; pass --force to overwrite or choose another --out")
    print("\n".join(plan_lines(cfg, args.quick)), flush=True)
    s = run_demo(cfg, out, args.cache_dir, force=args.force)
    print()
    print(markdown(TRAINING_HEADER, training_rows(s)))
    print(markdown(TABLE5_HEADER, s["table5"]))
    print(summary_table(s["sweep"]))
    print(f"report: {out / 'report.md'} ({s['seconds']['total']:.0f} s)")
    print(f"trained pair: {s['pair_checkpoints']}/baseline and {s['pair_checkpoints']}/diff; next:")
    for command in s["next"]:
        print(f"  {command}")
