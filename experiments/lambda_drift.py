"""Why did DIFF's λ fall below λ_init? Short exploratory runs before the second decomposition's plan (issue 49).

In the head-norm cells (docs/headnorm, emergence's bb-mini-lr3e-3-wd0 setting, 8M tokens) DIFF's learned λ ended
between −0.54 and 0.29 in every layer and seed, below λ_init (0.2, 0.36, 0.47 in layers 0-2), so DIFF computed
about A1 + |λ|·A2 and behaved as a Transformer with a head norm; DIFF without its norm kept λ at 0.68-0.96. Three
candidate causes, each varied alone from that setting, one seed each, λ of every layer recorded every 10 steps:

- the learning rate: AdamW moves each of the four λ vectors' elements by about the rate per step whatever the
  gradient's size, and λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init turns d such moves into one dot product, so at
  3e-3 λ can cross O(1) in ~100 steps (the paper trains its 3B models at 3.2e-4): DIFF at 3e-3, 1e-3 and 3e-4;
- the norm: the head RMSNorm makes a head's output scale-free, so λ no longer sets the output's size and is free to
  drift: DIFF (transformers' DiffLlama, a norm without gain), DIFF with the paper's norm (a learnable gain,
  `diff-gain`) and DIFF without the norm (`diff-nonorm`), at 3e-3;
- λ's parametrisation is the paper's in every run here (the reference code's formula); its effect shows through the
  rate runs, not a run of its own.

Each run is 2,000,000 tokens (a quarter of the setting's budget, with the setting's schedule compressed to it).
Exploratory, labelled so: no test, nothing here enters the decomposition's family; its plan
(docs/decomposition/plan.yaml) cites this file's results. Resumable run by run:

    python -m experiments.lambda_drift [--out docs/lambda] [--runs runs/lambda]
    python -m experiments.lambda_drift --quick --out /tmp/lambda      # the pipeline on a micro setting (seconds)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from diffquant.lab import atomic_write_json, atomic_write_text

# emergence's bb-mini-lr3e-3-wd0 setting, 2M tokens (see the docstring), no tracking: λ comes from the curve
SETTING = dict(preset="mini", corpus="synth:bb", seq_len=128, batch_size=32, weight_decay=0.0, tokens=2_000_000,
               eval_every=10**9, save_every=200)
CONDITIONS = {  # name: (design, learning rate)
    "diff@3e-3": ("diff", 3e-3),
    "diff@1e-3": ("diff", 1e-3),
    "diff@3e-4": ("diff", 3e-4),
    "diff-gain@3e-3": ("diff-gain", 3e-3),
    "diff-nonorm@3e-3": ("diff-nonorm", 3e-3),
}
SEEDS = (0,)  # one seed per condition: the machine is shared; the trajectories, not a test, are the point
# λ starts near, not at, λ_init: the λ vectors are drawn from N(0, 0.1), so each exp(λq·λk) is 1 ± ~0.06 (d = 32) and
# λ_init ± ~0.08; "below λ_init" means more than this under it (about two of those spreads)
BELOW = 0.15
QUICK = dict(preset="micro", corpus="synth:bb:vocab=32", seq_len=32, batch_size=8, weight_decay=0.0, tokens=8 * 32 * 30,
             eval_every=10**9, save_every=10**9)


def lambda_init(layer: int) -> float:
    """λ_init of a 0-based layer, as the paper (l − 1 for 1-based l) and transformers write it."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer)


def run_one(name: str, seed: int, setting: dict, runs: Path, out: Path) -> dict:
    """Train one condition and seed (resuming), and keep its λ trajectory: OUT/runs/<name>/s<seed>.json."""
    from diffquant.lab import TrainConfig, train_pair

    done = out / "runs" / name / f"s{seed}.json"
    if done.is_file():
        return json.loads(done.read_text())
    design, lr = CONDITIONS[name]
    folder = runs / name / f"s{seed}"
    cfg = TrainConfig(**setting, lr=lr, seed=seed, archs=(design,))
    result = train_pair(cfg, folder, device="cpu", resume=(folder / "train_config.json").exists(), progress=False,
                        figures=False)
    m = result["models"][design]
    curve = [{"step": p["step"], "loss": p["loss"], "lambda": p["lambda"]} for p in m["curve"] if "lambda" in p]
    row = {"condition": name, "design": design, "lr": lr, "seed": seed, "tokens": cfg.tokens,
           "steps": m["steps"], "final_loss": m["final_val"]["loss"] if m.get("final_val") else None,
           "final_lambda": curve[-1]["lambda"], "curve": curve}
    atomic_write_json(done, row)
    return row


