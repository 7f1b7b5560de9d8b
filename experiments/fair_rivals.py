"""Every attention design compared fairly in Guo et al.'s Bigram-Backcopy setting: each design at its own
learning rate, several seeds, results at matched tokens and at matched held-out loss, Holm-corrected tests.

1. Learning-rate sweep: every design at each rate of `lrs`, seed `seeds[0]`; each design's rate is the one
   with the lowest held-out loss of its own (sweep.json holds every loss and every choice).
2. Seeds: every design at its chosen rate for each seed of `seeds` (the sweep's run is seed 0's).
3. Matched tokens: held-out loss, outlier statistics (Table 5 analog, sink rate, max‖h‖/median) and the
   perplexity cost of the headline schemes (W8A8 and W4A4 with static per-tensor activations, int4 attention
   logits per tensor), of the secondary ones (per-token dynamic W8A8 and W4A4) and of the KV-cache presets
   (kv4, kv4-sink1, k4v2, kivi2: keys after RoPE and values quantized in one forward, prefill semantics;
   kivi2 keeps the sequence's last 128 positions in full precision for every query, see
   `recent_window_shares`), mean ± 95% t over seeds.
   Welch's test of every design against DIFF per metric, Holm-adjusted over the planned family (every metric
   planned before the run; the attention-logit ratio came later and is tested only in the exploratory reading)
   and, labelled exploratory, within a primary (the headline costs) and a secondary family (see `families`).
4. Matched loss: the tracked curves (`--track`) give each run's outlier statistics at the first snapshot whose
   held-out loss is at or below the worst single run's final loss (quantization costs need weights, so
   they are reported at matched tokens only).

Every cell (design, rate, seed) trains with resume and writes its measurements atomically to
OUT/cells/<design>/lr<rate>/s<seed>.json: an interrupted run continues where it stopped (checkpoints under
--runs), and a finished cell is never redone, in a later session too, since OUT is committed and RUNS is not (unless it
lacks a scheme the experiment now measures: then it is trained and measured again in full).
The token budget per model is fixed once in OUT/plan.json from `--budget-hours` and what was measured at start: each
design's training tokens/s, and the seconds of a tracking snapshot, a run's measurement and a checkpoint write.
With `--worker K/N`, worker K runs on GPU K mod the visible GPUs. `--minutes M` sets the budget from a
wall-clock limit instead (start-up included, RESERVE_S kept for the report): the GPU preset, `--experiment
small-bb` (the `small` preset, 25.4M parameters with its 66-symbol vocabulary, 8 designs × (3 rates + 4 more
seeds) = 56 runs), runs within 8 minutes of an H200, fully offline (generated Bigram-Backcopy: no corpus, no hub).

    python -m experiments.fair_rivals --plan-only                 # what it would run, and how long
    nice -n 19 python -m experiments.fair_rivals --budget-hours 6 # the comparison (resumable)
    python -m experiments.fair_rivals --quick --out /tmp/fr       # the whole pipeline in seconds
    python -m experiments.fair_rivals --render                    # tests and report again from results.json
    python -m experiments.fair_rivals --experiment small-bb --minutes 8 --out runs/gpu_fair --runs runs/gpu_fair/runs
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import diffquant as dq
from diffquant.lab import atomic_write_json, atomic_write_text, parse_worker

DESIGNS = ("baseline", "diff", "gated", "clipsoftmax", "sink", "baseline-headnorm", "diff-gain", "gated-nobias")
HEADLINE = ("w8a8-static", "w4a4-static", "logits-int4")  # what outliers affect (Bondarenko et al.'s static W8A8)
SECONDARY = ("w8a8", "w4a4")  # per-token dynamic: outliers barely matter
KV_CACHE = ("kv4", "kv4-sink1", "k4v2", "kivi2")  # the cache as deployed (issue 26), prefill semantics
OUTLIER_METRICS = ("hidden_ratio", "hidden_top1", "logit_top1", "hidden_kurtosis", "sink_rate", "massive_ratio")
CURVE_METRICS = {  # snapshot "model" key: label (read off the tracked curves at matched loss)
    "sink_rate": "sink rate", "massive_ratio_max": "max‖h‖ / median‖h‖", "value_ratio_min": "value-norm ratio (min)",
    "hidden_ratio_max": "hidden top-1 / median (max over layers)", "attn_logits_top1_max": "attention-logit top-1"}


@dataclass(frozen=True)
class Experiment:
    """One comparison: the training setting (TrainConfig fields) and what is swept."""

    name: str
    train: dict  # TrainConfig overrides shared by every run (not lr, seed, tokens, archs)
    tokens: int  # the most tokens per model wanted; the plan may cut it to fit the budget
    lrs: tuple[float, ...]
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    designs: tuple[str, ...] = DESIGNS
    eval_sequences: int = 64
    calibration_sequences: int = 32
    track_points: int = 16
    schemes: tuple[str, ...] = HEADLINE + SECONDARY + KV_CACHE
    notes: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.lrs) < 3 and self.name != "quick":
            raise ValueError("a learning-rate sweep needs at least 3 rates")
        if len(self.seeds) < 2:
            raise ValueError("tests over seeds need at least 2 seeds")


# Guo et al. 2024 (arXiv 2410.13835; their BBM/train_main.py and scripts/dynamics.sh, read at
# GuoTianYu2000/Active-Dormant-Attention): Bigram-Backcopy, 3 triggers (the most frequent tokens), BOS first,
# 256 predicted tokens, one head per layer, width 256, 3 layers, AdamW lr 3e-4, weight decay 1e-4, betas
# (0.9, 0.99), eps 1e-8, constant rate (no warm-up, no schedule), no gradient clipping, batch 512, 10k steps.
GUO_TRAIN = dict(preset="guo", corpus="synth:bb:vocab=65,triggers=3", seq_len=257, batch_size=32,
                 weight_decay=1e-4, betas=(0.9, 0.99), schedule="constant", warmup_frac=0.0, grad_clip=0.0,
                 eval_every=10**9, save_every=50)
GUO_NOTES = {
    "reproduced": ["task: Bigram-Backcopy (after a trigger the next token copies the token before it; the first "
                   "token after BOS is never a trigger), as their `bbm` class", "3 triggers = the most frequent tokens",
                   "one BOS per sequence, 256 predicted tokens (a 257-token window)", "one head per layer, width 256",
                   "3 layers (their 3L runs; `guo1` preset for 1 layer)", "AdamW lr 3e-4 (in the sweep), weight decay 1e-4, "
                   "betas (0.9, 0.99), eps 1e-8", "constant learning rate, no warm-up, no gradient clipping",
                   "untied input and output embeddings"],
    "differs": ["bigram chain: a Dirichlet(0.2) chain over 65 symbols (diffquant's synth:bb) instead of tiny "
                "Shakespeare's character bigrams (their 65 characters): no corpus download, and synth:bb is what the "
                "rest of diffquant trains on", "architecture: diffquant's Llama layout (pre-RMSNorm, RoPE, SwiGLU of 683 "
                "units = their ReLU MLP's 2·256·1024 parameters) instead of LayerNorm, learned absolute positions and a "
                "ReLU MLP: the designs compared are all Llama variants, so the baseline must be one",
                "weight decay on matrices only (norms and λ vectors undecayed) instead of on every parameter",
                "batch 32 sequences instead of 512 on 2 CPU cores (more updates per token at a budget of minutes per "
                "model); the small-bb experiment uses 64 × 512 tokens at the small preset",
                "tokens: cut to the budget (their 10k steps × 512 × 256 = 1.3B tokens per model)",
                "learning rate swept per design (their 3e-4 is one of the rates)"],
    "heads": "one head of width 256 per layer for every design; DIFF (and diff-gain) has one differential head: two "
             "softmax maps of width 128 (q, k) over a value of width 256, as DIFF halves the head count to keep "
             "the parameters; its count is the baseline's + 4·128 λ parameters per layer",
}
EXPERIMENTS = {
    "guo": Experiment("guo", GUO_TRAIN, tokens=10_000 * 512 * 256,  # their 10k steps × 512 sequences × 256 tokens
                      lrs=(3e-4, 1e-3, 3e-3), notes=GUO_NOTES),
    # the whole pipeline in seconds: two designs, 8 steps, one checkpoint per run, 3 tracked points
    "quick": Experiment("quick", dict(GUO_TRAIN, preset="micro", corpus="synth:bb:vocab=32", seq_len=32, batch_size=8,
                                      save_every=10**9), tokens=8 * 32 * 8, lrs=(1e-3, 3e-3, 1e-2), seeds=(0, 1),
                        designs=("baseline", "diff"), eval_sequences=8, calibration_sequences=8, track_points=3,
                        schemes=HEADLINE + ("kv4-sink1",)),
    # the GPU preset (`--minutes 8` on one H200): the small preset (width 512, 8 layers, 8 heads, 512-token windows)
    # on Guo et al.'s task and optimiser; vocabulary 65 symbols + BOS like theirs; 64 × 513 tokens per step
    "small-bb": Experiment("small-bb", dict(GUO_TRAIN, preset="small", seq_len=513, batch_size=64, save_every=100),
                           tokens=200_000_000, lrs=(3e-4, 1e-3, 3e-3), eval_sequences=32, calibration_sequences=16,
                           track_points=8, notes={"scale": "small preset, 8 heads per layer (DIFF: 4 differential "
                                                           "heads), not Guo's one head"}),
}
RESERVE_S = 20  # `--minutes`: the results, figures and report after the last cell


def train_config(e: Experiment, design: str, lr: float, seed: int, tokens: int):
    from diffquant.lab import TrainConfig

    return TrainConfig(**{**e.train, "lr": lr, "seed": seed, "tokens": tokens, "archs": (design,), "track": True,
                          "track_points": e.track_points, "eval_tokens": e.eval_sequences * e.train["seq_len"]})


def cell_folder(runs: Path, design: str, lr: float, seed: int) -> Path:
    return runs / design / f"lr{lr:g}" / f"s{seed}"


# ---------------------------------------------------------------- plan


def measure_costs(e: Experiment, device: str, steps: int = 2) -> dict:
    """What a plan is made from, measured on this machine: every design's training tokens/s (as `train` runs it),
    and on the slowest design the seconds of one tracking snapshot, of one run's measurement (held-out loss,
    profile, every scheme, calibration included) and of one checkpoint write (weights and optimizer state).
    Every design is charged the slowest one's tracking, measurement and checkpoints (an upper bound)."""
    import tempfile

    from diffquant.lab import build_model, fuse, get_preset, is_synthetic, snapshot, synthetic_spec
    from experiments.measure import measure
    from experiments.pairs import seconds, train_rate

    seq_len = e.train.get("seq_len") or get_preset(e.train["preset"]).seq_len
    vocab = synthetic_spec(e.train["corpus"]).vocab + 1 if is_synthetic(e.train["corpus"]) else None
    rates = {d: train_rate(e.train["preset"], d, e.train["batch_size"], seq_len, vocab, device, steps)
             for d in e.designs}
    slowest = min(rates, key=rates.get)
    model = build_model(get_preset(e.train["preset"]), slowest, vocab=vocab, seq_len=seq_len).to(device).eval()
    fuse(model)
    ids = lambda n: torch.randint(0, vocab or model.config.vocab_size, (n, seq_len), device=device)  # noqa: E731
    track_batch, seqs, calib = ids(train_config(e, slowest, e.lrs[0], 0, 1).track_sequences), ids(
        e.eval_sequences), ids(e.calibration_sequences)
    opt = torch.optim.AdamW(model.parameters())
    opt.step()  # the optimizer state a checkpoint holds
    with tempfile.TemporaryDirectory() as tmp:
        save = seconds(lambda: (model.save_pretrained(tmp), torch.save(opt.state_dict(), f"{tmp}/state.pt")), device)
    return {"tokens_per_s": rates, "slowest": slowest,
            "snapshot_s": seconds(lambda: snapshot(model, track_batch, 0, 0), device),
            "measure_s": seconds(lambda: measure(model, seqs, e.schemes, calib), device), "save_s": save}


