"""Saved schemes: write a scheme (with its static scales, the fixes applied before it and the weights a solver
chose) beside a model; quant/recipe.py's `load_quantized` attaches it again. Above both the scheme machinery
and the weight solvers, so neither imports the other."""

from __future__ import annotations

from pathlib import Path

from diffquant.quant.numerics.scheme import SCHEME_FILE


def save_scheme(attachment, folder, source: dict | None = None, fixes: list[dict] = (), solved=None) -> dict:
    """Write `attachment`'s scheme (with static scales) to folder/diffquant_scheme.json; `source` names the
    float model it applies to, for a folder that holds no weights of its own; `fixes` are the records of the
    transforms applied before the scheme, in order (replayed on load); `solved` the weights a solver (GPTQ)
    chose, written beside it (see `quant/algorithms/solvers.py`). Returns what was written."""
    from diffquant.paths import atomic_write_json

    scales = {name: q.state() for name, q in attachment.quantizers.items() if q.state()}
    doc = {"scheme": attachment.scheme.to_dict(), "scales": scales}
    if source is not None:
        doc["source"] = source
    fixes = [r for r in fixes if r.get("mitigation")]
    if fixes:
        doc["fixes"] = fixes
    if solved is not None and solved.changed:
        solved.save(folder)
        doc["weights"] = solved.record
    atomic_write_json(Path(folder) / SCHEME_FILE, doc)
    return doc
