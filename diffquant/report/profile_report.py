"""Profiler reports: stats.json, a Table-5-style table, per-layer series, outlier summaries, plots."""

from __future__ import annotations

from pathlib import Path

from diffquant.paths import atomic_write_json, atomic_write_text
from diffquant.report.tables import markdown, to_csv

TABLE5_RANKS = ("top1", "top2", "top3", "top10", "top100")
PAPER_TABLE5 = {  # 3B models, 350B tokens, 0.4M tokens profiled (Ye et al., Table 5)
    ("Transformer", "attn_logits"): (318.0, 308.2, 304.9, 284.7, 251.5, 5.4),
    ("DIFF", "attn_logits"): (38.8, 38.8, 37.3, 32.0, 27.4, 3.3),
    ("Transformer", "hidden"): (3608.6, 3607.4, 3603.6, 3552.1, 2448.2, 0.6),
    ("DIFF", "hidden"): (1688.2, 1672.5, 1672.1, 1624.3, 740.9, 1.2),
}
KIND_TITLE = {"attn_logits": "attention logits", "hidden": "hidden states"}


def table5_rows(profiles) -> list[list]:
    rows = []
    for kind in ("attn_logits", "hidden"):
        for prof in profiles:
            pooled = prof.pooled(kind)
            if pooled is None:
                continue
            s = pooled.summary(full=False)
            rows.append([prof.label, KIND_TITLE[kind], *[s["top"].get(r) for r in TABLE5_RANKS],
                         s["quantiles"]["median"], s["kurtosis"], s["count"], s["nonfinite"]])
    return rows


TABLE5_HEADER = ["model", "activation", "top-1", "top-2", "top-3", "top-10", "top-100", "median", "kurtosis",
                 "values", "non-finite"]


def layer_series(prof) -> dict[str, list[dict]]:
    """Per kind, one row per layer: kurtosis (Pearson, Gaussian = 3), absmax, quantiles, per-pass figures."""
    series: dict[str, list[dict]] = {}
    for name, stats in prof.sites.items():
        layer = prof.layer_of[name]
        if layer is None:
            continue
        s = stats.summary(full=False)
        series.setdefault(prof.kind_of[name], []).append({
            "layer": layer, "site": name, "kurtosis": s["kurtosis"], "absmax": s["absmax"],
            **s["quantiles"], "pass_kurtosis_mean": s.get("pass_kurtosis_mean"),
            "pass_infnorm_max": s.get("pass_infnorm_max"), "count": s["count"]})
    for rows in series.values():
        rows.sort(key=lambda r: r["layer"])
    return series


def int8_outlier_features(prof, kind: str = "hidden", magnitude: float = 6.0, layer_frac: float = 0.25,
                          pos_frac: float = 0.06) -> list[dict]:
    """LLM.int8 outlier features: channels with |x| >= 6 at >= 6% of positions in >= 25% of layers."""
    layers = {n: s for n, s in prof.sites.items() if prof.kind_of[n] == kind and s.channel_hits is not None}
    if not layers:
        return []
    per_channel: dict[int, list[int]] = {}
    for name, s in layers.items():
        frac = s.channel_hits.double().cpu() / max(1, int(s.positions))
        for c in (frac >= pos_frac).nonzero().flatten().tolist():
            per_channel.setdefault(c, []).append(prof.layer_of[name])
    need = layer_frac * len(layers)
    return [{"channel": c, "layers": sorted(ls)} for c, ls in sorted(per_channel.items()) if len(ls) >= need]


def massive_activations(prof, kind: str = "hidden", minimum: float = 100.0, ratio: float = 1000.0) -> list[dict]:
    """Sun et al. massive activations: |x| > 100 and > 1000× the layer's median |x|, with where they sit."""
    found = []
    for name, s in prof.sites.items():
        if prof.kind_of[name] != kind:
            continue
        median = s.hist.quantiles([0.5])[0] or 0.0
        for entry in s.top_entries():
            if abs(entry["value"]) > minimum and abs(entry["value"]) > ratio * median:
                found.append({"layer": prof.layer_of[name], "median": median, **entry})
    return found


def pooled_histograms(prof) -> dict:
    """Sparse |x| histograms pooled over layers, per kind (to redraw histogram figures)."""
    out = {}
    for kind in sorted(set(prof.kind_of.values())):
        pooled = prof.pooled(kind)
        if pooled is None or kind == "weight":
            continue
        out[kind] = pooled.hist.sparse()
    return out


