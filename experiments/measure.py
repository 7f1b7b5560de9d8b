"""Shared by the emergence, rivals and mitigation experiments: measure one trained model on held-out
sequences, and aggregate seeds into mean ± 95% t-intervals (metrics listed scale-free first)."""

from __future__ import annotations

import math

import torch

import diffquant as dq
from diffquant.lab import paired, t_interval

# key: (label, digits). Scale-free first: the designs' residual scales differ up to 10× (hidden medians 1.15-12.8
# in the demo setting) and RMSNorm makes scale irrelevant to quantization, so only ratios, kurtosis and sink shares
# compare designs; the quantization costs and the loss follow, the absolute magnitudes come last.
METRICS = {
    "hidden_ratio": ("hidden top-1 / median", 3),
    "logit_ratio": ("attention-logit top-1 / median", 3),
    "massive_ratio": ("max‖h‖ / median‖h‖", 3),
    "hidden_kurtosis": ("hidden kurtosis", 3),
    "sink_rate": ("sink rate", 2),
    "first_share_mean": ("first-token share", 3),
    "logits_int4_cost": ("logits int4: Δppl %", 3),
    "w8a8_cost": ("W8A8 per-token dynamic: Δppl %", 3),
    "loss": ("held-out loss (nats)", 4),
    "logit_top1": ("attention-logit top-1", 3),
    "logit_median": ("attention-logit median", 3),
    "hidden_top1": ("hidden-state top-1", 4),
    "hidden_median": ("hidden-state median", 3),
    "w8a8_static_cost": ("W8A8 static per-tensor: Δppl %", 3),
    "w4a4_static_cost": ("W4A4 static per-tensor: Δppl %", 3),
    "w4a4_cost": ("W4A4 per-token dynamic: Δppl %", 3),
    "kv4_cost": ("KV cache int4: Δppl %", 3),
    "kv4_sink1_cost": ("KV cache int4, sink kept: Δppl %", 3),
    "k4v2_cost": ("KV cache K int4 / V int2: Δppl %", 3),
    "kivi2_cost": ("KV cache KIVI-2: Δppl %", 3),
}
SCALE_FREE = ("hidden_ratio", "logit_ratio", "massive_ratio", "hidden_kurtosis", "sink_rate")


def quantization_cost(model, seqs: torch.Tensor, fp_losses: list[float], scheme,
                      calibration: torch.Tensor | None = None) -> dict:
    """Perplexity change (%) under `scheme` (a name or a QuantScheme), paired over the same sequences:
    exp(mean Δloss) − 1, with the paired 95% t-interval of Δloss carried through the same map. A scheme with
    static activation scales is calibrated first on `calibration` (training sequences, never the held-out ones)."""
    with dq.quantize_(model, scheme, calibration):
        q = dq.perplexity(model, seqs)["per_sequence_loss"]
    d = paired(fp_losses, q)
    pct = lambda x: 100 * (math.exp(x) - 1)  # noqa: E731
    return {"pct": pct(d["mean"]), "ci95": [pct(x) for x in d["ci95"]] if d["ci95"] else None, "n": d["n"]}


def cost_key(scheme) -> str:
    """The result key of a scheme's cost: "w8a8_static_cost", "a8_static_attn_in_cost" (name or QuantScheme)."""
    name = scheme if isinstance(scheme, str) else scheme.name
    return name.replace("-", "_").replace(":", "_") + "_cost"


def measure(model, seqs: torch.Tensor, schemes=("logits-int4",), calibration: torch.Tensor | None = None,
            metric_sets=(), positions: torch.Tensor | None = None) -> dict:
    """Loss, Table 5 analog (pooled logits and hidden states), sink rate (DIFF: over differential heads by
    their share of A1 − λ·A2 on token 0, stats/sinks.py), the mean first-token share, λ per layer (DIFF),
    massive-activation ratio and the perplexity cost of each scheme (a preset name or a QuantScheme), all on
    the same held-out sequences; `metric_sets` adds the papers' sets (under "metric_sets"), `positions` the
    loss at selected predictions ("positions_loss", dq.perplexity)."""
    fp = dq.perplexity(model, seqs, positions=positions)
    prof = dq.profile(model, seqs, ["*.attn_logits", "*.hidden"], sinks=True, k=10, metrics=metric_sets)
    logits, hidden = prof.pooled("attn_logits").summary(full=False), prof.pooled("hidden").summary(full=False)
    sinks = prof.sink_summary()["model"]
    out = {"loss": fp["loss"], "loss_se": fp["loss_se"], "tokens": fp["tokens"], "sequences": fp["sequences"],
           "logit_top1": logits["absmax"], "logit_median": logits["quantiles"]["median"],
           "hidden_top1": hidden["absmax"], "hidden_median": hidden["quantiles"]["median"],
           "hidden_kurtosis": hidden["kurtosis"], "sink_rate": sinks.get("sink_rate"),
           "sink_unit": sinks.get("sink_unit"), "first_share_mean": sinks.get("first_share_mean"),
           "lambda": sinks.get("lambda"), "massive_ratio": sinks.get("massive_ratio_max"), "sinks": sinks}
    out["hidden_ratio"] = out["hidden_top1"] / out["hidden_median"]
    out["logit_ratio"] = out["logit_top1"] / out["logit_median"]
    if positions is not None:
        out["positions_loss"], out["positions_tokens"] = fp["positions_loss"], fp["positions_tokens"]
    if metric_sets:
        out["metric_sets"] = prof.metric_results()
    for scheme in schemes:
        cost = quantization_cost(model, seqs, fp["per_sequence_loss"], scheme, calibration)
        out[cost_key(scheme)] = cost["pct"]
        out[cost_key(scheme) + "_ci95"] = cost["ci95"]
    return out


def aggregate(per_seed: list[dict]) -> dict:
    """{metric: t_interval over seeds} for every metric of METRICS present."""
    return {k: t_interval([m.get(k) for m in per_seed]) for k in METRICS if any(m.get(k) is not None for m in per_seed)}
