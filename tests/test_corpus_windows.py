"""Every command that takes --data/--corpus reads the same corpus names, synthetic ones included: profile, sweep and
quantize run end to end on synth:bb with a model saved with that corpus's tokenizer; train's data resolver too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffquant import DiffquantError
from diffquant.data import synthetic

SOURCE = "synth:bb:vocab=16,triggers=2"


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory):
    """A micro baseline over the corpus's 16 tokens + BOS, saved with the tokenizer `train` gives it."""
    from diffquant.models.presets import PRESETS, build

    spec = synthetic.parse(SOURCE)
    folder = tmp_path_factory.mktemp("synth_model")
    build(PRESETS["micro"], "baseline", vocab=spec.vocab + 1).save_pretrained(folder)
    synthetic.tokenizer(spec).save_pretrained(folder)
    return folder


def test_windows_are_the_generators_sequences():
    from diffquant.data.windows import corpus_windows

    spec = synthetic.parse(SOURCE)
    tok = synthetic.tokenizer(spec)
    w = corpus_windows(SOURCE, tok, "validation", 32, 100)
    assert w.dtype == torch.int64 and w.shape == (4, 32)  # ceil(100 / 32) windows
    assert np.array_equal(w.numpy(), synthetic.sequences(spec, "validation", 4, 32))
    assert (w[:, 0] == spec.bos).all()
    assert not torch.equal(w, corpus_windows(SOURCE, tok, "train", 32, 100))


def test_a_foreign_tokenizer_and_unknown_names_are_refused():
    from diffquant.data.tokens import byte_tokenizer
    from diffquant.data.windows import check_source, corpus_text, corpus_windows

    with pytest.raises(DiffquantError, match="ids would mean other tokens"):
        corpus_windows(SOURCE, byte_tokenizer(), "validation", 32, 64)
    with pytest.raises(DiffquantError, match="synth:bb or synth:markov"):
        check_source("no-such-corpus")
    with pytest.raises(DiffquantError, match="not text"):
        corpus_text("synth:bb")
    check_source("kjv"), check_source("hf:wikitext:wikitext-2-raw-v1"), check_source("synth:markov:seed=2")


@pytest.mark.parametrize("argv", [
    ["profile", "--data", SOURCE, "--tokens", "64", "--seq-len", "32", "--no-plots", "--sites", "*.hidden"],
    ["sweep", "--data", SOURCE, "--eval-tokens", "64", "--seq-len", "32", "--no-plots", "--bits", "16,8"],
    ["quantize", "--data", SOURCE, "--eval-tokens", "64", "--seq-len", "32", "--calib-tokens", "64", "--scheme", "w8a8"],
], ids=["profile", "sweep", "quantize"])
def test_each_data_command_reads_synth_bb(argv, synth_model, tmp_path, capsys):
    from diffquant.cli import main

    main([*argv, "--model", str(synth_model), "--out", str(tmp_path / "out")])
    assert any((tmp_path / "out").iterdir())
    assert "unknown corpus" not in capsys.readouterr().err


def test_the_cli_refuses_an_unknown_corpus_before_loading_anything(tmp_path, capsys):
    from diffquant.cli import main

    assert main(["profile", "--model", "tiny:diff", "--data", "synth:nope", "--out", str(tmp_path)]) != 0
    assert "unknown synthetic corpus" in capsys.readouterr().err


def test_train_resolves_synth_bb(tmp_path):
    from diffquant.training import TrainConfig, prepare_data

    data = prepare_data(TrainConfig(preset="micro", corpus=SOURCE, tokens=4 * 32, seq_len=32, batch_size=2,
                                    eval_tokens=64), tmp_path)
    assert data.val.shape[1] == 32 and (data.val[:, 0] == synthetic.parse(SOURCE).bos).all()
    with pytest.raises(DiffquantError, match="synth:bb or synth:markov"):
        prepare_data(TrainConfig(preset="micro", corpus="no-such-corpus"), tmp_path / "x")
