"""Saved schemes: write a scheme (with its static scales, the transform applied before it and the weights a
solver chose) beside a model, and attach it again on load. Above both the scheme machinery and the weight
solvers, so neither imports the other."""

from __future__ import annotations

import json
from pathlib import Path

from diffquant.quant.scheme import SCHEME_FILE, QuantScheme, quantize_


def save_scheme(attachment, folder, source: str | None = None, mitigation: dict | None = None, solved=None) -> dict:
    """Write `attachment`'s scheme (with static scales) to folder/diffquant_scheme.json; `source` names the
    float model it applies to, for a folder that holds no weights of its own; `mitigation` is the record of
    a transform applied before the scheme (replayed on load); `solved` the weights a solver (GPTQ) chose,
    written beside it (see `quant/solvers.py`). Returns what was written."""
    from diffquant.paths import atomic_write_json

    scales = {name: q.state() for name, q in attachment.quantizers.items() if q.state()}
    doc = {"scheme": attachment.scheme.to_dict(), "scales": scales}
    if source is not None:
        doc["source"] = source
    if mitigation is not None and mitigation.get("mitigation"):
        doc["mitigation"] = mitigation
    if solved is not None and solved.changed:
        solved.save(folder)
        doc["weights"] = solved.record
    atomic_write_json(Path(folder) / SCHEME_FILE, doc)
    return doc


def load_saved_scheme(model, folder):
    """Re-attach a scheme saved by `save_scheme` to `model` (after replaying its mitigation); returns the
    attachment (with `.mitigation`, the applied transform, and `.solved`, the weights a solver chose, whose
    `remove()` restore the float weights)."""
    data = json.loads((Path(folder) / SCHEME_FILE).read_text())
    mitigation = None
    if data.get("mitigation"):
        from diffquant.quant.mitigate import apply_record

        mitigation = apply_record(model, data["mitigation"])
    solved = None
    if data.get("weights"):
        from diffquant.quant.solvers import load_solved

        solved = load_solved(model, folder, data["weights"])
    attachment = quantize_(model, QuantScheme.from_dict(data["scheme"]))
    attachment.mitigation, attachment.solved = mitigation, solved
    for name, state in data.get("scales", {}).items():
        attachment.quantizers[name].load_state(state)
    return attachment
