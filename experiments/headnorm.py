"""Is it the differential map or the head norm? A pre-registered decomposition (issue 42).

Four arms in emergence's bb-mini-lr3e-3-wd0 setting, the one where outliers grow here: the Transformer, the
Transformer + DIFF's head norm, DIFF, and DIFF without its head norm; five seeds each at the setting's rate
(3e-3), and seed 0 of every arm at 1e-3 (rate sensitivity, descriptive). The plan, docs/headnorm/plan.yaml,
was committed before the first cell: it fixes the primary metrics (at the sites W8A8 quantizes), the one test
family (Welch over seeds, Holm), the TOST margins and the decision rule; this script reads it, and every
cell records its sha256 so no cell measured under another plan enters the analysis.

    python -m experiments.headnorm --plan-only               # the cells and the family's size and power
    nice -n 19 python -m experiments.headnorm --worker 0/2   # and 1/2: two processes share the cells
    python -m experiments.headnorm                           # every cell (resuming), then the report
    python -m experiments.headnorm --report-only             # the report from the committed cells, no training
    python -m experiments.headnorm --quick --out /tmp/hn     # the whole pipeline on a micro setting (seconds)

Every cell (arm, rate, seed) trains with resume (checkpoints under --runs) and writes its measurements
atomically to OUT/cells/<arm>/lr<rate>/s<seed>.json, committed as they come: a stop loses no finished cell.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

import diffquant as dq
from diffquant.lab import atomic_write_json, atomic_write_text, parse_worker
from experiments.planned import fmt_g, fmt_p, read_plan, tests, transform, units

PLAN = Path("docs/headnorm/plan.yaml")
# The quick run: the same pipeline on the micro preset, a few steps, two seeds (nothing here is a result).
QUICK = {"train": {"preset": "micro", "corpus": "synth:bb:vocab=32", "seq_len": 32, "batch_size": 8,
                   "weight_decay": 0.0, "tokens": 8 * 32 * 6, "eval_every": 10**9, "save_every": 10**9,
                   "track": True, "track_points": 3},
         "seeds": [0, 1], "held_out_sequences": 8, "calibration_sequences": 8}


# ---------------------------------------------------------------- the plan


def load_plan(path: Path = PLAN, quick: bool = False) -> dict:
    """The committed plan, with its sha256 and its primary metrics expanded per kind of site."""
    plan = read_plan(path)
    if quick:
        plan = {**plan, **{k: v for k, v in QUICK.items() if k != "train"},
                "setting": {**plan["setting"], "train": QUICK["train"], "name": "quick",
                            "scale": "quick pipeline check (micro preset, 48 steps; not a result)"}}
    return plan


def cells(plan: dict) -> list[tuple[str, float, int]]:
    """Every (arm, rate, seed) in the fixed order workers split: seed by seed over the arms, then the
    sensitivity cells."""
    main = [(arm, plan["lr"], seed) for seed in plan["seeds"] for arm in plan["arms"]]
    sens = [(arm, plan["sensitivity"]["lr"], seed) for seed in plan["sensitivity"]["seeds"] for arm in plan["arms"]]
    return main + sens


def family_size(plan: dict) -> int:
    return len(plan["metrics"]) * len(plan["contrasts"])


def describe(plan: dict) -> str:
    from diffquant.lab import minimum_detectable_effect

    n, m = len(plan["seeds"]), family_size(plan)
    return (f"{len(cells(plan))} cells: {len(plan['arms'])} arms × {n} seeds at lr {plan['lr']:g} + "
            f"{len(plan['arms']) * len(plan['sensitivity']['seeds'])} at lr {plan['sensitivity']['lr']:g}; "
            f"{plan['setting']['train']['tokens']:,} training tokens per model; family: {len(plan['metrics'])} "
            f"primary metrics × {len(plan['contrasts'])} contrasts = {m} tests; minimum detectable effect at "
            f"n = {n}: {minimum_detectable_effect(n, m, plan['alpha'], plan['power']):.2f} SD")


# ---------------------------------------------------------------- one cell


def train_config(plan: dict, arm: str, lr: float, seed: int):
    from diffquant.lab import TrainConfig

    seq_len = plan["setting"]["train"]["seq_len"]
    return TrainConfig(**{**plan["setting"]["train"], "lr": lr, "seed": seed, "archs": (arm,),
                          "eval_tokens": plan["held_out_sequences"] * seq_len})


def data(plan: dict, folder: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Held-out sequences (validation split), their copy positions, and the calibration draw (a training-split
    draw of its own: the generator is vectorised, so these are not the first windows a run sees)."""
    from diffquant.lab import copy_targets, prepare_data, synthetic_spec

    seq_len = plan["setting"]["train"]["seq_len"]
    cfg = train_config(plan, plan["arms"][0], plan["lr"], 0)
    cfg = replace(cfg, tokens=plan["calibration_sequences"] * seq_len)
    d = prepare_data(cfg, folder)
    seqs = d.val[:plan["held_out_sequences"]]
    return seqs, copy_targets(seqs, synthetic_spec(cfg.corpus)), d.train[:plan["calibration_sequences"]]


