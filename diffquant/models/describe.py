"""What a loaded model is, for reports: kept apart from loading so the profiler need not import the loaders."""

from __future__ import annotations


def describe(model) -> dict:
    """Provenance of a model for reports."""
    p = next(model.parameters())
    return {
        "name": getattr(model, "name_or_path", "") or type(model).__name__,
        "architecture": type(model).__name__,
        "model_type": model.config.model_type,
        "parameters": sum(x.numel() for x in model.parameters()),
        "layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size,
        "dtype": str(p.dtype).replace("torch.", ""),
        "device": str(p.device),
        **({"quantization": model._diffquant_source_quantization}  # a compressed-tensors checkpoint's (dequantized)
           if getattr(model, "_diffquant_source_quantization", None) else {}),
        **({"caveat": model._diffquant_caveat} if getattr(model, "_diffquant_caveat", None) else {}),
    }


def display(label: str) -> str:
    """The report name of an architecture key, a zoo name or alias, or a label ("baseline" -> "Transformer",
    "smollm2-135m" -> "SmolLM2-135M-Instruct (Q4_1 → fp32)"). A zoo alias followed by a qualifier keeps it
    ("SmolLM2-135M (demo)" -> "SmolLM2-135M-Instruct (Q4_1 → fp32) (demo)")."""
    from diffquant.designs import DESIGNS
    from diffquant.models.zoo import zoo_entry

    if label in DESIGNS:
        return DESIGNS[label].display
    head, _, rest = label.partition(" ")
    entry = zoo_entry(label) or zoo_entry(head)
    if entry is None:
        return label
    return entry.display + ("" if zoo_entry(label) else f" {rest}")
