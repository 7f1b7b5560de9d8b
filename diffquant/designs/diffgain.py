"""DIFF with a learnable gain on its head normalisation, as Microsoft's reference code has it
(unilm/Diff-Transformer: `subln = RMSNorm(2 * head_dim, elementwise_affine=True)`, one gain vector of 2d
shared by the layer's differential heads, initialised to ones), where transformers' DiffLlama uses an
RMSNorm without gain. Everything else is DiffLlama's: the model type is a subclass, so the fused forward,
the taps and the sink statistics treat it as DIFF.

An ablation: does the gain let DIFF rebuild large outputs the parameter-free norm prevents? Adds 2d
parameters per layer (within 0.1% of the baseline without narrowing anything). A gain of ones is DIFF
exactly (the neutral value).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DiffLlamaConfig, DiffLlamaForCausalLM


class DiffGainConfig(DiffLlamaConfig):
    model_type = "diffquant_diff_gain"


class DiffGainForCausalLM(DiffLlamaForCausalLM):
    config_class = DiffGainConfig

    def __init__(self, config):
        super().__init__(config)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.groupnorm = torch.nn.RMSNorm(2 * attn.head_dim, eps=config.rms_norm_eps, elementwise_affine=True)
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, torch.nn.RMSNorm) and module.weight is not None:
            torch.nn.init.ones_(module.weight)


AutoConfig.register(DiffGainConfig.model_type, DiffGainConfig, exist_ok=True)
AutoModelForCausalLM.register(DiffGainConfig, DiffGainForCausalLM, exist_ok=True)


def config(common: dict) -> DiffGainConfig:
    return DiffGainConfig(**common)
