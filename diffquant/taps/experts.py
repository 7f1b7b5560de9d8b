"""diffquant's experts function, registered with transformers' ExpertsInterface as "diffquant".

Mixture-of-experts layers keep their experts as fused 3-D parameters and compute them inside one
function, so the input of the experts' down projections is visible to no module hook. While a tap sits
on `experts.down_in`, the model runs this function: it computes every routed (token, slot) pair as
transformers' eager loop does, gathers the down-projection inputs into one [batch, pos, slot, channel]
tensor, passes it through the taps once, and projects the (maybe transformed) rows down. Experts modules
without taps fall through to the implementation the model ran before.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

NAME = "diffquant"


def _linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    y = x @ w if transposed else torch.nn.functional.linear(x, w)
    return y if bias is None else y + bias


def tapped_experts(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    from diffquant.taps.attention import run_taps
    from diffquant.taps.context import token_valid

    taps = self.__dict__.get("_diffquant_taps")
    if not taps:
        fallback = self.__dict__.get("_diffquant_fallback", "eager")
        original = type(self).forward.__wrapped__
        return ALL_EXPERTS_FUNCTIONS.get_interface(fallback, original)(self, hidden_states, top_k_index, top_k_weights)
    entries = taps["experts.down_in"]
    ctx = entries[0][1]
    n_tokens, k = top_k_index.shape
    transposed = getattr(self, "is_transposed", False)
    up = self.gate_up_proj if self.has_gate else self.up_proj
    up_bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    width = self.down_proj.shape[-1] if not transposed else self.down_proj.shape[-2]
    down_in = hidden_states.new_zeros(n_tokens, k, width)
    routed = top_k_index < self.num_experts  # expert-parallel sentinels route nowhere
    experts = top_k_index[routed].unique().tolist()
    rows = {}
    for e in experts:
        token, slot = torch.where(top_k_index == e)
        rows[e] = (token, slot)
        h = _linear(hidden_states[token], up[e], None if up_bias is None else up_bias[e], transposed)
        down_in[token, slot] = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    shape = ctx.batch.tokens if ctx.batch.tokens and ctx.batch.tokens[0] * ctx.batch.tokens[1] == n_tokens \
        else (1, n_tokens)
    x = down_in.view(*shape, k, width)
    valid = token_valid(ctx, x)
    if not bool(routed.all()):
        r = routed.view(*shape, k, 1)
        valid = r if valid is None else valid & r
    y = run_taps(entries, x, valid).reshape(n_tokens, k, width)
    out = torch.zeros_like(hidden_states)
    down_bias = self.down_proj_bias if self.has_bias else None
    for e, (token, slot) in rows.items():
        o = _linear(y[token, slot], self.down_proj[e], None if down_bias is None else down_bias[e], transposed)
        if getattr(self, "has_post_expert_norm", False):
            o = self.post_expert_norm(o)
        o = o * top_k_weights[token, slot, None]
        out.index_add_(0, token, o.to(out.dtype))
    return out


ALL_EXPERTS_FUNCTIONS.register(NAME, tapped_experts)
