"""The papers' outlier and sink metrics, each as its paper defines it, as named metric sets.

diffquant's default statistics (stats/site_stats.py, stats/sinks.py) pool what they can and leave out what
is fixed by construction; each paper made its own choices, and a number set beside a paper's must be
made the paper's way. A metric set is data (name, citation, definition, how it differs from the default,
the paper's protocol, the sites and top-k it reads, the per-sequence accumulator it adds) plus one
function that computes its figures from a finished `ModelProfile`. Everything streams: accumulators keep
per-head or per-site sums, never activations. docs/metrics.md describes each set in full.

The data profiled is never changed to fit a paper: where its window length, sequence count or BOS
convention differs from the paper's, the set's `conventions` say so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from typing import TYPE_CHECKING

from diffquant.errors import DiffquantError
from diffquant.stats.constants import EPSILON, LAMBDA_GUARD

if TYPE_CHECKING:  # torch loads when a set computes, not when the registry is read (`diffquant --help`)
    import torch

MASSIVE_ABS, MASSIVE_RATIO = 100.0, 1000.0  # Sun et al.: |x| > 100 and > 1000× the layer's median |x|


def sequence_first_key(probs: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Per sequence and head, the sum over query rows of the attention on the row's first valid key
    [batch, head]; per sequence, the rows counted [batch]). Unlike stats/sinks.first_key_mass, the first
    token's own row (mass 1 in a softmax) is counted, as Gu et al. count it."""
    import torch

    b, h, q, k = probs.shape
    if valid is None:
        return probs[..., 0].float().sum(-1).double().cpu(), torch.full((b,), float(q), dtype=torch.float64)
    v = valid.expand(b, -1, q, k)[:, :1]  # the mask is the same for every head
    first = v.to(torch.int8).argmax(dim=-1)  # [b, 1, q]
    rows = v.any(dim=-1)
    mass = probs.float().gather(-1, first[..., None].expand(b, h, q, 1))[..., 0]
    mass = torch.where(rows, mass, 0.0)
    return mass.sum(-1).double().cpu(), rows[:, 0].sum(-1).double().cpu()


class SequenceSinks:
    """Gu et al.'s Sink₁ inputs for one layer: per head, how many sequences have α > ε, where α is the
    mean over all query rows (the first included) of the attention on the first key, and the sum of α.
    DIFF: α of each differential head's share, (A1 − λ·A2)[q, 0] / (1 − λ), undefined where
    |1 − λ| ≤ 0.05. Query blocks of one attention call are summed before α is taken."""

    points = ("attn_probs",)
    diff_points = ("lambda", "attn_map")

    def __init__(self):
        self.sinks: torch.Tensor | None = None  # [head] sequences with α > ε
        self.alpha: torch.Tensor | None = None  # [head] sum of α over sequences
        self.sequences = 0
        self.lam: float | None = None
        self._part: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def undefined(self) -> bool:
        return self.lam is not None and abs(1.0 - self.lam) <= LAMBDA_GUARD

    def add(self, point: str, x: torch.Tensor, ctx) -> None:
        if point == "lambda":
            self.lam = float(x)
            return
        if point == "attn_map":
            if self.undefined:
                return
            x = x.float() / (1.0 - self.lam)
        s, n = sequence_first_key(x.detach(), ctx.valid)
        block = ctx.block
        if block is None or block.start == 0:
            self._part = (s, n)
        else:
            self._part = (self._part[0] + s, self._part[1] + n)
        if block is not None and block.end != block.queries:
            return  # more query blocks of this call follow
        s, n = self._part
        self._part = None
        ok = n > 0
        alpha = s[ok] / n[ok, None]
        sinks, total = (alpha > EPSILON).sum(0).double(), alpha.sum(0)
        self.sinks = sinks if self.sinks is None else self.sinks + sinks
        self.alpha = total if self.alpha is None else self.alpha + total
        self.sequences += int(ok.sum())

    def merge(self, other: "SequenceSinks") -> "SequenceSinks":
        out = SequenceSinks()
        out.lam = self.lam if self.lam is not None else other.lam
        parts = [p for p in (self, other) if p.sinks is not None]
        if parts:
            out.sinks = sum(p.sinks for p in parts)
            out.alpha = sum(p.alpha for p in parts)
        out.sequences = self.sequences + other.sequences
        return out

    def summary(self) -> dict:
        if self.undefined:
            return {"lambda": self.lam, "undefined": f"|1 − λ| = {abs(1.0 - self.lam):.3g} ≤ {LAMBDA_GUARD}"}
        if self.sinks is None or not self.sequences:
            return {"lambda": self.lam, "undefined": "no sequence seen"}
        heads = self.sinks.numel()
        return {"heads": heads, "sequences": self.sequences, "sinks": self.sinks.tolist(),
                "rate": float(self.sinks.sum()) / (heads * self.sequences),
                "alpha_mean": (self.alpha / self.sequences).tolist(), "lambda": self.lam}


