"""Bit-width sweeps: every (model, site, bits, granularity) cell, a weight × activation grid, and
per-layer sensitivity. Each finished cell is appended to `cells.jsonl` at once, so an interrupted sweep
resumes without redoing finished cells; `results.csv`/`results.json` are rewritten atomically after each.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from diffquant import DiffquantError
from diffquant.paths import atomic_write_json, atomic_write_text
from diffquant.quant import granularity as G
from diffquant.quant.config import int_config
from diffquant.quant.scheme import LAYER_WEIGHTS, LINEAR_INPUTS, QuantScheme
from diffquant.report.tables import to_csv

NATIVE = 16  # "16 bits": the model's own precision, as in the paper's Figure 8


@dataclass(frozen=True)
class Cell:
    model: str
    kind: str  # "act": one site everywhere; "wa": weights × Linear inputs; "layer": one site of one layer;
    # "scheme": the named scheme (a preset or file) in `site`
    site: str = "attn_logits"
    bits: int = NATIVE  # activation bits
    granularity: str = "tensor"
    wbits: int = NATIVE
    layer: int | None = None
    mitigate: str = "none"  # a function-preserving transform applied before the scheme (quant/mitigate.py)
    weights: str = "rtn"  # how the weights reach their grid (quant/solvers.py)

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
        if self.kind == "wa":
            return f"{self.model} W{self.wbits}A{self.bits}{fix}"
        where = f"layer {self.layer} " if self.kind == "layer" else ""
        bits = "fp" if self.bits == NATIVE else f"int{self.bits} per {self.granularity}"
        return f"{self.model} {where}{self.site} {bits}{fix}"

    def scheme(self) -> QuantScheme:
        if self.kind == "scheme":
            from diffquant.quant.scheme import get_scheme

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
                solvers: list[str] = ("rtn",)) -> list[Cell]:
    """Every cell of a sweep; the weight solvers vary the weight × activation grid only (the other cells
    quantize no weights)."""
    from diffquant.quant import solvers as S
    from diffquant.quant.mitigate import parse

    for g in grans:
        G.parse_granularity(g)  # fail before any model runs
    for m in mitigations:
        parse(m)
    for s in solvers:
        S.parse(s)
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
            if layer_bits:
                for site in sites:
                    cells += [Cell(label, "layer", site, layer_bits, grans[0], layer=i, mitigate=fix)
                              for i in range(layers[label])]
    return list(dict.fromkeys(cells))  # the float reference may also be one of the requested cells


class Evaluator:
    """Runs the requested evaluations of one model; `fp` results are computed once per model."""

    def __init__(self, evals: list[str], sequences, tokenizer, haystack: str, mc: dict[str, list]):
        self.evals, self.sequences, self.tokenizer, self.haystack, self.mc = evals, sequences, tokenizer, haystack, mc

    def __call__(self, model) -> dict:
        from diffquant.data.needle import needle_accuracy
        from diffquant.evaluate import language_modeling, multiple_choice

        out = {}
        for e in self.evals:
            if e == "ppl":
                r = language_modeling(model, self.sequences)
                out.update({"loss": r["loss"], "loss_se": r["loss_se"], "ppl": r["ppl"], "ppl_ci95": r["ppl_ci95"],
                            "next_token_acc": r["accuracy"], "next_token_acc_se": r["accuracy_se"],
                            "tokens": r["tokens"], "per_sequence_loss": r["per_sequence_loss"]})
            elif e == "needle":
                r = needle_accuracy(model, self.tokenizer, self.haystack)
                out.update({"needle_choice": r["choice"], "needle_exact": r["exact"]})
            elif e.startswith("mc:"):
                r = multiple_choice(model, self.tokenizer, self.mc[e[3:]])
                name = task_label(e[3:])
                out.update({f"{name}_acc": r["acc"], f"{name}_acc_se": r["acc_se"], f"{name}_acc_norm": r["acc_norm"],
                            f"{name}_acc_norm_se": r["acc_norm_se"], f"{name}_examples": r["examples"]})
        return out


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
    with open(out / "cells.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_results(out: Path, rows: list[dict]) -> None:
    atomic_write_json(out / "results.json", {"rows": rows})
    if rows:
        header = sorted({k for r in rows for k in r if k != "key"}, key=lambda k: (k not in asdict(Cell("", "")), k))
        atomic_write_text(out / "results.csv", to_csv(header, [[r.get(k) for k in header] for r in rows]))


def run_cells(models: dict[str, tuple], cells: list[Cell], evaluators: dict[str, Evaluator], out: Path,
              progress: bool = True, compile: bool = False, calibration: dict | None = None) -> list[dict]:
    """Evaluate every cell not yet in out/cells.jsonl; returns all rows (old and new) in cell order.
    `compile` fuses the fake quantizers (see `quantize_`); `calibration` ({model: token ids}) feeds
    mitigations that calibrate (smoothquant) and static scales."""
    from tqdm.auto import tqdm

    from diffquant.quant import solvers
    from diffquant.quant.mitigate import adjust_scheme, mitigate_, parse
    from diffquant.quant.scheme import calibrate, quantize_

    done = load_done(out)
    fp_cache: dict[str, dict] = {r["model"]: r["metrics"] for r in done.values() if r["scheme"] == "fp"}
    todo = [c for c in cells if c.key() not in done]
    bar = tqdm(todo, desc="sweep", unit="cell", disable=not progress)
    for cell in bar:
        bar.set_postfix_str(cell.label())
        model = models[cell.model][0]
        fix = parse(cell.mitigate)
        scheme = adjust_scheme(cell.scheme(), fix)
        calib = (calibration or {}).get(cell.model)
        t0 = time.perf_counter()
        if scheme.is_identity and fix is None and cell.model in fp_cache:
            metrics = fp_cache[cell.model]
        else:
            applied = mitigate_(model, fix, calib)
            attachment = solved = None
            try:
                solved = solvers.solve_weights_(model, solvers.parse(cell.weights), scheme, calib, progress=False)
                scheme = solved.scheme(scheme)
                attachment = quantize_(model, scheme, compile)
                solved.install(attachment)
                if any(not q.config.dynamic for q in attachment.quantizers.values()):
                    if calib is None:
                        raise DiffquantError(f"{cell.label()}: static scales need calibration data")
                    calibrate(model, attachment, calib.split(8))
                metrics = evaluators[cell.model](model)
            finally:
                if attachment is not None:
                    attachment.remove()
                if solved is not None:
                    solved.remove()
                applied.remove()
            if scheme.is_identity and fix is None:
                fp_cache[cell.model] = metrics
        if (not scheme.is_identity or fix is not None) and cell.model in fp_cache:
            metrics = {**metrics, **versus_float(fp_cache[cell.model], metrics)}
        row = {"key": cell.key(), **asdict(cell), "scheme": scheme.name, "metrics": metrics,
               "seconds": time.perf_counter() - t0}
        append_row(out, row)
        done[cell.key()] = row
        write_results(out, [_flat(done[c.key()]) for c in cells if c.key() in done])
    return [_flat(done[c.key()]) for c in cells]


def versus_float(fp: dict, q: dict) -> dict:
    """The cell's change from its model's float evaluation on the same sequences: paired Δloss with its 95%
    interval, and the same as a perplexity change in % (exp(Δ) − 1)."""
    import math

    from diffquant.stats.intervals import paired

    if "per_sequence_loss" not in fp or "per_sequence_loss" not in q:
        return {}
    d = paired(fp["per_sequence_loss"], q["per_sequence_loss"])
    pct = lambda x: 100 * (math.exp(x) - 1)  # noqa: E731
    return {"delta_loss": d["mean"], "delta_loss_ci95": d["ci95"], "ppl_change_pct": pct(d["mean"]),
            "ppl_change_pct_ci95": [pct(x) for x in d["ci95"]] if d["ci95"] else None}


def _flat(row: dict) -> dict:
    """A result row: the cell and its metrics, without the per-sequence values (kept in cells.jsonl)."""
    return {**{k: v for k, v in row.items() if k != "metrics"},
            **{k: v for k, v in row["metrics"].items() if k != "per_sequence_loss"}}


def run_cli(args) -> None:
    from diffquant.data.corpora import load_text, split
    from diffquant.data.tasks import load_task
    from diffquant.data.tokens import encode, sequences
    from diffquant.models.load import load_model
    from diffquant.profile import parse_model_args

    evals = [e.strip() for e in args.eval.split(",") if e.strip()]
    check_evals(evals)
    bits = parse_bits(args.bits)
    wa = parse_bits(args.wa_grid) if args.wa_grid else None
    grans = [g.strip() for g in args.granularity.split(",") if g.strip()]
    sites = [s.strip() for s in args.sites.split(",") if s.strip()]
    if args.tokens <= 0:
        raise DiffquantError(f"--tokens must be positive, got {args.tokens}")
    out = Path(args.out)
    config = {k: v for k, v in vars(args).items()
              if k not in ("func", "resume", "force", "no_plots", "debug", "compile")}
    if (out / "cells.jsonl").exists():
        if args.force:
            for name in ("cells.jsonl", "results.json", "results.csv"):
                (out / name).unlink(missing_ok=True)
        elif not args.resume:
            raise DiffquantError(f"{out} already holds a sweep; pass --resume to continue it or --force to restart")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "sweep_config.json", config)
    text, _ = load_text(args.data, args.cache_dir)
    _, val = split(text)
    mc = {e[3:]: load_task(e[3:], args.mc_limit, cache=args.cache_dir) for e in evals if e.startswith("mc:")}
    train_text = split(text)[0][:200_000]
    models, evaluators, calibration = {}, {}, {}
    for label, source in parse_model_args(args.model):
        model, tokenizer = load_model(source, cache=args.cache_dir)
        if tokenizer is None:
            raise DiffquantError(f"{source} has no tokenizer")
        models[label] = (model, tokenizer)
        evaluators[label] = Evaluator(evals, sequences(encode(tokenizer, val), args.seq_len, args.tokens), tokenizer,
                                      val, mc)
        calibration[label] = sequences(encode(tokenizer, train_text), args.seq_len, 16 * args.seq_len)
    layers = {label: m.config.num_hidden_layers for label, (m, _) in models.items()}
    mitigations = [m.strip() for m in args.mitigate.split(",") if m.strip()]
    cells = build_cells(list(models), sites, bits, grans, wa, args.per_layer, layers, mitigations,
                        [s.strip() for s in args.weights.split(",") if s.strip()])
    rows = run_cells(models, cells, evaluators, out, compile=args.compile, calibration=calibration)
    if not args.no_plots:
        from diffquant.report.sweep_plots import plot_sweep

        plot_sweep(rows, out)
    print(summary_table(rows))
    print(f"results in {out / 'results.csv'}")


def cell_text(r: dict, metric: str) -> str:
    """"74.11 ± 1.20" (95% interval over sequences), with the paired change from float for quantized cells:
    "76.04 ± 1.25 (+2.6% [+2.1, +3.1])"."""
    from diffquant.stats.intervals import Z95, fmt_pm

    v = r.get(metric)
    if v is None:
        return "-"
    if metric == "ppl":
        half = Z95 * r["loss_se"] * v if r.get("loss_se") else None  # delta method: d ppl = ppl · d loss
    else:
        se = r.get(f"{metric}_se")
        half = Z95 * se if se is not None else None
    text = fmt_pm(v, half, 4)
    if metric == "ppl" and r.get("ppl_change_pct_ci95"):
        lo, hi = r["ppl_change_pct_ci95"]
        text += f" ({r['ppl_change_pct']:+.1f}% [{lo:+.1f}, {hi:+.1f}])"
    return text


def summary_table(rows: list[dict]) -> str:
    """Markdown: one line per (model, site, granularity), one column per bit-width, first metric with its 95%
    interval over sequences and, for quantized cells, the paired change from the model's float evaluation."""
    from diffquant.report.tables import markdown

    act = [r for r in rows if r["kind"] == "act"]
    if not act:
        return ""
    metric = next((k for k in ("ppl", "needle_choice") if k in act[0]), None) or \
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
    n = next((r.get("tokens") or r.get(metric.replace("_acc", "_examples")) for r in act), None)
    return (f"{metric} by bit-width ({n:,} held-out {'tokens' if metric == 'ppl' else 'examples'} per cell; ± = 95% "
            "interval over sequences; in brackets the change from 16-bit with its 95% paired interval):\n\n"
            + markdown(["model", "site", "granularity", *(["fix"] if fixes else []), *[f"{b}-bit" for b in bits]], body))
