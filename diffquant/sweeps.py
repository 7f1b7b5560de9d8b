"""Bit-width sweeps: every (model, site, bits, granularity) cell, a weight × activation grid, and
per-layer sensitivity. Each finished cell is appended to `cells.jsonl` at once, so an interrupted sweep
resumes without redoing finished cells; `results.csv`/`results.json` are rewritten atomically after each.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from diffquant.errors import DiffquantError
from diffquant.paths import atomic_write_json, atomic_write_text
from diffquant.quant.numerics import granularity as G
from diffquant.quant.numerics.config import int_config
from diffquant.quant.numerics.scheme import LAYER_WEIGHTS, LINEAR_INPUTS, QuantScheme
from diffquant.report.tables import sample_size, to_csv

NATIVE = 16  # "16 bits": the model's own precision, as in the paper's Figure 8


@dataclass(frozen=True)
class Cell:
    model: str
    kind: str  # "act": one site everywhere; "wa": weights × Linear inputs; "layer": one site of one layer;
    # "scheme": the named scheme (a preset or file) in `site`; "recipe": the recipe file in `site`, all its steps
    site: str = "attn_logits"
    bits: int = NATIVE  # activation bits
    granularity: str = "tensor"
    wbits: int = NATIVE
    layer: int | None = None
    mitigate: str = "none"  # a function-preserving transform applied before the scheme (quant/algorithms/mitigate.py)
    weights: str = "rtn"  # how the weights reach their grid (quant/algorithms/solvers.py)

    def key(self) -> str:
        values = asdict(self)
        if values["weights"] == "rtn":  # the keys of sweeps made before the weights axis existed
            del values["weights"]
        return "|".join(str(v) for v in values.values())

    def label(self) -> str:
        """How a progress bar names the cell."""
        fix = ("" if self.mitigate == "none" else f" + {self.mitigate}") + (
            "" if self.weights == "rtn" else f" + {self.weights}")
        if self.kind == "scheme":
            return f"{self.model} {self.site}{fix}"
        if self.kind == "recipe":
            return f"{self.model} {Path(self.site).name}"
        if self.kind == "wa":
            return f"{self.model} W{self.wbits}A{self.bits}{fix}"
        where = f"layer {self.layer} " if self.kind == "layer" else ""
        bits = "fp" if self.bits == NATIVE else f"int{self.bits} per {self.granularity}"
        return f"{self.model} {where}{self.site} {bits}{fix}"

    def recipe(self):
        """The cell's recipe: its file, or its fix and solver before its scheme."""
        from diffquant.quant.recipe import from_cli, load_recipe

        if self.kind == "recipe":
            return load_recipe(self.site)
        return from_cli(self.mitigate, self.weights, self.scheme())

    def scheme(self) -> QuantScheme:
        if self.kind == "scheme":
            from diffquant.quant.numerics.scheme import get_scheme

            return get_scheme(self.site)
        if self.kind == "wa":
            acts = () if self.bits == NATIVE else tuple((p, int_config(self.bits, G.PerToken())) for p in LINEAR_INPUTS)
            weights = () if self.wbits == NATIVE else ((LAYER_WEIGHTS, int_config(self.wbits, G.PerChannel(0))),)
            return QuantScheme(f"w{self.wbits}a{self.bits}", acts, weights)
        if self.bits == NATIVE:
            return QuantScheme("fp")
        pattern = f"layers.{self.layer}.{self.site}" if self.kind == "layer" else f"*.{self.site}"
        config = int_config(self.bits, G.parse_granularity(self.granularity))
        return QuantScheme(f"{self.site}-int{self.bits}-{self.granularity}", ((pattern, config),))