class SequenceNorms:
    """Bondarenko et al.'s per-sequence figures of one token site, summed over sequences: the ∞-norm
    (max |x| over positions × channels) and the Pearson kurtosis (Gaussian = 3) over positions × channels
    of each sequence (valid tokens only)."""

    points = ("hidden", "attn_in", "mlp_in", "final_norm")
    diff_points = None

    def __init__(self):
        self.inf, self.kurtosis = 0.0, 0.0
        self.sequences, self.kurtosis_sequences = 0, 0

    def add(self, point: str, x: torch.Tensor, ctx) -> None:
        import torch

        x = x.detach().float()
        b = x.shape[0]
        mask = None if ctx.valid is None else ctx.valid.expand(x.shape)
        n = (torch.full((b,), x[0].numel(), dtype=torch.float64, device=x.device) if mask is None
             else mask.reshape(b, -1).sum(1).double())
        xz = x if mask is None else torch.where(mask, x, 0.0)
        mean = xz.sum(-1).double().sum(-1) / n.clamp_min(1)
        d = x - mean.float()[:, None, None]
        if mask is not None:
            d = torch.where(mask, d, 0.0)
        d2 = d * d
        m2 = d2.sum(-1).double().sum(-1) / n.clamp_min(1)
        m4 = (d2 * d2).sum(-1).double().sum(-1) / n.clamp_min(1)
        inf = xz.abs().reshape(b, -1).amax(1).double()
        seen = n > 0
        spread = seen & (m2 > 0)
        self.inf += float(inf[seen].sum())
        self.sequences += int(seen.sum())
        self.kurtosis += float((m4[spread] / m2[spread] ** 2).sum())
        self.kurtosis_sequences += int(spread.sum())

    def merge(self, other: "SequenceNorms") -> "SequenceNorms":
        out = type(self)()
        out.inf, out.kurtosis = self.inf + other.inf, self.kurtosis + other.kurtosis
        out.sequences = self.sequences + other.sequences
        out.kurtosis_sequences = self.kurtosis_sequences + other.kurtosis_sequences
        return out

    def summary(self) -> dict:
        return {"inf_norm_mean": self.inf / self.sequences if self.sequences else None,
                "kurtosis_mean": self.kurtosis / self.kurtosis_sequences if self.kurtosis_sequences else None,
                "sequences": self.sequences}


class LinearInputNorms(SequenceNorms):
    """The same per-sequence ∞-norm and kurtosis at the input of every quantized Linear: what W8A8 and W4A4
    actually round (q/k/v read attn_in, o_proj attn_out, gate/up mlp_in, down_proj down_in)."""

    points = ("attn_in", "attn_out", "mlp_in", "down_in")


@dataclass(frozen=True)
class MetricSet:
    """One paper's metric definitions. `sites`/`k`: the site globs whose SiteStats it reads and the top-k
    they must keep; `accumulator`: a per-sequence accumulator it adds (one per layer with `per_layer`,
    else one per site); `protocol`: the paper's data choices, compared with the data profiled."""

    name: str
    citation: str
    definition: str
    differs: str
    protocol: dict
    compute: Callable[["object"], dict]
    sites: tuple[str, ...] = ()
    k: int = 1
    accumulator: type | None = None
    per_layer: bool = True


def _diff_table5(prof) -> dict:
    out = {}
    for kind in ("attn_logits", "hidden"):
        s = prof.pooled(kind).summary(full=False)
        top, median = s["absmax"], s["quantiles"]["median"]
        out[kind] = {"top1": top, "median": median, "top1_over_median": top / median if median else None,
                     "values": s["count"]}
    return out


