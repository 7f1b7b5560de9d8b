"""Clipped softmax (Bondarenko et al. 2023, arXiv 2306.12929): clip((ζ − γ)·softmax(x) + γ, 0, 1).

With γ < 0 small probabilities are clipped to exactly 0 (and with ζ > 1 large ones to 1), so a head can
put no attention at all on the tokens it wants to ignore without pushing its logits to extremes, and can
do nothing without a sink. The paper's language-model setting: ζ = 1, γ = −α/T with α = 12 and T the
training window, which `config` uses. ζ = 1, γ = 0 is the plain softmax (the neutral value). No extra
parameters: matched to the baseline exactly. SDPA cannot clip, so layers run the explicit attention.
"""

from __future__ import annotations

from transformers import LlamaConfig

from diffquant.designs.variant import VariantAttention, llama_variant, register

ALPHA = 12.0


class ClipSoftmaxConfig(LlamaConfig):
    model_type = "diffquant_clipsoftmax"

    def __init__(self, clip_zeta: float = 1.0, clip_gamma: float = -ALPHA / 256, **kwargs):
        self.clip_zeta, self.clip_gamma = clip_zeta, clip_gamma
        super().__init__(**kwargs)


class ClipSoftmaxAttention(VariantAttention):
    explicit = True

    def attention_kwargs(self) -> dict:
        return {"clip_softmax": (self.config.clip_zeta, self.config.clip_gamma)}


ClipSoftmaxForCausalLM = llama_variant(ClipSoftmaxConfig, ClipSoftmaxAttention, sdpa=False)
register(ClipSoftmaxConfig, ClipSoftmaxForCausalLM)


def config(common: dict, seq_len: int) -> ClipSoftmaxConfig:
    return ClipSoftmaxConfig(clip_zeta=1.0, clip_gamma=-ALPHA / seq_len, **common)