def profile_json(prof) -> dict:
    return {
        "label": prof.label,
        "model": prof.info,
        "provenance": prof.provenance,
        "kurtosis_convention": "Pearson E[(x-mu)^4]/sigma^4 (Gaussian = 3)",
        "sites": {name: s.summary() for name, s in prof.sites.items()},
        "layers": layer_series(prof),
        "int8_outlier_features": int8_outlier_features(prof),
        "massive_activations": massive_activations(prof),
        "histograms": pooled_histograms(prof),
        "sinks": prof.sink_summary(),
        **({"metric_sets": prof.metric_results()} if prof.metric_sets else {}),
    }


SINK_HEADER = ["model", "sink rate", "counted over", "heads counted", "mean first-token share", "λ (min … max)",
               "A1 map sink rate", "A2 map sink rate", "max ‖h‖ ratio", "where (layer, row, pos, channel)",
               "min ‖v₀‖ ratio", "tokens"]


def _span(values) -> str | None:
    values = [v for v in values or () if v is not None]
    return f"{min(values):.3g} … {max(values):.3g}" if values else None


def sink_rows(models: list[dict]) -> list[list]:
    """One row per model from stats.json entries: Gu et al.'s sink rate (ε = 0.3; DIFF: over differential
    heads by their share on token 0), what it counts, the mean first-token share, DIFF's λ range and its
    maps' own rates (detail), the largest massive-activation ratio with its place, and the smallest
    value-state norm ratio."""
    rows = []
    for m in models:
        sinks = m.get("sinks") or {}
        if not sinks.get("layers"):
            continue
        rates = sinks["model"]
        best = max(((int(i), v["massive_max"]) for i, v in sinks["layers"].items() if v.get("massive_max")),
                   key=lambda kv: kv[1]["ratio"], default=None)
        where = (f"{best[0]}, {best[1]['row']}, {best[1]['position']}, {best[1]['channel']}" if best else None)
        undefined = rates.get("sink_heads_undefined")
        counted = rates.get("sink_unit")
        if undefined:
            counted = f"{counted}; {undefined} heads with |1 − λ| ≤ 0.05 not counted"
        rows.append([m["label"], rates.get("sink_rate"), counted, rates.get("sink_heads"),
                     rates.get("first_share_mean"), _span(rates.get("lambda")), rates.get("sink_rate_A1"),
                     rates.get("sink_rate_A2"), rates.get("massive_ratio_max"), where, rates.get("value_ratio_min"),
                     m["provenance"].get("tokens")])
    return rows


DIFF_LAYER_HEADER = ["model", "layer", "λ", "share on token 0 (mean)", "sinks / heads", "A1 first-key mass (mean)",
                     "A2 first-key mass (mean)"]


def diff_layer_rows(models: list[dict]) -> list[list]:
    """DIFF models, one row per layer: λ, the differential heads' mean share and sinks, the mean first-key
    mass of their A1 and A2 maps (per-head values are in stats.json)."""
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    rows = []
    for m in models:
        for i, v in sorted(((m.get("sinks") or {}).get("layers") or {}).items(), key=lambda kv: int(kv[0])):
            if "lambda" not in v:
                continue
            shares = [x for x in v.get("share", ()) if x is not None]
            sink = v.get("sink", {})
            rows.append([m["label"], int(i), v["lambda"], mean(shares) if shares else v.get("share_undefined"),
                         f"{sink.get('sinks')} / {sink.get('heads')}", mean(v["first_mass_A1"]),
                         mean(v["first_mass_A2"])])
    return rows


def metric_set_sections(models: list[dict]) -> str:
    """The selected papers' metric sets, one table each, with their citations and conventions."""
    from diffquant.stats.metric_sets import REGISTRY

    names = list(dict.fromkeys(n for m in models for n in m.get("metric_sets", {})))
    md = ""
    for name in names:
        ms = REGISTRY[name]
        done = [(m["label"], m["metric_sets"][name]) for m in models if name in m.get("metric_sets", {})]
        header, rows = METRIC_SET_TABLES[name]
        md += f"\n**{name}** ({ms.citation}): {ms.definition}. Differs from the default: {ms.differs}.\n\n"
        md += markdown(header, [row for label, r in done for row in rows(label, r)])
        for label, r in done:
            if r["conventions"]:
                md += f"\n{label}, data vs the paper: " + "; ".join(r["conventions"]) + ".\n"
    return md