def kind_schemes(plan: dict) -> list:
    """Static per-tensor int8 / int4 activations at one kind of Linear input alone, weights in float."""
    from diffquant.lab import PerTensor, int_config

    return [dq.QuantScheme(f"a{bits}-static:{kind}", ((f"*.{kind}", int_config(bits, PerTensor(), dynamic=False)),),
                           description=f"int{bits} static per-tensor activations at {kind} only, weights in float")
            for bits in (8, 4) for kind in plan["kinds"]]


def measure_cell(plan: dict, model, seqs, copies, calib) -> dict:
    """Every metric of the plan (and the exploratory ones) for one trained model."""
    from experiments.measure import measure

    m = measure(model, seqs, ("w8a8-static", "w4a4-static", "logits-int4", *kind_schemes(plan)), calib,
                metric_sets=("bondarenko2023-linear",), positions=copies)
    kinds = m.pop("metric_sets")["bondarenko2023-linear"]["kinds"]
    for kind, v in kinds.items():
        m[f"{kind}_inf_norm"], m[f"{kind}_kurtosis"] = v["max_inf_norm"], v["avg_kurtosis"]
        m[f"{kind}_ratio"] = v["max_top1_over_median"]
    m["linear_inputs"] = kinds
    m["copy_loss"], m["copy_tokens"] = m.pop("positions_loss"), m.pop("positions_tokens")
    other = m["tokens"] - m["copy_tokens"]
    m["noncopy_loss"] = (m["loss"] * m["tokens"] - m["copy_loss"] * m["copy_tokens"]) / other if other else None
    return m


def run_cell(plan: dict, arm: str, lr: float, seed: int, runs: Path, out: Path, device: str, seqs, copies,
             calib) -> dict:
    """Train (resuming) and measure one cell, or read it when it is done under this plan."""
    from diffquant.lab import from_pretrained, fuse, train_pair

    done = cell_path(out, arm, lr, seed)
    if done.is_file():
        cell = json.loads(done.read_text())
        if cell["plan_sha256"] != plan["sha256"]:
            raise dq.DiffquantError(f"{done} was measured under another plan ({cell['plan_sha256'][:12]}); the plan "
                                    "is fixed before the runs: restore it, or label any new analysis exploratory")
        return cell
    folder = runs / arm / f"lr{lr:g}" / f"s{seed}"
    t0 = time.perf_counter()
    train_pair(train_config(plan, arm, lr, seed), folder, device=device,
               resume=(folder / "train_config.json").exists(), progress=False, figures=False)
    train_s = time.perf_counter() - t0
    info = json.loads((folder / "metrics.json").read_text())["models"][arm]
    model = from_pretrained(folder / arm).to(device).eval()
    fuse(model)
    m = measure_cell(plan, model, seqs.to(device), copies, calib.to(device))
    cell = {**{k: v for k, v in m.items() if k != "sinks"}, "arm": arm, "lr": lr, "seed": seed,
            "plan_sha256": plan["sha256"], "train_tokens": info["emergence"][-1]["tokens"],
            "parameters": info["parameters"], "rms_norm_eps": model.config.rms_norm_eps, "train_seconds": train_s,
            "tokens_per_s": info.get("tokens_per_s"), "curve": info.get("emergence", [])}
    atomic_write_json(done, cell)
    return cell


def cell_path(out: Path, arm: str, lr: float, seed: int) -> Path:
    return out / "cells" / arm / f"lr{lr:g}" / f"s{seed}.json"


# ---------------------------------------------------------------- analysis


