"""`diffquant sweep`: load the models, build the cells, run them resumably, print and plot the table."""

from __future__ import annotations

from pathlib import Path

from diffquant.commands.common import parse_model_args
from diffquant.errors import DiffquantError
from diffquant.memory import check_fits
from diffquant.paths import atomic_write_json
from diffquant.sweep import (Evaluator, build_cells, check_evals, parse_bits, run_cells, save_layer_kurtosis,
                             summary_table)


def run_cli(args) -> None:
    from diffquant.data.tasks import load_task
    from diffquant.data.windows import corpus_text, corpus_windows
    from diffquant.models.load import load_model

    evals = [e.strip() for e in args.eval.split(",") if e.strip()]
    check_evals(evals)
    bits = parse_bits(args.bits)
    wa = parse_bits(args.wa_grid) if args.wa_grid else None
    grans = [g.strip() for g in args.granularity.split(",") if g.strip()]
    sites = [s.strip() for s in args.sites.split(",") if s.strip()]
    if args.tokens <= 0:
        raise DiffquantError(f"--tokens must be positive, got {args.tokens}")
    out = Path(args.out)
    config = {k: v for k, v in vars(args).items()
              if k not in ("func", "resume", "force", "no_plots", "debug", "compile")}
    if (out / "cells.jsonl").exists():
        if args.force:
            for name in ("cells.jsonl", "results.json", "results.csv"):
                (out / name).unlink(missing_ok=True)
        elif not args.resume:
            raise DiffquantError(f"{out} already holds a sweep; pass --resume to continue it or --force to restart")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "sweep_config.json", config)
    # the needle haystack, and the text the per-layer kurtosis profile reads
    val = corpus_text(args.data, "validation", args.cache_dir) if "needle" in evals or args.kurtosis_tokens else ""
    mc = {e[3:]: load_task(e[3:], args.mc_limit, cache=args.cache_dir) for e in evals if e.startswith("mc:")}
    models, evaluators, calibration = {}, {}, {}
    for label, source in parse_model_args(args.model):
        model, tokenizer = load_model(source, cache=args.cache_dir)
        if tokenizer is None:
            raise DiffquantError(f"{source} has no tokenizer")
        models[label] = (model, tokenizer)
        check_fits(model, 8, args.seq_len, f"evaluating {label}")
        evaluators[label] = Evaluator(evals, corpus_windows(args.data, tokenizer, "validation", args.seq_len,
                                                            args.tokens, args.cache_dir), tokenizer, val, mc)
        calibration[label] = corpus_windows(args.data, tokenizer, "train", args.seq_len, 16 * args.seq_len,
                                            args.cache_dir, chars=200_000)
    held = {label: m._diffquant_source_quantization for label, (m, _) in models.items()
            if getattr(m, "_diffquant_source_quantization", None)}
    if held:  # compressed-tensors checkpoints: what they held (their weights are dequantized, see quant/compressed.py)
        atomic_write_json(out / "sweep_config.json", {**config, "source_quantization": held})
    layers = {label: m.config.num_hidden_layers for label, (m, _) in models.items()}
    mitigations = [m.strip() for m in args.mitigate.split(",") if m.strip()]
    cells = build_cells(list(models), sites, bits, grans, wa, args.per_layer, layers, mitigations,
                        [x.strip() for x in args.schemes.split(",") if x.strip()],
                        [x.strip() for x in args.weights.split(",") if x.strip()])
    if args.kurtosis_tokens:
        save_layer_kurtosis(models, val, args.seq_len, args.kurtosis_tokens, out)
    rows = run_cells(models, cells, evaluators, out, compile=args.compile, calibration=calibration)
    if not args.no_plots:
        from diffquant.report.sweep_plots import plot_sweep

        plot_sweep(rows, out)
    print(summary_table(rows))
    print(f"results in {out / 'results.csv'}")
