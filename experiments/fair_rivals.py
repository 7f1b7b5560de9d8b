"""Every attention design compared fairly in Guo et al.'s Bigram-Backcopy setting: each design at its own
learning rate, several seeds, results at matched tokens and at matched held-out loss, Holm-corrected tests.

1. Learning-rate sweep: every design at each rate of `lrs`, seed `seeds[0]`; each design's rate is the one
   with the lowest held-out loss of its own (sweep.json holds every loss and every choice).
2. Seeds: every design at its chosen rate for each seed of `seeds` (the sweep's run is seed 0's).
3. Matched tokens: held-out loss, outlier statistics (Table 5 analog, sink rate, max‖h‖/median) and the
   perplexity cost of the headline schemes (W8A8 and W4A4 with static per-tensor activations, int4 attention
   logits per tensor), of the secondary ones (per-token dynamic W8A8 and W4A4) and of the KV-cache presets
   (kv4, kv4-sink1, k4v2, kivi2: keys after RoPE and values quantized in one forward, prefill semantics;
   kivi2 keeps the 128 most recent positions of each query in full precision), mean ± 95% t over seeds.
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
With `--worker K/N`, worker K runs on GPU K mod the visible GPUs.

    python experiments/fair_rivals.py --plan-only                 # what it would run, and how long
    nice -n 19 python experiments/fair_rivals.py --budget-hours 6 # the comparison (resumable)
    python experiments/fair_rivals.py --quick --out /tmp/fr       # the whole pipeline in seconds
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from diffquant.errors import DiffquantError  # noqa: E402
from diffquant.paths import atomic_write_json, atomic_write_text  # noqa: E402

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
                "model); gpu_fair.py uses 64 × 512 tokens at the small preset",
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
}


def train_config(e: Experiment, design: str, lr: float, seed: int, tokens: int):
    from diffquant.training import TrainConfig

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

    from diffquant.data.synthetic import is_synthetic, parse
    from diffquant.models.fused import fuse
    from diffquant.models.presets import build, get_preset
    from diffquant.track import snapshot
    from measure import measure
    from pairs import seconds, train_rate

    seq_len = e.train.get("seq_len") or get_preset(e.train["preset"]).seq_len
    vocab = parse(e.train["corpus"]).vocab + 1 if is_synthetic(e.train["corpus"]) else None
    rates = {d: train_rate(e.train["preset"], d, e.train["batch_size"], seq_len, vocab, device, steps)
             for d in e.designs}
    slowest = min(rates, key=rates.get)
    model = build(get_preset(e.train["preset"]), slowest, vocab=vocab, seq_len=seq_len).to(device).eval()
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
        raise DiffquantError(f"{budget_hours * 60:.1f} min do not fit {runs} runs: their tracking, measurement and "
                             f"checkpoints alone take {fixed / 60:.1f} min; allow more time, or fewer designs or seeds")
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
    from diffquant.training import prepare_data

    seq_len = e.train["seq_len"]
    cfg = train_config(e, e.designs[0], e.lrs[0], 0, e.calibration_sequences * seq_len)
    data = prepare_data(cfg, folder)
    return data.val[:e.eval_sequences], data.train[:e.calibration_sequences]


def run_cell(e: Experiment, design: str, lr: float, seed: int, tokens: int, runs: Path, device: str,
             seqs: torch.Tensor, calib: torch.Tensor, cells: Path) -> dict:
    """Train (resuming) and measure one cell, or read its measurements (under `cells`) when it is finished."""
    from transformers import AutoModelForCausalLM

    from diffquant.training import train_pair
    from measure import measure

    folder = cell_folder(runs, design, lr, seed)
    done = cells / design / f"lr{lr:g}" / f"s{seed}.json"
    if done.is_file():
        cell = json.loads(done.read_text())
        if cell["train_tokens"] != tokens:
            raise DiffquantError(f"{done} was trained for {cell['train_tokens']:,} tokens, this plan wants {tokens:,}: "
                                 "use another --runs folder or the plan.json that made it")
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
    model = AutoModelForCausalLM.from_pretrained(folder / design).to(device).eval()
    from diffquant.models.fused import fuse

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
    from diffquant.stats.intervals import t_interval

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


# The families the tests are corrected in. "planned": every metric of the report in one family, as the
# comparison was planned before any result was in; it leads. Then an exploratory reading, adopted after the first
# aggregation: "primary", the metrics outliers actually hurt (the headline: static per-tensor
# activations and int4 logits), and "secondary", the rest, scale-free only: absolute magnitudes (hidden-state
# and attention-logit top-1) measure the residual's scale, which RMSNorm makes irrelevant and which differs
# between designs, so that reading leaves them out and adds the attention-logit ratio.
PRIMARY = tuple(f"{s.replace('-', '_')}_cost" for s in HEADLINE)
NOT_TESTED = ("hidden_top1", "logit_top1")
MIN_REACHED = 0.8  # matched loss: a design is summarised only where at least this share of its seeds got there


def families(metrics: list[str]) -> dict[str, list[str]]:
    """{"planned": every metric, "primary": [...], "secondary": [...]} from the report's metrics."""
    return {"planned": list(metrics), "primary": [m for m in metrics if m in PRIMARY],
            "secondary": [m for m in [*metrics, "logit_ratio"] if m not in PRIMARY and m not in NOT_TESTED]}