def decompose(plan: dict, rows: list[dict]) -> dict[str, str]:
    """The plan's decision rule, per primary metric: which of the head norm and the differential map carries
    DIFF's difference from the Transformer."""
    alpha = plan["alpha"]
    by = {(r["contrast"], r["metric"]): r for r in rows}
    names = [c["name"] for c in plan["contrasts"]]
    total, norm, dmap = names[0], names[1], names[2]

    def sign(contrast: str, metric: str) -> int:
        r = by[(contrast, metric)]
        return 0 if r.get("constant") or r["p_holm"] >= alpha else (1 if r["diff"] > 0 else -1)

    out = {}
    for m in plan["metrics"]:
        s = sign(total, m["key"])
        if not s:
            out[m["key"]] = "no DIFF − Transformer difference detected"
            continue
        n, d = sign(norm, m["key"]) == s, sign(dmap, m["key"]) == s
        out[m["key"]] = ("both (each alone moves the Transformer the way DIFF does)" if n and d else
                         "the head norm" if n else "the differential map" if d else
                         "neither alone (no component difference detected)")
    return out


def sensitivity(plan: dict, main: dict[str, list[dict]], sens: dict[str, dict]) -> list[dict]:
    """Seed 0 at the sensitivity rate: for every contrast and primary metric, the seed-0 difference at that rate
    and whether its sign is the main rate's mean difference's."""
    rows = []
    for c in plan["contrasts"]:
        for m in plan["metrics"]:
            if c["a"] not in sens or c["b"] not in sens:
                continue
            t = m["transform"]
            at = transform([sens[c["a"]].get(m["key"])], t)[0], transform([sens[c["b"]].get(m["key"])], t)[0]
            ma = transform([x.get(m["key"]) for x in main[c["a"]]], t)
            mb = transform([x.get(m["key"]) for x in main[c["b"]]], t)
            if None in at or None in ma or None in mb:
                continue
            d_sens, d_main = at[0] - at[1], sum(ma) / len(ma) - sum(mb) / len(mb)
            rows.append({"contrast": c["name"], "metric": m["key"], "diff_sensitivity": d_sens, "diff_main": d_main,
                         "same_sign": (d_sens > 0) == (d_main > 0)})
    return rows


def analyse(plan: dict, out: Path) -> dict:
    from diffquant.lab import t_interval

    per_arm = {a: [json.loads(cell_path(out, a, plan["lr"], s).read_text()) for s in plan["seeds"]]
               for a in plan["arms"]}
    sens = {a: json.loads(p.read_text()) for a in plan["arms"] for s in plan["sensitivity"]["seeds"]
            if (p := cell_path(out, a, plan["sensitivity"]["lr"], s)).is_file()}
    for cell in [c for v in per_arm.values() for c in v] + list(sens.values()):
        if cell["plan_sha256"] != plan["sha256"]:
            raise dq.DiffquantError(f"cell {cell['arm']} lr {cell['lr']} s{cell['seed']} was measured under another "
                                    "plan")
    rows = tests(plan, per_arm)
    keys = [m["key"] for m in plan["metrics"]] + EXPLORATORY
    doc = {"plan_sha256": plan["sha256"], "setting": plan["setting"], "family_size": len([r for r in rows
                                                                                        if not r.get("constant")]),
           "aggregate": {a: {k: t_interval([c.get(k) for c in cs]) for k in keys} for a, cs in per_arm.items()},
           "tests": rows, "decomposition": decompose(plan, rows), "sensitivity": sensitivity(plan, per_arm, sens),
           "sensitivity_cells": {a: {k: c.get(k) for k in keys} for a, c in sens.items()},
           "scale": {a: {"parameters": cs[0]["parameters"], "train_tokens": cs[0]["train_tokens"],
                         "rms_norm_eps": cs[0].get("rms_norm_eps", TRAINED_EPS.get(a))} for a, cs in per_arm.items()},
           "held_out": {"sequences": per_arm[plan["arms"][0]][0]["sequences"],
                        "tokens": per_arm[plan["arms"][0]][0]["tokens"],
                        "copy_tokens": per_arm[plan["arms"][0]][0]["copy_tokens"]}}
    doc["lambda"] = {a: [min(v for c in cs for v in c["lambda"]), max(v for c in cs for v in c["lambda"])]
                     for a, cs in per_arm.items() if cs[0].get("lambda")}
    doc["rate_sensitive"] = rate_sensitive(plan, doc)
    doc["summary"] = summary(plan, doc)
    atomic_write_json(out / "results.json", doc)
    atomic_write_text(out / "results.md", render(plan, doc))
    return doc