def massive_count(stats, median: float | None) -> tuple[int, int]:
    """(Values of a site above Sun et al.'s threshold max(100, 1000 × median), values that may be): exact
    from the kept top-k when every value above the threshold is among them; otherwise from the |x|
    histogram, whose bins above the threshold's bin count for certain and whose own bin (0.8% wide) is
    reported apart, as undecided."""
    import torch

    from diffquant.stats.histogram import magnitude_bins

    threshold = max(MASSIVE_ABS, MASSIVE_RATIO * (median or 0.0))
    kept = stats.topk.abs.cpu()
    if kept.numel() < stats.topk.k or float(kept[-1]) <= threshold:
        return int((kept > threshold).sum()), 0
    at = int(magnitude_bins(torch.tensor([threshold], dtype=torch.float32)))
    counts = stats.hist.counts.cpu()
    return int(counts[at + 1:].sum()), int(counts[at])


def _sun2024(prof) -> dict:
    layers = {}
    for name, stats in prof.sites.items():
        if prof.kind_of[name] != "hidden" or prof.layer_of[name] is None:
            continue
        median = stats.hist.quantiles([0.5])[0]
        massive, undecided = massive_count(stats, median)
        top = [stats.topk.rank(r) for r in (1, 2, 3)]
        layers[prof.layer_of[name]] = {
            "top1": top[0], "top2": top[1], "top3": top[2], "median": median,
            "top1_over_median": top[0] / median if median else None,
            "massive": massive, "massive_undecided": undecided}
    rows = list(layers.values())
    return {"layers": {str(i): v for i, v in sorted(layers.items())},
            "massive_total": sum(v["massive"] for v in rows),
            "layers_with_massive": sorted(i for i, v in layers.items() if v["massive"]),
            "top1_over_median_max": max((v["top1_over_median"] for v in rows if v["top1_over_median"]), default=None)}


def _gu2024(prof) -> dict:
    per_layer = {layer: acc.summary() for layer, acc in sorted(prof.metric_state["gu2024"].items())}
    counted = [v for v in per_layer.values() if "rate" in v]
    cells = sum(v["heads"] * v["sequences"] for v in counted)
    sinks = sum(sum(v["sinks"]) for v in counted)
    diff = prof.info.get("model_type") == "diffllama"
    return {"epsilon": EPSILON, "unit": "differential head (share)" if diff else "attention head",
            "sink1": sinks / cells if cells else None, "layers_undefined": [i for i, v in per_layer.items()
                                                                         if "rate" not in v],
            "layers": {str(i): v for i, v in per_layer.items()}}


def _bondarenko2023(prof) -> dict:
    sites = {name: acc.summary() for name, acc in sorted(prof.metric_state["bondarenko2023"].items())}
    infs = {n: v["inf_norm_mean"] for n, v in sites.items() if v["inf_norm_mean"] is not None}
    kurts = {n: v["kurtosis_mean"] for n, v in sites.items() if v["kurtosis_mean"] is not None}
    layer_infs = [v for n, v in infs.items() if n.endswith(".hidden")]
    return {"max_inf_norm": max(infs.values(), default=None),
            "max_inf_norm_site": max(infs, key=infs.get) if infs else None,
            "max_layer_inf_norm": max(layer_infs, default=None),
            "avg_kurtosis": sum(kurts.values()) / len(kurts) if kurts else None,
            "max_kurtosis": max(kurts.values(), default=None), "sites": sites}


LINEAR_KINDS = LinearInputNorms.points


def _bondarenko2023_linear(prof) -> dict:
    """Per site and per kind of Linear input: Bondarenko's per-sequence figures, and top-1 / median |x|."""
    sites = {}
    for name, acc in sorted(prof.metric_state["bondarenko2023-linear"].items()):
        s = prof.sites[name].summary(full=False)
        top, median = s["absmax"], s["quantiles"]["median"]
        sites[name] = {**acc.summary(), "top1": top, "median": median,
                       "top1_over_median": top / median if median else None}
    kinds = {}
    for kind in LINEAR_KINDS:
        rows = {n: v for n, v in sites.items() if prof.kind_of.get(n) == kind}
        infs = {n: v["inf_norm_mean"] for n, v in rows.items() if v["inf_norm_mean"] is not None}
        kurts = [v["kurtosis_mean"] for v in rows.values() if v["kurtosis_mean"] is not None]
        ratios = [v["top1_over_median"] for v in rows.values() if v["top1_over_median"] is not None]
        if rows:
            kinds[kind] = {"max_inf_norm": max(infs.values(), default=None),
                           "max_inf_norm_site": max(infs, key=infs.get) if infs else None,
                           "avg_kurtosis": sum(kurts) / len(kurts) if kurts else None,
                           "max_kurtosis": max(kurts, default=None),
                           "max_top1_over_median": max(ratios, default=None), "layers": len(rows)}
    return {"kinds": kinds, "sites": sites}


