"""DIFF's sink metrics per differential head against independent computations: hand-built heads (the
issue's example, a λ < 0 layer, a λ ≈ 1 layer) and a plain-torch recomputation of every softmax map of a
micro DiffLlama from its q/k projections, RoPE and λ parameters (the paper's formulas, written here)."""

import copy
import json
import math

import numpy as np
import pytest
import torch

from diffquant.profiler import profile_model
from diffquant.stats.sinks import LayerSinks, model_sink_rates


def _rows(first: list[float], q: int = 6) -> torch.Tensor:
    """[1, heads, q, q] causal probabilities whose rows q ≥ 1 put mass first[h] on key 0, the rest spread
    evenly over the other allowed keys (row 0 is 1 on itself)."""
    p = torch.zeros(1, len(first), q, q, dtype=torch.float64)
    for h, m in enumerate(first):
        p[0, h, 0, 0] = 1.0
        for i in range(1, q):
            p[0, h, i, 0] = m
            p[0, h, i, 1:i + 1] = (1.0 - m) / i
    return p


def _layer(a1: list[float], a2: list[float], lam: float) -> LayerSinks:
    probs = _rows(a1 + a2)
    half = len(a1)
    s = LayerSinks()
    s.add_lambda(torch.tensor(lam))
    s.add_mass("probs", probs, None)
    s.add_mass("map", probs[:, :half] - lam * probs[:, half:], None)
    return s


def test_the_issues_example_is_not_a_sink():
    # A1 mass 0.1, A2 0.6, λ = 0.5: (0.1 − 0.3) / 0.5 = −0.4 of the head's output weight on token 0
    got = _layer([0.1, 0.5], [0.6, 0.1], 0.5).summary(diff=True)
    assert got["lambda"] == 0.5
    assert got["first_mass_A1"] == pytest.approx([0.1, 0.5]) and got["first_mass_A2"] == pytest.approx([0.6, 0.1])
    assert got["share"] == pytest.approx([-0.4, (0.5 - 0.05) / 0.5])
    assert got["sink"] == {"heads": 2, "sinks": 1, "undefined": 0}  # only the second head (share 0.9)
    assert got["sink_A2"] == {"heads": 2, "sinks": 1}  # the cancelling A2 map is a "sink" of its own map only


def test_a_negative_lambda_adds_the_maps():
    # λ = −0.3: (0.3 + 0.3·0.5) / 1.3 = 0.346 > ε although A1 alone (0.3) is not above it
    got = _layer([0.3, 0.2], [0.5, 0.3], -0.3).summary(diff=True)
    assert got["share"] == pytest.approx([0.45 / 1.3, 0.29 / 1.3])
    assert got["sink"]["sinks"] == 1 and got["sink_A1"]["sinks"] == 0


def test_lambda_near_one_leaves_the_share_undefined():
    near = _layer([0.9, 0.9], [0.1, 0.1], 0.97).summary(diff=True)
    assert near["share"] == [None, None] and "≤ 0.05" in near["share_undefined"]
    assert near["sink"] == {"heads": 2, "sinks": 0, "undefined": 2}
    far = _layer([0.9, 0.1], [0.1, 0.1], 0.5).summary(diff=True)
    rates = model_sink_rates({0: near, 1: far})
    assert rates["sink_rate"] == 0.5  # one sink among the two heads whose share is defined
    assert rates["sink_heads"] == 2 and rates["sink_heads_undefined"] == 2
    assert rates["lambda"] == pytest.approx([0.97, 0.5])
    assert rates["first_share_mean"] == pytest.approx(((0.9 - 0.05) / 0.5 + (0.1 - 0.05) / 0.5) / 2)
    assert "sink_rate_map" not in rates


def test_lambda_above_one_leaves_the_share_undefined():
    """The case found in a trained guo DIFF: λ = 1.077, A1 puts 0.0013 on token 0 and A2 0.128, so the map's
    mass there is 0.0013 − 1.077·0.128 = −0.137 over a row sum of 1 − λ = −0.077: a 'share' of 1.78 that is
    the opposite of a sink. Undefined, never counted."""
    got = _layer([0.0013], [0.128], 1.077).summary(diff=True)
    assert got["share"] == [None] and "1 − λ = -0.077" in got["share_undefined"]
    assert got["sink"] == {"heads": 1, "sinks": 0, "undefined": 1}
    assert model_sink_rates({0: got})["sink_rate"] is None  # no head with a defined share


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of x [batch, head, pos, d]."""
    d, t = x.shape[-1], x.shape[2]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def softmax_maps(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's softmax maps [batch, H, T, T] and its scaled logits, recomputed in float64 from the
    layer inputs (transformers' hidden states), the q/k projections and RoPE; causal, no padding."""
    cfg = model.config
    theta = cfg.rope_parameters["rope_theta"]
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    probs, logits = [], []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        with torch.no_grad():
            x = layer.input_layernorm(hs[i]).double()
            b, t, _ = x.shape
            d = cfg.hidden_size // cfg.num_attention_heads
            q = (x @ attn.q_proj.weight.double().T).view(b, t, -1, d).transpose(1, 2)
            k = (x @ attn.k_proj.weight.double().T).view(b, t, -1, d).transpose(1, 2)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = _rope(q, theta) @ _rope(k, theta).transpose(-1, -2) / math.sqrt(d)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        logits.append(s.masked_select(causal))
        probs.append(torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1))
    return probs, logits