EXPLORATORY = ["hidden_ratio", "massive_ratio", "hidden_kurtosis", "logit_ratio", "logits_int4_cost", "sink_rate",
               "first_share_mean", "noncopy_loss"]


def rate_sensitive(plan: dict, doc: dict) -> list[str]:
    """The plan's sensitivity rule: a primary metric whose verdict rests on a contrast (DIFF − Transformer, and the
    component the rule credits) whose seed-0 difference at the sensitivity rate has the other sign is flagged
    "rate-sensitive (one seed)"."""
    names = [c["name"] for c in plan["contrasts"]]
    rests = {"the head norm": [names[1]], "the differential map": [names[2]], "both": [names[1], names[2]]}
    flips = {(r["contrast"], r["metric"]) for r in doc["sensitivity"] if not r["same_sign"]}
    out = []
    for key, v in doc["decomposition"].items():
        if v.startswith("no DIFF"):
            continue
        if any((c, key) in flips for c in [names[0], *rests.get(v.split(" (")[0], [])]):
            out.append(key)
    return out


def summary(plan: dict, doc: dict) -> str:
    """One sentence per finding, read off the Holm-adjusted tests and the decision rule only."""
    from diffquant.lab import display

    n = len(plan["seeds"])
    dec = doc["decomposition"]
    label = {m["key"]: metric_label(plan, m) for m in plan["metrics"]}
    carried, quiet = {}, []
    for key, v in dec.items():
        if v.startswith("no DIFF"):
            quiet.append(key)
            continue
        flag = " (rate-sensitive, one seed)" if key in doc.get("rate_sensitive", []) else ""
        carried.setdefault(v.split(" (")[0], []).append(label[key] + flag)
    parts = [f"{v}: {', '.join(keys)}" for v, keys in carried.items()]
    text = (f"{plan['setting']['scale']}; {n} seeds per arm at lr {plan['lr']:g}; Welch over seeds, Holm over "
            f"the planned family of {doc['family_size']} tests. {display('diff')} differs from the "
            f"{display('baseline')} in {len(dec) - len(quiet)} of {len(dec)} primary metrics; which part carries "
            "each, by the plan's rule: " + ("; ".join(parts) if parts else "none") + f". In the other {len(quiet)} no "
            "DIFF − Transformer difference is detected (the table gives each one's minimum detectable effect or its "
            "TOST equivalence).")
    if not doc["sensitivity_cells"]:
        text += f" The rate-sensitivity cells (lr {plan['sensitivity']['lr']:g}, seed 0) are not in yet."
    return text


