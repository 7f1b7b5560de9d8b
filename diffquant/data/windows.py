"""One resolver for every command that reads a corpus (`profile`, `sweep`, `quantize` through `--data`, `train`
through `--corpus`), so they all accept the same names: a Debian corpus (`kjv`, ..., `debian-mix`), a local
text file or folder, `hf:NAME[:CONFIG]`, or a synthetic token corpus `synth:bb` / `synth:markov[:key=value,...]`.

Text corpora are split into train/validation by `corpora.split` and encoded with the model's tokenizer.
Synthetic corpora are token ids already: their windows come straight from `synthetic.sequences` (each starts
with BOS; the train and validation splits come from the separate generators `diffquant train` draws them from),
and only a model whose tokenizer is the one `train` saved for that corpus may read them, since any other
tokenizer would give the ids other meanings.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from diffquant.errors import DiffquantError
from diffquant.data import synthetic

SPLITS = ("train", "validation")


def check_source(source: str) -> None:
    """Refuse a corpus no command can read, with one line listing what is accepted (no heavy imports)."""
    from diffquant.data.corpora import NAMES

    if synthetic.is_synthetic(source):
        synthetic.parse(source)
    elif not (source.startswith("hf:") or source in NAMES or Path(source).exists()):
        raise DiffquantError(f"unknown corpus {source!r}: not one of {', '.join(NAMES)}, synth:bb or synth:markov"
                             "[:key=value,...], hf:NAME[:CONFIG], or an existing file or folder")


@lru_cache(maxsize=2)
def _split_text(source: str, cache: str | None) -> tuple[str, str]:
    from diffquant.data.corpora import load_text, split

    return split(load_text(source, cache)[0])


def corpus_text(source: str, split: str = "validation", cache: str | None = None) -> str:
    """The text of one split of a text corpus (needle haystacks need text; a synthetic corpus has none)."""
    check_source(source)
    if synthetic.is_synthetic(source):
        raise DiffquantError(f"{source} is a corpus of token ids, not text; this evaluation needs a text corpus")
    return _split_text(source, cache)[SPLITS.index(split)]


def check_synthetic_tokenizer(spec: synthetic.SynthSpec, tokenizer, source: str) -> None:
    """A synthetic corpus is readable only by the word-level tokenizer `train` saved for it ("t0".."t{V-1}", BOS)."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    expected = {f"t{i}": i for i in range(spec.vocab)} | {"<bos>": spec.bos}
    if any(vocab.get(word) != i for word, i in expected.items()):
        raise DiffquantError(f"{source} is a corpus of {spec.vocab} token ids and BOS; this model's tokenizer is not "
                             f"the one `diffquant train --corpus {source}` saves, so the ids would mean other tokens")


def corpus_windows(source: str, tokenizer, split: str, seq_len: int, tokens: int, cache: str | None = None,
                   chars: int | None = None):
    """[n, seq_len] int64 token windows of `split` ("train" or "validation") covering `tokens` tokens (fewer
    when a text split is shorter). `chars` keeps only the first characters of a text split (calibration)."""
    import torch

    from diffquant.data.tokens import encode, sequences

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    check_source(source)
    if tokens <= 0 or seq_len <= 0:
        raise DiffquantError(f"tokens and sequence length must be positive, got {tokens} and {seq_len}")
    if synthetic.is_synthetic(source):
        spec = synthetic.parse(source)
        check_synthetic_tokenizer(spec, tokenizer, source)
        return torch.from_numpy(synthetic.sequences(spec, split, -(-tokens // seq_len), seq_len))
    text = corpus_text(source, split, cache)
    return sequences(encode(tokenizer, text[:chars] if chars else text), seq_len, tokens)
