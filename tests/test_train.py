import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from diffquant import DiffquantError
from diffquant.data.corpora import split
from diffquant.training import TrainConfig, batch_at, lr_at, prepare_data, train_model, train_pair, unigram_entropy

WORDS = "light darkness water earth heaven king people city servant son daughter house field bread wine".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, size=12)) + "." for _ in range(3000)]
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(lines))
    return path


def _cfg(corpus, **kw):
    base = dict(preset="micro", corpus=str(corpus), tokens=8 * 4 * 64, batch_size=4, eval_every=4, save_every=4,
                eval_tokens=512, archs=("diff",))
    return TrainConfig(**{**base, **kw})


def test_schedule_and_data_order():
    cfg = TrainConfig(lr=1.0, warmup_frac=0.1, min_lr_ratio=0.1)
    assert lr_at(0, 100, cfg) == pytest.approx(0.1)
    assert lr_at(9, 100, cfg) == pytest.approx(1.0)
    assert lr_at(99, 100, cfg) == pytest.approx(0.1, abs=1e-3)
    windows = torch.arange(40).view(20, 2)
    first = torch.cat([batch_at(windows, s, 4, seed=3) for s in range(5)])
    assert sorted(first[:, 0].tolist()) == list(range(0, 40, 2))  # one epoch covers every window once
    assert torch.equal(batch_at(windows, 7, 4, 3), batch_at(windows, 7, 4, 3))


def test_split_never_overlaps():
    lines = [f"line {i}" for i in range(5000)]
    train, val = split("\n".join(lines))
    t, v = set(train.splitlines()), set(val.splitlines())
    assert not t & v and len(t) + len(v) == 5000 and 0.03 < len(v) / 5000 < 0.07


def test_unigram_entropy():
    assert unigram_entropy(np.array([0, 1, 0, 1])) == pytest.approx(np.log(2))


def test_resume_is_bit_exact(corpus, tmp_path):
    cfg = _cfg(corpus)
    straight = tmp_path / "straight"
    data = prepare_data(cfg, straight)
    train_model("diff", cfg, data, straight, progress=False)
    resumed = tmp_path / "resumed"
    data2 = prepare_data(cfg, resumed)
    train_model("diff", cfg, data2, resumed, progress=False, stop_after=4)
    assert json.loads(json.dumps(torch.load(resumed / "diff" / "trainer_state.pt", weights_only=False)["step"])) == 4
    train_model("diff", cfg, data2, resumed, resume=True, progress=False)
    a = load_file(straight / "diff" / "model.safetensors")
    b = load_file(resumed / "diff" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_train_pair_learns_and_records(corpus, tmp_path):
    cfg = _cfg(corpus, tokens=60 * 8 * 64, batch_size=8, eval_every=30, save_every=30, archs=("baseline", "diff"))
    results = train_pair(cfg, tmp_path / "run", progress=False)
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved["data"]["sha256"] == results["data"]["sha256"]
    for arch in ("baseline", "diff"):
        m = saved["models"][arch]
        assert m["final_val"]["loss"] < saved["data"]["unigram_entropy"] - 0.3
        assert m["parameters"] > 0 and m["tokens_per_s"] > 0 and m["curve"]
        assert (tmp_path / "run" / arch / "tokenizer.json").exists()
    with pytest.raises(DiffquantError, match="already holds a training run"):
        train_pair(cfg, tmp_path / "run", progress=False)
    with pytest.raises(DiffquantError, match="other settings"):
        train_pair(_cfg(corpus, tokens=999 * 64, archs=("baseline", "diff")), tmp_path / "run", resume=True,
                   progress=False)


def test_training_precision(corpus, tmp_path):
    """`--dtype`: auto on a CPU is fp32 (the same weights bit for bit), bf16 autocasts the forward on the CPU too (other
    weights, still finite and fp32 in storage), the precision is recorded, fp16 is refused in one line; the command
    line takes the flag."""
    from diffquant.cli import main

    cfg = _cfg(corpus, tokens=4 * 4 * 64)
    runs = {d: train_pair(cfg, tmp_path / d, "cpu", progress=False, figures=False, dtype=d) for d in ("auto", "fp32", "bf16")}
    weights = {d: load_file(tmp_path / d / "diff" / "model.safetensors") for d in runs}
    assert all(torch.equal(weights["auto"][k], weights["fp32"][k]) for k in weights["auto"])
    assert any(not torch.equal(weights["bf16"][k], weights["fp32"][k]) for k in weights["fp32"])
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights["bf16"].values())
    assert {d: r["environment"]["precision"] for d, r in runs.items()} == {d: d for d in runs}
    with pytest.raises(DiffquantError, match="fp16 needs loss scaling"):
        train_pair(cfg, tmp_path / "fp16", "cpu", progress=False, dtype="fp16")
    assert not (tmp_path / "fp16").exists()
    with pytest.raises(SystemExit):
        main(["train", "--preset", "micro", "--data", str(corpus), "--dtype", "fp16", "--out", str(tmp_path / "x")])


def test_bad_training_input(corpus, tmp_path):
    with pytest.raises(ValueError):
        TrainConfig(tokens=0)
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(DiffquantError):
        prepare_data(_cfg(short), tmp_path / "x")
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    with pytest.raises(DiffquantError, match="empty"):
        prepare_data(_cfg(empty), tmp_path / "y")


@pytest.mark.slow
def test_ddp_two_gloo_ranks_match_single_process(corpus, tmp_path):
    args = ["train", "--preset", "micro", "--corpus", str(corpus), "--tokens", str(6 * 4 * 64), "--batch-size", "4",
            "--arch", "diff", "--eval-every", "100", "--save-every", "100"]
    from diffquant.cli import main

    assert main([*args, "--out", str(tmp_path / "single")]) == 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
           "-m", "diffquant.cli", *args, "--out", str(tmp_path / "ddp")]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]  # torchrun's own message, to tell a port race from a bug
    a = load_file(tmp_path / "single" / "diff" / "model.safetensors")
    b = load_file(tmp_path / "ddp" / "diff" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4) for k in a)