REGISTRY: dict[str, MetricSet] = {}


def register(metric_set: MetricSet) -> None:
    if metric_set.name in REGISTRY:
        raise ValueError(f"metric set {metric_set.name!r} is registered twice")
    REGISTRY[metric_set.name] = metric_set


register(MetricSet(
    "diff-table5", "Ye et al. 2025, Differential Transformer (ICLR 2025, arXiv 2410.05258), Table 5",
    "max |q·kᵀ|/√d over every attention logit (DIFF: both softmax maps, q1k1ᵀ and q2k2ᵀ) at causal, unmasked "
    "positions, and max |h| over the decoder-layer outputs, each pooled over layers (and heads), with the "
    "median |value|",
    "the same pooled values as table5.md's default rows; this set reports only the paper's columns (top-1, "
    "median) and their ratio",
    {"tokens": 400_000}, _diff_table5, sites=("*.attn_logits", "*.hidden")))
register(MetricSet(
    "sun2024", "Sun et al. 2024, Massive Activations in Large Language Models (arXiv 2402.17762)",
    "per layer, the top-1/2/3 |value| and the median |value| of the decoder-layer output (the residual "
    "stream); an activation is massive when |x| > 100 and > 1000× its layer's median, counted per layer",
    "per layer, not pooled; the default's massive-activation list keeps top-k entries with their places, and "
    "its max‖h‖/median‖h‖ ratio is over token norms, not single values",
    {"sequences": 10, "seq_len": {"LLaMA, Mistral": 4096, "OPT, Pythia": 2048, "GPT-2": 1024},
     "bos": "no special tokens added"}, _sun2024, sites=("*.hidden",), k=100))
register(MetricSet(
    "gu2024", "Gu et al. 2024, When Attention Sink Emerges in Language Models (arXiv 2410.10781)",
    "Sink₁: per sequence, layer and head, α = mean over all queries (the first included) of the attention "
    "on the first token; the fraction of (sequence, layer, head) cells with α > ε = 0.3. DIFF: on each "
    "differential head's share (A1 − λ·A2)[q, 0] / (1 − λ)",
    "the default sink rate thresholds each head's mean over all sequences and leaves out the first query "
    "(whose attention on itself is 1 by construction); Sink₁ thresholds every sequence and counts it",
    {"sequences": 100, "seq_len": 64, "bos": "no BOS added"}, _gu2024, accumulator=SequenceSinks))
register(MetricSet(
    "bondarenko2023", "Bondarenko et al. 2023, Quantizable Transformers: Removing Outliers by Helping "
                      "Attention Heads Do Nothing (NeurIPS 2023, arXiv 2306.12929)",
    "per named module, the ∞-norm of each sequence's output (max |x| over positions × channels) averaged "
    "over sequences, and the per-sequence Pearson kurtosis over positions × channels averaged over sequences; "
    "max inf norm = the largest module average, avg kurtosis = the mean of the module averages. Modules "
    "(their OPT names → diffquant sites): decoder layers → hidden, self_attn_layer_norm → attn_in, "
    "final_layer_norm (per layer) → mlp_in, decoder final_layer_norm → final_norm",
    "per sequence, then averaged (the default kurtosis pools every value of a site); their out_proj and fc2 "
    "outputs are not diffquant sites and are left out; their code divides by the unbiased variance and "
    "adds 1e-6 (a relative difference of about 2/(positions × channels))",
    {"seq_len": 512, "data": "validation set (Wikipedia for OPT)"}, _bondarenko2023,
    accumulator=SequenceNorms, per_layer=False))

register(MetricSet(
    "bondarenko2023-linear", "Bondarenko et al. 2023 (arXiv 2306.12929), their per-sequence figures at the "
                             "inputs of the quantized Linears",
    "per Linear input site (attn_in → q/k/v, attn_out → o_proj, mlp_in → gate/up, down_in → down_proj) and "
    "layer: the ∞-norm of each sequence (max |x| over positions × channels) averaged over sequences, the "
    "per-sequence Pearson kurtosis averaged over sequences, and top-1 / median |x| over all values; per kind of "
    "site, the largest layer's ∞-norm, the mean and largest layer kurtosis and the largest top-1 / median",
    "Bondarenko et al. report module outputs (their max inf norm and avg kurtosis, `bondarenko2023`); these are "
    "the activations W8A8 / W4A4 round, each kind of site kept apart instead of pooling layers of different scale",
    {"seq_len": 512, "data": "validation set (Wikipedia for OPT)"}, _bondarenko2023_linear,
    sites=tuple(f"*.{k}" for k in LINEAR_KINDS), accumulator=LinearInputNorms, per_layer=False))


