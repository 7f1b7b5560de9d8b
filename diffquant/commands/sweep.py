"""`diffquant sweep`: load the models, run the sweep resumably (diffquant.sweeps.run_sweep), print and plot."""

from __future__ import annotations

from pathlib import Path

from diffquant.commands import split_list
from diffquant.commands.common import calib_tokens, load_models, site_points
from diffquant.errors import DiffquantError
from diffquant.paths import atomic_write_json
from diffquant.sweeps import parse_bits, run_sweep, source_caveats, sweep_report


def run_cli(args) -> None:
    out = Path(args.out)
    if (out / "cells.jsonl").exists():
        if args.force:
            for name in ("cells.jsonl", "results.json", "results.csv"):
                (out / name).unlink(missing_ok=True)
        elif not args.resume:
            raise DiffquantError(f"{out} already holds a sweep; pass --resume to continue it or --force to restart")
    out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items()
              if k not in ("func", "resume", "force", "no_plots", "debug", "compile", "verbose")
              and not k.startswith("old_")}
    split = lambda text: [x.strip() for x in (text or "").split(",") if x.strip()]  # noqa: E731
    models = load_models(args)
    from diffquant.kernels import resolve
    from diffquant.profiler import input_device

    first = next(iter(models.values()))[0]
    config["kernels"] = {"asked": args.kernels, "path": resolve(args.kernels, input_device(first))}
    atomic_write_json(out / "sweep_config.json", config)
    rows = run_sweep(models, args.data, out, sites=site_points(args.sites), bits=parse_bits(args.bits),
                     granularities=split(args.granularity), schemes=split(args.scheme),
                     fixes=split_list(args.fix) or ["none"], weights=split(args.solver) or ["rtn"],
                     wa_grid=parse_bits(args.wa_grid) if args.wa_grid else None, per_layer=args.per_layer,
                     evals=split(args.eval), seq_len=args.seq_len, tokens=args.eval_tokens,
                     calib_tokens=calib_tokens(args), recipes=args.recipe or [], kurtosis_tokens=args.kurtosis_tokens,
                     mc_limit=args.mc_limit, cache=args.cache_dir, compile=args.compile, kernels=args.kernels)
    if not args.no_plots:
        from diffquant.report.sweep_plots import plot_sweep

        plot_sweep(rows, out)
    print(sweep_report(rows, source_caveats(models)))
    print(f"results in {out / 'results.csv'}")