METRIC_SET_TABLES = {  # name: (header, rows(label, figures))
    "diff-table5": (["model", "activation", "top-1 / median", "top-1", "median"],
                    lambda label, r: [[label, KIND_TITLE[k], r[k]["top1_over_median"], r[k]["top1"], r[k]["median"]]
                                      for k in ("attn_logits", "hidden")]),
    "sun2024": (["model", "layer", "top-1 / median", "top-1", "top-2", "top-3", "median", "massive (> 100, > 1000× median)"],
                lambda label, r: [[label, int(i), v["top1_over_median"], v["top1"], v["top2"], v["top3"], v["median"],
                                   f"{v['massive']} (+{v['massive_undecided']} within 0.8% of the threshold)"
                                   if v["massive_undecided"] else v["massive"]]
                                  for i, v in r["layers"].items()]),
    "gu2024": (["model", "Sink₁ (ε = 0.3)", "counted over", "layers with share undefined"],
               lambda label, r: [[label, r["sink1"], r["unit"], ", ".join(map(str, r["layers_undefined"])) or None]]),
    "bondarenko2023": (["model", "avg kurtosis", "max inf norm", "at site", "max layer-output inf norm",
                        "max kurtosis"],
                       lambda label, r: [[label, r["avg_kurtosis"], r["max_inf_norm"], r["max_inf_norm_site"],
                                          r["max_layer_inf_norm"], r["max_kurtosis"]]]),
    "bondarenko2023-linear": (["model", "Linear input", "max inf norm", "at site", "avg kurtosis", "max kurtosis",
                               "max top-1 / median"],
                              lambda label, r: [[label, kind, v["max_inf_norm"], v["max_inf_norm_site"],
                                                 v["avg_kurtosis"], v["max_kurtosis"], v["max_top1_over_median"]]
                                                for kind, v in r["kinds"].items()]),
}


def table5_markdown(rows: list[list], tokens: str) -> str:
    """The Table 5 analog with the paper's figures under it; `tokens` says how many each model was profiled on."""
    md = (f"Largest |activation| values (Table 5 analog; {tokens}). Attention logits: |q·k/√d| at causal, "
          f"unmasked positions, DIFF maps pooled. Hidden states: decoder-layer outputs. Kurtosis: Pearson "
          f"(Gaussian = 3).\n\n" + markdown(TABLE5_HEADER, rows))
    paper = [[m, KIND_TITLE[k], *v] for (m, k), v in PAPER_TABLE5.items()]
    md += "\nPaper (3B parameters, 350B training tokens, 0.4M tokens profiled):\n\n"
    return md + markdown(["model", "activation", "top-1", "top-2", "top-3", "top-10", "top-100", "median"], paper)


def sink_sections(models: list[dict]) -> str:
    """From stats.json model entries: the sink table, DIFF per layer, and the selected metric sets."""
    md = ""
    sinks = sink_rows(models)
    if sinks:
        md += ("\nAttention sinks (Gu et al.: a head is a sink when its mean attention on the first token, over "
               "queries after the first, exceeds 0.3; sink rate = fraction of heads over all layers). DIFF counts "
               "differential heads: a head's share of its output weight on token 0 is the mean over queries of "
               "(A1 − λ·A2)[q, 0] / (1 − λ) (undefined where |1 − λ| ≤ 0.05); its A1 and A2 maps' own rates are "
               "detail, never pooled into the rate. Massive activations (Sun et al.: max over positions of the "
               "residual norm ‖h_t‖ / its median, per sequence, averaged; the largest single one located). ‖v₀‖ "
               "ratio: value-state norm of the first token / median of the others (Guo et al.'s value drains are "
               "≪ 1).\n\n" + markdown(SINK_HEADER, sinks))
    per_layer = diff_layer_rows(models)
    if per_layer:
        md += "\nDIFF per layer (means over differential heads):\n\n" + markdown(DIFF_LAYER_HEADER, per_layer)
    return md + metric_set_sections(models)


def caveat_lines(models: list[dict]) -> str:
    """Where a model's weights were quantized before it was loaded (models/load.source_caveat), said under the tables:
    its activations are those of the dequantized weights."""
    lines = [f"- {m['model']['caveat']}" for m in models if m["model"].get("caveat")]
    return ("\nSource caveats (activation statistics here are those of the dequantized model):\n\n"
            + "\n".join(lines) + "\n") if lines else ""


def write_report(profiles, out: Path, plots: bool = True) -> list[Path]:
    out = Path(out)
    rows = table5_rows(profiles)
    tokens = ", ".join(f"{p.label}: {p.provenance.get('tokens')} tokens" for p in profiles)
    models = [profile_json(p) for p in profiles]
    md = table5_markdown(rows, tokens) + sink_sections(models) + caveat_lines(models)
    written = [out / "stats.json", out / "table5.md", out / "table5.csv"]
    atomic_write_json(out / "stats.json", {"models": models})
    atomic_write_text(out / "table5.md", md)
    atomic_write_text(out / "table5.csv", to_csv(TABLE5_HEADER, rows))
    if plots:
        from diffquant.report.plots import plot_histograms, plot_layer_series, plot_sinks

        written += plot_layer_series({p.label: layer_series(p) for p in profiles}, out)
        written += plot_histograms(models, out)
        written += plot_sinks(models, out)
    return written
