"""Learned attention sinks: a per-head logit s_h in the softmax denominator only,
p_i = exp(x_i) / (Σ_j exp(x_j) + exp(s_h)), as gpt-oss (transformers passes it as `s_aux`).

The sink absorbs attention a head does not want to spend, so no token has to become a sink. With s_h
fixed at 0 it is "softmax + 1"; s_h → −∞ is the plain softmax (the neutral value: −1e4 gives exactly the
softmax in fp32). Initialised as gpt-oss does (normal, std = initializer_range). H parameters per layer
(within 0.1% of the baseline without narrowing anything). SDPA takes no sink, so layers run the explicit
attention.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from diffquant.designs.variant import VariantAttention, llama_variant, register


class SinkConfig(LlamaConfig):
    model_type = "diffquant_sink"


class SinkAttention(VariantAttention):
    explicit = True

    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.sinks = torch.nn.Parameter(torch.zeros(config.num_attention_heads))

    def attention_kwargs(self) -> dict:
        return {"s_aux": self.sinks}


def _init(module: SinkAttention, std: float) -> None:
    torch.nn.init.normal_(module.sinks, mean=0.0, std=std)


SinkForCausalLM = llama_variant(SinkConfig, SinkAttention, init=_init, sdpa=False)
register(SinkConfig, SinkForCausalLM)


def config(common: dict) -> SinkConfig:
    return SinkConfig(**common)
