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


def _torchrun(ranks: int, args: list[str]) -> subprocess.Popen:
    """`diffquant profile` under torchrun with `ranks` gloo ranks, started (wait on it); one thread each."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", port,
           "-m", "diffquant.cli", "profile", *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _same_statistics(a, b, where="") -> None:
    """Every number of two reports equal: integers exactly, floats to float64 rounding (sums over the same
    values in another order), lists and dicts key by key."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            if key == "topk":  # equal |values| (a token attending to itself in layer 0 ties wherever it recurs) keep no
                _same_top_entries(a[key], b[key], f"{where}.topk")  # order; the entries are the same
            else:
                _same_statistics(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_statistics(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert b == pytest.approx(a, rel=1e-9, abs=1e-12, nan_ok=True), where
    else:
        assert a == b, where


def _same_top_entries(a: list[dict], b: list[dict], where: str) -> None:
    """The same values in the same order, and at each value the same entries, except at the last value, where
    ties beyond k may keep any of the tied entries."""
    assert [e["value"] for e in a] == [e["value"] for e in b], where
    last = abs(a[-1]["value"]) if a else None
    key = lambda e: sorted(e.items())  # noqa: E731
    inside = lambda rows: sorted((key(e) for e in rows if abs(e["value"]) != last))  # noqa: E731
    assert inside(a) == inside(b), where


@pytest.mark.slow
def test_torchrun_ranks_merge_to_the_one_process_report(checkpoint, tmp_path):
    """1, 2 and 3 gloo ranks on 7 sequences in batches of 2 (uneven shards: the last batch holds one sequence)
    give the one-process report statistic by statistic, the per-pass ones included, over every kind of site the
    profile writes (token sites, attention logits, a weight, sinks, metric sets); more ranks than batches (two
    ranks, one sequence: rank 0 runs nothing) give the one-process report too. The text is random words, so no
    two windows tie and top-k locations are comparable."""
    import random

    rng = random.Random(0)
    words = TEXT.replace(",", "").replace(".", "").split()
    (tmp_path / "words.txt").write_text("\n".join(" ".join(rng.choices(words, k=12)) for _ in range(2000)))
    common = ["--model", str(checkpoint / "diffllama"), "--data", str(tmp_path / "words.txt"), "--seq-len", "32",
              "--batch-size", "2", "--no-plots", "--metrics", "bondarenko2023,gu2024",
              "--sites", "*.attn_logits", "*.hidden", "layers.0.mlp_in", "layers.1.self_attn.q_proj.weight"]

    def report(out):
        doc = json.loads((out / "stats.json").read_text())["models"][0]
        return doc, doc.pop("provenance")["world_size"]

    cases = [("224", 1), ("224", 2), ("224", 3), ("32", 2)]
    runs = [_torchrun(n, [*common, "--tokens", tokens, "--out", str(tmp_path / f"ranks{tokens}-{n}")])
            for tokens, n in cases]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank computes: the same activations bit for bit
    try:
        for tokens in ("224", "32"):
            assert main(["profile", *common, "--tokens", tokens, "--out", str(tmp_path / f"one{tokens}")]) == 0
    finally:
        torch.set_num_threads(threads)
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
    for tokens, n in cases:
        one, _ = report(tmp_path / f"one{tokens}")
        assert len(one["sites"]) == 6 and one["sites"]["layers.0.hidden"]["passes"] == (4 if tokens == "224" else 1)
        merged, world = report(tmp_path / f"ranks{tokens}-{n}")
        assert world == n
        _same_statistics(one, merged, f"{n} ranks, {tokens} tokens")


def test_the_profiler_counts_llm_int8_outliers_at_six(micro_pair):
    """LLM.int8's outlier features are |x| >= 6 (Dettmers et al. 2022), and the profiler builds its statistics with
    the default threshold: channel 3 planted at 5.5 (never counted), channel 5 at −6.0 (always), channel 7 at 6.0 in
    the first three positions only; every fraction against a count at 6.0 written here, on what the layer output."""
    model = micro_pair[0]
    seen = []

    def plant(module, args, out):
        out = out.index_fill(-1, torch.tensor([3]), 5.5).index_fill(-1, torch.tensor([5]), -6.0)
        out[:, :3, 7] = 6.0
        seen.append(out.detach().clone())
        return out

    handle = model.model.layers[0].register_forward_hook(plant)
    try:
        prof = profile_model(model, torch.randint(0, 512, (3, 16), generator=torch.Generator().manual_seed(1)),
                             ["layers.0.hidden"], batch_size=2, progress=False)
    finally:
        handle.remove()
    h = torch.cat(seen)
    fraction = (h.abs() >= 6.0).double().mean(dim=(0, 1))
    got = prof.sites["layers.0.hidden"].summary()["channel_hit_fraction"]
    assert got == [round(float(f), 6) for f in fraction]
    assert got[3] == 0.0 and got[5] == 1.0 and got[7] == pytest.approx(3 / 16, abs=1e-6)
