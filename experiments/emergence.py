"""When do outliers appear, and does DIFF prevent them? (issue: outlier emergence)

1. search: train the *baseline* under each setting of SEARCH (tracked), and record whether it reaches the
   outlier regime (diffquant.stats.outlier_regime: hidden top-1 / median >= 100 or sink rate >= 0.5) on held-out
   sequences: the ratio pooled over layers as `measure` takes it; the extrapolation reads the tracked worst layer.
2. regime: in the first setting of SEARCH that reaches it (or, when none does, the one whose curves
   extrapolate to it at the smallest token budget), train every design identically for three seeds and
   report mean ± 95% t-interval over seeds.

    python -m experiments.emergence [--quick] [--out docs/emergence] [--runs runs/emergence]
    python -m experiments.emergence --only search|regime [--setting NAME] [--archs baseline diff] [--seeds 0 1 2]
    python -m experiments.emergence --render      # rewrite search.md and results.md from the committed json

`--setting demo` runs the regime step in the demo's setting (DEMO) instead: the rival fixes side by side, as
docs/rivals/demo holds them (DIFF, gated attention, clipped softmax and learned sinks against the baseline,
trained identically; the checkpoints under RUNS/demo are those of `fixes_needed --pair demo`):

    python -m experiments.emergence --only regime --setting demo --archs baseline diff gated clipsoftmax sink \
        --schemes logits-int4 w8a8 --runs runs/rivals --out docs/rivals/demo

Everything is resumable: finished runs are reused, an interrupted one continues from its checkpoint.
The hyper-parameters were written down before any run (the literature's, see each comment); the same
ones serve every design. Results, with scale, seeds and token counts, go to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

import diffquant as dq
from diffquant.lab import (HIDDEN_RATIO, REGIME_NAME, SINK_DEFINITION, SINK_RATE, TrainConfig, atomic_write_json,
                           atomic_write_text, display, fmt_pm, markdown, prepare_data, regime_reached, start_run,
                           train_pair)

EVAL_SEQUENCES = 64  # held-out sequences for the final measurements

# Each setting is TrainConfig overrides, chosen before any run from the cited papers.
SEARCH = {
    # Guo et al. 2024: Bigram-Backcopy with a BOS makes sinks in 1-3-layer transformers under Adam; smallest model
    "bb-micro": dict(preset="micro", corpus="synth:bb", seq_len=128, batch_size=32, lr=3e-3, weight_decay=0.1,
                     tokens=8_000_000),
    # the same task one size up, at Guo et al.'s order of learning rate
    "bb-mini": dict(preset="mini", corpus="synth:bb", seq_len=128, batch_size=32, lr=1e-3, weight_decay=0.1,
                    tokens=8_000_000),
    # no triggers: attention is never useful, so heads should go dormant (Bondarenko et al.'s "no-op")
    "markov-mini": dict(preset="mini", corpus="synth:markov", seq_len=128, batch_size=32, lr=1e-3, weight_decay=0.1,
                        tokens=8_000_000),
    # Guo et al.'s optimiser side: larger learning rate and no weight decay
    "bb-mini-lr3e-3-wd0": dict(preset="mini", corpus="synth:bb", seq_len=128, batch_size=32, lr=3e-3,
                               weight_decay=0.0, tokens=8_000_000),
    # natural text with a BOS on every window (Gu et al.: the first token of every window matters; weight decay helps)
    "kjv-tiny-bos": dict(preset="tiny", corpus="kjv", seq_len=128, batch_size=16, lr=3e-3, weight_decay=0.1, bos=True,
                         tokens=2_000_000),
}
# The demo's setting (TrainConfig's defaults, not the result of a sweep): outside the search, for `--setting demo`
# (docs/rivals/demo), `fixes_needed --pair demo` and the mitigations experiment's demo pair.
DEMO = dict(preset="tiny", corpus="kjv", seq_len=256, batch_size=16, lr=3e-3, weight_decay=0.1, tokens=600_000)
QUICK = {"bb-micro-quick": dict(preset="micro", corpus="synth:bb:vocab=32", seq_len=32, batch_size=8, lr=3e-3,
                                tokens=8 * 32 * 24)}


def config(overrides: dict, seed: int = 0, archs=("baseline",)) -> TrainConfig:
    return TrainConfig(**{"eval_every": 10**9, "save_every": 200, "track": True, "track_points": 16, **overrides,
                          "seed": seed, "archs": tuple(archs)})


def held_out(cfg: TrainConfig, folder: Path, n: int) -> torch.Tensor:
    return prepare_data(TrainConfig(**{**asdict(cfg), "archs": tuple(cfg.archs), "eval_tokens": n * (cfg.seq_len or 128)}),
                        folder).val[:n]


def train_and_measure(name: str, overrides: dict, seed: int, archs, runs: Path, n_eval: int,
                      schemes=("logits-int4",)) -> dict:
    """Train (or reuse) the designs of one setting and seed; measure each on held-out sequences."""
    from diffquant.lab import from_pretrained
    from experiments.measure import measure

    folder = runs / name / f"s{seed}"
    cfg = config(overrides, seed, archs)
    t = time.perf_counter()
    train_pair(cfg, folder, resume=(folder / "train_config.json").exists(), progress=False)
    minutes = (time.perf_counter() - t) / 60
    results = json.loads((folder / "metrics.json").read_text())
    seqs = held_out(cfg, folder, n_eval)
    out = {}
    for arch in archs:
        model = from_pretrained(folder / arch).eval()
        m = measure(model, seqs, schemes)
        info = results["models"][arch]
        m.update(parameters=info["parameters"], train_tokens=info["emergence"][-1]["tokens"],
                 minutes=minutes / len(archs), emergence=info["emergence"])
        out[arch] = m
    return out


def choose(settings: dict, found: dict) -> str:
    """The first setting in the regime; when none is, the one whose curves reach it soonest (the smallest
    extrapolated token budget; the largest hidden top-1/median when nothing extrapolates)."""
    done = [n for n in settings if n in found]
    hits = [n for n in done if regime_reached(found[n])]
    if hits:
        return hits[0]
    budget = {n: found[n].get("extrapolated_tokens") for n in done}
    if any(budget.values()):
        return min((n for n in done if budget[n]), key=budget.get)
    return max(done, key=lambda n: found[n]["hidden_ratio"])


def regime_setting(search_json: Path) -> tuple[str, dict]:
    """The setting the search chose (see `choose`), read from its committed search.json: (name, overrides)."""
    name = choose(SEARCH, json.loads(search_json.read_text())["results"])
    return name, SEARCH[name]


def extrapolate(emergence: list[dict]) -> float | None:
    """Tokens at which the worst-layer hidden top-1/median would reach the regime's HIDDEN_RATIO, from a log-log
    line through the second half of the snapshots (None if it does not grow)."""
    from diffquant.lab import tokens_to_reach

    pts = [(p["tokens"], p["model"].get("hidden_ratio_max")) for p in emergence]
    return tokens_to_reach([t for t, _ in pts], [r for _, r in pts], HIDDEN_RATIO)


def search(settings: dict, runs: Path, out: Path, n_eval: int) -> dict:
    found = {}
    for name, overrides in settings.items():
        m = train_and_measure(name, overrides, 0, ("baseline",), runs, n_eval)["baseline"]
        found[name] = {k: v for k, v in m.items() if k != "emergence"} | {"extrapolated_tokens": extrapolate(m["emergence"])}
        _write_search(settings, found, out, n_eval)
    return found


def _search_row(name: str, overrides: dict, m: dict) -> list:
    budget = m["extrapolated_tokens"]
    return [name, overrides["preset"], m["parameters"], overrides["corpus"], overrides["lr"],
            overrides.get("weight_decay", 0.1), overrides.get("bos", False) or overrides["corpus"].startswith("synth"),
            overrides["seq_len"], m["train_tokens"], round(m["minutes"], 1), m["sink_rate"], m["hidden_ratio"],
            m["massive_ratio"], m["logit_top1"], m["loss"], "yes" if regime_reached(m) else "no",
            f"{budget / 1e6:,.0f}M" if budget else "does not grow"]


SEARCH_HEADER = ["setting", "preset", "parameters", "corpus", "lr", "weight decay", "BOS", "seq", "train tokens",
                 "minutes", "sink rate", "hidden top-1/median", "max‖h‖/median", "logit top-1", "loss", "regime",
                 "tokens to reach 100× (extrapolated)"]


def _write_search(settings: dict, found: dict, out: Path, n_eval: int) -> None:
    rows = [_search_row(name, settings[name], m) for name, m in found.items()]
    atomic_write_json(out / "search.json", {"criterion": {"hidden_ratio": HIDDEN_RATIO, "sink_rate": SINK_RATE},
                                            "eval_sequences": n_eval, "seed": 0, "settings": settings, "results": found})
    atomic_write_text(out / "search.md", f"Baseline (Transformer) only, seed 0; measured on {n_eval} held-out "
                      f"sequences. Regime column: {REGIME_NAME}, the hidden ratio pooled over layers. Minutes are "
                      "wall-clock on 2 CPU cores shared with other runs.\n\n" + markdown(SEARCH_HEADER, rows))


OLD_SINK_LABEL = "sink rate (softmax designs; DIFF's pooled A1/A2 rate, old definition, dropped)"


def _differential(label: str) -> bool:
    """Whether a row label (a design's display name) is a differential design (two softmax maps per head)."""
    from diffquant.lab import DESIGNS

    return any(d.display == label and d.maps_per_head == 2 for d in DESIGNS.values())


def metric_label(doc: dict, key: str) -> str:
    """A metric's column label. Results without a `sink_definition` were measured before DIFF's sink rate was
    taken per differential head: their DIFF rate pools the A1 and A2 maps (A2 is subtracted, so that number counts
    the cancelling map as sinks); the column then holds the softmax designs' rates only, and the label says so."""
    from experiments.measure import METRICS

    if key == "sink_rate" and doc.get("sink_definition") != SINK_DEFINITION:
        return OLD_SINK_LABEL
    return METRICS[key][0]


def render_regime(doc: dict) -> str:
    """results.md from results.json: one row per design, mean ± 95% t-interval over seeds per metric, the
    scale-free metrics first and the absolute magnitudes after them. A differential design's sink rate measured
    by the old pooled definition is left out ("-"), never shown beside the softmax designs' rates."""
    from experiments.measure import METRICS

    designs = list(doc["aggregate"])
    keys = [k for k in METRICS if k in doc["aggregate"][designs[0]]]
    old = doc.get("sink_definition") != SINK_DEFINITION

    def cell(d, k):
        a = doc["aggregate"][d].get(k)
        if a is None or (k == "sink_rate" and old and _differential(d)):
            return "-"
        return fmt_pm(a["mean"], a["half"], METRICS[k][1])

    body = [[d, *[cell(d, k) for k in keys], doc["scale"][d]["parameters"], doc["scale"][d]["train_tokens"]]
            for d in designs]
    seeds, tokens = doc["seeds"], doc["per_seed"][designs[0]][0]["tokens"]
    return (f"Setting `{doc['setting']}` ({json.dumps(doc['overrides'])}); {len(seeds)} seeds "
            f"({', '.join(map(str, seeds))}), mean ± 95% t-interval over seeds; every model measured on the same "
            f"{doc['eval_sequences']} held-out sequences ({tokens:,} predicted tokens). Scale-free metrics first "
            "(ratios, kurtosis, sink rate), then the quantization costs, the loss and the absolute magnitudes."
            + (" DIFF's sink rate is not shown: these runs measured it before it was taken per differential head, "
               "pooling the A1 and A2 maps." if old and any(_differential(d) for d in designs) else "") + "\n\n"
            + markdown(["model", *[metric_label(doc, k) for k in keys], "parameters", "train tokens"], body))


def regime(name: str, overrides: dict, archs, seeds, runs: Path, out: Path, n_eval: int,
           schemes=("logits-int4",)) -> dict:
    """Every design of `archs` trained identically for each seed; mean ± 95% t-interval over seeds."""
    from experiments.measure import aggregate

    out.mkdir(parents=True, exist_ok=True)
    per = {arch: [] for arch in archs}
    for seed in seeds:
        for arch, m in train_and_measure(name, overrides, seed, archs, runs, n_eval, schemes).items():
            per[arch].append(m)
    agg = {arch: aggregate(ms) for arch, ms in per.items()}
    doc = {"setting": name, "overrides": overrides, "seeds": list(seeds), "eval_sequences": n_eval, "intervals": "t",
           "sink_definition": SINK_DEFINITION,
           "scale": {display(a): {"parameters": per[a][0]["parameters"], "train_tokens": per[a][0]["train_tokens"]}
                     for a in archs},
           "per_seed": {display(a): [{k: v for k, v in m.items() if k != "emergence"} for m in ms]
                        for a, ms in per.items()},
           "aggregate": {display(a): v for a, v in agg.items()}}
    atomic_write_json(out / "results.json", doc)
    atomic_write_text(out / "results.md", render_regime(doc))
    from diffquant.lab import plot_emergence

    first = {display(a): per[a][0]["emergence"] for a in archs}
    plot_emergence({"models": first, "track_sequences": 8,
                    "scale": {display(a): {"parameters": per[a][0]["parameters"], "tokens": per[a][0]["train_tokens"]}
                              for a in archs}}, out)
    return doc


def render(out: Path) -> None:
    """search.md and results.md rewritten from the committed search.json and results.json (no model runs)."""
    if (out / "search.json").is_file():
        search = json.loads((out / "search.json").read_text())
        _write_search(search["settings"], search["results"], out, search["eval_sequences"])
    if (out / "results.json").is_file():
        atomic_write_text(out / "results.md", render_regime(json.loads((out / "results.json").read_text())))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a tiny synthetic setting: the pipeline in a minute")
    p.add_argument("--only", choices=["search", "regime"])
    p.add_argument("--setting", help="regime: a SEARCH setting, or demo (default: the one the search chose)")
    p.add_argument("--archs", nargs="+", default=["baseline", "diff"])
    p.add_argument("--schemes", nargs="+", default=["logits-int4"],
                   help="regime: the schemes whose perplexity cost is measured (docs/rivals/demo: logits-int4 w8a8)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (--quick: 0 1)")
    p.add_argument("--out", default="docs/emergence")
    p.add_argument("--runs", default="runs/emergence")
    p.add_argument("--render", action="store_true", help="only rewrite search.md and results.md from OUT's json")
    a = p.parse_args(argv)
    if a.render:
        return render(Path(a.out))
    a.seeds = a.seeds or ([0, 1] if a.quick else [0, 1, 2])
    settings = QUICK if a.quick else SEARCH
    named = {**settings, "demo": DEMO}
    if a.setting and a.setting not in named:
        raise dq.DiffquantError(f"--setting {a.setting} is not one of {', '.join(named)}")
    n_eval = 8 if a.quick else EVAL_SEQUENCES
    out, runs = Path(a.out), (Path(a.out) / "runs" if a.quick else Path(a.runs))
    used = {**settings, "demo": DEMO} if a.setting == "demo" else settings
    start_run(out, {**vars(a), "settings": used}, "cuda" if torch.cuda.is_available() else "cpu")
    found = None
    if a.only != "regime":
        found = search(settings, runs, out, n_eval)
        print((out / "search.md").read_text())
    if a.only == "search":
        return
    name = a.setting or choose(settings, found or json.loads((out / "search.json").read_text())["results"])
    regime(name, named[name], tuple(a.archs), a.seeds, runs, out, n_eval, tuple(a.schemes))
    print((out / "results.md").read_text())


if __name__ == "__main__":
    try:
        main()
    except dq.DiffquantError as err:  # one line, not a traceback
        raise SystemExit(f"emergence: {err}") from None