def parse(text: str | None) -> tuple[str, ...]:
    """Metric-set names from a comma-separated list; an unknown name is an error naming the choices."""
    names = tuple(dict.fromkeys(n.strip() for n in (text or "").split(",") if n.strip()))
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise DiffquantError(f"unknown metric set {', '.join(map(repr, unknown))}; choose from {', '.join(REGISTRY)}")
    return names


class MetricObserver:
    """A tap that feeds one accumulator of a metric set from one site."""

    transforms = False

    def __init__(self, accumulator, point: str):
        self.accumulator, self.point = accumulator, point

    def __call__(self, x: torch.Tensor, ctx) -> None:
        self.accumulator.add(self.point, x, ctx)


def attach_accumulators(names: tuple[str, ...], table, taps: dict[str, list]) -> dict[str, dict]:
    """Add the accumulator taps of the sets `names` to `taps` ({site: [taps]}); returns
    {set: {layer or site name: accumulator}}."""
    state: dict[str, dict] = {}
    for name in names:
        ms = REGISTRY[name]
        if ms.accumulator is None:
            continue
        points = ms.accumulator.diff_points if table.diff and ms.accumulator.diff_points else ms.accumulator.points
        accs: dict = {}
        for site in table:
            if site.kind in points and (site.layer is not None or not ms.per_layer):
                acc = accs.setdefault(site.layer if ms.per_layer else site.name, ms.accumulator())
                taps.setdefault(site.name, []).append(MetricObserver(acc, site.kind))
        if not accs:
            raise DiffquantError(f"metric set {name}: this model has none of the sites it reads ({', '.join(points)})")
        state[name] = accs
    return state


def conventions(ms: MetricSet, provenance: dict) -> list[str]:
    """How the data profiled compares with the paper's protocol, one sentence each (never hidden)."""
    seqs, seq_len, bos = provenance.get("sequences"), provenance.get("seq_len"), provenance.get("bos_first_sequences")
    notes = []
    p = ms.protocol
    if "tokens" in p and provenance.get("tokens") != p["tokens"]:
        notes.append(f"the paper profiled {p['tokens']:,} tokens; here {provenance.get('tokens'):,}")
    if "sequences" in p and seqs != p["sequences"]:
        notes.append(f"the paper used {p['sequences']} sequences; here {seqs}")
    if isinstance(p.get("seq_len"), int) and seq_len != p["seq_len"]:
        notes.append(f"the paper used windows of {p['seq_len']} tokens; here {seq_len}")
    elif isinstance(p.get("seq_len"), dict):
        lens = ", ".join(f"{v:,} ({k})" for k, v in p["seq_len"].items())
        notes.append(f"the paper used windows of {lens}; here {seq_len}")
    if "bos" in p and bos is None:
        notes.append(f"the paper: {p['bos']}; here the model declares no single BOS token id, so whether "
                     "sequences start with one was not checked")
    elif "bos" in p:
        here = ("every sequence starts with the model's BOS token" if bos == seqs else
                "no sequence starts with the model's BOS token" if bos == 0 else
                f"{bos} of {seqs} sequences start with the model's BOS token")
        notes.append(f"the paper: {p['bos']}; here {here}")
    return notes


def compute(names: tuple[str, ...], prof) -> dict:
    """{set: {"citation", "conventions", figures...}} for a finished profile."""
    out = {}
    for name in names:
        ms = REGISTRY[name]
        out[name] = {"citation": ms.citation, "conventions": conventions(ms, prof.provenance), **ms.compute(prof)}
    return out


def required_sites(names: tuple[str, ...]) -> tuple[list[str], int]:
    """(The site globs the sets `names` read through SiteStats, the top-k they need)."""
    sites = [g for n in names for g in REGISTRY[n].sites]
    return list(dict.fromkeys(sites)), max([REGISTRY[n].k for n in names], default=1)