def tests_against(per_design: dict[str, list[dict]], fams: dict[str, list[str]], reference: str = "diff") -> list[dict]:
    """Welch's test of each design against `reference` per metric, Holm-adjusted within each family. A metric
    that takes one value in every run of both designs (e.g. a sink rate of 0 everywhere) is not a test: it is
    reported as constant and left out of the family, so it does not dilute the correction."""
    from diffquant.stats.intervals import holm_adjust, welch

    rows = []
    for family, metrics in fams.items():
        block = []
        for metric in dict.fromkeys(metrics):
            ref = [c.get(metric) for c in per_design.get(reference, [])]
            for design, cells in per_design.items():
                if design == reference:
                    continue
                values = [c.get(metric) for c in cells]
                row = {"family": family, "metric": metric, "design": design, "reference": reference,
                       "n": len([v for v in values if v is not None]), "n_ref": len([v for v in ref if v is not None])}
                if len({v for v in values + ref if v is not None}) == 1:
                    rows.append({**row, "diff": 0.0, "p": None, "p_holm": None, "verdict": "constant (no test)"})
                    continue
                w = welch(values, ref)
                block.append({**row, "diff": w["diff"] if w else None, "p": w["p"] if w else None})
        for row, adj in zip(block, holm_adjust([r["p"] for r in block])):
            n = min(row["n"], row["n_ref"])
            row["p_holm"] = adj
            row["verdict"] = ("n/a" if adj is None else f"no difference detected (n = {n})" if adj >= 0.05
                              else "design higher than DIFF" if row["diff"] > 0 else "design lower than DIFF")
        rows += block
    return rows


def _display(metric: str) -> str:
    from measure import METRICS

    return METRICS[metric][0] if metric in METRICS else metric


def _tie(v: dict) -> bool:
    """The chosen rate beat the runner-up by less than the seed-0 loss's standard error."""
    losses = sorted(v["losses"].values())
    return bool(len(losses) > 1 and v.get("loss_se") and losses[1] - losses[0] < v["loss_se"])


def lr_ties(doc: dict) -> list[str]:
    """Designs whose chosen rate beat the runner-up by less than the seed-0 loss's standard error (a tie the
    sweep cannot resolve), with the margin."""
    from diffquant.report.style import display

    out = []
    for design, v in doc["rates"].items():
        if _tie(v):
            losses = sorted(v["losses"].values())
            out.append(f"{display(design)} (by {losses[1] - losses[0]:.4f} nats, standard error {v['loss_se']:.4f})")
    return out


def _findings(tested: list[dict], family: str, n: int, say_quiet: bool) -> tuple[list[str], list[str]]:
    """Per metric of `family`: the designs DIFF is below and above at Holm-adjusted p < 0.05 ("no difference
    detected" for the rest, never "equal"); metrics without any difference go to the second list when
    `say_quiet`, so a paragraph names them instead of spelling each out."""
    from diffquant.report.style import display

    parts, quiet = [], []
    for metric in dict.fromkeys(r["metric"] for r in tested if r["family"] == family):
        rows = [r for r in tested if r["metric"] == metric and r["family"] == family]
        # r["diff"] is design − DIFF: DIFF is lower where the design is higher
        below = [display(r["design"]) for r in rows if r["p_holm"] < 0.05 and r["diff"] > 0]
        above = [display(r["design"]) for r in rows if r["p_holm"] < 0.05 and r["diff"] < 0]
        if say_quiet and not (below or above):
            quiet.append(_display(metric))
            continue
        rest = len(rows) - len(below) - len(above)
        said = ([f"lower than {', '.join(below)}"] if below else []) + \
               ([f"higher than {', '.join(above)}"] if above else [])
        if rest:
            said.append(f"no difference detected against {'the other' if said else 'any of the'} {rest} (n = {n})")
        parts.append(f"{_display(metric)}: DIFF " + "; ".join(said))
    return parts, quiet


