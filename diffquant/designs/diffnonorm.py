"""DIFF without its head norm: transformers' DiffLlama with the per-head RMSNorm (the paper's "GroupNorm")
replaced by the identity, so a differential head's output is `(1 − λ_init)·(A1 − λ·A2)·V` before o_proj.

An ablation for the question "is it the differential map or the head norm?" (issue 42): the paper's own
ablation removes the norm and reports a worse loss, and the later "Differential Transformer V2" write-up
drops the per-head RMSNorm for training stability, so this is both an ablation and a design in use. The
(1 − λ_init) factor is kept: it is DIFF's, and only the norm is under test. DiffLlama's norm has no
parameters, so the parameter count is DIFF's exactly. `head_norm=True` is DIFF exactly (the neutral
setting the tests compare against). The model type subclasses DiffLlama's: the fused forward, the taps and
the sink statistics treat it as DIFF.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DiffLlamaConfig, DiffLlamaForCausalLM


class DiffNoNormConfig(DiffLlamaConfig):
    model_type = "diffquant_diff_nonorm"

    def __init__(self, head_norm: bool = False, **kwargs):
        self.head_norm = head_norm
        super().__init__(**kwargs)


class DiffNoNormForCausalLM(DiffLlamaForCausalLM):
    config_class = DiffNoNormConfig

    def __init__(self, config):
        super().__init__(config)
        if not config.head_norm:
            for layer in self.model.layers:
                layer.self_attn.groupnorm = torch.nn.Identity()
        self.post_init()


AutoConfig.register(DiffNoNormConfig.model_type, DiffNoNormConfig, exist_ok=True)
AutoModelForCausalLM.register(DiffNoNormConfig, DiffNoNormForCausalLM, exist_ok=True)


def config(common: dict) -> DiffNoNormConfig:
    return DiffNoNormConfig(**common)