def parse_bits(text: str) -> list[int]:
    try:
        bits = [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise DiffquantError(f"bits must be integers such as 16,8,6,4, got {text!r}") from None
    bad = [b for b in bits if not 2 <= b <= 16]
    if bad or not bits:
        raise DiffquantError(f"bit-widths must be 2..16 (16 = the model's own precision), got {text!r}")
    return bits


def build_cells(labels: list[str], sites: list[str], bits: list[int], grans: list[str], wa: list[int] | None,
                layer_bits: int | None, layers: dict[str, int], mitigations: list[str] = ("none",),
                schemes: list[str] = (), solvers: list[str] = ("rtn",), recipes: list[str] = ()) -> list[Cell]:
    """Every cell of the sweep, the float reference first; `schemes` (presets or files, such as w8a8-static
    and w4a16) add one whole-model cell each, beside the one-site bit-width cells; the weight solvers vary the
    weight × activation grid only (the other cells quantize no weights, or name their own); each of `recipes`
    (recipe files, quant/recipe.py) is one cell per model, with its own fixes, solver and scheme."""
    from diffquant.quant.algorithms import solvers as S
    from diffquant.quant.algorithms.mitigate import parse
    from diffquant.quant.recipe import load_recipe
    from diffquant.quant.numerics.scheme import get_scheme

    for g in grans:
        G.parse_granularity(g)  # fail before any model runs
    for m in mitigations:
        parse(m)
    for name in schemes:
        get_scheme(name)
    for s in solvers:
        S.parse(s)
    for r in recipes:
        load_recipe(r)
    cells = []
    for label in labels:
        cells.append(Cell(label, "act", sites[0] if sites else "attn_logits", NATIVE, grans[0]))  # the float reference
        for fix in mitigations:
            for site in sites:
                for g in grans:
                    cells += [Cell(label, "act", site, b, g, mitigate=fix) for b in bits]
            if wa:
                cells += [Cell(label, "wa", "linear", a, "token", w, mitigate=fix, weights=s)
                          for s in solvers for w in wa for a in wa]
            cells += [Cell(label, "scheme", name, mitigate=fix) for name in schemes]
            if layer_bits:
                for site in sites:
                    cells += [Cell(label, "layer", site, layer_bits, grans[0], layer=i, mitigate=fix)
                              for i in range(layers[label])]
        cells += [Cell(label, "recipe", str(r)) for r in recipes]
    return list(dict.fromkeys(cells))  # the float reference may also be one of the requested cells


class Evaluator:
    """Runs the requested evaluations of one model; `fp` results are computed once per model. `needle_examples`:
    needle contexts per evaluation (two queries each)."""

    def __init__(self, evals: list[str], sequences, tokenizer, haystack: str, mc: dict[str, list],
                 needle_examples: int = 20):
        self.evals, self.sequences, self.tokenizer, self.haystack, self.mc = evals, sequences, tokenizer, haystack, mc
        self.needle_examples = needle_examples

    def __call__(self, model) -> dict:
        from diffquant.data.needle import needle_accuracy
        from diffquant.evaluate import language_modeling, multiple_choice

        out = {}
        for e in self.evals:
            if e == "ppl":
                r = language_modeling(model, self.sequences)
                out.update({"loss": r["loss"], "loss_se": r["loss_se"], "ppl": r["ppl"], "ppl_ci95": r["ppl_ci95"],
                            "next_token_acc": r["accuracy"], "next_token_acc_se": r["accuracy_se"],
                            "tokens": r["tokens"], "sequences": r["sequences"],
                            "per_sequence_loss": r["per_sequence_loss"]})
            elif e == "needle":
                r = needle_accuracy(model, self.tokenizer, self.haystack, examples=self.needle_examples)
                out.update({"needle_choice": r["choice"], "needle_exact": r["exact"]})
            elif e.startswith("mc:"):
                r = multiple_choice(model, self.tokenizer, self.mc[e[3:]])
                name = task_label(e[3:])
                out.update({f"{name}_{k}": r[k] for k in ("acc", "acc_se", "acc_ci95", "acc_norm", "acc_norm_se",
                                                           "acc_norm_ci95", "examples", "chance", "correct",
                                                           "correct_norm")})
        return out


def save_layer_kurtosis(models: dict[str, tuple], text: str, seq_len: int, tokens: int, out: Path) -> Path:
    """Profile each model's attention logits and hidden states on `tokens` tokens of `text` (float, no
    quantizer) and write their Pearson kurtosis per layer to out/layer_kurtosis.json, so the accuracy figure
    shows beside each model's accuracy where its outliers are. Kept when it exists (a resumed sweep)."""
    from diffquant.data.tokens import encode, sequences
    from diffquant.profiler import profile_model
    from diffquant.report.profile_report import layer_series

    path = out / "layer_kurtosis.json"
    if path.exists():
        return path
    result = {"tokens": tokens, "seq_len": seq_len, "models": {}}
    for label, (model, tokenizer) in models.items():
        prof = profile_model(model, sequences(encode(tokenizer, text), seq_len, tokens), progress=False, label=label)
        result["models"][label] = {kind: [{"layer": r["layer"], "kurtosis": r["kurtosis"], "absmax": r["absmax"]}
                                          for r in rows] for kind, rows in layer_series(prof).items()}
    atomic_write_json(path, result)
    return path


def task_label(spec: str) -> str:
    """Column prefix of a multiple-choice task: a file's stem, or the BIG-bench name with / as _."""
    path = Path(spec)
    return path.stem if path.suffix in (".json", ".jsonl") else spec.replace("/", "_")


def check_evals(evals: list[str]) -> None:
    for e in evals:
        if e not in ("ppl", "needle") and not (e.startswith("mc:") and len(e) > 3):
            raise DiffquantError(f"unknown evaluation {e!r}; choose ppl, needle or mc:TASK")


def load_done(out: Path) -> dict[str, dict]:
    path = out / "cells.jsonl"
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by an interruption
            done[row["key"]] = row
    return done


def append_row(out: Path, row: dict) -> None:
    path = out / "cells.jsonl"
    cut = False
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(("\n" if cut else "") + json.dumps(row) + "\n")  # a line cut by an interruption stays apart
        f.flush()
        os.fsync(f.fileno())


def write_results(out: Path, rows: list[dict]) -> None:
    atomic_write_json(out / "results.json", {"rows": rows})
    if rows:
        header = sorted({k for r in rows for k in r if k not in ("key", "stage_seconds")},  # stages: in the JSON
                        key=lambda k: (k not in asdict(Cell("", "")), k))
        atomic_write_text(out / "results.csv", to_csv(header, [[r.get(k) for k in header] for r in rows]))


def run_cells(models: dict[str, tuple], cells: list[Cell], evaluators: dict[str, Evaluator], out: Path,
              progress: bool = True, compile: bool = False, calibration: dict | None = None) -> list[dict]:
    """Evaluate every cell not yet in out/cells.jsonl; returns all rows (old and new) in cell order.
    `compile` fuses the fake quantizers (see `attach_scheme`); `calibration` ({model: token ids}) feeds
    mitigations that calibrate (smoothquant) and static scales. Each row holds its wall `seconds` and, under
    `stage_seconds`, those of quantize_'s steps and the evaluation (printed per cell with `progress`)."""
    from tqdm.auto import tqdm

    from diffquant.quant.recipe import quantize_
    from diffquant.stopwatch import Stopwatch

    done = load_done(out)
    fp_cache: dict[str, dict] = {r["model"]: r["metrics"] for r in done.values() if r["scheme"] == "fp"}
    todo = [c for c in cells if c.key() not in done]
    bar = tqdm(todo, desc="sweep", unit="cell", disable=not progress)
    for cell in bar:
        bar.set_postfix_str(cell.label())
        model = models[cell.model][0]
        recipe = cell.recipe()
        float_cell = recipe.scheme.is_identity and not recipe.fixes
        clock = Stopwatch()  # the cell's stages (none for a cached float cell)
        if float_cell and cell.model in fp_cache:
            metrics, name = fp_cache[cell.model], recipe.scheme.name
        else:
            calib = (calibration or {}).get(cell.model)
            if recipe.needs_calibration and calib is None:
                raise DiffquantError(f"{cell.label()}: static scales, fixes and weight solvers need calibration data")
            with quantize_(model, recipe, calib, compile=compile) as q:
                clock.add(q.seconds)
                metrics, name = evaluators[cell.model](model), q.scheme.name
                clock.lap("evaluate")
            if float_cell:
                fp_cache[cell.model] = metrics
        if not float_cell and cell.model in fp_cache:
            metrics = {**metrics, **versus_float(fp_cache[cell.model], metrics)}
        row = {"key": cell.key(), **asdict(cell), "scheme": name, "metrics": metrics,
               "seconds": clock.total(), "stage_seconds": clock.seconds}
        if cell.kind == "recipe":  # its fixes and solver, in the columns the other cells fill from their axes
            row.update(mitigate=" → ".join(f.label() for f in recipe.fixes) or "none",
                       weights=recipe.solver.label() if recipe.solver else "rtn")
        if progress and clock.seconds:
            bar.write(f"{cell.label()}: " + ", ".join(f"{k} {v:.1f} s" for k, v in clock.seconds.items()))
        append_row(out, row)
        done[cell.key()] = row
        write_results(out, [_flat(done[c.key()]) for c in cells if c.key() in done])
    return [_flat(done[c.key()]) for c in cells]


def versus_float(fp: dict, q: dict) -> dict:
    """The cell's change from its model's float evaluation on the same sequences and examples: paired Δloss
    with its 95% interval and the same as a perplexity change in % (exp(Δ) − 1); for each multiple-choice
    accuracy, the change in accuracy with the exact McNemar test over the same examples."""
    import math

    from diffquant.stats.intervals import mcnemar_exact, paired

    out = {}
    if "per_sequence_loss" in fp and "per_sequence_loss" in q:
        d = paired(fp["per_sequence_loss"], q["per_sequence_loss"])
        pct = lambda x: 100 * (math.exp(x) - 1)  # noqa: E731
        out.update({"delta_loss": d["mean"], "delta_loss_ci95": d["ci95"], "ppl_change_pct": pct(d["mean"]),
                    "ppl_change_pct_ci95": [pct(x) for x in d["ci95"]] if d["ci95"] else None})
    for key in OUTCOMES:
        for name in (k[:-len(key)] for k in q if k.endswith(key) and k in fp):
            metric = name + key.replace("_correct", "_acc")
            t = mcnemar_exact(fp[name + key], q[name + key])
            out.update({f"{metric}_delta": t["delta"], f"{metric}_mcnemar_p": t["p"], f"{metric}_gained": t["gained"],
                        f"{metric}_lost": t["lost"]})
    return out


OUTCOMES = ("_correct", "_correct_norm")  # per-example 0/1 metrics of a multiple-choice task, kept in cells.jsonl


def _flat(row: dict) -> dict:
    """A result row: the cell and its metrics, without the per-sequence and per-example values (kept in
    cells.jsonl)."""
    return {**{k: v for k, v in row.items() if k != "metrics"},
            **{k: v for k, v in row["metrics"].items() if k != "per_sequence_loss" and not k.endswith(OUTCOMES)}}


def cell_text(r: dict, metric: str) -> str:
    """Perplexity as "74.11 [71.8, 76.5]" (exp of the loss's 95% t-interval over sequences), other metrics as
    "0.242 ± 0.010", with the paired change from float for quantized cells: "76.04 [73.7, 78.5] (+2.6% [+2.1, +3.1])";
    a multiple-choice accuracy: "61.3% [55.7, 66.7] (-2.0 pts, McNemar p = 0.041)" (95% Wilson interval, paired
    change from float with the exact McNemar test)."""
    from diffquant.stats.intervals import fmt_interval, fmt_pm, half95

    v = r.get(metric)
    if v is None:
        return "-"
    if r.get(f"{metric}_ci95") and metric != "ppl":  # a multiple-choice accuracy: Wilson interval, McNemar test
        lo, hi = r[f"{metric}_ci95"]
        text = f"{100 * v:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}]"
        if r.get(f"{metric}_mcnemar_p") is not None:
            text += f" ({100 * r[f'{metric}_delta']:+.1f} pts, McNemar p = {r[f'{metric}_mcnemar_p']:.2g})"
        return text
    if metric == "ppl":
        text = fmt_interval(v, r.get("ppl_ci95"), 4)
    else:
        text = fmt_pm(v, half95(r.get(f"{metric}_se"), sample_size(r, metric)), 4)
    if metric == "ppl" and r.get("ppl_change_pct_ci95"):
        lo, hi = r["ppl_change_pct_ci95"]
        text += f" ({r['ppl_change_pct']:+.1f}% [{lo:+.1f}, {hi:+.1f}])"
    return text


def summary_table(rows: list[dict], metric: str | None = None) -> str:
    """Markdown: one line per (model, site, granularity), one column per bit-width, `metric` (default: the first of
    perplexity, needle, a task's accuracy) with its 95% interval and, for quantized cells, the paired change from the
    model's float evaluation."""
    from diffquant.report.tables import markdown

    act = [r for r in rows if r["kind"] == "act" and (metric is None or metric in r)]
    if not act:
        return ""
    metric = metric or next((k for k in ("ppl", "needle_choice") if k in act[0]), None) or \
        next(k for k in act[0] if k.endswith("_acc"))
    bits = sorted({r["bits"] for r in act}, reverse=True)
    groups: dict[tuple, dict] = {}
    for r in act:
        if r["bits"] == NATIVE and r.get("mitigate", "none") == "none":
            continue
        groups.setdefault((r["model"], r["site"], r["granularity"], r.get("mitigate", "none")), {})[r["bits"]] = r
    fp = {r["model"]: r for r in act if r["bits"] == NATIVE and r.get("mitigate", "none") == "none"}
    fixes = any(k[3] != "none" for k in groups)

    def cell(m, v, b):
        r = v.get(b, fp.get(m) if b == NATIVE else None)
        return cell_text(r, metric) if r is not None else "-"

    body = [[m, s, g, *([fix] if fixes else []), *[cell(m, v, b) for b in bits]] for (m, s, g, fix), v in groups.items()]
    n = next((r.get(metric.replace("_acc", "_examples")) if metric.endswith("_acc") else r.get("tokens")
              for r in act), None)
    if metric != "ppl" and act[0].get(f"{metric}_ci95"):
        how = "95% Wilson interval; in parentheses the paired change from 16-bit with the exact McNemar test"
    else:
        what = ("perplexity [95% interval: exp of the loss's t-interval over sequences]" if metric == "ppl"
                else f"{metric} ± 95% t-interval")
        how = f"{what}; in parentheses the change from 16-bit with its 95% paired t-interval"
    return (f"{metric} by bit-width ({n:,} held-out {'tokens' if metric == 'ppl' else 'examples'} per cell; {how}):\n\n"
            + markdown(["model", "site", "granularity", *(["fix"] if fixes else []), *[f"{b}-bit" for b in bits]], body))


def sweep_metrics(rows: list[dict]) -> list[str]:
    """The metrics a sweep measured, in the order reports show them: perplexity, needle retrieval, each multiple-choice
    task's accuracy (`acc`: its plain log-likelihood choice, the accuracy figure's metric)."""
    keys = {k for r in rows for k in r}
    return ([m for m in ("ppl", "needle_choice") if m in keys]
            + sorted(k for k in keys if k.endswith("_acc") and k != "next_token_acc"))


def _quantizes_weights(row: dict) -> bool:
    """Whether a result row's cell quantized weights: a whole-model scheme with weight quantizers, a W×A grid cell."""
    if row["kind"] == "scheme":
        from diffquant.quant.numerics.scheme import get_scheme

        return bool(get_scheme(row["site"]).weights)
    if row["kind"] == "recipe":
        from diffquant.quant.recipe import load_recipe

        return bool(load_recipe(row["site"]).scheme.weights)
    return row.get("wbits", NATIVE) != NATIVE


def sweep_report(rows: list[dict], caveats: dict[str, str] | None = None) -> str:
    """What `diffquant sweep` prints: a bit-width table per metric, the whole-model schemes' rows (every metric a
    column) and, where a model's weights were quantized before it was loaded, its caveat beside the schemes that
    quantize weights."""
    from diffquant.report.tables import markdown

    metrics = sweep_metrics(rows)
    parts = [t for t in (summary_table(rows, m) for m in metrics) if t]
    other = [r for r in rows if r["kind"] != "act"]
    if other:
        cols = ["model", "scheme", "fix", "weights", *metrics]
        body = [[r["model"], r["site"] if r["kind"] == "scheme" else r["scheme"], r.get("mitigate", "none"),
                 r.get("weights", "rtn"), *[cell_text(r, m) for m in metrics]] for r in other]
        parts.append("Whole-model schemes (in parentheses the paired change from the model's float evaluation):\n\n"
                     + markdown(cols, body))
    weighted = {r["model"] for r in other if _quantizes_weights(r)}
    notes = [f"caveat: {text}" for model, text in (caveats or {}).items() if model in weighted]
    return "\n\n".join(parts + notes)


def source_caveats(models: dict[str, tuple]) -> dict[str, str]:
    """{label: caveat} of the models whose weights were quantized before they were loaded (models/load.py)."""
    return {label: m._diffquant_caveat for label, (m, _) in models.items() if getattr(m, "_diffquant_caveat", None)}


def run_sweep(models: dict[str, tuple], data: str, out: Path, *, sites: list[str], bits: list[int],
              granularities: list[str], schemes: list[str], fixes: list[str], weights: list[str],
              wa_grid: list[int] | None, per_layer: int | None, evals: list[str], seq_len: int, tokens: int,
              kurtosis_tokens: int = 0, mc_limit: int = 200, cache: str | None = None, compile: bool = False,
              progress: bool = True, kernels: str | None = None, calib_tokens: int | None = None,
              recipes: list[str] = ()) -> list[dict]:
    """The whole sweep of `models` ({label: (model, tokenizer)}): evaluation windows (`tokens` of the validation
    split of `data`), calibration windows (`calib_tokens` of the training split, by default 16 windows, for fixes,
    weight solvers and static scales), the cells (`recipes`: one cell per recipe file), and their rows, resumably
    in `out` (the command line and `dq.sweep` both run this). `kernels`: the tapped attention's and the kurtosis
    profile's (diffquant/kernels; None: the choice in force)."""
    from diffquant.data.tasks import load_task
    from diffquant.data.windows import corpus_text, corpus_windows
    from diffquant.kernels import chosen
    from diffquant.memory import check_fits
    from diffquant.paths import atomic_write_json

    check_evals(evals)
    out.mkdir(parents=True, exist_ok=True)
    held = {label: m._diffquant_source_quantization for label, (m, _) in models.items()
            if getattr(m, "_diffquant_source_quantization", None)}
    if held:  # compressed-tensors checkpoints: what they held (weights dequantized: the "16-bit" cells run them)
        atomic_write_json(out / "source_quantization.json", held)
    caveats = source_caveats(models)
    if caveats:  # weights quantized before they were loaded: beside every weight-quantization row of the report
        atomic_write_json(out / "source_caveats.json", caveats)
    # the needle haystack, and the text the per-layer kurtosis profile reads
    val = corpus_text(data, "validation", cache) if "needle" in evals or kurtosis_tokens else ""
    mc = {e[3:]: load_task(e[3:], mc_limit, cache=cache) for e in evals if e.startswith("mc:")}
    evaluators, calibration = {}, {}
    for label, (model, tokenizer) in models.items():
        if tokenizer is None:
            raise DiffquantError(f"model {label} has no tokenizer")
        check_fits(model, 8, seq_len, f"evaluating {label}")
        evaluators[label] = Evaluator(evals, corpus_windows(data, tokenizer, "validation", seq_len, tokens, cache),
                                      tokenizer, val, mc)
        calibration[label] = corpus_windows(data, tokenizer, "train", seq_len, calib_tokens or 16 * seq_len, cache,
                                            chars=200_000)
    layers = {label: m.config.num_hidden_layers for label, (m, _) in models.items()}
    cells = build_cells(list(models), sites, bits, granularities, wa_grid, per_layer, layers, fixes, schemes, weights,
                        recipes)
    with chosen(kernels):
        if kurtosis_tokens:
            save_layer_kurtosis(models, val, seq_len, kurtosis_tokens, out)
        return run_cells(models, cells, evaluators, out, progress=progress, compile=compile, calibration=calibration)