def _tie_effects(doc: dict, tested: list[dict]) -> list[str]:
    """For each primary finding that involves a design whose rate was a tie: that design's seed-0 value of the
    metric at its chosen rate and at the runner-up, so the reader sees how much the finding rests on the choice."""
    from diffquant.report.style import display

    tied = {d for d, v in doc["rates"].items() if _tie(v)}
    out = []
    for r in tested:
        if r["family"] != "primary" or r["p_holm"] >= 0.05:
            continue
        for design in dict.fromkeys(("diff", r["design"])):
            if design in tied and doc.get("sweep_metrics"):
                v, by_lr = doc["rates"][design], doc["sweep_metrics"][design]
                chosen, runner = f"{v['chosen']:g}", sorted(v["losses"], key=v["losses"].get)[1]
                value = {lr: by_lr[lr].get(r["metric"]) for lr in (chosen, runner)}
                out.append(f"{display(design)}'s {_display(r['metric'])} (seed 0) is {value[chosen]:.3g} at its "
                           f"chosen rate and {value[runner]:.3g} at the runner-up {runner}")
    return list(dict.fromkeys(out))


def standing(doc: dict) -> str:
    """Where DIFF stands, read off Holm-adjusted tests only. First the correction planned before any result (one
    family of every metric); then the exploratory reading (primary / secondary families, adopted after the first
    aggregation), every secondary metric with a difference said so none can hide; then what limits both: rate
    ties next to the findings they touch, and the scale (no outlier regime)."""
    per_seed = doc["per_seed"]
    n = min(len(v) for v in per_seed.values())
    tested = [r for r in doc["tests"] if r["p_holm"] is not None]
    size = {f: sum(r["family"] == f for r in tested) for f in ("planned", "primary", "secondary")}
    planned, _ = _findings(tested, "planned", n, say_quiet=True)
    primary, _ = _findings(tested, "primary", n, say_quiet=False)
    secondary, quiet = _findings(tested, "secondary", n, say_quiet=True)
    text = (f"Where DIFF stands ({doc['plan']['tokens_per_model']:,} training tokens per model, {n} seeds per design; "
            f"Welch's t over seeds, Holm-adjusted, adjusted p < 0.05). As planned (every metric planned before the "
            f"run, in one family, {size['planned']} tests): " + (". ".join(planned) + "; " if planned else "")
            + "no difference detected (n = {}) on every other metric, the static W8A8 / W4A4 and int4-logit costs "
              "among them{}. ".format(n, "" if not any(p.split(":")[0] in {_display(m) for m in PRIMARY}
                                                     for p in planned) else " where not said")
            + f"Exploratory reading, adopted after the first aggregation (the issue's headline costs as a primary "
              f"family of {size['primary']} tests; the other metrics, scale-free only, as a secondary family of "
              f"{size['secondary']}): " + ". ".join(primary + secondary))
    if quiet:
        text += f". No difference detected (n = {n}) on the other secondary metrics: {'; '.join(quiet)}"
    tied = lr_ties(doc)
    if tied:
        text += (". The learning-rate sweep could not separate the best two rates of " + ", ".join(tied)
                 + " (every rate's seed-0 metrics are tabled)")
    ties = _tie_effects(doc, tested)
    if ties:
        text += ". The exploratory primary findings rest on such ties: " + "; ".join(ties)
    cells = [c for v in per_seed.values() for c in v]
    swept = [c for by_lr in (doc.get("sweep_metrics") or {}).values() for c in by_lr.values()]
    constant = sorted({_display(r["metric"]) for r in doc["tests"] if r["verdict"].startswith("constant")})
    text += (f". At this scale no design is in an outlier regime: at the chosen rates the sink rate is at most "
             f"{max(c.get('sink_rate') or 0 for c in cells):.2f} and max‖h‖/median‖h‖ at most "
             f"{max(c.get('massive_ratio') or 0 for c in cells):.2f} over all {len(cells)} runs"
             + (f" ({max(c.get('massive_ratio') or 0 for c in swept):.2f} in the sweep's runs at other rates)"
                if swept else "") + ", so this compares designs early in training, before the outliers the paper "
             "measures exist")
    if constant:
        text += f"; not tested (one value in every run): {'; '.join(constant)}"
    return text + "."


