"""How much fixing does DIFF need compared with the baseline? Post-training fixes on the fair comparison's
checkpoints (experiments/fair_rivals.py, Guo et al.'s recipe): the baseline and DIFF, each at its own learning
rate (chosen by its own held-out loss, sweep.json), every trained seed.

    python -m experiments.fixes_needed [--quick] [--designs baseline diff] [--out docs/rivals/fair-guo/fixes]
    python -m experiments.fixes_needed --pair demo [--runs runs/rivals]   # the demo pair (emergence.DEMO)
    python -m experiments.fixes_needed --render [--pair demo]   # rewrite the report from the committed results

Per model: the held-out loss in float and under each scheme (W8A8-static, W4A4-static: static per-tensor
activations, what outliers hurt) with each fix: none, `smoothquant:search` (α per model), `rotate` (the complete
QuaRot rotation, weights by RTN), `quarot` (rotate + GPTQ weights), `clip:output` (ranges of least reader output
error, activations and weights). The fair cells' held-out sequences and calibration sequences (static scales,
SmoothQuant's search, GPTQ) are reused. A cell's cost is its mean loss change from the same model in float
(paired over the same sequences). Per design: mean ± 95% t over seeds of each cost, and the share of the
no-fix cost a fix recovers. DIFF against the baseline: Welch's t over seeds per (scheme, fix), Holm-adjusted
over the table. Results per model are written as they finish (a stopped run resumes).
`--quick` runs on the fair comparison's --quick checkpoints (trained here in seconds when missing).
`--pair demo` runs on the demo pair instead: the demo setting (experiments/emergence.py's DEMO: tiny preset, 600K KJV tokens,
lr 3e-3 for every design: TrainConfig's default, not chosen by a sweep), every seed trained under
RUNS/demo/s<seed>/<design>; held-out and calibration windows from KJV's validation and training splits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments.emergence import DEMO

import diffquant as dq
from diffquant.lab import atomic_write_json, atomic_write_text, detectable

SCHEMES = ("w8a8-static", "w4a4-static")
PAIRS = {"demo": DEMO}  # the trained pairs `--pair` reads: name -> TrainConfig overrides
FIXES = ("none", "smoothquant:search", "rotate", "quarot", "clip:output")


def measure_model(model, seqs, calib) -> dict:
    """{"float": per-sequence losses, "cells": {scheme: {fix: {"delta", "delta_ci95", "loss"}}}}."""
    from diffquant.lab import paired, recipe_from_cli

    fp = dq.perplexity(model, seqs)["per_sequence_loss"]
    cells = {}
    for name in SCHEMES:
        for fix_text in FIXES:
            with dq.quantize_(model, recipe_from_cli(fix_text, "rtn", name), calib) as handle:
                q = dq.perplexity(model, seqs)["per_sequence_loss"]
            alpha = handle.record["fixes"][0].get("alpha") if handle.record["fixes"] else None
            d = paired(fp, q)
            cells.setdefault(name, {})[fix_text] = {"delta": d["mean"], "delta_ci95": d["ci95"],
                                                    "loss": sum(q) / len(q), "alpha": alpha}
    return {"float_loss": sum(fp) / len(fp), "cells": cells}


def summarise(models: dict, designs: list[str]) -> dict:
    """Per design × scheme × fix: mean ± t over seeds of the cost and of the share of no-fix cost recovered;
    DIFF − baseline Welch tests, Holm-adjusted over every (scheme, fix)."""
    from diffquant.lab import holm_adjust, t_interval, welch

    def costs(design, scheme, fix):
        return [m["cells"][scheme][fix]["delta"] for m in models.values() if m["design"] == design]

    per = {}
    for d in designs:
        for s in SCHEMES:
            for f in FIXES:
                none, fixed = costs(d, s, "none"), costs(d, s, f)
                recovered = [1 - b / a if a > 0 else None for a, b in zip(none, fixed)]
                per.setdefault(d, {}).setdefault(s, {})[f] = {"cost": t_interval(fixed),
                                                              "recovered": t_interval(recovered)}
    tests = []
    if len(designs) == 2:
        a, b = designs[1], designs[0]  # DIFF − baseline
        for s in SCHEMES:
            for f in FIXES:
                w = welch(costs(a, s, f), costs(b, s, f))
                tests.append({"scheme": s, "fix": f, "diff": None if w is None else w["diff"],
                              "p": None if w is None else w["p"], "n": [len(costs(a, s, f)), len(costs(b, s, f))]})
        for t, adj in zip(tests, holm_adjust([t["p"] for t in tests])):
            t["p_holm"] = adj
    return {"per_design": per, "tests": tests, "versus": designs[::-1]}


def render(doc: dict, fair: dict | None = None) -> str:
    """results.md. With `fair` (the fair comparison's results.json, its tests recomputed by fair_rivals.analyse with
    this table's tests in its grown family, so each carries "p_holm_grown"), the verdicts are read inside that
    family, this table's own Holm is shown as the exploratory reading it is, rate ties are flagged on the rows, and
    the head-norm observation follows."""
    from diffquant.lab import display, fmt_pm, markdown

    s = doc["summary"]
    seeds = {d: sorted(m["seed"] for m in doc["models"].values() if m["design"] == d) for d in doc["designs"]}
    head = pair_head(doc, seeds) if doc.get("pair") else (
            f"Post-training fixes on the fair comparison's {doc['experiment']} checkpoints "
            f"({doc['tokens_per_model']:,} training tokens per model), each design at its own learning rate ("
            + ", ".join(f"{display(d)} {doc['rates'][d]:g}, seeds {seeds[d]}" for d in doc["designs"])
            + f"). Held-out: {doc['eval_sequences']} sequences × {doc['seq_len']} tokens of the synthetic corpus; "
            f"calibration (static scales, SmoothQuant's α search, GPTQ, clip search): {doc['calibration_sequences']} "
            "training sequences. Cost: the mean held-out loss change from the same model in float, in nats; mean ± "
            "95% t over seeds. Recovered: 1 − cost(fix) / cost(none) per seed, then its mean ± t, shown where the no-fix "
            "cost's interval lies above 0 (elsewhere there is no cost to recover). rotate's weights are "
            "rounded to nearest, quarot's solved by GPTQ; clip:output clips activations (static per-tensor ranges) "
            "and weights on their readers' output error; SmoothQuant smooths o_proj's input through v_proj for the "
            "baseline only (DIFF's per-head norm does not commute with per-channel scales). "
            + rate_margins(doc) + "These are 3-layer models of width 256 on a synthetic bigram-backcopy task, "
            "not the paper's scale, and not in the outlier regime (diffquant.stats.outlier_regime; docs/regime and the fair "
            "comparison's scale note). Which family of tests governs is said under the tests.\n\n")
    rows = []
    for d in doc["designs"]:
        for sc in SCHEMES:
            for f in FIXES:
                c, none = s["per_design"][d][sc][f], s["per_design"][d][sc]["none"]["cost"]
                costly = none["half"] is not None and none["mean"] - none["half"] > 0
                rec = ("-" if f == "none" else "no cost to recover" if not costly
                       else fmt_pm(c["recovered"]["mean"], c["recovered"]["half"], 2))
                rows.append([display(d), sc, f, fmt_pm(c["cost"]["mean"], c["cost"]["half"], 4), rec])
    text = head + markdown(["design", "scheme", "fix", "cost (nats)", "recovered"], rows) + "\n"
    if not s["tests"]:
        return text
    a, b = (display(x) for x in s["versus"])
    grown = (fair or {}).get("grown")
    costs = {d: {(sc, f): [m["cells"][sc][f]["delta"] for m in chosen_models(doc).values() if m["design"] == d]
                 for sc in SCHEMES for f in FIXES} for d in doc["designs"]}
    for t in s["tests"]:
        governing = t.get("p_holm_grown") if grown else t.get("p_holm")
        t["detectable"] = None if governing is None else detectable(
            costs[s["versus"][0]][(t["scheme"], t["fix"])], costs[s["versus"][1]][(t["scheme"], t["fix"])],
            grown["tests"] if grown else len(s["tests"]))
    ties = _ties(doc, fair)
    columns = ["scheme", "fix", f"cost difference ({a} − {b})", "p", "p (Holm, this table's rows: exploratory)"]
    columns += ["p (Holm, grown family: governs)", "learning-rate tie"] if grown else []
    body = [[t["scheme"], t["fix"], "-" if t["diff"] is None else f"{t['diff']:+.4f}",
             "-" if t["p"] is None else f"{t['p']:.3g}", "-" if t.get("p_holm") is None else f"{t['p_holm']:.3g}",
             *(["-" if t.get("p_holm_grown") is None else f"{t['p_holm_grown']:.3g}",
                ties[t["scheme"]] if t["fix"] == "none" and t["scheme"] in ties else ties.get("any", "-")]
               if grown else []),
             verdict(t, "p_holm_grown" if grown else "p_holm")] for t in s["tests"]]
    if grown:
        family = (f"Which correction governs: these {len(s['tests'])} rows were measured after the fair comparison, on "
                  f"its checkpoints, so they join its family: the {grown['planned']} planned tests (every metric × "
                  f"design − DIFF, fixed before the run), grown by {grown['added']} contrasts added after the audit "
                  f"and by these rows to {grown['tests']} (docs/rivals/fair-guo/results.md); Holm over that grown "
                  "family governs the verdicts below. Holm over this table's rows alone is shown as the exploratory "
                  "reading it is; where the two disagree, the grown family's \"no difference detected\" stands."
                  + _disagreements(s["tests"]) + _planned_twin(fair))
    else:
        family = "Holm over this table's rows (no fair comparison results to read them inside)."
    text += (f"\n{a} against {b}: cost difference ({a} − {b}, nats), Welch's t over seeds. {family} "
             "'detectable': the smallest true difference the test detects with 80% power at Holm's first step, in "
             "standard deviations and, after '=', in nats from the pooled SD (no equivalence margin was stated, so "
             "none is claimed).\n\n" + markdown([*columns, "verdict"], body) + "\n")
    if fair:
        text += "\n" + headnorm_note(fair) + "\n"
    return text


def chosen_models(doc: dict) -> dict:
    """The measured models at each design's chosen rate (keys "<design>/lr<rate>/s<seed>"), which the summary reads;
    a `--pair` document has no rates: every model."""
    rates = doc.get("rates")
    if not rates:
        return doc["models"]
    return {k: m for k, m in doc["models"].items() if k.startswith(f"{m['design']}/lr{rates[m['design']]:g}/")}


def _disagreements(tests: list[dict]) -> str:
    """The rows whose verdict differs between this table's own Holm and the grown family's."""
    rows = [t for t in tests if t.get("p_holm") is not None and t.get("p_holm_grown") is not None
            and (t["p_holm"] < 0.05) != (t["p_holm_grown"] < 0.05)]
    return (" They disagree on " + "; ".join(f"{t['scheme']} {t['fix']} (p {t['p']:.3g}: Holm {t['p_holm']:.3g} over "
                                             f"this table, {t['p_holm_grown']:.3g} over the grown family)" for t in rows)
            + "." if rows else " They agree on every row.")


def _planned_twin(fair: dict) -> str:
    """The planned test of the same no-fix static W4A4 cost (as Δppl %, Transformer − DIFF) in the fair comparison."""
    row = next((r for r in fair["tests"] if r["family"] == "planned" and r["metric"] == "w4a4_static_cost"
                and r["design"] == "baseline" and r.get("reference", "diff") == "diff"), None)
    if row is None or row.get("p_holm") is None:
        return ""
    return (f" The no-fix static W4A4 cost is also a planned test of the fair comparison (as Δppl %, Welch p "
            f"{row['p']:.3g}, Holm p {row['p_holm']:.3g} among its {fair['grown']['planned']} planned tests): "
            "no difference detected there either.")


def _ties(doc: dict, fair: dict | None) -> dict:
    """{scheme: tie text} for the no-fix rows (the fair sweep measured each scheme's no-fix cost at every rate, seed
    0, as Δppl %) and {"any": text} for the fixed rows (measured at the chosen rates only), where a design of the
    table won its rate by less than one standard error."""
    from experiments import fair_rivals as F

    if not fair:
        return {}
    out = {}
    for sc in SCHEMES:
        said = [t for t in (F.tie_values(fair, d, f"{sc.replace('-', '_')}_cost") for d in doc["designs"]) if t]
        if said:
            out[sc] = "; ".join(said) + " (Δppl %)"
    tied = [d for d in doc["designs"] if F.tie_values(fair, d, "loss")]
    if tied:
        from diffquant.lab import display

        out["any"] = f"{', '.join(display(d) for d in tied)} (fixed models at other rates: not measured)"
    return out


def headnorm_note(fair: dict) -> str:
    """The exploratory reading of the fair comparison's own no-fix static W4A4 costs (Δppl %) that the audit of issue
    42 pointed to: the Transformer with DIFF's head norm alone against the Transformer and DIFF, with the raw Welch
    p and the Holm p the grown family gives it, and how the sign of DIFF − Transformer moves with the rate (seed 0)."""
    from diffquant.lab import display, fmt_pm, t_interval, welch

    metric = "w4a4_static_cost"
    per = {d: [c[metric] for c in fair["per_seed"][d]] for d in ("baseline", "baseline-headnorm", "diff", "diff-gain")
           if d in fair["per_seed"]}
    if not {"baseline", "baseline-headnorm", "diff"} <= set(per):
        return ""
    row = {(r["design"], r.get("reference", "diff")): r for r in fair["tests"]
           if r["metric"] == metric and r["family"] in ("planned", "added")}
    m = {d: t_interval(v) for d, v in per.items()}
    hn, dh = welch(per["baseline-headnorm"], per["baseline"]), welch(per["diff"], per["baseline-headnorm"])
    grown = row[("baseline-headnorm", "baseline")]
    planned = row[("baseline-headnorm", "diff")]
    pm = lambda d: fmt_pm(m[d]["mean"], m[d]["half"], 3)  # noqa: E731
    cells = [c for v in fair["per_seed"].values() for c in v]
    rates = fair.get("sweep_metrics") or {}
    by_rate = "; ".join(f"{lr}: DIFF {rates['diff'][lr][metric]:.3g} vs Transformer {rates['baseline'][lr][metric]:.3g}"
                        for lr in rates.get("diff", {}) if lr in rates.get("baseline", {}))
    return (f"Exploratory, added after the audit (issue 42), from the fair comparison's per-seed no-fix W4A4-static "
            f"costs (Δppl %, mean ± 95% t over {len(per['baseline'])} seeds): {display('baseline')} {pm('baseline')}, "
            f"{display('baseline-headnorm')} {pm('baseline-headnorm')} (Welch p {hn['p']:.2g} against the "
            f"Transformer; Holm p {grown['p_holm_grown']:.2g} over the grown family of {fair['grown']['tests']}: no "
            f"difference detected there), DIFF {pm('diff')} (against the head norm: Welch p {dh['p']:.2g}, planned "
            f"Holm p {planned['p_holm']:.2g})"
            + (f", {display('diff-gain')} {pm('diff-gain')}" if "diff-gain" in m else "")
            + ". Read as an observation, not a finding: the Transformer with DIFF's per-head norm alone (no "
              "differential map) has a mean cost closer to DIFF's than to the Transformer's; experiments/headnorm.py tests "
              "that decomposition as planned. The sign of DIFF − Transformer also moves with the learning rate (seed "
              f"0, Δppl % at each rate: {by_rate}), and no design has outliers here (sink rate at most "
              f"{max(c.get('sink_rate') or 0 for c in cells):.2f} and max‖h‖/median‖h‖ at most "
              f"{max(c.get('massive_ratio') or 0 for c in cells):.2f} in all {len(cells)} runs at the chosen rates).")


def pair_head(doc: dict, seeds: dict) -> str:
    """The table's preamble for a trained pair (`--pair`): its setting in place of the fair comparison's."""
    from diffquant.lab import TrainConfig, display

    o = doc["setting"]
    return (f"Post-training fixes on the `{doc['pair']}` pair (its setting, `emergence --setting {doc['pair']}`: "
            f"preset {o['preset']}, "
            f"{o['corpus'].upper()}, {doc['tokens_per_model']:,} training tokens per model, lr {o['lr']:g} and weight "
            f"decay {o.get('weight_decay', TrainConfig.weight_decay):g} for every design, not chosen by a sweep; "
            + ", ".join(f"{display(d)} seeds {seeds[d]}" for d in doc["designs"])
            + ", " + ", ".join(f"{display(d)} {n:,} parameters" for d, n in doc["parameters"].items())
            + f"). Held-out: {doc['eval_sequences']} sequences × {doc['seq_len']} tokens of "
            f"{o['corpus'].upper()}'s validation split; calibration (static scales, SmoothQuant's α search, GPTQ, clip "
            f"search): {doc['calibration_sequences']} training windows. Cost: the mean held-out loss change from the "
            "same model in float, in nats; mean ± 95% t over seeds. Recovered: 1 − cost(fix) / cost(none) per seed, "
            "then its mean ± t, shown where the no-fix cost's interval lies above 0. rotate's weights are rounded to "
            "nearest, quarot's solved by GPTQ; clip:output clips activations (static per-tensor ranges) and weights on "
            "their readers' output error; SmoothQuant smooths o_proj's input through v_proj for the baseline only "
            "(DIFF's per-head norm does not commute with per-channel scales). " + ("These are 4-layer models of width 256 "
            "trained on 600K tokens, not the paper's scale; the demo pair has no attention sink (docs/rivals/demo).\n\n"
            if o["preset"] == "tiny" else f"{o['preset']} preset models, not the paper's scale.\n\n"))


def rate_margins(doc: dict) -> str:
    """How clearly each design's learning rate won its sweep (seed 0): the runner-up's held-out loss minus the
    chosen one's, so a near-tie is stated beside the results that depend on it."""
    from diffquant.lab import display

    margins = doc.get("rate_margins") or {}
    if not margins:
        return ""
    ties = [display(d) for d, m in margins.items() if m["margin"] < m["loss_se"]]  # the fair comparison's rule
    return ("Learning-rate choice (seed 0, held-out loss of the runner-up rate minus the chosen one's): "
            + ", ".join(f"{display(d)} {m['margin']:.4f} nats over lr {m['runner_up']:g} (the chosen model's loss "
                        f"SE {m['loss_se']:.4f})" for d, m in margins.items())
            + (f"; {' and '.join(ties)}: within one standard error, a tie one seed cannot settle (flagged on the "
               "tests below). " if ties else ". "))


def verdict(t: dict, key: str = "p_holm") -> str:
    """The row's verdict at its Holm p under `key` (this table's own, or the grown family's): which design costs more,
    or "no difference detected" with the detectable effect when `t["detectable"]` holds it (see render)."""
    if t.get(key) is None:
        return "n/a"
    n = min(t["n"])
    if t[key] >= 0.05:
        size = t.get("detectable")
        return (f"no difference detected (n = {n}" + (f"; detectable {size['sd']:.1f} SD = {size['units']:.3g} nats"
                                                       if size else "") + ")")
    return "DIFF costs more" if t["diff"] > 0 else "DIFF costs less"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--designs", nargs=2, default=["baseline", "diff"], help="the reference design, then DIFF")
    p.add_argument("--out", default=None, help="default: the fair comparison's folder + /fixes")
    p.add_argument("--runs", default=None, help="the fair comparison's checkpoints (default runs/fair/<experiment>)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--pair", choices=list(PAIRS), help="a trained pair of `emergence --setting NAME` instead (see above)")
    p.add_argument("--render", action="store_true",
                   help="only rewrite results.json's tests and results.md from the committed files (no model runs)")
    a = p.parse_args(argv)
    if a.render:
        out = Path(a.out or (f"docs/rivals/{a.pair}/fixes" if a.pair else "docs/rivals/fair-guo/fixes"))
        return write_report(json.loads((out / "results.json").read_text()), out)
    if a.pair:
        return pair_main(a)
    import torch

    from experiments import fair_rivals as F

    from diffquant.lab import from_pretrained, fuse

    torch.set_num_threads(a.threads)
    e = F.EXPERIMENTS["quick" if a.quick else "guo"]
    fair_out = Path("docs/rivals") / f"fair-{e.name}" if not a.quick else Path(a.out or "/tmp/fixes-quick") / "fair"
    runs = Path(a.runs) if a.runs else (fair_out / "runs" if a.quick else Path("runs/fair") / e.name)
    if a.quick and not (fair_out / "sweep.json").is_file():
        F.main(["--quick", "--out", str(fair_out), "--runs", str(runs)])
    out = Path(a.out) if a.out else fair_out / "fixes"
    sweep = json.loads((fair_out / "sweep.json").read_text())
    rates = {d: sweep["rates"][d]["chosen"] for d in a.designs}
    margins = {}
    for d in a.designs:
        losses = {float(k): v for k, v in sweep["rates"][d]["losses"].items()}
        runner = min((lr for lr in losses if lr != rates[d]), key=losses.get)
        chosen_cell = json.loads((fair_out / "cells" / d / f"lr{rates[d]:g}" / f"s{sweep['seed']}.json").read_text())
        margins[d] = {"runner_up": runner, "margin": losses[runner] - losses[rates[d]],
                      "loss_se": chosen_cell["loss_se"]}
    seqs, calib = F.held_out_and_calibration(e, runs / "data")
    path = out / "results.json"
    doc = json.loads(path.read_text()) if path.is_file() else {"models": {}}
    doc.update({"experiment": e.name, "designs": a.designs, "rates": rates, "tokens_per_model": sweep["tokens_per_model"],
                "eval_sequences": len(seqs), "seq_len": seqs.shape[1], "calibration_sequences": len(calib),
                "schemes": list(SCHEMES), "fixes": list(FIXES), "rate_margins": margins})
    for design in a.designs:
        for seed in e.seeds:
            key = f"{design}/lr{rates[design]:g}/s{seed}"
            folder = F.cell_folder(runs, design, rates[design], seed) / design
            finished = fair_out / "cells" / design / f"lr{rates[design]:g}" / f"s{seed}.json"  # written after training
            if key in doc["models"] or not finished.is_file():  # a checkpoint mid-training is never measured
                continue
            model = from_pretrained(folder).eval()
            fuse(model)
            doc["models"][key] = {"design": design, "seed": seed, **measure_model(model, seqs, calib)}
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, doc)
            print(f"{key}: done", flush=True)
    counts = [sum(m["design"] == d for m in doc["models"].values()) for d in a.designs]
    if min(counts) < 2:
        raise dq.DiffquantError("fixes_needed needs two trained seeds per design; found "
                                f"{dict(zip(a.designs, counts))}")
    doc["summary"] = summarise(chosen_models(doc), a.designs)  # only the models at each design's chosen rate
    write_report(doc, out)


