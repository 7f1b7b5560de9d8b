"""The baseline with DIFF's head normalisation alone: softmax attention whose per-head output is
RMS-normalised and scaled by (1 − λ_init) before o_proj, exactly as transformers' DiffLlama treats a
differential head's output (`(1 - lambda_init) * groupnorm(out)`, an RMSNorm without gain, eps =
rms_norm_eps, λ_init = 0.8 − 0.6·exp(−0.3·layer_idx)), but over each head's d channels and without the
second softmax map.

An ablation: if DIFF's outlier reduction came from the norm rather than from the differential map, this
design would show it. No parameters are added. `head_norm=False` is the plain baseline (the neutral
setting the tests compare against).
"""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig

from diffquant.designs.variant import VariantAttention, llama_variant, register


def lambda_init(layer_idx: int) -> float:
    """DiffLlama's λ_init of a layer (transformers' `lambda_init_fn`, 0-based layer index)."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


class HeadNormConfig(LlamaConfig):
    model_type = "diffquant_headnorm"

    def __init__(self, head_norm: bool = True, **kwargs):
        self.head_norm = head_norm
        super().__init__(**kwargs)


class HeadNormAttention(VariantAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.scale = 1 - lambda_init(layer_idx)
        self.head_norm = torch.nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps, elementwise_affine=False)

    def gate_output(self, output, hidden_states):
        if not self.config.head_norm:
            return output
        return self.scale * self.head_norm(output)  # output: [batch, pos, head, head_dim]


HeadNormForCausalLM = llama_variant(HeadNormConfig, HeadNormAttention)
register(HeadNormConfig, HeadNormForCausalLM)


def config(common: dict) -> HeadNormConfig:
    return HeadNormConfig(**common)
