"""Synthetic corpora, training conventions and emergence tracking, against independent computations."""

import json

import numpy as np
import pytest
import torch

from diffquant import DiffquantError
from diffquant.data import synthetic
from diffquant.track import track_steps
from diffquant.training import TrainConfig, prepare_data, train_model, train_pair


def test_bigram_backcopy_rules():
    spec = synthetic.parse("synth:bb:vocab=16,triggers=2,seed=3")
    ids = synthetic.sequences(spec, "train", 2000, 40)
    assert (ids[:, 0] == spec.bos).all() and (ids[:, 1:] < spec.vocab).all()
    chain = synthetic.Chain(spec)
    # the triggers are the most frequent tokens of the chain's stationary distribution (eigenvector of Pᵀ)
    w, v = np.linalg.eig(chain.P.T)
    pi = np.real(v[:, np.argmin(np.abs(w - 1))])
    pi /= pi.sum()
    assert set(chain.triggers.tolist()) == set(np.argsort(-pi)[:2].tolist())
    copies = 0
    counts = np.zeros((16, 16))
    for row in ids:
        for t in range(2, len(row)):
            if row[t - 1] in chain.triggers:
                assert row[t] == row[t - 2]  # back-copy
                copies += 1
            else:
                counts[row[t - 1], row[t]] += 1
    assert copies > 500
    # elsewhere the next token follows the bigram rows: total variation within sampling noise
    busy = counts.sum(1) > 2000
    tv = 0.5 * np.abs(counts[busy] / counts[busy].sum(1, keepdims=True) - chain.P[busy]).sum(1)
    assert busy.sum() >= 3 and tv.max() < 0.06
    # deterministic by seed; train and validation differ
    assert np.array_equal(ids, synthetic.sequences(spec, "train", 2000, 40))
    assert not np.array_equal(ids[:10], synthetic.sequences(spec, "validation", 10, 40))
    markov = synthetic.sequences(synthetic.parse("synth:markov:vocab=16,seed=3"), "train", 50, 40)
    assert (markov[:, 0] == 16).all() and (markov[:, 1:] < 16).all()


def test_synthetic_specs_refused_clearly():
    for bad in ("synth:nope", "synth:bb:vocab=1", "synth:bb:triggers=99", "synth:bb:colour=3", "synth:bb:vocab=x"):
        with pytest.raises(DiffquantError):
            synthetic.parse(bad)


def test_synthetic_tokenizer_round_trip():
    spec = synthetic.parse("synth:bb:vocab=8")
    tok = synthetic.tokenizer(spec)
    assert tok("<bos> t3 t7", add_special_tokens=False)["input_ids"] == [8, 3, 7]
    assert len(tok) == 9


def test_track_steps():
    s = track_steps(1000, 16)
    assert s[0] == 0 and s[-1] == 1000 and len(s) >= 12 and s == sorted(set(s))
    ratios = [b / a for a, b in zip(s[2:], s[3:])]
    assert max(ratios) / min(ratios) < 2  # log-spaced


def _cfg(tmp, **kw):
    base = dict(preset="micro", corpus="synth:bb:vocab=32", tokens=30 * 8 * 32, batch_size=8, seq_len=32,
                eval_every=1000, save_every=10, eval_tokens=32 * 16, archs=("baseline", "diff"), track=True,
                track_points=14, track_sequences=4)
    return TrainConfig(**{**base, **kw})


@pytest.mark.slow
def test_tracking_matches_an_independent_profile_and_changes_nothing(tmp_path, drawn):
    from test_figures import _emergence_check

    cfg = _cfg(tmp_path)
    res = train_pair(cfg, tmp_path / "tracked", progress=False)
    train_pair(TrainConfig(**{**cfg.__dict__, "track": False}), tmp_path / "plain", progress=False)
    doc = json.loads((tmp_path / "tracked" / "emergence.json").read_text())
    assert (tmp_path / "tracked" / "emergence.png").is_file()
    _emergence_check(doc, drawn)  # the figure draws the document written
    for arch, label in (("baseline", "Transformer"), ("diff", "DIFF")):
        pts = doc["models"][label]
        assert len(pts) >= 12 and pts[0]["step"] == 0 and pts[-1]["step"] == 30
        assert pts[-1]["tokens"] == 30 * 8 * 32
        # training is the same with and without tracking
        a = torch.load(tmp_path / "tracked" / arch / "trainer_state.pt", weights_only=False)["metrics"]["val"]
        b = torch.load(tmp_path / "plain" / arch / "trainer_state.pt", weights_only=False)["metrics"]["val"]
        assert a == b
        # the last snapshot describes the final checkpoint: hidden top-1 from output_hidden_states
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tmp_path / "tracked" / arch).eval()
        batch = prepare_data(cfg, tmp_path / "tracked").val[:4]
        with torch.no_grad():
            out = model(batch, labels=batch, output_hidden_states=True)
        assert pts[-1]["layers"]["0"]["hidden"]["top1"] == pytest.approx(float(out.hidden_states[1].abs().max()), rel=1e-5)
        assert pts[-1]["loss"] == pytest.approx(float(out.loss), rel=1e-5)
    assert res["models"]["baseline"]["track_seconds"] > 0


