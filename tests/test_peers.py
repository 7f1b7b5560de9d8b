"""benchmarks/peers.py: the one statistics function every workflow is reduced with, checked by hand and
against scipy, and the peers.json -> markdown rendering on a small fixture. No venv is created here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from conftest import load_script_module as _module  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent




peer_stats = _module("benchmarks/peer_stats.py", "peer_stats_under_test")
peers = _module("benchmarks/peers.py", "peers_under_test")


def test_exact_stats_on_a_hand_worked_case():
    # |x| sorted: 1, 2, 3, 4, 4, so the median is 3; the mean is 2 / 5 = 0.4, so the deviations are:
    x = np.array([1.0, -2.0, 3.0, -4.0, 4.0], dtype=np.float32)
    d = np.array([0.6, -2.4, 2.6, -4.4, 3.6])
    m2, m4 = (d**2).mean(), (d**4).mean()
    s = peer_stats.exact_stats(x)
    assert s["count"] == 5 and s["top1"] == 4.0 and s["median"] == 3.0
    assert s["top10"] is None and s["top100"] is None  # fewer than 10 values
    assert s["kurtosis"] == pytest.approx(m4 / m2**2, rel=1e-12)


def test_exact_stats_against_scipy_and_sorting():
    rng = np.random.default_rng(0)
    x = (rng.standard_t(3, size=(7, 300)) * 5).astype(np.float32)
    s = peer_stats.exact_stats(x)
    mags = np.sort(np.abs(x).ravel())[::-1]
    assert [s["top1"], s["top10"], s["top100"]] == [float(mags[0]), float(mags[9]), float(mags[99])]
    assert s["median"] == pytest.approx(float(np.quantile(np.abs(x.ravel()).astype(np.float64), 0.5)), rel=1e-7)
    assert s["kurtosis"] == pytest.approx(sps.kurtosis(x.ravel().astype(np.float64), fisher=False), rel=1e-9)
    assert s["count"] == x.size
    assert peer_stats.exact_stats(np.zeros(0))["top1"] is None


def test_compare_flags_sites_outside_tolerance():
    ours = {"layers.0.hidden": {"top1": 10.0, "median": 1.0, "count": 4, "kurtosis": 3.0},
            "layers.1.hidden": {"top1": 20.0, "median": 1.0, "count": 4, "kurtosis": 3.0}}
    theirs = {"layers.0.hidden": {"top1": 10.0, "median": 1.003, "count": 4, "kurtosis": 3.0},
              "layers.1.hidden": {"top1": 20.1, "median": 1.0, "count": 5, "kurtosis": 3.0}}
    assert peers.compare(ours, {**theirs, "layers.0.hidden": {"median": 1.008}})["median"]["outside_tolerance"] == 1
    c = peers.compare(ours, theirs)
    assert c["top1"]["outside_tolerance"] == 1 and c["top1"]["at"] == "layers.1.hidden"
    assert c["top1"]["max_rel_diff"] == pytest.approx(0.005)
    assert c["median"]["outside_tolerance"] == 0  # 1.003 lies within the histogram's resolution (2^-8) of 1.0
    assert c["count"]["first_outside"] == ["layers.1.hidden"]
    assert c["kurtosis"]["max_rel_diff"] == 0


def test_rendering_from_a_small_fixture():
    same = {"max_rel_diff": 0.0, "at": "layers.0.hidden", "outside_tolerance": 0, "first_outside": []}
    off = {"max_rel_diff": 0.02, "at": "layers.1.attn_logits", "outside_tolerance": 2, "first_outside": []}
    stats = {s: same for s in ("top1", "top10", "top100", "median", "count")}
    results = {
        "model": "M", "corpus": "C", "cores": 2, "load_average": 3.0,
        "parity": {"seq_len": 256, "tokens": 1024, "sites": 2,
                   "diffquant": {"versions": {"torch": "2.13.0"}},
                   "peers": {"nnsight": {"versions": {"nnsight": "0.8.1"},
                                         "by_point": {"hidden": {**stats, "kurtosis": same},
                                                      "attn_logits": {**stats, "kurtosis": off}}},
                             "transformer_lens": {"error": "exit 1: boom"}}},
        "cost": [{"tokens": 8192, "seq_len": 256, "workflows": {
                      "diffquant": {"tokens_per_s": 1000.0, "tokens_per_cpu_s": 600.0, "peak_mib": 900.0},
                      "transformer_lens": {"refused": "its cache would hold 9.0 GiB; 4.0 GiB available"},
                      "nnsight": {"error": "killed by signal 9"}}},
                 {"tokens": 65536, "seq_len": 256, "not_run": "not run in this session", "workflows": {}}],
        "attention_cost": [{"tokens": 2048, "seq_len": 2048, "workflows": {
            "diffquant": {"tokens_per_s": 50.0, "peak_mib": 1200.4}}}],
    }
    text = "\n".join(peers.markdown_part(results))
    assert "torch 2.13.0" in text and "nnsight 0.8.1" in text
    # each side's versions as recorded, parity and cost apart; a transformers mismatch in the cost cases is said
    results["cost"][0]["workflows"]["diffquant"]["versions"] = {"transformers": "5.25.0"}
    results["cost"][0]["workflows"]["nnsight"]["versions"] = {"transformers": "5.24.0"}
    said = peers.versions_text(results)
    assert said.startswith("Versions in the parity run: diffquant profile (streaming): torch 2.13.0; nnsight 0.8 "
                           "LanguageModel: nnsight 0.8.1. In the cost cases: diffquant profile (streaming): "
                           "transformers 5.25.0; nnsight 0.8 LanguageModel: transformers 5.24.0.")
    assert "diffquant on transformers 5.25.0 and the peers on 5.24.0" in said
    results["cost"][0]["workflows"]["nnsight"]["versions"] = {"transformers": "5.25.0"}
    assert "not one version" not in peers.versions_text(results)
    assert "| nnsight 0.8 LanguageModel | attn_logits | 0 | 0 | 0 | 0 | 2.0e-02 (2 sites outside) | 0 |" in text
    assert "| TransformerLens 4.3 TransformerBridge | all | exit 1: boom |" in text
    assert "| hidden + Linear inputs, all layers: 8,192 tokens | 1,000 tok/s (600 per CPU-s), 900 MiB | not started (its cache" in text
    assert "killed by signal 9 |" in text
    assert "| hidden + Linear inputs, all layers: 65,536 tokens | not run in this session |" in text
    assert "| attention scores, all layers: one window of 2,048 | 50 tok/s, 1,200 MiB | – | – |" in text


def test_llmcompressor_check_layer_error_by_hand():
    """The side-by-side's per-Linear output error ‖X·Ŵᵀ − X·Wᵀ‖² / ‖X·Wᵀ‖² on the float inputs, written out here."""
    import torch

    check = _module("benchmarks/llmcompressor_check.py", "llmcompressor_check_under_test")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False), torch.nn.ReLU(), torch.nn.Linear(3, 2, bias=False))
    x = torch.randn(2, 5, 4)
    w0, w2 = model[0].weight.detach().clone(), model[2].weight.detach().clone()
    q0, q2 = w0.round(), w2 * 1.1
    got = check.layer_errors(model, {"0.weight": q0, "2.weight": q2}, x, limit=2)
    flat = x.reshape(-1, 4).double()
    want0 = float(((flat @ q0.double().T - flat @ w0.double().T) ** 2).sum() / ((flat @ w0.double().T) ** 2).sum())
    assert got["0"] == pytest.approx(want0, rel=1e-9)
    assert got["2"] == pytest.approx(0.01, rel=1e-6)  # (1.1 − 1)² whatever the input (q2 rounded to fp32)
    assert torch.equal(model[0].weight, w0)  # the model is left as it was


