"""The outlier profiler: stream tokens through models with observers on selected sites.

Nothing proportional to the number of tokens is kept: each site's `SiteStats` lives on the device of
its activation and is updated in place. With `torchrun`, each rank profiles its share of the sequences
and the statistics are merged across ranks before the report is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from diffquant import DiffquantError
from diffquant.frozen import frozen_weights
from diffquant.stats.distributed import gather_merge, merge_across_ranks
from diffquant.stats.sinks import LayerSinks, model_sink_rates
from diffquant.stats.site_stats import SiteStats
from diffquant.taps import Batch, site_table, tapped

DEFAULT_SITES = ("*.attn_logits", "*.hidden")


class StatsObserver:
    """A tap that feeds one site's activations into its SiteStats (created on the activation's device)."""

    transforms = False

    def __init__(self, k: int = 100, compile: bool = False):
        self.k, self.compile = k, compile
        self.stats: SiteStats | None = None

    def __call__(self, x: torch.Tensor, ctx) -> None:
        if self.stats is None:
            self.stats = SiteStats(ctx.site.dims, self.k, x.device, compile=self.compile)
        self.stats.update(x, ctx.valid, ctx.batch.input_ids, ctx.batch.row_offset, ctx.block)


class SinkObserver:
    """Feeds one layer's LayerSinks: first-key mass (attn_probs, attn_map), value norms (v), residual
    norms (hidden)."""

    transforms = False

    def __init__(self, sinks: LayerSinks, point: str):
        self.sinks, self.point = sinks, point

    def __call__(self, x: torch.Tensor, ctx) -> None:
        if self.point == "attn_probs":
            self.sinks.add_mass("probs", x, ctx.valid, ctx.block)
        elif self.point == "attn_map":
            self.sinks.add_mass("map", x, ctx.valid, ctx.block)
        elif self.point == "v":
            self.sinks.add_values(x, ctx.valid)
        else:
            self.sinks.add_hidden(x, ctx.valid, ctx.batch.row_offset)


SINK_POINTS = ("attn_probs", "attn_map", "v", "hidden")


@dataclass
class ModelProfile:
    """Statistics of one model's sites, with provenance."""

    label: str
    info: dict
    sites: dict[str, SiteStats]
    layer_of: dict[str, int | None]
    kind_of: dict[str, str]
    provenance: dict = field(default_factory=dict)
    sinks: dict[int, LayerSinks] = field(default_factory=dict)

    def sink_summary(self) -> dict:
        """{"layers": {layer: per-layer figures}, "model": sink rates and extremes} (see stats/sinks.py)."""
        diff = self.info.get("model_type") == "diffllama"
        layers = {i: s.summary(diff) for i, s in sorted(self.sinks.items())}
        return {"epsilon": 0.3, "layers": layers, "model": model_sink_rates(layers)} if layers else {}

    def pooled(self, kind: str) -> SiteStats | None:
        """All layers of one kind merged (the paper pools attention logits over layers and heads)."""
        parts = [s for name, s in self.sites.items() if self.kind_of[name] == kind]
        if not parts:
            return None
        total = parts[0]
        for p in parts[1:]:
            total = total.merge(p)
        return total


