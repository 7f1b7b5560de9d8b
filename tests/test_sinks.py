"""Sink and massive-activation metrics against independent computations: numpy on hand-made tensors,
and a Llama whose layer-0 sink is built by hand, read back from transformers' own eager attention."""

import numpy as np
import pytest
import torch

from diffquant.profiler import profile_model
from diffquant.stats.sinks import first_key_mass, norm_ratio

BOS = 1


def test_first_key_mass_matches_numpy_with_padding():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(3, 4, 7, 7, generator=g)
    valid = torch.ones(3, 1, 7, 7, dtype=torch.bool).tril()
    valid[1, :, :, :2] = False  # left padding of two tokens in row 1
    valid[1, :, :2, :] = False
    s, n = first_key_mass(probs, valid)
    ref_sum, ref_n = np.zeros(4), 0
    p, v = probs.numpy(), valid.numpy()
    for b in range(3):
        for q in range(7):
            keys = np.flatnonzero(v[b, 0, q])
            if len(keys) == 0 or keys[0] == q:
                continue  # no valid key, or the query is the first token itself
            ref_sum += p[b, :, q, keys[0]]
            ref_n += 1
    assert int(n) == ref_n == 3 * 6 - 2
    np.testing.assert_allclose(s.numpy(), ref_sum, rtol=1e-6)
    s0, n0 = first_key_mass(probs, None)
    np.testing.assert_allclose(s0.numpy(), p[:, :, 1:, 0].sum(axis=(0, 2)), rtol=1e-6)
    assert int(n0) == 3 * 6


def test_norm_ratio_matches_numpy():
    x = torch.randn(4, 9, 5, generator=torch.Generator().manual_seed(1))
    x[2, 3] *= 40
    valid = torch.ones(4, 9, dtype=torch.bool)
    valid[1, :3] = False
    r_first, _ = norm_ratio(x, valid, first_only=True)
    r_max, pos = norm_ratio(x, valid, first_only=False)
    n = np.linalg.norm(x.numpy(), axis=-1)
    for b in range(4):
        ok = n[b][valid[b].numpy()]
        assert float(r_first[b]) == pytest.approx(ok[0] / np.median(ok[1:]), rel=1e-5)
        assert float(r_max[b]) == pytest.approx(ok.max() / np.median(ok), rel=1e-5)
    assert int(pos[2]) == 3


def _sink_llama():
    """Layer 0, heads 0 and 1: every query sends almost all its attention to BOS (q = a·x₁, k = a·x₀ in the
    slowest rotary pair, where only BOS has x₀ ≠ 0 and RoPE barely turns); heads 2 and 3: q = 0, uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 1e6})
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        emb = m.model.embed_tokens.weight
        emb[:, 0] = 0.0
        emb[:, 1] = 1.0
        emb[BOS, 0] = 30.0
        attn = m.model.layers[0].self_attn
        attn.q_proj.weight.zero_()
        for h in (0, 1):
            attn.q_proj.weight[h * 16 + 7, 1] = 0.5
            attn.k_proj.weight[h * 16 + 7].zero_()
            attn.k_proj.weight[h * 16 + 7, 0] = 0.5
    return m


def _ids(n=3, t=16):
    ids = torch.randint(2, 64, (n, t), generator=torch.Generator().manual_seed(2))
    ids[:, 0] = BOS
    return ids


def test_sink_metrics_on_a_hand_built_sink():
    m = _sink_llama()
    ids = _ids()
    with torch.no_grad():
        m.set_attn_implementation("eager")
        out = m(ids, output_attentions=True, output_hidden_states=True)
        m.set_attn_implementation("sdpa")
        inputs = [out.hidden_states[0], out.hidden_states[1]]  # layer inputs
        values = [m.model.layers[i].self_attn.v_proj(m.model.layers[i].input_layernorm(inputs[i])) for i in (0, 1)]
        last = []
        h = m.model.layers[1].register_forward_hook(lambda mod, a, o: last.append(o[0] if isinstance(o, tuple) else o))
        m(ids)
        h.remove()
    prof = profile_model(m, ids, ["*.hidden"], sinks=True, progress=False)
    summary = prof.sink_summary()
    sinks_total = 0
    for layer in (0, 1):
        a = out.attentions[layer].numpy()  # [batch, head, q, k], transformers' eager softmax
        mass = a[:, :, 1:, 0].mean(axis=(0, 2))
        got = summary["layers"][layer]
        np.testing.assert_allclose(got["first_mass"], mass, rtol=1e-5, atol=1e-7)
        assert got["sink"] == {"heads": 4, "sinks": int((mass > 0.3).sum())}
        sinks_total += int((mass > 0.3).sum())
        v = np.linalg.norm(values[layer].numpy(), axis=-1)
        assert got["value_ratio"] == pytest.approx(np.mean([r[0] / np.median(r[1:]) for r in v]), rel=1e-5)
        hid = (out.hidden_states[1] if layer == 0 else last[0]).numpy()
        n = np.linalg.norm(hid, axis=-1)
        ratios = n.max(axis=1) / np.median(n, axis=1)
        assert got["massive_ratio"] == pytest.approx(ratios.mean(), rel=1e-5)
        best = int(ratios.argmax())
        assert got["massive_max"]["row"] == best and got["massive_max"]["position"] == int(n[best].argmax())
        assert got["massive_max"]["channel"] == int(np.abs(hid[best, n[best].argmax()]).argmax())
    assert summary["layers"][0]["sink"]["sinks"] == 2  # the two heads built as sinks, and only those
    assert summary["layers"][0]["first_mass"][0] > 0.8 and summary["layers"][0]["first_mass"][2] < 0.3
    assert summary["layers"][0]["massive_max"]["position"] == 0 and summary["layers"][0]["massive_max"]["channel"] == 0
    assert summary["model"]["sink_rate"] == pytest.approx(sinks_total / 8)


def test_diff_sink_per_map_and_differential_map(micro_pair):
    model = micro_pair[1]
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model.set_attn_implementation("eager")
        out = model(ids, output_attentions=True)
        model.set_attn_implementation("sdpa")
    prof = profile_model(model, ids, ["*.hidden"], sinks=True, progress=False)
    s = prof.sink_summary()
    for layer in range(model.config.num_hidden_layers):
        a = out.attentions[layer].numpy()
        h = a.shape[1] // 2
        attn = model.model.layers[layer].self_attn
        lam = float(torch.exp((attn.lambda_q1 * attn.lambda_k1).sum()) - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum())
                    + attn.lambda_init)
        diff_map = a[:, :h] - lam * a[:, h:]
        got = s["layers"][layer]
        np.testing.assert_allclose(got["first_mass"], a[:, :, 1:, 0].mean(axis=(0, 2)), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got["first_mass_map"], diff_map[:, :, 1:, 0].mean(axis=(0, 2)), rtol=1e-4, atol=1e-6)
        assert got["sink_A1"]["heads"] == got["sink_A2"]["heads"] == h
    assert set(s["model"]) >= {"sink_rate", "sink_rate_A1", "sink_rate_A2", "lambda", "massive_ratio_max"}
    assert "sink_rate_map" not in s["model"]  # ε on the unnormalised differential map is no one's criterion
