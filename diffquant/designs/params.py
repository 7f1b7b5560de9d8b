"""Parameter bookkeeping shared by the registry and the designs that add parameters (no transformers import)."""

from __future__ import annotations


def mlp_narrowing(added: int, hidden: int) -> int:
    """SwiGLU units to remove so a layer that adds `added` parameters stays matched: 3·hidden parameters
    per unit, rounded (the count then differs by at most 1.5·hidden per layer)."""
    return round(added / (3 * hidden))


def gate_parameters(hidden: int, heads: int, gate: str = "elementwise", bias: bool = True) -> int:
    """The gate projection of `gated`: hidden → H·d (= hidden) or → H, with a bias (or without: gated-nobias)."""
    width = hidden if gate == "elementwise" else heads
    return hidden * width + (width if bias else 0)


def paper_norm_width(hidden: int, heads: int) -> int:
    """The channels `baseline-diffnorm`'s head norm (and so its gain) spans: two heads' (DIFF's 2d), or the one
    head's where a model has one head (Guo et al.'s presets: DIFF's one differential head is as wide)."""
    return 2 * (hidden // heads) if heads > 1 else hidden
