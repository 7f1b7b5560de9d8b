"""The outlier profiler: stream tokens through models with observers on selected sites.

Nothing proportional to the number of tokens is kept: each site's `SiteStats` lives on the device of
its activation and is updated in place. With `torchrun`, each rank profiles a contiguous run of the batches one
process would run (`rank_batches`), and the statistics are merged across ranks before the report is written: the
same passes as one process, so the merged report is one process's (sums to float64 rounding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch

from diffquant import kernels as choose_kernels
from diffquant.errors import DiffquantError
from diffquant.frozen import evaluating
from diffquant.models.describe import describe
from diffquant.stats import metric_sets as paper_sets
from diffquant.stats.distributed import gather_merge, merge_across_ranks, rank_world
from diffquant.stats.sinks import LayerSinks, model_sink_rates
from diffquant.stats.site_stats import SiteStats
from diffquant.taps import Batch, site_table, tapped

DEFAULT_SITES = ("*.attn_logits", "*.hidden")


class StatsObserver:
    """A tap that feeds one site's activations into its SiteStats (created on the activation's device)."""

    transforms = False
    cut_keys = True  # takes causal query blocks that end at their last visible key (taps/attention.py)

    def __init__(self, k: int = 100, compile: bool = False, kernels: str | None = None):
        self.k, self.compile, self.kernels = k, compile, kernels
        self.stats: SiteStats | None = None

    def __call__(self, x: torch.Tensor, ctx) -> None:
        self.site_stats(ctx, x.device).update(x, ctx.valid, ctx.batch.input_ids, ctx.batch.row_offset, ctx.block)

    def site_stats(self, ctx, device) -> SiteStats:
        """This site's statistics, made at first use on `device`. The tapped attention's Triton path (taps/triton_attention.py)
        updates them from its own kernel instead of calling the observer with the logits."""
        if self.stats is None:
            self.stats = SiteStats(ctx.site.dims, self.k, device, compile=self.compile, kernels=self.kernels)
        return self.stats


class SinkObserver:
    """Feeds one layer's LayerSinks: first-key mass (attn_probs, attn_map), DIFF's λ (lambda), value
    norms (v), residual norms (hidden)."""

    transforms = False
    cut_keys = True

    def __init__(self, sinks: LayerSinks, point: str):
        self.sinks, self.point = sinks, point

    def __call__(self, x: torch.Tensor, ctx) -> None:
        if self.point == "attn_probs":
            self.sinks.add_mass("probs", x, ctx.valid, ctx.block)
        elif self.point == "attn_map":
            self.sinks.add_mass("map", x, ctx.valid, ctx.block)
        elif self.point == "lambda":
            self.sinks.add_lambda(x)
        elif self.point == "v":
            self.sinks.add_values(x, ctx.valid)
        else:
            self.sinks.add_hidden(x, ctx.valid, ctx.batch.row_offset)

    def first_key(self, mass: torch.Tensor, rows: torch.Tensor, ctx) -> None:
        """attn_probs / attn_map from each query's mass on its first key alone, which the layer's own attention
        kernel gives (taps/attention.py `first_key_masses`): the layer need not compute its T × T map."""
        self.sinks.add_first_key("probs" if self.point == "attn_probs" else "map", mass, rows)


SINK_POINTS = ("attn_probs", "attn_map", "lambda", "v", "hidden")


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
    metric_sets: tuple[str, ...] = ()  # the papers' metric sets selected (stats/metric_sets.py)
    metric_state: dict = field(default_factory=dict)  # their accumulators: {set: {layer or site: ...}}

    def metric_results(self) -> dict:
        """{set: figures} of the selected metric sets, each with its citation and conventions."""
        return paper_sets.compute(self.metric_sets, self)

    def sink_summary(self) -> dict:
        """{"layers": {layer: per-layer figures}, "model": sink rates and extremes} (see stats/sinks.py)."""
        from diffquant.taps.sites import DIFF_MODEL_TYPES

        diff = self.info.get("model_type") in DIFF_MODEL_TYPES
        layers = {i: s.summary(diff) for i, s in sorted(self.sinks.items())}
        return {"epsilon": 0.3, "layers": layers, "model": model_sink_rates(layers)} if layers else {}

    def merge(self, other: "ModelProfile") -> "ModelProfile":
        """The profile of both token sets (the same model and sites): every statistic merges exactly, as the
        ranks of a torchrun profile do."""
        if set(self.sites) != set(other.sites) or self.metric_sets != other.metric_sets:
            raise DiffquantError(f"cannot merge profiles of different sites or metric sets ({self.label}, {other.label})")
        merge = lambda a, b: {k: a[k].merge(b[k]) if k in a and k in b else a.get(k, b.get(k))  # noqa: E731
                              for k in dict.fromkeys([*a, *b])}
        provenance = {**self.provenance, **{k: self.provenance.get(k, 0) + other.provenance.get(k, 0)
                                            for k in ("tokens", "sequences") if k in self.provenance}}
        return ModelProfile(self.label, self.info, merge(self.sites, other.sites), self.layer_of, self.kind_of,
                            provenance, merge(self.sinks, other.sinks), self.metric_sets,
                            {name: merge(self.metric_state[name], other.metric_state[name]) for name in self.metric_state})

    def save(self, folder, plots: bool = True) -> list:
        """The report (stats.json, table5.md/.csv, figures) and the profile itself (profile.pt: `load` reads it
        back, mergeable), written atomically into `folder`."""
        from pathlib import Path

        from diffquant.report.profile_report import write_report

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / "profile.pt.part"
        torch.save({"version": 1, "profile": self}, part)
        part.replace(folder / "profile.pt")
        return [folder / "profile.pt", *write_report([self], folder, plots=plots)]

    @staticmethod
    def load(folder) -> "ModelProfile":
        """A profile `save` wrote (profile.pt holds Python objects: load only folders you wrote yourself)."""
        from pathlib import Path

        path = Path(folder) / "profile.pt"
        if not path.is_file():
            raise DiffquantError(f"{folder} holds no saved profile (profile.pt); write one with profile.save(folder)")
        return torch.load(path, weights_only=False, map_location="cpu")["profile"]

    def table(self) -> str:
        """The Table 5 analog of this profile, as markdown."""
        from diffquant.report.profile_report import table5_markdown, table5_rows

        return table5_markdown(table5_rows([self]), f"{self.label}: {self.provenance.get('tokens')} tokens")

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


def rank_batches(n: int, batch_size: int, rank: int, world: int) -> list[int]:
    """First rows of this rank's batches: the batches of one process (rows 0, b, 2b, ...) dealt out as
    contiguous runs, so every pass of the per-pass statistics holds the same sequences whatever the number of
    ranks, and the merged report equals one process's. A rank left without a batch (more ranks than batches)
    runs nothing and adds nothing to the merge."""
    starts = list(range(0, n, batch_size))
    return starts[rank * len(starts) // world:(rank + 1) * len(starts) // world]


def profile_model(model, sequences: torch.Tensor, sites: Iterable[str] = DEFAULT_SITES, *, batch_size: int = 8,
                  k: int = 100, progress: bool = True, label: str = "model", compile: bool = False,
                  sinks: bool = False, metrics: Iterable[str] = (), kernels: str | None = None) -> ModelProfile:
    """Run `sequences` ([n, seq_len] token ids) through `model` with observers on `sites`.

    `sinks=True` adds the attention-sink and massive-activation metrics of every layer (stats/sinks.py).
    `metrics` names the papers' metric sets to compute as well (stats/metric_sets.py; names or one
    comma-separated string): the sites they read are profiled too, and nothing is added when none is named.
    `compile=True` fuses the statistics of token sites with torch.compile: several times faster once
    compiled (a one-off 3–20 s per activation shape on CPU), worth it for long runs. `kernels` ("auto", "triton",
    "torch"; None: the choice in force, diffquant/kernels) picks the statistics' kernels and, for attention logits,
    the attention kernel; the report records which path computed each site (provenance and each site's summary)."""
    from tqdm.auto import tqdm

    if sequences.numel() == 0:
        raise DiffquantError("no tokens to profile")
    vocab = model.get_input_embeddings().num_embeddings
    if int(sequences.max()) >= vocab:
        raise DiffquantError(f"token id {int(sequences.max())} is outside {label}'s vocabulary of {vocab}: "
                             "the data was tokenized with another tokenizer")
    metrics = paper_sets.parse(metrics if isinstance(metrics, str) else ",".join(metrics))
    extra_sites, need_k = paper_sets.required_sites(metrics)
    k = max(k, need_k)
    table = site_table(model)
    selected = table.match(list(dict.fromkeys([*sites, *extra_sites])))
    device = input_device(model)
    kernels = choose_kernels.check(choose_kernels.current() if kernels is None else kernels)
    path = choose_kernels.resolve(kernels, device)  # "triton" where it cannot run: one clear error, before any work
    observers = {s.name: StatsObserver(k, compile, kernels) for s in selected if not s.is_weight}
    weight_observers = {s.name: StatsObserver(k) for s in selected if s.is_weight}
    layer_sinks: dict[int, LayerSinks] = {}
    taps: dict[str, list] = {name: [o] for name, o in {**observers, **weight_observers}.items()}
    if sinks:
        for site in table:
            if site.layer is not None and site.kind in SINK_POINTS:
                sink = layer_sinks.setdefault(site.layer, LayerSinks())
                taps.setdefault(site.name, []).append(SinkObserver(sink, site.kind))
    metric_state = paper_sets.attach_accumulators(metrics, table, taps)
    rank, world = rank_world()
    starts = rank_batches(len(sequences), batch_size, rank, world)
    batches = -(-len(sequences) // batch_size)
    if world > batches and rank == 0 and progress:
        print(f"profile {label}: {batches} batches of {batch_size} for {world} ranks; {world - batches} ranks idle "
              "(a smaller --batch-size would use them)")
    batch = Batch()
    with choose_kernels.chosen(kernels), tapped(model, taps, batch), evaluating(model):
        bar = tqdm(total=sequences[starts[0]:starts[-1] + batch_size].numel() if starts else 0, unit="tok",
                   desc=f"profile {label}", disable=not progress or rank != 0)
        for start in starts:
            ids = sequences[start:start + batch_size].to(device)
            batch.input_ids, batch.row_offset = ids, start
            model(ids, use_cache=False, logits_to_keep=1)  # no site reads the vocabulary logits
            bar.update(ids.numel())
        bar.close()
    stats = merge_across_ranks({name: o.stats for name, o in observers.items() if o.stats is not None})
    # every rank observed the same weights when the taps were attached: one rank's statistics, not a sum of all
    stats.update({name: o.stats for name, o in weight_observers.items() if o.stats is not None})
    stats = {s.name: stats[s.name] for s in selected if s.name in stats}
    layer_sinks = gather_merge({i: s.to("cpu") for i, s in layer_sinks.items()})  # small: read back once
    metric_state = {name: gather_merge(accs) for name, accs in metric_state.items()}
    bos = getattr(model.config, "bos_token_id", None)
    bos = bos if isinstance(bos, int) else None  # absent, or several ids
    return ModelProfile(label, describe(model), stats, {s.name: s.layer for s in selected},
                        {s.name: s.kind for s in selected},
                        {"tokens": int(sequences.numel()), "sequences": int(sequences.shape[0]),
                         "seq_len": int(sequences.shape[1]), "world_size": world, "k": k,
                         "kernels": {"asked": kernels, "path": path},
                         "bos_first_sequences": None if bos is None else int((sequences[:, 0] == bos).sum())},
                        layer_sinks, metrics, metric_state)