def render(plan: dict, doc: dict) -> str:
    from diffquant.lab import display, fmt_pm, markdown

    arms = plan["arms"]
    ho = doc["held_out"]
    lines = [f"# Is it the differential map or the head norm? ({plan['setting']['name']})\n",
             f"Plan: `docs/headnorm/plan.yaml` (sha256 {doc['plan_sha256'][:12]}…), committed before the first "
             f"cell. Scale: {plan['setting']['scale']}. Held-out: {ho['sequences']} sequences, {ho['tokens']:,} "
             f"predicted tokens ({ho['copy_tokens']:,} copies); calibration: {plan['calibration_sequences']} "
             "training-split sequences.\n", arms_text(plan, doc) + "\n", doc["summary"] + "\n",
             f"## Primary metrics, lr {plan['lr']:g}, mean ± 95% t over {len(plan['seeds'])} seeds\n"]
    label = {m["key"]: metric_label(plan, m) for m in plan["metrics"]}
    lines.append(markdown(["metric", *[display(a) for a in arms], "which part carries DIFF − Transformer"],
                          [[label[k], *[fmt_pm(doc["aggregate"][a][k]["mean"], doc["aggregate"][a][k]["half"], 4)
                                        for a in arms], _carried(plan, doc, k)] for k in label]))
    lines.append(f"\n## Exploratory (measured, not in the family), lr {plan['lr']:g}\n")
    lines.append(markdown(["metric", *[display(a) for a in arms]],
                          [[k, *[fmt_pm(doc["aggregate"][a][k]["mean"], doc["aggregate"][a][k]["half"], 4)
                                 for a in arms]] for k in EXPLORATORY]))
    lines.append(f"\n## The tests: Welch over seeds, Holm over all {doc['family_size']} (log metrics compared "
                 "as logs: differences are factors); TOST within the plan's margins where no difference is found\n")
    lines.append(markdown(["contrast", "metric", "difference", "p", "p (Holm)", "TOST p (Holm)", "verdict"],
                          [[r["contrast"], label[r["metric"]], "-" if r.get("constant") else units(r["diff"], r["transform"]),
                            fmt_p(r.get("p")), fmt_p(r.get("p_holm")), fmt_p(r.get("p_tost_holm")), r["verdict"]]
                           for r in doc["tests"]]))
    if doc["sensitivity_cells"]:
        lines.append(f"\n## Rate sensitivity: seed 0 at lr {plan['sensitivity']['lr']:g} (descriptive, one seed)\n")
        lines.append(markdown(["metric", *[display(a) for a in arms if a in doc["sensitivity_cells"]]],
                              [[k, *[fmt_g(doc["sensitivity_cells"][a].get(k)) for a in arms
                                     if a in doc["sensitivity_cells"]]] for k in label]))
        flips = [r for r in doc["sensitivity"] if not r["same_sign"]]
        lines.append(f"\n{len(flips)} of {len(doc['sensitivity'])} contrast × metric differences change sign at "
                     f"lr {plan['sensitivity']['lr']:g} (seed 0) against the lr {plan['lr']:g} mean"
                     + (": " + "; ".join(f"{r['contrast']} on {label[r['metric']]}" for r in flips) if flips else "")
                     + ".\n")
    return "\n".join(lines)


def _carried(plan: dict, doc: dict, key: str) -> str:
    """The decision rule's verdict for a metric; where DIFF − Transformer is no difference, that test's own verdict
    (its minimum detectable effect, or TOST equivalence) beside it; the rate-sensitivity flag where it applies."""
    v = doc["decomposition"][key]
    if v.startswith("no DIFF"):
        total = next(r for r in doc["tests"] if r["contrast"] == plan["contrasts"][0]["name"] and r["metric"] == key)
        v = f"no DIFF − Transformer difference: {total['verdict']}"
    return v + ("; rate-sensitive (one seed)" if key in doc.get("rate_sensitive", []) else "")


# rms_norm_eps of the committed cells, which were trained before presets set it for both sides of a pair (issue
# 49) and did not record it: each arm took its config class's default, Llama's 1e-6 or DiffLlama's 1e-5. Cells
# trained since record their own.
TRAINED_EPS = {"baseline": 1e-6, "baseline-headnorm": 1e-6, "diff": 1e-5, "diff-nonorm": 1e-5}


def arms_text(plan: dict, doc: dict) -> str:
    """What each arm is, exactly, as it was trained (the ablations are not a perfect split of DIFF's norm: said
    here)."""
    from diffquant.lab import get_preset

    spec = get_preset(plan["setting"]["train"]["preset"])
    eps = {a: doc["scale"][a].get("rms_norm_eps") or TRAINED_EPS[a] for a in plan["arms"]}
    d = spec.hidden // spec.heads
    p = {a: v["parameters"] for a, v in doc["scale"].items()}
    lam = doc.get("lambda", {})
    lam_text = "; ".join(f"{a} learned λ from {lo:.2f} to {hi:.2f} (every layer and seed)" for a, (lo, hi) in lam.items())
    return (f"Arms, exactly: the Transformer is transformers' Llama ({p['baseline']:,} parameters, rms_norm_eps "
            f"{eps['baseline']:g}); + head norm adds to it a parameter-free RMSNorm over each softmax head's d = {d} "
            f"channels times (1 − λ_init) ({p['baseline-headnorm']:,} parameters, eps {eps['baseline-headnorm']:g}); "
            "DIFF is transformers' DiffLlama (the paper's reference code gives its norm a learnable gain; here it has "
            f"none): a parameter-free RMSNorm over each differential head's 2d = {2 * d} channels times (1 − λ_init), "
            f"rms_norm_eps {eps['diff']:g} ({p['diff']:,} parameters); DIFF without norm drops that RMSNorm and keeps "
            f"the (1 − λ_init) factor ({p['diff-nonorm']:,} parameters, eps {eps['diff-nonorm']:g}). So the head-norm "
            "arm's groups are half DIFF's, the factor stays in DIFF without norm"
            + (", and the two DIFF arms' norms have another eps than the Transformer arms'"
               if eps["diff"] != eps["baseline"] else "") + ". " + (lam_text + "." if lam_text else ""))