def _w(cpu_s: float, tokens: int = 8192) -> dict:
    return {"tokens_per_s": tokens / cpu_s, "tokens_per_cpu_s": tokens / cpu_s, "cpu_seconds": cpu_s, "peak_mib": 500.0}


def test_verdicts_say_which_is_faster_and_the_forward_floor():
    # diffquant 40 CPU-s, nnsight 50, TransformerLens 60, the bare forward 30: diffquant 1.25x nnsight, 75% of its
    # time is the forward, and free statistics would reach at most 50 / 30 = 1.67x; on tiny TransformerLens is faster
    results = {"cost": [{"tokens": 8192, "seq_len": 256, "workflows": {
                   "diffquant": _w(40.0), "nnsight": _w(50.0), "transformer_lens": _w(60.0), "forward": _w(30.0)}},
               {"model": "tiny", "tokens": 8192, "seq_len": 256, "workflows": {
                   "diffquant": _w(10.0), "transformer_lens": _w(8.0), "nnsight": {"error": "exit 1"}}}],
               "attention_cost": [{"tokens": 2048, "seq_len": 2048, "not_run": "not run", "workflows": {}}]}
    said = peers.verdicts(results)
    assert said[2:] == ["- The target of 3× the fastest peer's tokens per CPU-second is met on no case and not on 2 "
                        "(SmolLM2, 8,192 tokens; tiny (random weights), 8,192 tokens)."]
    assert said[:2] == [
        "- SmolLM2, 8,192 tokens: diffquant 1.25× the tokens per CPU-second of the fastest peer (nnsight 0.8 "
        "LanguageModel); the bare forward is 75% of diffquant's CPU time, so even statistics that cost nothing would "
        "make it at most 1.7× that peer.",
        "- tiny (random weights), 8,192 tokens: TransformerLens 4.3 TransformerBridge is faster, diffquant does 0.80× "
        "its tokens per CPU-second."]
    rows = peers.cost_rows(results)
    assert rows[1][0] == "tiny (random weights), hidden + Linear inputs, all layers: 8,192 tokens"
    assert rows[0][-1].startswith("273 tok/s")  # the bare forward is the last column


def test_merge_keeps_other_models_and_results_not_rerun():
    disk = [{"tokens": 8192, "seq_len": 256, "workflows": {"diffquant": 1}},
            {"model": "tiny", "tokens": 65536, "seq_len": 256, "workflows": {"diffquant": 2}}]
    ran = [{"model": "smollm2-135m", "tokens": 8192, "seq_len": 256, "not_run": "not run", "workflows": {}},
           {"model": "smollm2-135m", "tokens": 65536, "seq_len": 256, "workflows": {"diffquant": 3}}]
    merged = peers.merge_cases(disk, ran)
    assert [(c.get("model", "smollm2-135m"), c["tokens"], c["workflows"]) for c in merged] == [
        ("smollm2-135m", 8192, {"diffquant": 1}), ("smollm2-135m", 65536, {"diffquant": 3}),
        ("tiny", 65536, {"diffquant": 2})]