def summarise(rows: list[dict]) -> dict:
    """Per condition: each layer's λ after the first logged step and at the end, over seeds, and λ_init; the steps at
    which λ first fell more than BELOW under λ_init and below 0 in any layer; the final loss."""
    out = {}
    for name in CONDITIONS:
        mine = [r for r in rows if r["condition"] == name]
        if not mine:
            continue
        layers = len(mine[0]["final_lambda"])
        below, negative = [], []
        for r in mine:
            below.append(next((p["step"] for p in r["curve"]
                               if any(v < lambda_init(i) - BELOW for i, v in enumerate(p["lambda"]))), None))
            negative.append(next((p["step"] for p in r["curve"] if min(p["lambda"]) < 0), None))
        out[name] = {"design": mine[0]["design"], "lr": mine[0]["lr"], "seeds": [r["seed"] for r in mine],
                     "lambda_init": [lambda_init(i) for i in range(layers)],
                     "first_lambda": [r["curve"][0]["lambda"] for r in mine],
                     "final_lambda": [r["final_lambda"] for r in mine],
                     "first_step_below_init": below, "first_step_negative": negative,
                     "final_loss": [r["final_loss"] for r in mine], "steps": mine[0]["steps"],
                     "tokens": mine[0]["tokens"]}
    return out


def render(summary: dict) -> str:
    lines = ["# Why did DIFF's λ fall below λ_init? (exploratory)", "",
             "Short runs in emergence's bb-mini-lr3e-3-wd0 setting (mini preset, Bigram-Backcopy, 128-token windows, "
             "AdamW without weight decay, cosine schedule), one cause varied at a time, written by "
             "`python -m experiments.lambda_drift`; no test (exploratory). λ per layer after the last step, each seed; "
             f"\"below λ_init\": the first logged step where any layer's λ was more than {BELOW} under its λ_init "
             "(λ starts near it: the λ vectors are drawn from N(0, 0.1), which moved λ at step 0 by up to 0.16 in "
             "the second decomposition's cells).", "",
             "| condition | tokens | λ_init (layers) | λ after step 0, seed by seed | final λ, seed by seed "
             "| first step below λ_init | first step λ < 0 | held-out loss |", "|---|---|---|---|---|---|---|---|"]
    fmt = lambda xs: "[" + ", ".join(f"{x:.2f}" for x in xs) + "]"  # noqa: E731
    for name, v in summary.items():
        lams = "; ".join(fmt(x) for x in v["final_lambda"])
        first = "; ".join(fmt(x) for x in v["first_lambda"])
        steps = lambda xs: ", ".join("never" if s is None else str(s) for s in xs)  # noqa: E731
        loss = ", ".join(f"{x:.4f}" for x in v["final_loss"] if x is not None)
        lines.append(f"| {name} | {v['tokens']:,} ({v['steps']} steps) | {fmt(v['lambda_init'])} | {first} | {lams} | "
                     f"{steps(v['first_step_below_init'])} | {steps(v['first_step_negative'])} | {loss} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = len(rows[0]["final_lambda"])
    fig, axes = plt.subplots(1, layers, figsize=(4.2 * layers, 3.6), sharey=True, constrained_layout=True)
    colors = dict(zip(CONDITIONS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for layer, ax in enumerate(axes):
        for r in rows:
            ax.plot([p["step"] for p in r["curve"]], [p["lambda"][layer] for p in r["curve"]],
                    color=colors[r["condition"]], alpha=0.9 if r["seed"] == 0 else 0.5,
                    label=r["condition"] if r["seed"] == 0 else None)
        ax.axhline(lambda_init(layer), color="black", linestyle="--", linewidth=0.8)
        ax.set_title(f"layer {layer} (dashed: λ_init)")
        ax.set_xlabel("step")
    axes[0].set_ylabel("λ")
    axes[0].legend(fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="docs/lambda")
    p.add_argument("--runs", default="runs/lambda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", nargs="*", choices=list(CONDITIONS), help="conditions to run (default: all)")
    a = p.parse_args(argv)
    out, runs = Path(a.out), Path(a.runs)
    setting = QUICK if a.quick else SETTING
    rows = [run_one(name, seed, setting, runs, out) for name in (a.only or CONDITIONS) for seed in SEEDS]
    summary = summarise(rows)
    atomic_write_json(out / "results.json", {"setting": setting, "conditions": summary})
    atomic_write_text(out / "results.md", render(summary))
    plot(rows, out / "lambda_vs_step.png")
    print(render(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
