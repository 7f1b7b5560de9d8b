"""A pre-registered comparison, read from its committed plan file: the plan's sha256, its primary metrics expanded per
kind of site, and the one test family (Welch over seeds on the transformed values, Holm over the family, TOST within
the plan's margins, each verdict with its minimum detectable effect). Shared by the head-norm decomposition
(experiments/headnorm.py) and the second one (experiments/decomposition.py); not an entry point.

Transforms: `raw` (the value), `log` (natural log of a positive magnitude: differences are factors), `logcost` (the
log of a perplexity cost in %, floored at the plan's `floor` first: a cost at or below the floor, which the
held-out tokens cannot resolve from zero, counts as the floor)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import yaml


def read_plan(path: Path) -> dict:
    """The committed plan, with its sha256 and its primary metrics expanded per kind of site ("{kind}" keys)."""
    text = Path(path).read_text()
    plan = yaml.safe_load(text)
    plan["sha256"] = hashlib.sha256(text.encode()).hexdigest()
    metrics = []
    for m in plan["primary"]:
        kinds = plan["kinds"] if "{kind}" in m["key"] else [None]
        metrics += [{**m, "key": m["key"].format(kind=k) if k else m["key"], "kind": k} for k in kinds]
    plan["metrics"] = metrics
    return plan


def transform(values: list, how: str, floor: float | None = None) -> list:
    if how == "raw":
        return values
    if how == "logcost":
        return [None if v is None else math.log(max(v, floor)) for v in values]
    return [math.log(v) if v is not None and v > 0 else None for v in values]


def tests(plan: dict, per_arm: dict[str, list[dict]]) -> list[dict]:
    """Welch and TOST per (contrast, primary metric) on the transformed values; Holm over the whole family for
    each; the verdict and the minimum detectable effect in the metric's units."""
    from statistics import stdev

    from diffquant.lab import holm_adjust, minimum_detectable_effect, tost, welch

    rows = []
    for c in plan["contrasts"]:
        for m in plan["metrics"]:
            a = transform([x.get(m["key"]) for x in per_arm[c["a"]]], m["transform"], m.get("floor"))
            b = transform([x.get(m["key"]) for x in per_arm[c["b"]]], m["transform"], m.get("floor"))
            row = {"contrast": c["name"], "a": c["a"], "b": c["b"], "metric": m["key"], "transform": m["transform"],
                   "margin": m["margin"], "n": min(len([v for v in a if v is not None]),
                                                   len([v for v in b if v is not None]))}
            if len({v for v in a + b if v is not None}) <= 1:
                rows.append({**row, "diff": 0.0, "p": None, "p_tost": None, "constant": True})
                continue
            w, e = welch(a, b), tost(a, b, m["margin"])
            sd = math.sqrt((stdev([v for v in a if v is not None]) ** 2 + stdev([v for v in b if v is not None]) ** 2) / 2)
            rows.append({**row, "diff": w["diff"], "p": w["p"], "p_tost": e["p"], "ci90": e["ci90"], "sd": sd})
    tested = [r for r in rows if not r.get("constant")]
    for r, p, q in zip(tested, holm_adjust([r["p"] for r in tested]), holm_adjust([r["p_tost"] for r in tested])):
        r["p_holm"], r["p_tost_holm"] = p, q
    mde = minimum_detectable_effect(min(len(v) for v in per_arm.values()), max(1, len(tested)), plan["alpha"],
                                    plan["power"])
    for r in rows:
        r["mde_sd"] = mde
        r["verdict"] = verdict(r, mde, plan["alpha"])
    return rows


def units(value: float, how: str) -> str:
    """A difference in the metric's own units: a factor for log metrics, the value otherwise."""
    return f"×{math.exp(value):.3g}" if how in ("log", "logcost") else f"{value:+.3g}"


def _margin(r: dict) -> str:
    return f"×{math.exp(r['margin']):.3g}" if r["transform"] in ("log", "logcost") else f"±{r['margin']:g}"


def verdict(r: dict, mde: float, alpha: float) -> str:
    if r.get("constant"):
        return "constant (no test)"
    if r["p_holm"] < alpha:
        found = f"{'higher' if r['diff'] > 0 else 'lower'} ({units(r['diff'], r['transform'])})"
        if r["p_tost_holm"] < alpha:  # detected, and still inside the plan's margin: a small difference
            found += f"; also within {_margin(r)} (TOST)"
        return found
    if r["p_tost_holm"] < alpha:
        return f"equivalent within {_margin(r)} (TOST)"
    detectable = mde * r["sd"]
    size = f"×{math.exp(detectable):.3g}" if r["transform"] in ("log", "logcost") else f"{detectable:.3g}"
    return f"no difference detected (n = {r['n']}, minimum detectable effect {mde:.2f} SD = {size})"


def fmt_p(p: float | None) -> str:
    return "-" if p is None else f"{p:.3g}"


def fmt_g(v) -> str:
    return "-" if v is None else f"{v:.4g}"
