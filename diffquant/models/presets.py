"""Matched DIFF/baseline model presets.

A preset fixes width, depth, SwiGLU width, vocabulary and RoPE. The baseline is a `LlamaConfig` with
`heads` softmax heads; the DIFF model is a `DiffLlamaConfig` whose `num_attention_heads` also counts
softmax maps, so it has `heads / 2` differential heads of width 2d, as the paper prescribes. The two
differ only by the 4·head_dim λ parameters per layer; every other setting, RMSNorm's eps included, is set
here for both (tests/test_models.py checks that a pair's configs differ only in attention fields).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from diffquant.errors import DiffquantError


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a matched pair; `seq_len` is the training context."""

    name: str
    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    one_head: bool = False  # Guo et al.'s one head per layer (see `heads_of`); needs heads == 2
    # Every RMSNorm's eps, the same for every design of a pair: transformers' defaults differ (LlamaConfig 1e-6,
    # DiffLlamaConfig 1e-5), and inside a head norm eps sets how close to zero a head's output can get. 1e-5 is
    # the paper's reference code's (unilm's `RMSNorm(2 * head_dim, eps=1e-5)`) and DiffLlama's.
    rms_norm_eps: float = 1e-5

    def heads_of(self, arch: str) -> int:
        """Softmax maps per layer of design `arch` (its `num_attention_heads`). Normally `heads` for every
        design. With `one_head`, every design has one head of width `hidden` per layer: a softmax design
        gets heads / 2 = 1 head, a differential design (two maps per head) one differential head of two
        maps of width hidden / 2 each, so both attend with one head whose output is `hidden` wide."""
        from diffquant.designs import get

        return self.heads // (2 // get(arch).maps_per_head) if self.one_head else self.heads

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % 2:
            raise ValueError(f"heads must be even (DIFF pairs softmax maps), got {self.heads}")
        if self.one_head and self.heads != 2:
            raise ValueError(f"one_head counts DIFF's two softmax maps: heads must be 2, got {self.heads}")

    def _common(self, vocab: int | None = None, heads: int | None = None) -> dict:
        heads = heads or self.heads
        return dict(
            vocab_size=vocab or self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.ffn,
            num_hidden_layers=self.layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=self.context,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_embeddings,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )

    def config(self, arch: str, vocab: int | None = None, seq_len: int | None = None):
        """The config of design `arch` (see diffquant.designs) at this preset's shape; `vocab` overrides the
        preset's vocabulary (synthetic corpora bring their own), `seq_len` is the training window (some
        designs depend on it; default the preset's)."""
        from diffquant.designs import get

        return get(arch).config(self._common(vocab, self.heads_of(arch)), seq_len or self.seq_len)

    @property
    def context(self) -> int:
        """The positions the models are built for (max_position_embeddings): the training window, at least 2048."""
        return max(self.seq_len, 2048)

    def to_dict(self) -> dict:
        return asdict(self)

    def parameters(self, arch: str, vocab: int | None = None) -> int:
        """Parameter count of design `arch` at this preset, by formula (no torch): embeddings and an untied
        head, per layer 4·hidden² attention + 3·hidden·ffn SwiGLU + two norms + what the design adds (an
        MLP-narrowing design gives back 3·hidden per unit it removes), and the final norm."""
        from diffquant.designs import get, mlp_narrowing

        design, h = get(arch), self.hidden
        added = design.added(h, self.heads_of(arch))
        ffn = self.ffn - (mlp_narrowing(added, h) if design.narrow_mlp else 0)
        per_layer = 4 * h * h + 3 * h * ffn + 2 * h + added
        return (vocab or self.vocab) * h * (1 if self.tie_embeddings else 2) + self.layers * per_layer + h


# Sizes chosen so `micro` and `mini` train on synthetic corpora in minutes (emergence searches), `tiny` on
# text on 2 CPU cores in minutes, `small` on one GPU in minutes and `base` is GPT-2-small sized (~125M).
PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("micro", hidden=64, layers=2, heads=4, ffn=176, vocab=512, seq_len=64),
        ModelSpec("mini", hidden=128, layers=3, heads=4, ffn=352, vocab=2048, seq_len=128),
        ModelSpec("tiny", hidden=256, layers=4, heads=8, ffn=688, vocab=4096, seq_len=256),
        ModelSpec("small", hidden=512, layers=8, heads=8, ffn=1376, vocab=8192, seq_len=512),
        ModelSpec("base", hidden=768, layers=12, heads=12, ffn=2048, vocab=24576, seq_len=1024),
        # Guo et al. 2024's Bigram-Backcopy model (arXiv 2410.13835, their scripts/dynamics.sh): width 256,
        # 3 layers, one head per layer, 256 predicted tokens after BOS (a 257-token window); their ReLU MLP of
        # 4·256 = 1024 units has 2·256·1024 parameters, matched by a SwiGLU of 683 (3·256·683 ≈ 2·256·1024).
        # The vocabulary comes from the corpus (synth:bb, 65 symbols + BOS like their 65 characters).
        ModelSpec("guo", hidden=256, layers=3, heads=2, ffn=683, vocab=66, seq_len=257, one_head=True),
        ModelSpec("guo1", hidden=256, layers=1, heads=2, ffn=683, vocab=66, seq_len=257, one_head=True),
    )
}


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise DiffquantError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


def build(spec: ModelSpec, arch: str, seed: int = 0, vocab: int | None = None, seq_len: int | None = None):
    """A fresh model of design `arch` at this preset, initialised from `seed`."""
    import torch
    from transformers import AutoModelForCausalLM

    from diffquant.models.fused import fuse

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(spec.config(arch, vocab, seq_len)).eval()
    fuse(model)  # DIFF: one softmax per layer
    return model


def build_pair(spec: ModelSpec, seed: int = 0):
    """Build (baseline, diff) with the same seed, as fresh `LlamaForCausalLM`/`DiffLlamaForCausalLM`."""
    return build(spec, "baseline", seed), build(spec, "diff", seed)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