def input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def profile_model(model, sequences: torch.Tensor, sites: Iterable[str] = DEFAULT_SITES, *, batch_size: int = 8,
                  k: int = 100, progress: bool = True, label: str = "model", compile: bool = False,
                  sinks: bool = False) -> ModelProfile:
    """Run `sequences` ([n, seq_len] token ids) through `model` with observers on `sites`.

    `sinks=True` adds the attention-sink and massive-activation metrics of every layer (stats/sinks.py).
    `compile=True` fuses the statistics of token sites with torch.compile: several times faster once
    compiled (a one-off 3–20 s per activation shape on CPU), worth it for long runs."""
    from tqdm.auto import tqdm

    if sequences.numel() == 0:
        raise DiffquantError("no tokens to profile")
    vocab = model.get_input_embeddings().num_embeddings
    if int(sequences.max()) >= vocab:
        raise DiffquantError(f"token id {int(sequences.max())} is outside {label}'s vocabulary of {vocab}: "
                             "the data was tokenized with another tokenizer")
    table = site_table(model)
    selected = table.match(list(sites))
    observers = {s.name: StatsObserver(k, compile) for s in selected if not s.is_weight}
    weight_observers = {s.name: StatsObserver(k) for s in selected if s.is_weight}
    layer_sinks: dict[int, LayerSinks] = {}
    taps: dict[str, list] = {name: [o] for name, o in {**observers, **weight_observers}.items()}
    if sinks:
        for site in table:
            if site.layer is not None and site.kind in SINK_POINTS:
                sink = layer_sinks.setdefault(site.layer, LayerSinks())
                taps.setdefault(site.name, []).append(SinkObserver(sink, site.kind))
    rank, world = _rank()
    lo, hi = rank * len(sequences) // world, (rank + 1) * len(sequences) // world
    mine = sequences[lo:hi]  # contiguous shards keep global row numbers simple
    batch = Batch()
    device = input_device(model)
    with tapped(model, taps, batch), torch.inference_mode(), frozen_weights():
        bar = tqdm(total=mine.numel(), unit="tok", desc=f"profile {label}", disable=not progress or rank != 0)
        for start in range(0, len(mine), batch_size):
            ids = mine[start:start + batch_size].to(device)
            batch.input_ids, batch.row_offset = ids, lo + start
            model(ids, use_cache=False)
            bar.update(ids.numel())
        bar.close()
    stats = {name: o.stats for name, o in {**observers, **weight_observers}.items() if o.stats is not None}
    stats = merge_across_ranks(stats)
    layer_sinks = gather_merge(layer_sinks)
    from diffquant.models.load import describe

    return ModelProfile(label, describe(model), stats, {s.name: s.layer for s in selected},
                        {s.name: s.kind for s in selected},
                        {"tokens": int(sequences.numel()), "sequences": int(sequences.shape[0]),
                         "seq_len": int(sequences.shape[1]), "world_size": world, "k": k}, layer_sinks)


def _rank() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init_distributed() -> None:
    """Join the torchrun process group when launched by torchrun (gloo on CPU, nccl on CUDA)."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def finish_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def parse_model_args(values: list[str]) -> list[tuple[str, str]]:
    out = []
    for v in values:
        label, sep, source = v.partition("=")
        out.append((label, source) if sep and source else (Path(v).name or v, v))
    labels = [label for label, _ in out]
    if len(set(labels)) != len(labels):
        raise DiffquantError(f"model labels must differ, got {labels}; name them LABEL=SOURCE")
    return out


def prepare_out(out: str | Path, force: bool, marker: str) -> Path:
    """Create the output folder; refuse one that already holds results unless --force."""
    path = Path(out)
    if (path / marker).exists() and not force:
        raise DiffquantError(f"{path} already holds results ({marker}); pass --force to overwrite or choose another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".diffquant-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise DiffquantError(f"cannot write to {path}: {e.strerror}") from None
    return path


def run_cli(args) -> None:
    from diffquant.data.corpora import load_text, split
    from diffquant.data.tokens import encode, sequences
    from diffquant.models.load import load_model
    from diffquant.report.profile_report import write_report

    if args.tokens <= 0:
        raise DiffquantError(f"--tokens must be positive, got {args.tokens}")
    init_distributed()
    out = Path(args.out)
    if _rank()[0] == 0:
        prepare_out(out, args.force, "stats.json")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    text, _ = load_text(args.data, args.cache_dir)
    _, val = split(text)
    profiles = []
    for label, source in parse_model_args(args.model):
        model, tokenizer = load_model(source, dtype=args.dtype, device=None if args.device_map else device,
                                      device_map=args.device_map, hub=args.hub, cache=args.cache_dir)
        if tokenizer is None:
            raise DiffquantError(f"{source} has no tokenizer files; pass a folder that holds them (diffquant train "
                                 "saves them with every checkpoint)")
        seqs = sequences(encode(tokenizer, val), args.seq_len, args.tokens)
        if seqs.numel() < args.tokens:
            print(f"{label}: the validation split of {args.data} holds {seqs.numel():,} tokens in whole sequences of "
                  f"{args.seq_len}, fewer tokens than asked ({args.tokens:,}); profiling {seqs.numel():,}")
        prof = profile_model(model, seqs, args.sites, batch_size=args.batch_size, k=args.k, label=label,
                             compile=args.compile, sinks=not args.no_sinks)
        prof.provenance.update({"source": source, "data": args.data, "split": "validation", "dtype": args.dtype,
                                "device": str(input_device(model))})
        from diffquant.quant.superweights import profile_entry  # noqa: E402 - lazy: profile loads no quant code

        prof.provenance["super_weights"] = profile_entry(model, seqs, label)
        profiles.append(prof)
        del model
    if _rank()[0] == 0:
        paths = write_report(profiles, out, plots=not args.no_plots)
        print((out / "table5.md").read_text())
        print(f"wrote {', '.join(str(p) for p in paths)}")
    finish_distributed()
