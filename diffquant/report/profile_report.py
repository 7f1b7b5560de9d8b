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
    }


SINK_HEADER = ["model", "sink rate (all maps)", "DIFF A1", "DIFF A2", "DIFF A1−λA2", "max ‖h‖ ratio",
               "where (layer, row, pos, channel)", "min ‖v₀‖ ratio", "tokens"]


def sink_rows(models: list[dict]) -> list[list]:
    """One row per model from stats.json entries: Gu et al.'s sink rate (ε = 0.3), DIFF's per map, the
    largest massive-activation ratio with its place, and the smallest value-state norm ratio."""
    rows = []
    for m in models:
        sinks = m.get("sinks") or {}
        if not sinks.get("layers"):
            continue
        rates = sinks["model"]
        best = max(((int(i), v["massive_max"]) for i, v in sinks["layers"].items() if v.get("massive_max")),
                   key=lambda kv: kv[1]["ratio"], default=None)
        where = (f"{best[0]}, {best[1]['row']}, {best[1]['position']}, {best[1]['channel']}" if best else None)
        rows.append([m["label"], rates.get("sink_rate"), rates.get("sink_rate_A1"), rates.get("sink_rate_A2"),
                     rates.get("sink_rate_map"), rates.get("massive_ratio_max"), where, rates.get("value_ratio_min"),
                     m["provenance"].get("tokens")])
    return rows


def write_report(profiles, out: Path, plots: bool = True) -> list[Path]:
    out = Path(out)
    rows = table5_rows(profiles)
    tokens = ", ".join(f"{p.label}: {p.provenance.get('tokens')} tokens" for p in profiles)
    md = (f"Largest |activation| values (Table 5 analog; {tokens}). Attention logits: |q·k/√d| at causal, "
          f"unmasked positions, DIFF maps pooled. Hidden states: decoder-layer outputs. Kurtosis: Pearson "
          f"(Gaussian = 3).\n\n" + markdown(TABLE5_HEADER, rows))
    paper = [[m, KIND_TITLE[k], *v] for (m, k), v in PAPER_TABLE5.items()]
    md += "\nPaper (3B parameters, 350B training tokens, 0.4M tokens profiled):\n\n"
    md += markdown(["model", "activation", "top-1", "top-2", "top-3", "top-10", "top-100", "median"], paper)
    written = [out / "stats.json", out / "table5.md", out / "table5.csv"]
    models = [profile_json(p) for p in profiles]
    sinks = sink_rows(models)
    if sinks:
        md += ("\nAttention sinks (Gu et al.: a head is a sink when its mean attention on the first token, over "
               "queries after the first, exceeds 0.3; sink rate = fraction of heads over all layers) and massive "
               "activations (Sun et al.: max over positions of the residual norm ‖h_t‖ / its median, per sequence, "
               "averaged; the largest single one located). ‖v₀‖ ratio: value-state norm of the first token / median "
               "of the others (Guo et al.'s value drains are ≪ 1).\n\n" + markdown(SINK_HEADER, sinks))
    atomic_write_json(out / "stats.json", {"models": models})
    atomic_write_text(out / "table5.md", md)
    atomic_write_text(out / "table5.csv", to_csv(TABLE5_HEADER, rows))
    if plots:
        from diffquant.report.plots import plot_histograms, plot_layer_series, plot_sinks

        written += plot_layer_series({p.label: layer_series(p) for p in profiles}, out)
        written += plot_histograms(models, out)
        written += plot_sinks(models, out)
    return written
