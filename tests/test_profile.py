import json
import os
import subprocess
import sys

import pytest
import torch

from diffquant.cli import main
from diffquant.profiler import profile_model
from diffquant.report.profile_report import int8_outlier_features, massive_activations

TEXT = "\n".join(f"And the {w} said unto the {v}, behold the {u} of the land." for w, v, u in
                 zip(["lord", "king", "man", "woman"] * 60, ["people", "city", "servant", "son"] * 60,
                     ["light", "day", "water", "field", "house"] * 48))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, micro_pair):
    """The micro DIFF model saved with a BPE tokenizer trained on TEXT, plus a corpus file."""
    from diffquant.data.tokens import train_tokenizer

    root = tmp_path_factory.mktemp("ckpt")
    tok = train_tokenizer(TEXT, 300)
    for model in micro_pair:
        model.save_pretrained(root / model.config.model_type)
        tok.save_pretrained(root / model.config.model_type)
    (root / "corpus.txt").write_text(TEXT * 3)
    return root


def test_hidden_top1_matches_output_hidden_states(micro_pair):
    model = micro_pair[1]
    seqs = torch.randint(0, 512, (6, 20))
    prof = profile_model(model, seqs, ["*.hidden"], batch_size=4, progress=False)
    with torch.no_grad():
        hs = model(seqs, output_hidden_states=True).hidden_states
    # hidden_states[i + 1] is the output of layer i, except the last, which has the final norm applied
    for i in range(model.config.num_hidden_layers - 1):
        assert prof.sites[f"layers.{i}.hidden"].topk.rank(1) == pytest.approx(float(hs[i + 1].abs().max()), rel=1e-6)


def test_logit_stats_match_explicit_computation(micro_pair):
    """Pooled logits: |q·k/√d| at causal positions of both maps, recomputed here from q/k projections."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = micro_pair[1]
    seqs = torch.randint(0, 512, (2, 12))
    prof = profile_model(model, seqs, ["layers.0.attn_logits"], progress=False)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        h = model.model.layers[0].input_layernorm(model.model.embed_tokens(seqs))
        q = attn.q_proj(h).view(2, 12, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(h).view(2, 12, -1, attn.head_dim).transpose(1, 2)
        cos, sin = model.model.rotary_emb(h, torch.arange(12)[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        logits = (q @ k.transpose(-1, -2)) * attn.head_dim ** -0.5
    causal = torch.ones(12, 12, dtype=torch.bool).tril()
    vals = logits[..., causal].abs()
    s = prof.sites["layers.0.attn_logits"].summary()
    assert s["count"] == vals.numel()
    assert s["absmax"] == pytest.approx(float(vals.max()), rel=1e-5)
    assert s["quantiles"]["median"] == pytest.approx(float(vals.median()), rel=0.01)


def test_memory_does_not_grow_with_tokens(micro_pair):
    def state_bytes(n):
        prof = profile_model(micro_pair[0], torch.randint(0, 512, (n, 16)), progress=False)
        total = 0
        for s in prof.sites.values():
            for v in vars(s).values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
            total += sum(t.numel() * t.element_size() for t in (s.topk.abs, s.topk.values, s.topk.coords))
            total += s.hist.counts.numel() * 8
        return total

    assert state_bytes(40) == state_bytes(4)


def test_outlier_summaries(micro_pair):
    model = micro_pair[0]
    handle = model.model.layers[0].register_forward_hook(
        lambda m, a, out: out.index_fill(-1, torch.tensor([5]), 1e4))
    try:
        prof = profile_model(model, torch.randint(0, 512, (2, 16)), ["*.hidden"], progress=False)
    finally:
        handle.remove()
    features = int8_outlier_features(prof)
    assert {"channel": 5, "layers": [0, 1]} in features or any(f["channel"] == 5 for f in features)
    massive = massive_activations(prof)
    assert massive and all(m["channel"] == 5 for m in massive if m["layer"] == 0)


def test_profile_cli_writes_everything(checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["profile", "--model", f"base={checkpoint / 'llama'}", "--model", f"diff={checkpoint / 'diffllama'}",
            "--data", str(checkpoint / "corpus.txt"), "--tokens", "256", "--seq-len", "32", "--out", str(out)]
    assert main(args) == 0
    for name in ("stats.json", "table5.md", "table5.csv", "kurtosis_vs_layer.png", "absmax_vs_layer.png"):
        assert (out / name).exists(), name
    stats = json.loads((out / "stats.json").read_text())
    assert [m["label"] for m in stats["models"]] == ["base", "diff"]
    assert stats["models"][1]["provenance"]["tokens"] == 256
    assert "attention logits" in (out / "table5.md").read_text()
    assert main(args) == 2  # refuses to overwrite
    assert "already holds results" in capsys.readouterr().err


def test_profile_cli_errors(checkpoint, tmp_path, capsys):
    base = ["profile", "--model", str(checkpoint / "llama"), "--data", str(checkpoint / "corpus.txt"), "--out",
            str(tmp_path / "o")]
    assert main([*base, "--tokens", "0"]) == 2
    assert main([*base, "--sites", "*.nope"]) == 2
    assert "no site matches" in capsys.readouterr().err
    assert main(["profile", "--model", str(checkpoint / "llama"), "--data", str(tmp_path / "missing.txt"),
                 "--out", str(tmp_path / "o2")]) == 2
    capsys.readouterr()
    assert main(["profile", "--model", "micro:diff", "--out", str(tmp_path / "o3"), "--data",
                 str(checkpoint / "corpus.txt"), "--tokens", "256", "--seq-len", "32", "--no-plots"]) == 0  # bytes
    from diffquant.models.presets import PRESETS, build

    build(PRESETS["micro"], "baseline").save_pretrained(tmp_path / "bare")
    assert main(["profile", "--model", str(tmp_path / "bare"), "--out", str(tmp_path / "o4"), "--data",
                 str(checkpoint / "corpus.txt")]) == 2
    assert "no tokenizer files" in capsys.readouterr().err


@pytest.mark.slow
def test_torchrun_two_ranks_merge_to_one_report(checkpoint, tmp_path):
    common = ["--model", str(checkpoint / "diffllama"), "--data", str(checkpoint / "corpus.txt"),
              "--tokens", "512", "--seq-len", "32", "--no-plots"]
    assert main(["profile", *common, "--out", str(tmp_path / "single")]) == 0
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
           "-m", "diffquant.cli", "profile", *common, "--out", str(tmp_path / "ddp")]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=180)
    single = json.loads((tmp_path / "single" / "stats.json").read_text())["models"][0]
    ddp = json.loads((tmp_path / "ddp" / "stats.json").read_text())["models"][0]
    assert ddp["provenance"]["world_size"] == 2
    for name, s in single["sites"].items():
        assert ddp["sites"][name]["count"] == s["count"]
        # the corpus repeats itself, so equal values can sit at several locations: compare values
        assert [e["value"] for e in ddp["sites"][name]["topk"]] == [e["value"] for e in s["topk"]]
        assert ddp["sites"][name]["kurtosis"] == pytest.approx(s["kurtosis"], rel=1e-6)
