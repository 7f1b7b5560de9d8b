"""The baseline with DIFF's head normalisation alone: softmax attention whose per-head output is
RMS-normalised and scaled by (1 − λ_init) before o_proj, exactly as transformers' DiffLlama treats a
differential head's output (`(1 - lambda_init) * groupnorm(out)`, an RMSNorm without gain, eps =
rms_norm_eps, λ_init = 0.8 − 0.6·exp(−0.3·layer_idx)), but over each head's d channels and without the
second softmax map.

An ablation: if DIFF's outlier reduction came from the norm rather than from the differential map, this
design would show it. No parameters are added. `head_norm=False` is the plain baseline (the neutral
setting the tests compare against).

`baseline-diffnorm` (issue 49) is DIFF's norm as the paper builds it, on the Transformer: groups of two adjacent
heads (2d channels, as a differential head's output is 2d wide and DiffLlama normalises it whole) and a learnable
gain of 2d shared by the layer's groups (unilm's `RMSNorm(2 * head_dim, elementwise_affine=True)`), then
(1 − λ_init). It adds 2d parameters per layer; with `head_norm_group=1, head_norm_gain=False` it is
`baseline-headnorm`.
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

    def __init__(self, head_norm: bool = True, head_norm_group: int = 1, head_norm_gain: bool = False, **kwargs):
        self.head_norm = head_norm
        self.head_norm_group = head_norm_group  # adjacent heads normalised together (2: DIFF's 2d channels)
        self.head_norm_gain = head_norm_gain  # a learnable gain over the group's channels, shared by the layer
        super().__init__(**kwargs)
        if head_norm_group < 1 or self.num_attention_heads % head_norm_group:
            raise ValueError(f"head_norm_group {head_norm_group} must divide the {self.num_attention_heads} heads")


class HeadNormAttention(VariantAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.scale = 1 - lambda_init(layer_idx)
        self.group = config.head_norm_group
        self.head_norm = torch.nn.RMSNorm(self.group * self.head_dim, eps=config.rms_norm_eps,
                                          elementwise_affine=config.head_norm_gain)

    def gate_output(self, output, hidden_states):
        if not self.config.head_norm:
            return output
        shape = output.shape  # [batch, pos, head, head_dim]: adjacent heads' channels are contiguous
        grouped = output.reshape(*shape[:-2], shape[-2] // self.group, self.group * shape[-1])
        return (self.scale * self.head_norm(grouped)).reshape(shape)


def _init(module, std):
    if module.head_norm.weight is not None:
        torch.nn.init.ones_(module.head_norm.weight)


HeadNormForCausalLM = llama_variant(HeadNormConfig, HeadNormAttention, init=_init)
register(HeadNormConfig, HeadNormForCausalLM)


def config(common: dict, paper: bool = False) -> HeadNormConfig:
    """`paper`: DIFF's norm as the paper builds it (2d-channel groups, a gain): `baseline-diffnorm`. A model of one
    head (Guo et al.'s presets) normalises it whole: DIFF's one differential head there is as wide as it."""
    if not paper:
        return HeadNormConfig(**common)
    return HeadNormConfig(**common, head_norm_group=2 if common["num_attention_heads"] > 1 else 1, head_norm_gain=True)