@pytest.mark.slow
def test_tracking_resumes(tmp_path):
    cfg = _cfg(tmp_path, archs=("diff",))
    straight = train_pair(cfg, tmp_path / "a", progress=False)
    data = prepare_data(cfg, tmp_path / "b")
    train_model("diff", cfg, data, tmp_path / "b", progress=False, stop_after=20)  # checkpoint at step 20
    resumed = train_pair(cfg, tmp_path / "b", resume=True, progress=False)
    a = [(p["step"], p["loss"]) for p in straight["models"]["diff"]["emergence"]]
    b = [(p["step"], p["loss"]) for p in resumed["models"]["diff"]["emergence"]]
    assert a == b


def test_bos_windows_and_config_recorded(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"line {i} of some words here" for i in range(4000)))
    cfg = TrainConfig(preset="micro", corpus=str(text), tokens=4096, batch_size=4, seq_len=32, bos=True,
                      weight_decay=0.0, schedule="constant", archs=("baseline",), eval_tokens=256)
    data = prepare_data(cfg, tmp_path / "run")
    bos = data.tokenizer.convert_tokens_to_ids(data.tokenizer.eos_token)
    assert data.train.shape[1] == 32 and (data.train[:, 0] == bos).all() and (data.val[:, 0] == bos).all()
    assert (data.train[:, 1:] != bos).float().mean() > 0.99
    train_pair(cfg, tmp_path / "run2", progress=False)
    saved = json.loads((tmp_path / "run2" / "train_config.json").read_text())
    assert saved["bos"] is True and saved["weight_decay"] == 0.0 and saved["schedule"] == "constant"


def _experiment():
    from conftest import load_script_module

    return load_script_module("experiments/emergence.py", "emergence_experiment")


def test_extrapolated_budget_and_choice_hand_worked():
    e = _experiment()
    # ratio = 2·sqrt(tokens / 1e4) in the second half: reaches 100 at tokens = (50)² · 1e4 = 2.5e7
    pts = [{"tokens": t, "model": {"hidden_ratio_max": 2 * (t / 1e4) ** 0.5}} for t in (0, 1e3, 1e4, 1e5, 1e6, 4e6, 8e6)]
    assert e.extrapolate(pts) == pytest.approx(2.5e7, rel=1e-9)
    flat = [{"tokens": t, "model": {"hidden_ratio_max": 5.0}} for t in (1e3, 1e4, 1e5, 1e6, 1e7, 1e8)]
    assert e.extrapolate(flat) is None
    found = {"a": {"hidden_ratio": 20, "sink_rate": 0, "extrapolated_tokens": 9e8},
             "b": {"hidden_ratio": 10, "sink_rate": 0, "extrapolated_tokens": 4e7},
             "c": {"hidden_ratio": 30, "sink_rate": 0, "extrapolated_tokens": None}}
    assert e.choose({"a": {}, "b": {}, "c": {}}, found) == "b"  # none in the regime: the smallest budget
    found["c"]["sink_rate"] = 0.6
    assert e.choose({"a": {}, "b": {}, "c": {}}, found) == "c"  # the first in the regime
    row = e._search_row("b", {"preset": "mini", "corpus": "synth:bb", "lr": 3e-3, "seq_len": 128},
                        {**found["b"], "parameters": 1, "train_tokens": 2, "minutes": 3.04, "massive_ratio": 1,
                         "logit_top1": 1, "loss": 1})
    assert row[-1] == "40M" and row[-2] == "no" and row[6] is True
