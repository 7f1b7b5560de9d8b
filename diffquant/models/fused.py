"""One softmax per DIFF layer: a fused forward for transformers' DiffLlama attention.

transformers' DiffLlama calls the attention function twice per layer, with the same Q and K and the two
halves of V, so every softmax map is computed twice and every probability multiplies a value of width d
twice. The paper's formulation needs one: per differential head j, A_j = softmax(Q1K1ᵀ) − λ·softmax(Q2K2ᵀ)
(maps j and j + H/2, as transformers pairs them) times its value [V_j | V_{j+H/2}] of width 2d, which costs
what the baseline's attention costs. `fuse(model)` gives every DiffLlama attention of `model` this forward
(same parameters, same checkpoints, numerically equal to the two-call forward, ≤ 1e-5 in fp32):

- with diffquant's tapped attention, one call that passes `diff_lambda` and the paired values, so every
  logit, probability and differential map is observed (and quantized) once, in the layers that have taps;
  layers whose taps need no map (none, the cache sites, λ, the sink metrics' first-key mass) run as below;
- on SDPA where the mask is plainly causal (or a single query decodes), one SDPA call with Q and K zero-padded
  to 2d (the same scores) and V = [V1 | V2]: one softmax and SDPA's fused kernels (its flash kernel on a GPU:
  every head dimension 2d), in training and inference, with no T × T tensor;
- on flash-attention (any implementation whose mask transformers builds as flash-attention's), and on SDPA with
  a padding mask, the registered kernel twice, with the two halves of V, as transformers' DiffLlama and the
  paper's reference code (multihead_flashdiff_1) do: flash-attention wants one head dimension for Q, K and V,
  and its padding masks ([batch, key]) are the kernel's to read;
- on eager, the explicit fused computation (one fp32 softmax, the differential map times the paired values).
"""

from __future__ import annotations

import types

import torch


def fuse(model) -> None:
    """Give every DiffLlama attention module of `model` the fused forward (idempotent)."""
    from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention

    for module in model.modules():
        if isinstance(module, DiffLlamaAttention) and not getattr(module, "_diffquant_fused", False):
            module.forward = types.MethodType(fused_forward, module)
            module._diffquant_fused = True
    model.__dict__.pop("_diffquant_sites", None)  # a site table built before has no cache sites: rebuild it


def paired_values(value: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, H/2, T, 2d]: the value of differential head j, [V1_j | V2_j], as transformers' two calls pair
    them (V split into halves along the KV heads, each repeated to KV heads, then to H query heads)."""
    from transformers.integrations.sdpa_attention import repeat_kv

    n_rep = heads // value.shape[1]
    v1, v2 = (repeat_kv(x.repeat(1, 2, 1, 1), n_rep) for x in torch.chunk(value, 2, dim=1))
    return torch.cat([v1, v2], dim=-1)[:, : heads // 2]


def diff_lambda(module, dtype=torch.float32) -> torch.Tensor:
    """λ of a DiffLlama attention layer (taps/attention.py computes it as transformers does), in `dtype`."""
    from diffquant.taps.attention import diff_lambda

    return diff_lambda(module).to(dtype)


def layer_lambdas(model) -> list[float] | None:
    """Each DiffLlama attention layer's λ, in layer order (None for a model without differential attention):
    read off the parameters, no forward, so training can record λ at every logged step."""
    from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention

    with torch.no_grad():
        lams = [float(diff_lambda(m)) for m in model.modules() if isinstance(m, DiffLlamaAttention)]
    return lams or None


def fused_forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
    from diffquant.designs.variant import project_qkv  # DiffLlama's prelude is Llama's
    from diffquant.taps import attention as A

    input_shape = hidden_states.shape[:-1]
    query, key, value = project_qkv(self, hidden_states, position_embeddings, cache, kwargs)
    lam = diff_lambda(self, query.dtype)
    heads, half = query.shape[1], query.shape[1] // 2
    q_len, k_len = query.shape[2], key.shape[2]
    impl, taps = self.config._attn_implementation, {}
    if impl == A.NAME:  # tapped: the cache sites (K1|K2 and V1|V2 as KV heads) first, then the model's own kernel
        key, value, taps = A.cache_taps(self, q_len, key, value, attention_mask, kwargs)
        impl = self.__dict__.get("_diffquant_fallback")
    kernel = A.kernel_for(impl, attention_mask)
    if kwargs.get("output_attentions") or (taps and not A.first_key_only(self, taps, attention_mask)):
        kernel = None  # the maps are wanted: the explicit fused computation
    weights = None
    if kernel is None:
        out, weights = A.diff_attention(self, query, key, paired_values(value, heads), attention_mask, self.scaling,
                                        lam, taps, kwargs)
    elif impl == "sdpa" and attention_mask is None and (q_len == k_len or q_len == 1):
        out = _sdpa_padded(query, key, value, self.scaling)  # [B, T, H, 2d], the two calls' layout
        out = out[:, :, :half] - lam * out[:, :, half:]
    else:  # transformers' two calls on the kernel (flash-attention, or SDPA with a padding mask)
        v1, v2 = (v.repeat(1, 2, 1, 1) for v in torch.chunk(value, 2, dim=1))
        out = torch.cat([kernel(self, query, key, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)[0]
                         for v in (v1, v2)], dim=-1)
        out = out[:, :, :half] - lam * out[:, :, half:]
    if kernel is not None and taps:  # the sink metrics' first-key mass, from the kernel (first_key_only)
        A.first_key_taps(taps, A.first_key_masses(kernel, self, query, key, self.scaling, kwargs), k_len, lam)
    out = (1 - self.lambda_init) * self.groupnorm(out)
    return self.o_proj(out.reshape(*input_shape, -1)), weights


def _sdpa_padded(query, key, value, scaling):
    """Both value halves in one SDPA call: Q and K padded with zeros to 2d leave every score as it is, and SDPA's
    fused kernels then take the 2d-wide values. Causal when queries and keys are the same positions; a single
    query (decoding with a cache) attends every key."""
    v1, v2 = (x.repeat(1, 2, 1, 1) for x in torch.chunk(value, 2, dim=1))
    q = torch.cat([query, torch.zeros_like(query)], dim=-1)
    k = torch.cat([key, torch.zeros_like(key)], dim=-1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, torch.cat([v1, v2], dim=-1),
                                                           is_causal=query.shape[2] == key.shape[2] > 1, scale=scaling,
                                                           enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)