def metric_label(plan: dict, m: dict) -> str:
    """"o_proj input: ∞-norm (max over layers)", "W8A8 static: Δppl %", "a4 static at down_proj input: Δppl %"."""
    key, kind = m["key"], m.get("kind")
    where = plan["kinds"][kind] if kind else None
    if key.endswith("_inf_norm"):
        return f"{where}: ∞-norm (largest layer)"
    if key.endswith("_kurtosis"):
        return f"{where}: kurtosis (mean over layers)"
    if key.endswith("_ratio"):
        return f"{where}: top-1 / median (largest layer)"
    if kind:
        return f"{key[:2].upper()} static at {where} alone: Δppl %"
    return {"w8a8_static_cost": "W8A8 static: Δppl %", "w4a4_static_cost": "W4A4 static: Δppl %",
            "loss": "held-out loss (nats)", "copy_loss": "loss at copy positions (nats)"}.get(key, key)


# ---------------------------------------------------------------- driver


def run(plan: dict, out: Path, runs: Path, device: str, worker: tuple[int, int] | None = None) -> dict | None:
    from diffquant.lab import start_run

    out.mkdir(parents=True, exist_ok=True)
    start_run(out, {"plan_sha256": plan["sha256"], "setting": plan["setting"], "worker": worker}, device)
    seqs, copies, calib = data(plan, runs / "data")
    missing = []
    for i, (arm, lr, seed) in enumerate(cells(plan)):
        if worker is not None and i % worker[1] != worker[0] and not cell_path(out, arm, lr, seed).is_file():
            missing.append((arm, lr, seed))
            continue
        print(f"cell {i + 1}/{len(cells(plan))}: {arm} lr {lr:g} seed {seed}", flush=True)
        run_cell(plan, arm, lr, seed, runs, out, device, seqs, copies, calib)
    if missing:
        print(f"worker {worker[0]}/{worker[1]}: its cells are done; {len(missing)} are the others'", flush=True)
        return None
    doc = analyse(plan, out)
    print(doc["summary"])
    return doc


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the pipeline on a micro setting, two seeds (seconds)")
    p.add_argument("--plan", default=str(PLAN), help="the committed plan (default docs/headnorm/plan.yaml)")
    p.add_argument("--plan-only", action="store_true", help="print the cells and the family, run nothing")
    p.add_argument("--out", default=None, help="results (default docs/headnorm)")
    p.add_argument("--runs", default=None, help="checkpoints (default runs/headnorm; --quick: OUT/runs)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when there is one)")
    p.add_argument("--worker", default=None, metavar="K/N", help="train only every N-th cell, starting at K")
    p.add_argument("--report-only", action="store_true",
                   help="write results.json/.md from the cells in OUT, training nothing (every cell at the plan's rate "
                        "must be in; the rate-sensitivity cells as far as they are)")
    a = p.parse_args(argv)
    plan = load_plan(Path(a.plan), a.quick)
    print(describe(plan), flush=True)
    if a.plan_only:
        return None
    worker = parse_worker(a.worker)
    out = Path(a.out or "docs/headnorm")
    if a.report_only:
        missing = [f"{arm} s{seed}" for arm in plan["arms"] for seed in plan["seeds"]
                   if not cell_path(out, arm, plan["lr"], seed).is_file()]
        if missing:
            raise dq.DiffquantError(f"{len(missing)} cells at lr {plan['lr']:g} are not in {out}/cells yet "
                                    f"({', '.join(missing)}): nothing is reported before every one is")
        doc = analyse(plan, out)
        print(doc["summary"])
        return doc
    runs = Path(a.runs) if a.runs else (out / "runs" if a.quick else Path("runs/headnorm"))
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return run(plan, out, runs, device, worker)


if __name__ == "__main__":
    try:
        main()
    except dq.DiffquantError as err:  # one line, not a traceback
        raise SystemExit(f"headnorm: {err}") from None
