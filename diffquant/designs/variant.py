"""The scaffolding every rival design shares: Llama's model with one attention class swapped in.

`llama_variant(Config, Attention)` returns a causal-LM class that is Llama's with `Attention` in every
layer, so a design module holds only its config and its attention; `register` adds them to transformers'
Auto classes, so a saved checkpoint loads with `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM


def llama_variant(config_class, attention_class, init=None, sdpa: bool = True):
    """The causal-LM class of a design. `init(module, std)` initialises the design's own attention
    parameters; `sdpa=False` for designs whose softmax SDPA cannot compute (their layers run
    `explicit_attention` or diffquant's tapped attention, which compute the same)."""
    name = config_class.__name__.removesuffix("Config")

    class ForCausalLM(LlamaForCausalLM):
        _supports_sdpa = sdpa
        _supports_flash_attn = sdpa
        _supports_flex_attn = sdpa

        def __init__(self, config):
            super().__init__(config)
            for i, layer in enumerate(self.model.layers):
                layer.self_attn = attention_class(config, i)
            self.post_init()  # initialises the new attention modules like the rest

        def _init_weights(self, module):
            super()._init_weights(module)
            if init is not None and isinstance(module, attention_class):
                init(module, self.config.initializer_range)

    ForCausalLM.config_class = config_class
    ForCausalLM.__name__ = ForCausalLM.__qualname__ = f"{name}ForCausalLM"
    ForCausalLM.__module__ = attention_class.__module__
    return ForCausalLM


def register(config_class, causal_lm_class) -> None:
    AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, causal_lm_class, exist_ok=True)


BUILT_IN_KERNELS = ("sdpa", "flash", "flex", "paged")  # transformers' kernels: no clipping, no sinks


def attention_function(module, fallback):
    """The attention function a design whose softmax the built-in kernels cannot compute calls: a
    registered custom implementation (diffquant's tapped attention, a user's), which receives the design's
    arguments, else the design's own exact computation (`fallback`; the model's default, eager)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = module.config._attn_implementation or "eager"
    if impl in ALL_ATTENTION_FUNCTIONS and not impl.startswith(BUILT_IN_KERNELS):
        return ALL_ATTENTION_FUNCTIONS[impl]
    return fallback


from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb, eager_attention_forward  # noqa: E402


def project_qkv(module, hidden_states, position_embeddings, cache, kwargs):
    """Llama's attention prelude: q, k, v as [batch, head, pos, head_dim], RoPE on q and k, the KV cache."""
    hidden_shape = (*hidden_states.shape[:-1], -1, module.head_dim)
    query = module.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    return query, key, value


class VariantAttention(LlamaAttention):
    """LlamaAttention's forward with the two places designs change: the attention function and its extra
    arguments (`attention_kwargs`), and the output before o_proj (`gate_output`). `explicit` designs
    change the softmax itself, so they run `explicit_attention` (or diffquant's tapped attention)."""

    explicit = False

    def attention_kwargs(self) -> dict:
        return {}

    def gate_output(self, output, hidden_states):
        return output

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from diffquant.taps.attention import explicit_attention

        input_shape = hidden_states.shape[:-1]
        query, key, value = project_qkv(self, hidden_states, position_embeddings, cache, kwargs)
        impl = self.config._attn_implementation
        if self.explicit:
            attend = attention_function(self, explicit_attention)
        else:
            attend = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
        out, weights = attend(self, query, key, value, attention_mask,
                              dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                              **self.attention_kwargs(), **kwargs)
        out = self.gate_output(out, hidden_states)  # [batch, pos, head, head_dim]
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