def paper_lambda(attn, layer: int) -> float:
    """λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init, λ_init = 0.8 − 0.6·exp(−0.3·layer) (Ye et al., eq. 2)."""
    dot = lambda a, b: float((a.detach().double() * b.detach().double()).sum())  # noqa: E731
    return (math.exp(dot(attn.lambda_q1, attn.lambda_k1)) - math.exp(dot(attn.lambda_q2, attn.lambda_k2))
            + 0.8 - 0.6 * math.exp(-0.3 * layer))


def _steer(model):
    """A copy whose layer 0 has λ ≈ 0.98 (share undefined) and layer 1 λ ≈ −0.5 (maps add)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for attn in (layer.self_attn for layer in m.model.layers):
            for p in (attn.lambda_q1, attn.lambda_k1, attn.lambda_q2, attn.lambda_k2):
                p.zero_()
        a0, a1 = m.model.layers[0].self_attn, m.model.layers[1].self_attn
        a0.lambda_q2[0], a0.lambda_k2[0] = math.log(0.22), 1.0  # 1 − 0.22 + 0.2 = 0.98
        a1.lambda_q2[0], a1.lambda_k2[0] = math.log(1.0 + 0.5 + 0.8 - 0.6 * math.exp(-0.3)), 1.0
    return m


@pytest.mark.parametrize("steered", [False, True])
def test_profile_matches_plain_torch_per_differential_head(micro_pair, steered):
    model = _steer(micro_pair[1]) if steered else micro_pair[1]
    ids = torch.randint(0, 512, (3, 16), generator=torch.Generator().manual_seed(5))
    probs, _ = softmax_maps(model, ids)
    summary = profile_model(model, ids, ["*.hidden"], sinks=True, progress=False).sink_summary()
    total_sinks, total_heads = 0, 0
    for i, p in enumerate(probs):
        attn = model.model.layers[i].self_attn
        lam = paper_lambda(attn, i)
        assert attn.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * i))
        h = p.shape[1] // 2
        a1, a2 = p[:, :h, 1:, 0].mean(dim=(0, 2)), p[:, h:, 1:, 0].mean(dim=(0, 2))  # queries after the first
        got = summary["layers"][i]
        assert got["lambda"] == pytest.approx(lam, rel=1e-6)
        np.testing.assert_allclose(got["first_mass_A1"], a1.numpy(), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got["first_mass_A2"], a2.numpy(), rtol=1e-5, atol=1e-7)
        if abs(1 - lam) <= 0.05:
            assert got["share"] == [None] * h and got["sink"]["undefined"] == h
            continue
        share = ((p[:, :h] - lam * p[:, h:])[:, :, 1:, 0] / (1 - lam)).mean(dim=(0, 2))
        np.testing.assert_allclose(got["share"], share.numpy(), rtol=1e-4, atol=1e-6)
        assert got["sink"]["sinks"] == int((share > 0.3).sum())
        total_sinks, total_heads = total_sinks + int((share > 0.3).sum()), total_heads + h
    if steered:
        assert summary["layers"][0]["share_undefined"] and summary["layers"][1]["lambda"] < 0
    assert summary["model"]["sink_heads"] == total_heads
    assert summary["model"]["sink_rate"] == pytest.approx(total_sinks / total_heads)


def test_diffquant_profile_writes_the_differential_heads(tmp_path):
    from diffquant.cli import main

    (tmp_path / "t.txt").write_text("In the beginning was the word, and the word was with God.\n" * 200)
    assert main(["profile", "--model", "micro:diff", "--data", str(tmp_path / "t.txt"), "--tokens", "256",
                 "--seq-len", "32", "--out", str(tmp_path / "p"), "--no-plots"]) == 0
    model = json.loads((tmp_path / "p" / "stats.json").read_text())["models"][0]
    sinks = model["sinks"]
    for layer in sinks["layers"].values():
        lam, h = layer["lambda"], len(layer["first_mass_A1"])
        assert len(layer["share"]) == len(layer["first_mass_A2"]) == h == len(layer["first_mass"]) // 2
        # the share from the differential map's own first column equals the one from the two maps' masses
        np.testing.assert_allclose(layer["share"], (np.array(layer["first_mass_A1"]) - lam
                                                    * np.array(layer["first_mass_A2"])) / (1 - lam), rtol=1e-4)
    assert sinks["model"]["sink_unit"].startswith("differential head")
    assert len(sinks["model"]["lambda"]) == len(sinks["layers"])
    table = (tmp_path / "p" / "table5.md").read_text()
    assert "λ" in table and "A1 − λ·A2" in table
