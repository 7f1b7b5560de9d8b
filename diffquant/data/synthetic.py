"""Synthetic corpora known to make extreme tokens in small transformers, generated as token ids.

`synth:bb[:key=value,...]` — Bigram-Backcopy (Guo et al. 2024, arXiv 2410.13835): a bigram Markov chain over
`vocab` tokens; after one of the `triggers` most frequent tokens the next token copies the token before the
trigger; every sequence starts with BOS. Attention is needed only after a trigger, so heads learn to do
nothing elsewhere, which Guo et al. show makes the BOS an attention sink with a small value state and a large
residual norm.

`synth:markov[:...]` — the same chain without triggers: nothing in the context beyond the current token
helps, so every head's best update is none at all (the "no-op" that Bondarenko et al. 2023 tie to outliers).

Options: vocab (64), triggers (3; bb only), alpha (0.2, Dirichlet concentration of the bigram rows: small
makes peaked rows, like character bigrams), seed (0, of the chain itself; the sequences of the train and
validation splits come from separate generators derived from it). Deterministic: the same spec gives the
same chain and the same sequences. Token i is "t{i}", BOS is "<bos>" (id = vocab); the tokenizer is a
word-level one that needs no training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from diffquant.errors import DiffquantError

KINDS = ("bb", "markov")


@dataclass(frozen=True)
class SynthSpec:
    kind: str = "bb"
    vocab: int = 64
    triggers: int = 3
    alpha: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise DiffquantError(f"unknown synthetic corpus {self.kind!r}; choose one of: {', '.join(KINDS)}")
        if not 2 <= self.vocab <= 65535:
            raise DiffquantError(f"synthetic vocab must be 2..65535, got {self.vocab}")
        if self.kind == "bb" and not 1 <= self.triggers < self.vocab:
            raise DiffquantError(f"bb needs 1 <= triggers < vocab, got {self.triggers}")
        if self.alpha <= 0:
            raise DiffquantError(f"alpha must be positive, got {self.alpha}")

    @property
    def bos(self) -> int:
        return self.vocab

    @property
    def n_triggers(self) -> int:
        return self.triggers if self.kind == "bb" else 0

    def label(self) -> str:
        opts = f"vocab={self.vocab},alpha={self.alpha},seed={self.seed}"
        return f"synth:{self.kind}:" + (f"triggers={self.triggers}," if self.kind == "bb" else "") + opts


def parse(source: str) -> SynthSpec:
    """`synth:bb`, `synth:bb:triggers=5,vocab=128`, `synth:markov:seed=1`."""
    parts = source.split(":", 2)
    if len(parts) < 2 or parts[0] != "synth":
        raise DiffquantError(f"not a synthetic corpus: {source!r}")
    kw: dict = {}
    for item in filter(None, (parts[2] if len(parts) > 2 else "").split(",")):
        key, _, value = item.partition("=")
        types = {"vocab": int, "triggers": int, "alpha": float, "seed": int}
        if key not in types or not value:
            raise DiffquantError(f"bad option {item!r} in {source!r}; options: {', '.join(types)} (key=value)")
        try:
            kw[key] = types[key](value)
        except ValueError:
            raise DiffquantError(f"option {key} needs a number, got {value!r}") from None
    return SynthSpec(parts[1], **kw)


def is_synthetic(source: str) -> bool:
    return source.startswith("synth:")


class Chain:
    """The bigram chain and trigger set of one spec."""

    def __init__(self, spec: SynthSpec):
        rng = np.random.default_rng(spec.seed)
        self.spec = spec
        self.P = rng.dirichlet(np.full(spec.vocab, spec.alpha), size=spec.vocab)
        self.cum = np.cumsum(self.P, axis=1)
        self.cum[:, -1] = 1.0
        # stationary distribution by power iteration; triggers are its most frequent tokens (as Guo et al.)
        pi = np.full(spec.vocab, 1.0 / spec.vocab)
        for _ in range(500):
            pi = pi @ self.P
        self.pi = pi / pi.sum()
        self.triggers = np.argsort(-self.pi, kind="stable")[: spec.n_triggers]
        first = self.pi.copy()
        first[self.triggers] = 0.0  # the first token is never a trigger (there is nothing before it to copy)
        self.first_cum = np.cumsum(first / first.sum())
        self.first_cum[-1] = 1.0

    def sample(self, n: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
        """[n, seq_len] int64: BOS, then the chain (all sequences advance together, one position a step)."""
        out = np.empty((n, seq_len), dtype=np.int64)
        out[:, 0] = self.spec.bos
        if seq_len == 1:
            return out
        out[:, 1] = np.searchsorted(self.first_cum, rng.random(n), side="right")
        is_trigger = np.zeros(self.spec.vocab + 1, dtype=bool)
        is_trigger[self.triggers] = True
        for t in range(2, seq_len):
            prev = out[:, t - 1]
            u = rng.random(n)
            nxt = (self.cum[prev] < u[:, None]).sum(axis=1)
            copy = is_trigger[prev] & (out[:, t - 2] != self.spec.bos)
            out[:, t] = np.where(copy, out[:, t - 2], np.minimum(nxt, self.spec.vocab - 1))
        return out


def sequences(spec: SynthSpec, split: str, n: int, seq_len: int) -> np.ndarray:
    """`n` sequences of the train or validation split (separate generators, both derived from the seed)."""
    stream = {"train": 1, "validation": 2}[split]
    return Chain(spec).sample(n, seq_len, np.random.default_rng([spec.seed, stream]))


def tokenizer(spec: SynthSpec):
    """A word-level tokenizer over "t0".."t{vocab-1}" and "<bos>", saved with checkpoints like any other."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(spec.vocab)} | {"<bos>": spec.bos}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<bos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<bos>", pad_token="<bos>",
                                   unk_token="<bos>")


def copy_targets(ids, spec: SynthSpec):
    """Which predictions of Bigram-Backcopy sequences `ids` ([n, T] token ids, BOS first) are copies: a bool
    tensor [n, T − 1] aligned with next-token targets ids[:, 1:], True at target t (t ≥ 2) when token t − 1 is
    a trigger and token t − 2 is not BOS (the only positions where attention can help; Guo et al.'s own
    diagnostic is the loss there). A chain without triggers (markov) has none."""
    import torch

    ids = torch.as_tensor(ids)
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)
    if spec.n_triggers == 0 or ids.shape[1] < 3:
        return out
    triggers = torch.as_tensor(Chain(spec).triggers, dtype=ids.dtype)
    out[:, 1:] = torch.isin(ids[:, 1:-1], triggers) & (ids[:, :-2] != spec.bos)
    return out
