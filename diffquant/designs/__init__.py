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

from diffquant.designs.params import gate_parameters, mlp_narrowing, paper_norm_width  # noqa: F401 - the registry's API
from diffquant.errors import DiffquantError


@dataclass(frozen=True)
class Design:
    key: str
    display: str
    color: str
    config: Callable[[dict, int], object]  # (the preset's common settings, training window) -> config
    doc: str
    added: Callable[[int, int], int] = lambda hidden, heads: 0  # parameters a layer adds to Llama's
    narrow_mlp: bool = False  # absorbs `added` by narrowing the SwiGLU width (see mlp_narrowing)
    maps_per_head: int = 1  # softmax maps a head combines: 2 for differential heads (presets' one_head reads it)


def _llama(common: dict, seq_len: int):
    from transformers import LlamaConfig

    return LlamaConfig(**common)


def _diffllama(common: dict, seq_len: int):
    from transformers import DiffLlamaConfig

    return DiffLlamaConfig(**common)


def _gated(common: dict, seq_len: int):
    from diffquant.designs import gated

    return gated.config(common)


def _clipsoftmax(common: dict, seq_len: int):
    from diffquant.designs import clipsoftmax

    return clipsoftmax.config(common, seq_len)


def _sink(common: dict, seq_len: int):
    from diffquant.designs import sink

    return sink.config(common)


def _gated_nobias(common: dict, seq_len: int):
    from diffquant.designs import gated

    return gated.config(common, bias=False)


def _headnorm(common: dict, seq_len: int):
    from diffquant.designs import headnorm

    return headnorm.config(common)


def _diffnorm(common: dict, seq_len: int):
    from diffquant.designs import headnorm

    return headnorm.config(common, paper=True)


def _diff_frozen(common: dict, seq_len: int):
    from diffquant.designs import difffrozen

    return difffrozen.config(common)


def _diff_gain(common: dict, seq_len: int):
    from diffquant.designs import diffgain

    return diffgain.config(common)


def _diff_nonorm(common: dict, seq_len: int):
    from diffquant.designs import diffnonorm

    return diffnonorm.config(common)


def register_auto_classes() -> None:
    """Register the rival designs with transformers' Auto classes (imports transformers)."""
    from diffquant.designs import clipsoftmax, difffrozen, diffgain, diffnonorm, gated, headnorm, sink  # noqa: F401 - each registers itself


DESIGNS: dict[str, Design] = {}


def register(design: Design) -> None:
    """Add a design; a second design of the same key is an error. Reports read names and colours from here."""
    if design.key in DESIGNS:
        raise ValueError(f"design {design.key!r} is registered already")
    DESIGNS[design.key] = design


def get(key: str) -> Design:
    if key not in DESIGNS:
        raise DiffquantError(f"unknown architecture {key!r}; choose one of: {', '.join(DESIGNS)}")
    return DESIGNS[key]


register(Design("baseline", "Transformer", "#1f77b4", _llama, "Llama: softmax attention"))
register(Design("diff", "DIFF", "#d62728", _diffllama,
                "DiffLlama: (softmax(Q1K1ᵀ) − λ·softmax(Q2K2ᵀ))·V, heads/2 differential heads of width 2d",
                added=lambda h, heads: 4 * (h // heads), maps_per_head=2))
register(Design("gated", "Gated", "#2ca02c", _gated,
                "softmax attention, output gated per element by σ(X·W_g + b) (Qiu et al. 2025, G1); MLP narrowed",
                added=gate_parameters, narrow_mlp=True))
register(Design("clipsoftmax", "ClipSoftmax", "#9467bd", _clipsoftmax,
                "clip((ζ−γ)·softmax + γ, 0, 1), ζ = 1, γ = −12/T (Bondarenko et al. 2023)"))
register(Design("sink", "Sink", "#ff7f0e", _sink, "a learned per-head sink logit in the softmax denominator (gpt-oss)",
                added=lambda h, heads: heads))
# Ablations that isolate DIFF's parts and the gate's bias (issue 27).
register(Design("baseline-headnorm", "Transformer + head norm", "#17becf", _headnorm,
                "Llama with DIFF's head norm alone: (1 − λ_init)·RMSNorm(head output), no gain, no second map"))
register(Design("diff-gain", "DIFF + norm gain", "#8c564b", _diff_gain,
                "DiffLlama with a learnable gain on its head RMSNorm (as Microsoft's reference code)",
                added=lambda h, heads: 4 * (h // heads) + 2 * (h // heads), maps_per_head=2))
register(Design("gated-nobias", "Gated without bias", "#bcbd22", _gated_nobias,
                "Qiu et al.'s G1 gate without bias: output ⊙ σ(X·W_g); MLP narrowed",
                added=lambda h, heads: gate_parameters(h, heads, bias=False), narrow_mlp=True))
# Ablation for the head-norm question (issue 42): the differential map without DIFF's per-head norm.
register(Design("diff-nonorm", "DIFF without head norm", "#e377c2", _diff_nonorm,
                "DiffLlama without its per-head RMSNorm: (1 − λ_init)·(A1 − λ·A2)·V straight into o_proj",
                added=lambda h, heads: 4 * (h // heads), maps_per_head=2))
# The second decomposition (issue 49): DIFF kept differential, and DIFF's norm as the paper builds it on the Transformer.
register(Design("diff-frozen", "DIFF, λ frozen", "#7f7f7f", _diff_frozen,
                "DIFF with the paper's norm (diff-gain) and λ frozen at λ_init: the λ vectors are zero buffers",
                added=lambda h, heads: 2 * (h // heads), maps_per_head=2))
register(Design("baseline-diffnorm", "Transformer + DIFF's norm", "#aec7e8", _diffnorm,
                "Llama with DIFF's head norm as the paper builds it: RMSNorm over 2d-channel groups of two heads, "
                "a learnable gain, (1 − λ_init)", added=paper_norm_width))
