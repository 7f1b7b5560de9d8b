"""`diffquant train`: matched models on identical data, with their summary printed."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from diffquant.commands import split_list
from diffquant.errors import DiffquantError
from diffquant.stats.distributed import finish_distributed, init_distributed, rank_world
from diffquant.training import TrainConfig, train_pair


def run_cli(args) -> None:
    try:
        archs = tuple(split_list(args.design))
        cfg = TrainConfig(preset=args.preset, corpus=args.data, tokens=args.tokens, batch_size=args.batch_size,
                          seq_len=args.seq_len, lr=args.lr, schedule=args.schedule, seed=args.seed,
                          eval_every=args.eval_every, save_every=args.save_every, archs=archs,
                          needle_fraction=args.needle_fraction, weight_decay=args.weight_decay,
                          warmup_frac=args.warmup_frac, min_lr_ratio=args.min_lr_ratio, bos=args.bos,
                          track=args.track, track_points=args.track_points, track_metrics=args.track_metrics)
    except ValueError as e:
        raise DiffquantError(str(e)) from None
    init_distributed()
    if args.device is None and torch.cuda.is_available():
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    else:
        from diffquant.models.placement import resolve_device

        device = resolve_device(args.device)
    from diffquant.kernels import chosen

    with chosen(args.kernels):  # the --track profiles' kernels
        results = train_pair(cfg, args.out, device, resume=args.resume, force=args.force, cache=args.cache_dir,
                             dtype=args.dtype)
    if rank_world()[0] == 0:
        print(f"unigram entropy of the training tokens: {results['data']['unigram_entropy']:.3f} nats")
        from diffquant.report.style import display

        for arch, m in results["models"].items():
            v = m["final_val"]
            print(f"{display(arch):<12} params {m['parameters']:,}  val loss {v['loss']:.3f}  ppl {v['ppl']:.2f}  "
                  f"acc {v['accuracy']:.3f}  {m['tokens_per_s']:,.0f} tok/s  ({v['tokens']:,} held-out tokens)")
        print(f"checkpoints in {', '.join(str(Path(args.out) / a) for a in cfg.archs)}")
        if cfg.track:
            print(f"emergence: {Path(args.out) / 'emergence.json'} and emergence*.png")
    finish_distributed()