def write_report(doc: dict, out: Path) -> None:
    """results.json and results.md; the fair comparison's results (beside OUT, when they exist) are re-read with
    this table's tests in their grown family (fair_rivals.analyse), which gives each test "p_holm_grown"."""
    from experiments import fair_rivals as F

    fair_path = out.parent / "results.json"
    fair = None
    if doc.get("experiment") and not doc.get("pair") and fair_path.is_file():
        fair = F.analyse(json.loads(fair_path.read_text()), doc)
    atomic_write_json(out / "results.json", doc)
    atomic_write_text(out / "results.md", render(doc, fair))
    print(render(doc, fair))


def pair_main(a) -> None:
    """`--pair`: every seed of the two designs trained under RUNS/<pair>/s<seed>/<design> (the layout of `emergence --runs RUNS`)."""
    import torch

    from experiments.emergence import config, held_out

    from diffquant.lab import from_pretrained, fuse, prepare_data

    torch.set_num_threads(a.threads)
    runs = Path(a.runs or "runs/rivals") / a.pair
    out = Path(a.out or f"docs/rivals/{a.pair}/fixes")
    folders = sorted(f for f in runs.glob("s*") if (f / "metrics.json").is_file())  # metrics: written once trained
    if not folders:
        raise dq.DiffquantError(f"fixes_needed --pair {a.pair}: no trained seed under {runs} (train it with "
                                f"python -m experiments.emergence --only regime --setting {a.pair} --runs "
                                f"{runs.parent} --archs {' '.join(a.designs)} --out docs/rivals/{a.pair})")
    setting = PAIRS[a.pair]
    cfg = config(setting, 0, a.designs)
    seqs = held_out(cfg, folders[0], 64)
    calib = prepare_data(cfg, folders[0]).train[:32]
    path = out / "results.json"
    doc = json.loads(path.read_text()) if path.is_file() else {"models": {}}
    params = {}
    for folder in folders:
        seed = int(folder.name[1:])
        for design in a.designs:
            model = from_pretrained(folder / design).eval()
            params[design] = sum(p.numel() for p in model.parameters())
            key = f"{design}/s{seed}"
            if key in doc["models"]:
                continue
            fuse(model)
            doc["models"][key] = {"design": design, "seed": seed, **measure_model(model, seqs, calib)}
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, doc)
            print(f"{key}: done", flush=True)
    tokens = json.loads((folders[0] / "metrics.json").read_text())["models"][a.designs[0]]["emergence"][-1]["tokens"]
    doc.update({"pair": a.pair, "setting": setting, "designs": a.designs, "tokens_per_model": tokens,
                "parameters": params,
                "eval_sequences": len(seqs), "seq_len": seqs.shape[1], "calibration_sequences": len(calib),
                "schemes": list(SCHEMES), "fixes": list(FIXES)})
    counts = [sum(m["design"] == d for m in doc["models"].values()) for d in a.designs]
    if min(counts) < 2:
        raise dq.DiffquantError("fixes_needed needs two trained seeds per design; found "
                                f"{dict(zip(a.designs, counts))}")
    doc["summary"] = summarise(doc["models"], a.designs)
    write_report(doc, out)


if __name__ == "__main__":
    main()