def render(doc: dict) -> str:
    from diffquant.report.style import display
    from diffquant.report.tables import markdown
    from diffquant.stats.intervals import fmt_pm

    from measure import METRICS

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
                 "scale); the attention-logit top-1 / median only in the exploratory one.\n")
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
    lines.append("\n## Against DIFF: Welch's t over seeds, Holm-adjusted within each family (planned: every metric "
                 "planned before the run; exploratory: primary and secondary)\n")
    lines.append(standing(doc) + "\n")
    lines.append(markdown(["family", "metric", "design", "difference (design − DIFF)", "p", "p (Holm)", "verdict"],
                          [[r["family"], _display(r["metric"]), display(r["design"]),
                            "-" if r["diff"] is None else f"{r['diff']:.4g}",
                            "-" if r["p"] is None else f"{r['p']:.3g}", "-" if r["p_holm"] is None else f"{r['p_holm']:.3g}",
                            r["verdict"]] for r in doc["tests"]]))
    return "\n".join(lines)


# ---------------------------------------------------------------- driver


def run(e: Experiment, out: Path, runs: Path, budget_hours: float, device: str, plan_only: bool = False,
        replan: bool = False, worker: tuple[int, int] | None = None) -> dict | None:
    """The whole comparison, resuming from OUT's cells. `worker` (k, n): train only the cells whose place in the
    fixed order (the sweep's, then each design's further seeds) is k mod n, reading the others where done, so n
    processes share the runs without meeting; a worker stops where it lacks another's cells, and a run without
    `worker` (or the last one) writes the results once every cell is in."""
    from diffquant.runs import start_run

    from measure import aggregate

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
    metrics = ["loss", *[f"{s.replace('-', '_')}_cost" for s in e.schemes], *OUTLIER_METRICS]
    sweep_metrics = {d: {f"{lr:g}": {k: v for k, v in c.items() if k != "curve"} for lr, c in by_lr.items()}
                     for d, by_lr in sweep.items()}
    doc = {"experiment": {**asdict(e), "lrs": list(e.lrs), "seeds": list(e.seeds)}, "plan": plan, "rates": rates,
           "sweep_metrics": sweep_metrics,
           "aggregate": {d: aggregate(cells) for d, cells in per_design.items()},
           "per_seed": {d: [{k: v for k, v in c.items() if k != "curve"} for c in cells] for d, cells in per_design.items()},
           "matched_loss": {**matched_loss(per_design),
                            "track_sequences": train_config(e, e.designs[0], e.lrs[0], e.seeds[0], tokens).track_sequences},
           "tests": tests_against(per_design, families(metrics))}
    atomic_write_json(out / "results.json", doc)
    atomic_write_text(out / "results.md", render(doc))
    _plot(per_design, tokens, out)
    return doc


def _plot(per_design: dict[str, list[dict]], tokens: int, out: Path) -> None:
    from diffquant.report.emergence_plots import plot_emergence
    from diffquant.report.style import display

    plot_emergence({"models": {display(d): cells[0]["curve"] for d, cells in per_design.items()},
                    "scale": {display(d): {"parameters": cells[0]["parameters"], "tokens": tokens}
                              for d, cells in per_design.items()}}, out)


def main(argv=None, experiments: dict | None = None) -> dict | None:
    from pairs import device, worker_device

    experiments = experiments or EXPERIMENTS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experiment", default="guo", choices=sorted(experiments))
    p.add_argument("--quick", action="store_true", help="the whole pipeline on micro settings (seconds)")
    p.add_argument("--budget-hours", type=float, default=6.0, help="training budget of the whole comparison")
    p.add_argument("--plan-only", action="store_true", help="measure tokens/s, print the plan, run nothing")
    p.add_argument("--replan", action="store_true", help="make a new plan even where OUT/plan.json exists")
    p.add_argument("--out", default=None, help="results (default docs/rivals/fair-<experiment>)")
    p.add_argument("--runs", default=None, help="checkpoints (default runs/fair/<experiment>; --quick: OUT/runs)")
    p.add_argument("--worker", default=None, metavar="K/N",
                   help="train only every N-th cell, starting at K (0 ≤ K < N): N processes share the runs")
    a = p.parse_args(argv)
    worker = None
    if a.worker:
        k, _, n = a.worker.partition("/")
        if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
            raise DiffquantError(f"--worker takes K/N with 0 ≤ K < N, got {a.worker!r}")
        worker = (int(k), int(n))
    e = experiments["quick" if a.quick else a.experiment]
    out = Path(a.out or f"docs/rivals/fair-{e.name}")
    runs = Path(a.runs) if a.runs else (out / "runs" if a.quick else Path("runs/fair") / e.name)
    budget = a.budget_hours if not a.quick or "--budget-hours" in (argv or sys.argv) else 1.0
    where = device() if worker is None else worker_device(worker[0], torch.cuda.device_count())
    return run(e, out, runs, budget, where, a.plan_only, a.replan, worker)


if __name__ == "__main__":
    main()
