"""`diffquant profile`: load each model, profile the validation split of a corpus, write the report."""

from __future__ import annotations

from pathlib import Path

from diffquant.commands.common import model_label, parse_model_args, prepare_out
from diffquant.errors import DiffquantError
from diffquant.memory import check_fits
from diffquant.profiler import input_device, profile_model
from diffquant.quant.algorithms.superweights import profile_entry
from diffquant.stats.distributed import finish_distributed, init_distributed, rank_world


def run_cli(args) -> None:
    from diffquant.data.windows import corpus_windows
    from diffquant.models.load import load_model
    from diffquant.report.profile_report import write_report

    if args.tokens <= 0:
        raise DiffquantError(f"--tokens must be positive, got {args.tokens}")
    init_distributed()
    out = Path(args.out)
    if rank_world()[0] == 0:
        prepare_out(out, args.force, "stats.json")
    from diffquant.models.placement import resolve_device
    from diffquant.taps.sites import site_globs

    device = resolve_device(args.device) if not args.device_map else None
    sites = site_globs(args.sites)
    profiles = []
    for label, source in parse_model_args(args.model):
        model, tokenizer = load_model(source, dtype=args.dtype, device=device,
                                      device_map=args.device_map, hub=args.hub, cache=args.cache_dir)
        if tokenizer is None:
            raise DiffquantError(f"{source} has no tokenizer files; pass a folder that holds them (diffquant train "
                                 "saves them with every checkpoint)")
        label = model_label(label, source, model)
        seqs = corpus_windows(args.data, tokenizer, "validation", args.seq_len, args.tokens, args.cache_dir)
        if seqs.numel() < args.tokens:
            print(f"{label}: the validation split of {args.data} holds {seqs.numel():,} tokens in whole sequences of "
                  f"{args.seq_len}, fewer tokens than asked ({args.tokens:,}); profiling {seqs.numel():,}")
        check_fits(model, min(args.batch_size, len(seqs)), args.seq_len, f"profiling {label}")
        prof = profile_model(model, seqs, sites, batch_size=args.batch_size, k=args.k, label=label,
                             compile=args.compile, sinks=not args.no_sinks, metrics=args.metrics.split(","),
                             kernels=args.kernels)
        prof.provenance["super_weights"] = profile_entry(model, seqs, label)
        prof.provenance.update({"source": source, "data": args.data, "split": "validation", "dtype": args.dtype,
                                "device": str(input_device(model))})
        profiles.append(prof)
        del model
    if rank_world()[0] == 0:
        paths = write_report(profiles, out, plots=not args.no_plots)
        print((out / "table5.md").read_text())
        print(f"wrote {', '.join(str(p) for p in paths)}")
    finish_distributed()