def make_plan(e: Experiment, budget_hours: float, costs: dict) -> dict:
    """Runs to do and the tokens per model that fit `budget_hours` with everything a run does: each design's
    training at its own measured rate, `track_points` snapshots (+2: the first and the last), one measurement,
    and a checkpoint every `save_every` steps and at the end (`costs` from `measure_costs`); in whole steps,
    never more than e.tokens. A budget that tracking, measurement and checkpoints alone exceed is refused."""
    per_design = len(e.lrs) + len(e.seeds) - 1  # runs of each design: the sweep's run is the first seed's
    runs = len(e.designs) * per_design
    step_tokens = e.train["batch_size"] * e.train["seq_len"]
    saves_per_token = 1 / (e.train.get("save_every", 200) * step_tokens)
    fixed = runs * ((e.track_points + 2) * costs["snapshot_s"] + costs["measure_s"] + costs["save_s"])
    per_token = per_design * sum(1 / costs["tokens_per_s"][d] for d in e.designs) + runs * costs["save_s"] * saves_per_token
    budget = budget_hours * 3600
    tokens = int(min(e.tokens, (budget - fixed) / per_token) // step_tokens * step_tokens)
    if tokens < step_tokens:
        raise dq.DiffquantError(f"{budget_hours * 60:.1f} min do not fit {runs} runs: their tracking, measurement "
                                f"and checkpoints alone take {fixed / 60:.1f} min; allow more time, or fewer designs "
                                "or seeds")
    train_s = per_design * sum(tokens / costs["tokens_per_s"][d] for d in e.designs)
    estimate = {"training": train_s, "tracking": runs * (e.track_points + 2) * costs["snapshot_s"],
                "measurement": runs * costs["measure_s"],
                "checkpoints": runs * costs["save_s"] * (1 + tokens * saves_per_token)}
    return {"experiment": e.name, "runs": runs, "designs": list(e.designs), "lrs": list(e.lrs), "seeds": list(e.seeds),
            "tokens_per_model": tokens, "wanted_tokens": e.tokens, "cut": tokens < e.tokens, "steps": tokens // step_tokens,
            "tokens_per_s": min(costs["tokens_per_s"].values()), "budget_hours": budget_hours, "costs": costs,
            "estimate_s": estimate, "train_hours": train_s / 3600}


def describe_plan(plan: dict) -> str:
    cut = (f"cut from {plan['wanted_tokens']:,} to fit {plan['budget_hours']:.3g} h" if plan["cut"] else "not cut")
    head = (f"{plan['experiment']}: {plan['runs']} runs ({len(plan['designs'])} designs × ({len(plan['lrs'])} rates + "
            f"{len(plan['seeds']) - 1} more seeds)), {plan['tokens_per_model']:,} tokens per model ({plan['steps']} steps; "
            f"{cut})")
    if "estimate_s" not in plan:  # plans made before tracking, measurement and checkpoints were measured
        return (head + f", {plan['tokens_per_s']:,.0f} tokens/s measured: about {plan['train_hours']:.2f} h of training "
                f"+ {plan['overhead']:.0%} for tracking and measurement")
    est = plan["estimate_s"]
    rates = plan["costs"]["tokens_per_s"]
    return (head + f", {min(rates.values()):,.0f}-{max(rates.values()):,.0f} training tokens/s measured per design: "
            f"about {sum(est.values()) / 60:.1f} min (" + ", ".join(f"{k} {v / 60:.1f}" for k, v in est.items()) + ")")


# ---------------------------------------------------------------- cells


def held_out_and_calibration(e: Experiment, folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Held-out sequences (the validation split) and calibration sequences (a draw of the training split of its
    own: the generator is vectorised, so they are not the first windows a training run sees)."""
    from diffquant.lab import prepare_data

    seq_len = e.train["seq_len"]
    cfg = train_config(e, e.designs[0], e.lrs[0], 0, e.calibration_sequences * seq_len)
    data = prepare_data(cfg, folder)
    return data.val[:e.eval_sequences], data.train[:e.calibration_sequences]


def run_cell(e: Experiment, design: str, lr: float, seed: int, tokens: int, runs: Path, device: str,
             seqs: torch.Tensor, calib: torch.Tensor, cells: Path) -> dict:
    """Train (resuming) and measure one cell, or read its measurements (under `cells`) when it is finished."""
    from diffquant.lab import from_pretrained, train_pair
    from experiments.measure import measure

    folder = cell_folder(runs, design, lr, seed)
    done = cells / design / f"lr{lr:g}" / f"s{seed}.json"
    if done.is_file():
        cell = json.loads(done.read_text())
        if cell["train_tokens"] != tokens:
            raise dq.DiffquantError(f"{done} was trained for {cell['train_tokens']:,} tokens, this plan wants "
                                    f"{tokens:,}: use another --runs folder or the plan.json that made it")
        missing = [s for s in e.schemes if f"{s.replace('-', '_')}_cost" not in cell]
        if not missing:
            return cell
        # a cell measured before a scheme joined the experiment: every design must be measured on every scheme,
        # so it is trained again (resuming its checkpoint where one is kept) and measured in full, never patched
        print(f"{done}: no {', '.join(missing)}; training and measuring it again", flush=True)
        previous = cell
    else:
        previous = None
    cfg = train_config(e, design, lr, seed, tokens)
    t0 = time.perf_counter()
    train_pair(cfg, folder, device=device, resume=(folder / "train_config.json").exists(), progress=False,
               figures=False)
    train_s = time.perf_counter() - t0
    info = json.loads((folder / "metrics.json").read_text())["models"][design]
    model = from_pretrained(folder / design).to(device).eval()
    from diffquant.lab import fuse

    fuse(model)
    m = measure(model, seqs.to(device), e.schemes, calib.to(device))
    cell = {**{k: v for k, v in m.items() if k != "sinks"}, "design": design, "lr": lr, "seed": seed,
            "train_tokens": tokens, "parameters": info["parameters"], "train_seconds": train_s,
            "tokens_per_s": info.get("tokens_per_s"), "curve": info.get("emergence", [])}
    if previous is not None:  # what the earlier measurement said, so a reader can see the retraining reproduced it
        cell["previous"] = {k: previous[k] for k in ("loss", "w4a4_static_cost", "hidden_ratio") if k in previous}
    atomic_write_json(done, cell)
    return cell


# ---------------------------------------------------------------- analysis


def choose_rates(sweep: dict[str, dict[float, dict]]) -> dict:
    """{design: {"losses": {lr: held-out loss}, "chosen": lr}}: each design's own lowest held-out loss."""
    out = {}
    for design, cells in sweep.items():
        losses = {lr: c["loss"] for lr, c in cells.items()}
        chosen = min(losses, key=losses.get)
        out[design] = {"losses": {f"{lr:g}": v for lr, v in losses.items()}, "chosen": chosen,
                       "loss_se": cells[chosen].get("loss_se")}
    return out


def at_loss(curve: list[dict], target: float) -> dict | None:
    """The first tracked snapshot whose held-out loss is at or below `target` (None if the run never got there)."""
    for point in curve:
        if point["loss"] is not None and point["loss"] <= target:
            return point
    return None


def matched_loss(per_design: dict[str, list[dict]]) -> dict:
    """Outlier statistics at the loss every run reaches: the worst single run's final tracked loss (a design's
    mean would leave out the seeds of every design that end above it, DIFF's included)."""
    from diffquant.lab import t_interval

    finals = {d: sum(c["curve"][-1]["loss"] for c in cells) / len(cells) for d, cells in per_design.items()}
    target = max(c["curve"][-1]["loss"] for cells in per_design.values() for c in cells)
    out = {"target_loss": target, "final_loss": finals, "designs": {}}
    for design, cells in per_design.items():
        points = [at_loss(c["curve"], target) for c in cells]
        reached = [p for p in points if p is not None]
        row = {"reached": len(reached), "seeds": len(cells), "tokens": t_interval([p["tokens"] for p in reached])}
        for key in CURVE_METRICS:
            row[key] = t_interval([p["model"].get(key) for p in reached])
        out["designs"][design] = row
    return out


# The families the tests are corrected in. "planned": every metric of the report × every design against DIFF, in
# one family, as the comparison was planned before any result was in; it leads. Then an exploratory reading, adopted
# after the first aggregation: "primary", the metrics outliers actually hurt (the headline: static
# per-tensor activations and int4 logits), and "secondary", the rest, scale-free only: absolute magnitudes
# (hidden-state and attention-logit top-1) measure the residual's scale, which RMSNorm makes irrelevant and which
# differs between designs, so that reading leaves them out and adds the attention-logit ratio.
PRIMARY = tuple(f"{s.replace('-', '_')}_cost" for s in HEADLINE)
NOT_TESTED = ("hidden_top1", "logit_top1")
MIN_REACHED = 0.8  # matched loss: a design is summarised only where at least this share of its seeds got there
# Contrasts added after the audit of issue 42, so exploratory: each ablation against its parent and against the
# Transformer, on the planned family's metrics (the planned tests compare every design with DIFF only, so none said
# whether an ablation moved its parent). DIFF + norm gain − DIFF and Transformer − DIFF are planned tests already.
ADDED = (("baseline-headnorm", "baseline"), ("diff-gain", "baseline"), ("gated-nobias", "gated"),
         ("gated-nobias", "baseline"))
# KV-cache presets whose scales are per token and KV head: with one head of 256 channels for a softmax design and
# two of 128 for a differential one (the guo preset), DIFF gets twice the scales. KV_MATCHED gives every design of
# the guo preset the same count (groups of 128 channels: 2 per token); a future run adds it to `schemes` (every
# finished cell is then trained and measured again, see run_cell); the committed runs did not measure it.
KV_PER_HEAD = ("kv4", "kv4-sink1", "k4v2")
KV_MATCHED = ("kv4-g128",)


def families(metrics: list[str]) -> dict[str, list[str]]:
    """{"planned": every metric, "primary": [...], "secondary": [...]} from the report's metrics."""
    return {"planned": list(metrics), "primary": [m for m in metrics if m in PRIMARY],
            "secondary": [m for m in [*metrics, "logit_ratio"] if m not in PRIMARY and m not in NOT_TESTED]}


def _contrast(per_design: dict[str, list[dict]], family: str, metric: str, design: str, reference: str) -> dict:
    """Welch's test of design − reference over seeds, with the pooled SD its detectable effect is read in. A metric
    that takes one value in every run of both (a sink rate of 0 everywhere) is no test: "constant (no test)"."""
    from diffquant.lab import pooled_sd, welch

    values = [c.get(metric) for c in per_design[design]]
    ref = [c.get(metric) for c in per_design[reference]]
    row = {"family": family, "metric": metric, "design": design, "reference": reference,
           "n": len([v for v in values if v is not None]), "n_ref": len([v for v in ref if v is not None])}
    if len({v for v in values + ref if v is not None}) == 1:
        return {**row, "diff": 0.0, "p": None, "p_holm": None, "verdict": "constant (no test)"}
    w = welch(values, ref)
    if w is None:
        return {**row, "diff": None, "p": None, "p_holm": None, "verdict": "n/a"}
    return {**row, "diff": w["diff"], "p": w["p"], "sd": pooled_sd(values, ref)}


def _judge(row: dict, p_adjusted: float, tests: int) -> None:
    """The verdict of one test at its Holm-adjusted p over a family of `tests`: which side is higher, or "no
    difference detected" with the smallest difference the test could detect at 80% power (Holm's first step, the
    smaller n), in SD and in the metric's units from the pooled SD, never "equal"."""
    from diffquant.lab import display, minimum_detectable_effect

    n = min(row["n"], row["n_ref"])
    row.update(p_holm=p_adjusted, tests=tests, mde_sd=minimum_detectable_effect(n, tests))
    row["mde"] = row["mde_sd"] * row["sd"]
    row["verdict"] = (f"design {'higher' if row['diff'] > 0 else 'lower'} than {display(row['reference'])}"
                      if p_adjusted < 0.05 else
                      f"no difference detected (n = {n}; detectable {row['mde_sd']:.1f} SD = {row['mde']:.3g})")


def tests_against(per_design: dict[str, list[dict]], fams: dict[str, list[str]], reference: str = "diff",
                  fixes: list[dict] | None = None) -> list[dict]:
    """Welch's test of each design against `reference` per metric, Holm-adjusted within each family; then the
    contrasts added after the audit (ADDED, on the planned metrics, family "added"), judged by Holm over the
    planned family grown by them and by `fixes` (the fixes table's tests: dicts with "p"), see `grow`. A metric
    constant in every run of both designs is reported as such and left out of every family."""
    from diffquant.lab import holm_adjust

    rows = []
    pairs = {family: [(d, reference) for d in per_design if d != reference] for family in fams}
    if "planned" in fams:
        fams = {**fams, "added": fams["planned"]}
        pairs["added"] = [(d, r) for d, r in ADDED if d in per_design and r in per_design]
    for family, metrics in fams.items():
        block = [_contrast(per_design, family, m, d, r) for m in dict.fromkeys(metrics) for d, r in pairs[family]]
        rows += [r for r in block if "sd" not in r]  # constants first, as the table always listed them
        tested = [r for r in block if "sd" in r]
        if family != "added":
            for r, adj in zip(tested, holm_adjust([r["p"] for r in tested])):
                _judge(r, adj, len(tested))
        rows += tested
    grow(rows, fixes or [])
    return rows


def grow(rows: list[dict], fixes: list[dict]) -> int:
    """Holm over the planned family grown by the added contrasts and the fixes table's tests: "p_holm_grown" on
    each; the added rows are judged by it (they have no family of their own), the planned rows keep the planned
    family's verdicts (fixed before the run) and carry it to show which survive the growth. Returns its size."""
    from diffquant.lab import holm_adjust

    grown = [r for r in rows if r["family"] in ("planned", "added") and r.get("p") is not None]
    grown += [t for t in fixes if t.get("p") is not None]
    for r, adj in zip(grown, holm_adjust([r["p"] for r in grown])):
        r["p_holm_grown"] = adj
    for r in rows:
        if r["family"] == "added" and "sd" in r:
            _judge(r, r["p_holm_grown"], len(grown))
    return len(grown)


def analyse(doc: dict, fixes: dict | None = None) -> dict:
    """doc["tests"] and doc["grown"] from doc's per-seed values (exact: what `run` writes, and what `--render`
    rewrites without training); `fixes`: the fixes table's results (experiments/fixes_needed.py), whose tests join
    the grown family."""
    metrics = ["loss", *[f"{s.replace('-', '_')}_cost" for s in doc["experiment"]["schemes"]], *OUTLIER_METRICS]
    fixes_tests = ((fixes or {}).get("summary") or {}).get("tests") or []
    doc["tests"] = tests_against(doc["per_seed"], families(metrics), fixes=fixes_tests)
    count = {f: sum(r["family"] == f and r.get("p") is not None for r in doc["tests"]) for f in ("planned", "added")}
    doc["grown"] = {**count, "fixes": sum(t.get("p") is not None for t in fixes_tests),
                    "tests": count["planned"] + count["added"] + sum(t.get("p") is not None for t in fixes_tests)}
    return doc


def _display(metric: str) -> str:
    from experiments.measure import METRICS

    return METRICS[metric][0] if metric in METRICS else metric


def _tie(v: dict) -> bool:
    """The chosen rate beat the runner-up by less than the seed-0 loss's standard error."""
    losses = sorted(v["losses"].values())
    return bool(len(losses) > 1 and v.get("loss_se") and losses[1] - losses[0] < v["loss_se"])


def lr_ties(doc: dict) -> list[str]:
    """Designs whose chosen rate beat the runner-up by less than the seed-0 loss's standard error (a tie the
    sweep cannot resolve), with the margin."""
    from diffquant.lab import display

    out = []
    for design, v in doc["rates"].items():
        if _tie(v):
            losses = sorted(v["losses"].values())
            out.append(f"{display(design)} (by {losses[1] - losses[0]:.4f} nats, standard error {v['loss_se']:.4f})")
    return out


def tie_values(doc: dict, design: str, metric: str) -> str | None:
    """For a design whose rate was a tie: its seed-0 value of `metric` at the chosen rate and at the runner-up
    ("DIFF 9.12 at its chosen 0.001, 60.7 at 0.003"), or that the files do not hold them; None if no tie."""
    from diffquant.lab import display

    v = doc["rates"].get(design)
    if v is None or not _tie(v):
        return None
    chosen, runner = f"{v['chosen']:g}", sorted(v["losses"], key=v["losses"].get)[1]
    by_lr = (doc.get("sweep_metrics") or {}).get(design, {})
    a, b = by_lr.get(chosen, {}).get(metric), by_lr.get(runner, {}).get(metric)
    if a is None or b is None:
        return f"{display(design)} (its seed-0 values at both rates are not in the files)"
    return f"{display(design)} {a:.3g} at its chosen {chosen}, {b:.3g} at {runner}"


def _tie_note(doc: dict, rows: list[dict]) -> str:
    """" [rate ties, seed 0: ...]" for the tied designs among the rows' designs and references, or ""."""
    involved = dict.fromkeys(d for r in rows for d in (r["reference"], r["design"]))
    said = [t for t in (tie_values(doc, d, rows[0]["metric"]) for d in involved) if t]
    return f" [on learning-rate ties; seed 0 at the chosen rate and the runner-up: {'; '.join(said)}]" if said else ""


def _units(rows: list[dict]) -> str:
    """The detectable effects of undetected tests in the metric's units: "0.021" or "0.012–0.045"."""
    lo, hi = min(r["mde"] for r in rows), max(r["mde"] for r in rows)
    return f"{lo:.3g}" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g}–{hi:.3g}"


def _findings(doc: dict, tested: list[dict], family: str, say_quiet: bool) -> tuple[list[str], list[str]]:
    """Per metric of a family of tests against DIFF: the designs DIFF is below and above at Holm-adjusted p < 0.05,
    with any learning-rate tie behind them; "no difference detected" for the rest with what it could have detected,
    never "equal"; metrics without any difference go to the second list when `say_quiet`, so a paragraph names them
    instead of spelling each out."""
    from diffquant.lab import display

    parts, quiet = [], []
    for metric in dict.fromkeys(r["metric"] for r in tested if r["family"] == family):
        rows = [r for r in tested if r["metric"] == metric and r["family"] == family]
        found = [r for r in rows if r["p_holm"] < 0.05]
        # r["diff"] is design − DIFF: DIFF is lower where the design is higher
        below = [display(r["design"]) for r in found if r["diff"] > 0]
        above = [display(r["design"]) for r in found if r["diff"] < 0]
        if say_quiet and not found:
            quiet.append(_display(metric))
            continue
        said = ([f"lower than {', '.join(below)}"] if below else []) + \
               ([f"higher than {', '.join(above)}"] if above else [])
        rest = [r for r in rows if r["p_holm"] >= 0.05]
        if rest:
            said.append(f"no difference detected against {'the other' if said else 'any of the'} {len(rest)} (n = "
                        f"{min(r['n'] for r in rest)}; detectable {rest[0]['mde_sd']:.1f} SD = {_units(rest)})")
        parts.append(f"{_display(metric)}: DIFF " + "; ".join(said) + (_tie_note(doc, found) if found else ""))
    return parts, quiet


def _added_findings(doc: dict, tested: list[dict]) -> list[str]:
    """Per added contrast (design against reference): the metrics where the design is higher or lower at the grown
    family's Holm p < 0.05 (with any rate tie behind them), and how many show no difference."""
    from diffquant.lab import display

    out = []
    for design, reference in dict.fromkeys((r["design"], r["reference"]) for r in tested if r["family"] == "added"):
        rows = [r for r in tested if r["family"] == "added" and r["design"] == design and r["reference"] == reference]
        found = [r for r in rows if r["p_holm"] < 0.05]
        said = [f"{'higher' if r['diff'] > 0 else 'lower'} on {_display(r['metric'])} (Holm p {r['p_holm']:.2g})"
                + _tie_note(doc, [r]) for r in found]
        rest = len(rows) - len(found)
        if rest:
            said.append(f"no difference detected on {'the other' if found else 'any of the'} {rest} metrics (n = "
                        f"{min(r['n'] for r in rows)}; detectable {rows[0]['mde_sd']:.1f} SD)")
        out.append(f"{display(design)} against {display(reference)}: " + "; ".join(said))
    return out


def kv_heads(doc: dict) -> dict[str, tuple[int, int]]:
    """{design: (KV heads, channels per head)} of each design's cache at the experiment's preset."""
    from diffquant.lab import get_preset

    spec = get_preset(doc["experiment"]["train"]["preset"])
    return {d: (c.num_key_value_heads, c.head_dim) for d in doc["per_seed"] for c in [spec.config(d)]}


def cache_scales(scheme: str, heads: int, head_dim: int) -> tuple[int | None, int | None]:
    """(key scales, value scales) per token and layer that a KV-cache preset gives a cache of `heads` KV heads of
    `head_dim` channels; None where the scales are not per token (keys per channel over runs of positions)."""
    from diffquant.lab import PerGroup, PerToken

    def count(g):
        if isinstance(g, PerToken):
            return heads
        if isinstance(g, PerGroup):
            return heads * math.ceil(head_dim / g.size)
        return None

    found = dict((p.rsplit(".", 1)[-1], c.granularity) for p, c in dq.scheme(scheme).activations)
    return count(found["k_cache"]), count(found["v_cache"])


def kv_granularity(doc: dict) -> str:
    """What the per-token-and-KV-head cache presets give each design here, and which verdicts that touches."""
    from diffquant.lab import display

    shapes = kv_heads(doc)
    per_head = [s for s in doc["experiment"]["schemes"] if s in KV_PER_HEAD]
    if not per_head or len({cache_scales(per_head[0], *hw) for hw in shapes.values()}) == 1:
        return ""
    groups = {}
    for d, hw in shapes.items():
        groups.setdefault(hw, []).append(display(d))
    kinds = "; ".join(f"{', '.join(ds)}: {h} KV head{'s' if h > 1 else ''} of {w} channels, so "
                      f"{cache_scales(per_head[0], h, w)[0]} key and {cache_scales(per_head[0], h, w)[1]} value "
                      "scale(s) per token and layer" for (h, w), ds in groups.items())
    first = next(iter(shapes.values()))
    matched = ", ".join(f"{s} ({cache_scales(s, *first)[0]} key and {cache_scales(s, *first)[1]} value scales per "
                        "token and layer for every design)"
                        for s in KV_MATCHED if len({cache_scales(s, *hw) for hw in shapes.values()}) == 1)
    return (f"The KV-cache costs {', '.join(per_head)} quantize per token and KV head, which is not one granularity "
            f"here: {kinds}. Their columns and verdicts are not at matched granularity. KIVI-2 (keys per channel, "
            "values in groups of 32 channels) gives every design the same scales. A matched preset, "
            f"{matched or 'none'}, is offered for a future run; these runs did not measure it.")


def recent_window_shares(length: int, recent: int) -> dict:
    """What KIVI's full-precision recent window covers on one sequence of `length` positions: "entries", the share
    of cached positions the one-forward simulation keeps in full precision (QuantConfig.quantized_span: the
    sequence's last `recent`, for every query); "prefill_pairs", the share of causal query–key pairs that read a
    quantized entry there; "decode_pairs", that share in a decoding cache, which keeps each query's `recent` most
    recent positions in full precision instead."""
    from diffquant.lab import kv_config

    start, end = kv_config(2, recent=recent).quantized_span(length)
    pairs = [(q, k) for q in range(length) for k in range(q + 1)]
    return {"entries": 1 - (end - start) / length, "pairs": len(pairs),
            "prefill_pairs": sum(start <= k < end for _, k in pairs) / len(pairs),
            "decode_pairs": sum(q - k >= recent for q, k in pairs) / len(pairs)}


COPY_LOSS_NOTE = ("The loss at copy positions (the predictions after a trigger, Guo et al.'s diagnostic of what "
                  "attention does on this task) is not reported: it needs the trained models, whose checkpoints were "
                  "not kept (only their measurements are committed); experiments/headnorm.py measures it in its "
                  "decomposition.")


def standing(doc: dict) -> str:
    """Where DIFF stands, read off Holm-adjusted tests only, in paragraphs. First the correction planned before any
    result (one family: every metric × design − DIFF); then the contrasts added after the audit (each ablation
    against its parent and the Transformer, judged in the planned family grown by them and the fixes table);
    then the exploratory reading (primary / secondary families, adopted after the first aggregation), every
    secondary metric with a difference said so none can hide; then what limits all of them: rate ties (also next
    to every verdict they touch), the KV cache's granularity, what is not measured, and the scale."""
    from diffquant.lab import REGIME_NAME, minimum_detectable_effect

    per_seed = doc["per_seed"]
    n = min(len(v) for v in per_seed.values())
    tested = [r for r in doc["tests"] if r["p_holm"] is not None]
    size = {f: sum(r["family"] == f for r in tested) for f in ("planned", "primary", "secondary", "added")}
    grown = doc.get("grown") or {"tests": size["planned"] + size["added"], "added": size["added"], "fixes": 0}
    planned, _ = _findings(doc, tested, "planned", say_quiet=True)
    primary, _ = _findings(doc, tested, "primary", say_quiet=False)
    secondary, quiet = _findings(doc, tested, "secondary", say_quiet=True)
    mde = minimum_detectable_effect(n, size["planned"]) if size["planned"] else None
    paragraphs = [
        f"Where DIFF stands ({doc['plan']['tokens_per_model']:,} training tokens per model, {n} seeds per design; "
        "Welch's t over seeds, Holm-adjusted, adjusted p < 0.05; a \"no difference detected\" says the smallest "
        "true difference its test detects with 80% power at Holm's first step, in standard deviations and, after "
        "'=', in the metric's units from the two designs' pooled SD: it is not equality, and no equivalence margin "
        f"was stated before the run, so none is claimed). As planned (every metric × design − DIFF, fixed before the "
        f"run, one family of {size['planned']} tests, Holm over all of them): "
        + (". ".join(planned) + "; " if planned else "")
        + "no difference detected (n = {}; detectable {}) on every other metric, the static W8A8 / W4A4 and "
          "int4-logit costs among them{}.".format(n, f"{mde:.1f} SD" if mde else "-", "" if not any(
              p.split(":")[0] in {_display(m) for m in PRIMARY} for p in planned) else " where not said")]
    if size["added"]:
        survive = [r for r in tested if r["family"] == "planned" and r["p_holm"] < 0.05]
        kept = sum((r.get("p_holm_grown") or 1) < 0.05 for r in survive)
        pairs = dict.fromkeys((r["design"], r["reference"]) for r in tested if r["family"] == "added")
        paragraphs.append(
            f"Added after the audit (issue 42), exploratory: each ablation against its parent and against the "
            f"Transformer ({len(pairs)} contrasts × the planned metrics; DIFF + norm gain − DIFF and Transformer − "
            f"DIFF are planned tests already). The family grew from the {size['planned']} planned tests by these "
            f"{grown['added']}" + (f" and by the fixes table's {grown['fixes']} (docs/rivals/fair-guo/fixes)"
                                   if grown.get("fixes") else "")
            + f" to {grown['tests']}; Holm over the grown family judges the added contrasts (detectable "
              f"{minimum_detectable_effect(n, grown['tests']):.1f} SD), and {kept} of the {len(survive)} planned "
              "verdicts above survive it (column \"p (Holm, grown)\"): " + ". ".join(_added_findings(doc, tested))
            + ". " + _raw_only(doc, tested))
    text = (f"Exploratory reading, adopted after the first aggregation (the issue's headline costs as a primary "
            f"family of {size['primary']} tests; the other metrics, scale-free only, as a secondary family of "
            f"{size['secondary']}): " + ". ".join(primary + secondary))
    if quiet:
        text += (f". No difference detected (n = {n}; detectable {minimum_detectable_effect(n, size['secondary']):.1f} "
                 f"SD) on the other secondary metrics: {'; '.join(quiet)}")
    paragraphs.append(text + ".")
    limits = []
    tied = lr_ties(doc)
    if tied:
        limits.append("The learning-rate sweep could not separate the best two rates of " + ", ".join(tied)
                      + ": every verdict above that involves one of them says so in brackets, with its seed-0 values "
                        "at both rates (every rate's seed-0 metrics are tabled).")
    kv = kv_granularity(doc)
    if kv:
        limits.append(kv)
    limits.append(COPY_LOSS_NOTE)
    cells = [c for v in per_seed.values() for c in v]
    swept = [c for by_lr in (doc.get("sweep_metrics") or {}).values() for c in by_lr.values()]
    constant = sorted({_display(r["metric"]) for r in doc["tests"] if r["verdict"].startswith("constant")})
    limits.append(f"At this scale no design is in {REGIME_NAME}: at the chosen rates the hidden top-1/median (pooled "
                  f"over layers) is at most {max(c.get('hidden_ratio') or 0 for c in cells):.1f} and the sink rate at "
                  f"most {max(c.get('sink_rate') or 0 for c in cells):.2f} over all {len(cells)} runs"
                  + (f" ({max(c.get('hidden_ratio') or 0 for c in swept):.1f} and "
                     f"{max(c.get('sink_rate') or 0 for c in swept):.2f} in the sweep's runs at other rates)"
                     if swept else "")
                  + f", and max‖h‖/median‖h‖ at most {max(c.get('massive_ratio') or 0 for c in cells):.2f}, so this "
                    "compares designs early in training, before the outliers the paper measures exist"
                  + (f"; not tested (one value in every run): {'; '.join(constant)}" if constant else "") + ".")
    paragraphs.append(" ".join(limits))
    return "\n\n".join(paragraphs)


def _raw_only(doc: dict, tested: list[dict]) -> str:
    """The added contrasts whose uncorrected p is below 0.05 while the grown family's Holm p is not: said with
    both p-values, so an observation the correction does not support is visible and labelled."""
    from diffquant.lab import display

    rows = [r for r in tested if r["family"] == "added" and r["p"] < 0.05 <= r["p_holm"]]
    headline = [r for r in rows if r["metric"] in PRIMARY]
    if not rows:
        return ""
    return ("Uncorrected p < 0.05 that Holm over the grown family does not support (observations, not findings)"
            + (" on the headline costs: " + "; ".join(
                f"{display(r['design'])} − {display(r['reference'])} on {_display(r['metric'])} {r['diff']:+.3g} "
                f"(p {r['p']:.2g}, Holm {r['p_holm']:.2g})" + _tie_note(doc, [r]) for r in headline) if headline else "")
            + (f"{'; and' if headline else ':'} {len(rows) - len(headline)} on the other metrics (in the table)"
               if len(rows) > len(headline) else "") + ".")


def render(doc: dict) -> str:
    from diffquant.lab import display, fmt_pm, markdown

    from experiments.measure import METRICS

    e, plan = doc["experiment"], doc["plan"]
    lines = [f"# Fair comparison: {e['name']}\n", describe_plan(plan) + ".\n",
             f"Seeds {e['seeds']}; held-out sequences: {e['eval_sequences']}; calibration sequences (static "
             f"scales): {e['calibration_sequences']}.\n", "## Learning rates (each design's own held-out loss, seed "
             f"{e['seeds'][0]})\n"]
    lines.append(markdown(["design", *[f"lr {lr:g}" for lr in e["lrs"]], "chosen", "loss standard error (seed 0)"],
                          [[display(d), *[f"{v['losses'][f'{lr:g}']:.4f}" for lr in e["lrs"]], f"{v['chosen']:g}",
                            f"{v['loss_se']:.4f}" if v.get("loss_se") else "-"]
                           for d, v in doc["rates"].items()]))
    if doc.get("sweep_metrics"):
        shown = [k for k in ("loss", *PRIMARY, "hidden_ratio", "massive_ratio") if k in METRICS]
        lines.append(f"\n## Every rate, seed {e['seeds'][0]}: how much the choice of rate moves the metrics\n")
        lines.append(markdown(["design", "lr", *[METRICS[k][0] for k in shown]],
                              [[display(d), f"{lr}{' (chosen)' if float(lr) == doc['rates'][d]['chosen'] else ''}",
                                *[f"{c[k]:.{METRICS[k][1]}g}" if c.get(k) is not None else "-" for k in shown]]
                               for d, by_lr in doc["sweep_metrics"].items() for lr, c in by_lr.items()]))
    keys = ["loss", *[f"{s.replace('-', '_')}_cost" for s in e["schemes"]], "logit_ratio", *OUTLIER_METRICS]
    lines.append(f"\n## Matched tokens ({plan['tokens_per_model']:,} per model), mean ± 95% t over seeds\n")
    lines.append("The absolute top-1 magnitudes are tested only in the planned family (they measure the residual's "
                 "scale); the attention-logit top-1 / median only in the exploratory one. " + kv_granularity(doc) + "\n")
    lines.append(markdown(["design", *[METRICS[k][0] for k in keys if k in METRICS]],
                          [[display(d), *[fmt_pm(a[k]["mean"], a[k]["half"], METRICS[k][1]) if k in a else "-"
                                          for k in keys if k in METRICS]] for d, a in doc["aggregate"].items()]))
    ml = doc["matched_loss"]
    need = math.ceil(MIN_REACHED * max(r["seeds"] for r in ml["designs"].values()))
    lines.append(f"\n## Matched held-out loss ({ml['target_loss']:.4f} nats: the worst run's final loss on the "
                 f"{ml.get('track_sequences', 'tracked')} tracked held-out sequences), first tracked point at or "
                 f"below it; a design is summarised only where at least {need} seeds reach it\n")
    lines.append(markdown(["design", "seeds reaching it", "tokens", *CURVE_METRICS.values()],
                          [[display(d), f"{r['reached']}/{r['seeds']}",
                            *([fmt_pm(r["tokens"]["mean"], r["tokens"]["half"]),
                               *[fmt_pm(r[k]["mean"], r[k]["half"]) for k in CURVE_METRICS]] if r["reached"] >= need
                              else ["too few seeds reach it"] + [""] * len(CURVE_METRICS))]
                           for d, r in ml["designs"].items()]))
    lines.append("\n## Tests: every design against DIFF, and the ablations against their parents and the Transformer\n")
    lines.append("Welch's t over seeds. p (Holm, family): within the test's own family (planned: every metric × "
                 "design − DIFF, fixed before the run; primary and secondary: the exploratory reading). p (Holm, "
                 "grown): over the planned family grown by the contrasts added after the audit and the fixes table's "
                 "tests, which judges the added rows. Learning-rate tie: a design of the row whose chosen rate won by "
                 "less than one standard error, with its seed-0 value at the chosen rate and at the runner-up.\n")
    lines.append(standing(doc) + "\n")
    label = {"planned": "planned", "primary": "primary (exploratory)", "secondary": "secondary (exploratory)",
             "added": "added (exploratory)"}
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    lines.append(markdown(["family", "metric", "design", "against", "difference (design − against)", "p",
                           "p (Holm, family)", "p (Holm, grown)", "learning-rate tie", "verdict"],
                          [[label[r["family"]], _display(r["metric"]), display(r["design"]),
                            display(r.get("reference", "diff")), fmt(r["diff"], ".4g"), fmt(r["p"], ".3g"),
                            "-" if r["family"] == "added" else fmt(r["p_holm"], ".3g"),
                            fmt(r.get("p_holm_grown"), ".3g"),
                            "; ".join(t for t in (tie_values(doc, d, r["metric"]) for d in
                                                  dict.fromkeys((r.get("reference", "diff"), r["design"]))) if t)
                            or "-" if r["p"] is not None else "-",
                            r["verdict"]] for r in doc["tests"]]))
    return "\n".join(lines)


# ---------------------------------------------------------------- driver


def run(e: Experiment, out: Path, runs: Path, budget_hours: float, device: str, plan_only: bool = False,
        replan: bool = False, worker: tuple[int, int] | None = None) -> dict | None:
    """The whole comparison, resuming from OUT's cells. `worker` (k, n): train only the cells whose place in the
    fixed order (the sweep's, then each design's further seeds) is k mod n, reading the others where done, so n
    processes share the runs without meeting; a worker stops where it lacks another's cells, and a run without
    `worker` (or the last one) writes the results once every cell is in."""
    from diffquant.lab import start_run

    from experiments.measure import aggregate

    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / "plan.json"
    if plan_path.is_file() and not replan:
        plan = json.loads(plan_path.read_text())
    else:
        t0 = time.perf_counter()
        costs = measure_costs(e, device)
        plan = make_plan(e, budget_hours - (time.perf_counter() - t0) / 3600, costs)  # the budget counts measuring
        if not plan_only:
            atomic_write_json(plan_path, plan)
    print(describe_plan(plan), flush=True)
    if plan_only:
        return None
    start_run(out, {**asdict(e), "plan": plan}, device)
    tokens = plan["tokens_per_model"]
    seqs, calib = held_out_and_calibration(e, runs / "data")
    order = iter(range(10**9))  # each cell's place in the fixed order, for `worker`

    def cell(d, lr, s, place):
        done = out / "cells" / d / f"lr{lr:g}" / f"s{s}.json"
        if worker is not None and place % worker[1] != worker[0] and not done.is_file():
            return None  # another worker's, not done yet
        return run_cell(e, d, lr, s, tokens, runs, device, seqs, calib, out / "cells")

    sweep = {d: {lr: cell(d, lr, e.seeds[0], next(order)) for lr in e.lrs} for d in e.designs}
    if any(c is None for cells in sweep.values() for c in cells.values()):
        print(f"worker {worker[0]}/{worker[1]}: its sweep cells are done; the sweep waits for the others", flush=True)
        return None
    rates = choose_rates(sweep)
    atomic_write_json(out / "sweep.json", {"seed": e.seeds[0], "tokens_per_model": tokens, "rates": rates})
    per_design = {d: [sweep[d][rates[d]["chosen"]]] + [cell(d, rates[d]["chosen"], s, next(order))
                                                       for s in e.seeds[1:]] for d in e.designs}
    if any(c is None for cells in per_design.values() for c in cells):
        print(f"worker {worker[0]}/{worker[1]}: its cells are done; the others' are not in yet", flush=True)
        return None
    sweep_metrics = {d: {f"{lr:g}": {k: v for k, v in c.items() if k != "curve"} for lr, c in by_lr.items()}
                     for d, by_lr in sweep.items()}
    doc = {"experiment": {**asdict(e), "lrs": list(e.lrs), "seeds": list(e.seeds)}, "plan": plan, "rates": rates,
           "sweep_metrics": sweep_metrics,
           "aggregate": {d: aggregate(cells) for d, cells in per_design.items()},
           "per_seed": {d: [{k: v for k, v in c.items() if k != "curve"} for c in cells] for d, cells in per_design.items()},
           "matched_loss": {**matched_loss(per_design),
                            "track_sequences": train_config(e, e.designs[0], e.lrs[0], e.seeds[0], tokens).track_sequences},
           "tests": []}
    fixes = out / "fixes" / "results.json"
    analyse(doc, json.loads(fixes.read_text()) if fixes.is_file() else None)
    atomic_write_json(out / "results.json", doc)
    atomic_write_text(out / "results.md", render(doc))
    _plot(per_design, tokens, out)
    return doc


def _plot(per_design: dict[str, list[dict]], tokens: int, out: Path) -> None:
    from diffquant.lab import display, plot_emergence

    plot_emergence({"models": {display(d): cells[0]["curve"] for d, cells in per_design.items()},
                    "scale": {display(d): {"parameters": cells[0]["parameters"], "tokens": tokens}
                              for d, cells in per_design.items()}}, out)


def render_only(out: Path) -> dict:
    """`--render`: the committed results' tests recomputed (`analyse`) and the report rewritten, from the files."""
    path = out / "results.json"
    if not path.is_file():
        raise dq.DiffquantError(f"{path} does not exist: nothing to render (run the comparison first)")
    fixes = out / "fixes" / "results.json"
    doc = analyse(json.loads(path.read_text()), json.loads(fixes.read_text()) if fixes.is_file() else None)
    atomic_write_json(path, doc)
    atomic_write_text(out / "results.md", render(doc))
    return doc


def main(argv=None, experiments: dict | None = None) -> dict | None:
    t0 = time.perf_counter()
    from experiments.pairs import device, worker_device

    experiments = experiments or EXPERIMENTS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experiment", default="guo", choices=sorted(experiments))
    p.add_argument("--quick", action="store_true", help="the whole pipeline on micro settings (seconds)")
    p.add_argument("--budget-hours", type=float, default=6.0, help="training budget of the whole comparison")
    p.add_argument("--minutes", type=float, default=None,
                   help="instead of --budget-hours: the whole run, start-up included (small-bb on one GPU: 8)")
    p.add_argument("--plan-only", action="store_true", help="measure tokens/s, print the plan, run nothing")
    p.add_argument("--replan", action="store_true", help="make a new plan even where OUT/plan.json exists")
    p.add_argument("--out", default=None, help="results (default docs/rivals/fair-<experiment>)")
    p.add_argument("--runs", default=None, help="checkpoints (default runs/fair/<experiment>; --quick: OUT/runs)")
    p.add_argument("--worker", default=None, metavar="K/N",
                   help="train only every N-th cell, starting at K (0 ≤ K < N): N processes share the runs")
    p.add_argument("--render", action="store_true",
                   help="only recompute the tests from OUT/results.json's per-seed values (and OUT/fixes's tests) and "
                        "rewrite results.json and results.md: no training, no measurement")
    a = p.parse_args(argv)
    if a.render:
        return render_only(Path(a.out or f"docs/rivals/fair-{experiments[a.experiment].name}"))
    worker = parse_worker(a.worker)
    e = experiments["quick" if a.quick else a.experiment]
    out = Path(a.out or f"docs/rivals/fair-{e.name}")
    runs = Path(a.runs) if a.runs else (out / "runs" if a.quick else Path("runs/fair") / e.name)
    budget = a.budget_hours if not a.quick or "--budget-hours" in (argv or sys.argv) else 1.0
    where = device() if worker is None else worker_device(worker[0], torch.cuda.device_count())
    if a.minutes is None:
        return run(e, out, runs, budget, where, a.plan_only, a.replan, worker)
    if where == "cpu" and e.train.get("preset") == "small":
        print("no GPU: the small-preset comparison would take days here; use --quick, or the guo experiment on CPU")
    doc = run(e, out, runs, max(0.0, a.minutes * 60 - (time.perf_counter() - t0) - RESERVE_S) / 3600, where,
              a.plan_only, a.replan, worker)
    if doc is not None:
        print((out / "results.md").read_text())
        print(f"total {time.perf_counter() - t0:.0f} s of the {a.minutes:g} min allowed; {doc['plan']['runs']} runs; "
              f"everything under {out}")
    return doc


if __name__ == "__main__":
    try:
        main()
    except dq.DiffquantError as err:  # one line, not a traceback
        raise SystemExit(f"fair_rivals: {err}") from None
