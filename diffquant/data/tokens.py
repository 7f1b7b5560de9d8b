"""Tokenizers (byte-level BPE trained with `tokenizers`) and token streams cut into sequences."""

from __future__ import annotations


import numpy as np
import torch

from diffquant.errors import DiffquantError

EOS = "<|endoftext|>"


def train_tokenizer(text: str, vocab_size: int):
    """Byte-level BPE on `text`, wrapped as a transformers fast tokenizer (saved with checkpoints)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not text.strip():
        raise DiffquantError("cannot train a tokenizer on empty text")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_chunks(text), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def byte_tokenizer():
    """One token per UTF-8 byte (ids 0..255, no merges): the tokenizer of the random-weight presets
    (`tiny:diff`), which have none of their own, so every command that reads text runs on them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _BYTE_OF[ch])
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _byte_of() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: the byte each ByteLevel character stands for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + n
            n += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_OF = _byte_of()


def _chunks(text: str, size: int = 1 << 16):
    for i in range(0, len(text), size):
        yield text[i:i + size]


def encode(tokenizer, text: str) -> np.ndarray:
    """The whole text as one int32 token stream (encoded in chunks of lines, in parallel by `tokenizers`)."""
    lines = text.splitlines(keepends=True)
    step = 2000
    pieces = ["".join(lines[i:i + step]) for i in range(0, len(lines), step)] or [text]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        ids = [np.asarray(e.ids, dtype=np.int32) for e in backend.encode_batch(pieces, add_special_tokens=False)]
    else:
        ids = [np.asarray(tokenizer(p, add_special_tokens=False)["input_ids"], dtype=np.int32) for p in pieces]
    return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)

def sequences(stream: np.ndarray, seq_len: int, tokens: int | None = None) -> torch.Tensor:
    """[n, seq_len] windows from the start of the stream covering `tokens` tokens (all if None)."""
    if tokens is not None and tokens <= 0:
        raise DiffquantError(f"--tokens must be positive, got {tokens}")
    if seq_len <= 0:
        raise DiffquantError(f"sequence length must be positive, got {seq_len}")
    n_avail = len(stream) // seq_len
    if n_avail == 0:
        raise DiffquantError(f"the corpus has {len(stream)} tokens, fewer than one sequence of {seq_len}; "
                             "use a longer text or a shorter --seq-len")
    n = n_avail if tokens is None else max(1, min(n_avail, -(-tokens // seq_len)))
    return torch.from_numpy(stream[: n * seq_len].astype(np.int64)).view(n, seq_len)
