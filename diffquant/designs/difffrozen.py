"""DIFF as the paper builds it (the reference code's head norm, with its learnable gain: `diff-gain`) with λ frozen
at λ_init: the four λ vectors are zeros that training never moves, so λ = exp(0) − exp(0) + λ_init = λ_init in
every layer, and the map stays differential (A1 − λ_init·A2) whatever the optimiser would have done to λ.

An ablation for issue 49: in the head-norm cells DIFF's learned λ fell below λ_init (to −0.54…0.29), so DIFF
behaved as a Transformer with a head norm; freezing λ asks what DIFF does when it must stay differential. The λ
vectors become buffers of zeros (not parameters: no optimiser can move them, and `requires_grad` would not survive
`from_pretrained`, which makes parameters anew), under the same names, so checkpoints have DIFF's layout and the
model has 4·head_dim fewer parameters per layer than DIFF; `freeze_lambda=False` is `diff-gain` exactly (the
neutral setting the tests compare against).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention

from diffquant.designs.diffgain import DiffGainConfig, DiffGainForCausalLM

LAMBDA_VECTORS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


class DiffFrozenConfig(DiffGainConfig):
    model_type = "diffquant_diff_frozen"

    def __init__(self, freeze_lambda: bool = True, **kwargs):
        self.freeze_lambda = freeze_lambda
        super().__init__(**kwargs)


class DiffFrozenForCausalLM(DiffGainForCausalLM):
    config_class = DiffFrozenConfig

    def __init__(self, config):
        super().__init__(config)
        if config.freeze_lambda:
            for module in self.modules():
                if isinstance(module, DiffLlamaAttention):
                    for name in LAMBDA_VECTORS:
                        size = getattr(module, name).shape
                        delattr(module, name)
                        module.register_buffer(name, torch.zeros(size))
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)  # DiffLlama's draws the λ vectors from N(0, 0.1): zero them again
        if self.config.freeze_lambda and isinstance(module, DiffLlamaAttention):
            for name in LAMBDA_VECTORS:
                getattr(module, name).zero_()


AutoConfig.register(DiffFrozenConfig.model_type, DiffFrozenConfig, exist_ok=True)
AutoModelForCausalLM.register(DiffFrozenConfig, DiffFrozenForCausalLM, exist_ok=True)


def config(common: dict) -> DiffFrozenConfig:
    return DiffFrozenConfig(**common)
