"""Tiny random-weight models of Hugging Face decoder families: the architecture matrix.

The tests prove every statistic and scheme on each of them against an independent computation, and
`docs/support_table.py` writes the README's support table from the same list, so the table cannot
claim what the tests do not check. Widths are tiny (64, 2 layers) so the matrix runs in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

VOCAB = 512
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)


@dataclass(frozen=True)
class Family:
    name: str
    config: str  # transformers config class ("" for a diffquant design)
    model: str  # transformers causal-LM class, or the diffquant design key
    extra: dict = field(default_factory=dict)
    note: str = ""

    def build(self, seed: int = 0):
        import torch
        import transformers

        torch.manual_seed(seed)
        if not self.config:  # a diffquant design at the `micro` preset (the same widths as the rest); DIFF-like
            # designs keep transformers' two-call forward, as the `diffllama` family does (not models/fused.py)
            from diffquant.models.presets import PRESETS

            return transformers.AutoModelForCausalLM.from_config(PRESETS["micro"].config(self.model)).eval()
        config = getattr(transformers, self.config)(**{**_COMMON, **self.extra})
        return getattr(transformers, self.model)(config).eval()


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2), "GQA"),
        Family("diffllama", "DiffLlamaConfig", "DiffLlamaForCausalLM", dict(num_key_value_heads=4), "DIFF, MHA"),
        Family("diffllama-gqa", "DiffLlamaConfig", "DiffLlamaForCausalLM", dict(num_key_value_heads=2), "DIFF, GQA"),
        Family("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2), "qkv bias"),
        Family("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16), "q/k norm"),
        Family("mistral", "MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, sliding_window=5),
               "sliding window 5"),
        Family("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
               dict(num_key_value_heads=2, head_dim=16, sliding_window=5, attn_logit_softcapping=5.0,
                    layer_types=["sliding_attention", "full_attention"]),
               "logit softcap 5, sliding + full layers, eager"),
        Family("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_key_value_heads=2, head_dim=16, sliding_window=5,
                    layer_types=["sliding_attention", "full_attention"]), "sliding + full layers"),
        Family("phi3", "Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=2), "fused qkv, fused gate_up"),
        Family("gpt2", "GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
               "Conv1D projections"),
        Family("opt", "OPTConfig", "OPTForCausalLM", dict(ffn_dim=128, word_embed_proj_dim=64), "fc1/fc2, no MLP module"),
        Family("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {}, "norms after attention and MLP"),
        Family("gpt_neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", {}, "parallel residual, fused qkv, `attention`"),
        Family("falcon", "FalconConfig", "FalconForCausalLM", {}, "own attention before transformers 5.25"),
        Family("stablelm", "StableLmConfig", "StableLmForCausalLM", dict(num_key_value_heads=4), "partial RoPE"),
        Family("granite", "GraniteConfig", "GraniteForCausalLM", dict(num_key_value_heads=2), "scaled residuals"),
        Family("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", dict(num_key_value_heads=2), "NoPE layers"),
        Family("mixtral", "MixtralConfig", "MixtralForCausalLM",
               dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2), "MoE, fused 3-D experts"),
        Family("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
               dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                    shared_expert_intermediate_size=64), "MoE with a shared expert"),
        Family("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
               dict(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16),
               "MoE"),
        Family("bloom", "BloomConfig", "BloomForCausalLM", dict(n_layer=2, n_head=4), "ALiBi, own attention"),
        Family("gated", "", "gated", note="diffquant design: output gate σ(X·W_g + b)"),
        Family("clipsoftmax", "", "clipsoftmax", note="diffquant design: clipped softmax"),
        Family("sink", "", "sink", note="diffquant design: learned sink logit"),
        Family("baseline-headnorm", "", "baseline-headnorm", note="diffquant ablation: DIFF's head norm on softmax heads"),
        Family("diff-gain", "", "diff-gain", note="diffquant ablation: DIFF with a learnable head-norm gain"),
        Family("gated-nobias", "", "gated-nobias", note="diffquant ablation: output gate σ(X·W_g), no bias"),
        Family("diff-nonorm", "", "diff-nonorm", note="diffquant ablation: DIFF without its per-head norm"),
        Family("diff-frozen", "", "diff-frozen", note="diffquant ablation: DIFF (the paper's norm) with λ frozen at λ_init"),
        Family("baseline-diffnorm", "", "baseline-diffnorm",
               note="diffquant ablation: DIFF's head norm as the paper builds it (2d groups, gain) on softmax heads"),
    )
}
