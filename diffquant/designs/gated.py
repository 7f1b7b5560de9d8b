"""Gated attention: a head-specific sigmoid gate on the attention output, Y' = Y ⊙ σ(X·W_g + b_g).

Qiu et al. 2025 (arXiv 2505.06708), their best variant "G1": the gate is computed from X, the layer's
normalised input (the input of q/k/v), and multiplies the scaled-dot-product output of every head
elementwise before o_proj; `gate="headwise"` gives one gate per head and token instead (Bondarenko et al.
2023's gated attention is of this kind). A gate lets a head output nothing without a sink: σ → 0.

The gate projection has a bias (zero at init): with W_g = 0 and a large bias the gate is exactly open (1.0
in fp32 from b = 40), the neutral value that reproduces the baseline. Matched parameters: the gate adds
hidden·H·d + H·d parameters per layer (headwise: hidden·H + H), and the SwiGLU width is narrowed by
round(added / (3·hidden)) (the MLP has 3·hidden parameters per unit of width), so the count stays within
1.5·hidden per layer, and within 0.1%, of the baseline's.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from diffquant.designs.params import gate_parameters, mlp_narrowing
from diffquant.designs.variant import VariantAttention, llama_variant, register

GATES = ("elementwise", "headwise")


class GatedConfig(LlamaConfig):
    model_type = "diffquant_gated"

    def __init__(self, gate: str = "elementwise", gate_bias: bool = True, **kwargs):
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        self.gate = gate
        self.gate_bias = gate_bias
        super().__init__(**kwargs)


class GatedAttention(VariantAttention):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        heads = config.num_attention_heads
        width = heads * self.head_dim if config.gate == "elementwise" else heads
        self.gate = torch.nn.Linear(config.hidden_size, width, bias=getattr(config, "gate_bias", True))

    def gate_output(self, output, hidden_states):
        g = torch.sigmoid(self.gate(hidden_states))  # [batch, pos, H·d] or [batch, pos, H]
        return output * g.view(*output.shape[:-1], -1).to(output.dtype)


GatedForCausalLM = llama_variant(GatedConfig, GatedAttention)
register(GatedConfig, GatedForCausalLM)


def config(common: dict, gate: str = "elementwise", bias: bool = True) -> GatedConfig:
    """The preset's config with the MLP narrowed to absorb the gate (see the module docstring). `bias=False`
    is the `gated-nobias` ablation: σ(X·W_g), Qiu et al.'s G1 gate without a bias (no exactly-open neutral
    value; with the bias at 0 the two designs compute the same)."""
    h = common["hidden_size"]
    narrow = mlp_narrowing(gate_parameters(h, common["num_attention_heads"], gate, bias), h)
    return GatedConfig(gate=gate, gate_bias=bias, **{**common, "intermediate_size": common["intermediate_size"] - narrow})
