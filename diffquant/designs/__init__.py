"""Attention designs: one registry that presets, `train --arch`, `diffquant models` and the reports read.

Each design is a transformers config + causal-LM class on the Llama layout (pre-RMSNorm, SwiGLU, RoPE)
that changes only the attention. `baseline` and `diff` are transformers' own Llama and DiffLlama; the
rivals live in modules of this package and register their classes with transformers' Auto classes, so a
saved checkpoint loads with `AutoModelForCausalLM.from_pretrained(path)` after `import diffquant`.

`config(common)` receives the preset's shared settings (width, depth, heads, FFN width, vocabulary, RoPE)
and returns the design's config; a design that adds parameters narrows its MLP to stay matched (its
module states the rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from diffquant import DiffquantError


@dataclass(frozen=True)
class Design:
    key: str
    display: str
    color: str
    config: Callable[[dict], object]
    doc: str


def _llama(common: dict):
    from transformers import LlamaConfig

    return LlamaConfig(**common)


def _diffllama(common: dict):
    from transformers import DiffLlamaConfig

    return DiffLlamaConfig(**common)


DESIGNS: dict[str, Design] = {}


def register(design: Design) -> None:
    """Add a design; a second design of the same key is an error."""
    from diffquant.report.style import register as register_style

    if design.key in DESIGNS:
        raise ValueError(f"design {design.key!r} is registered already")
    DESIGNS[design.key] = design
    register_style(design.key, design.display, design.color)


def get(key: str) -> Design:
    if key not in DESIGNS:
        raise DiffquantError(f"unknown architecture {key!r}; choose one of: {', '.join(DESIGNS)}")
    return DESIGNS[key]


register(Design("baseline", "Transformer", "#1f77b4", _llama, "Llama: softmax attention"))
register(Design("diff", "DIFF", "#d62728", _diffllama,
                "DiffLlama: (softmax(Q1K1ᵀ) − λ·softmax(Q2K2ᵀ))·V, heads/2 differential heads of width 2d"))
