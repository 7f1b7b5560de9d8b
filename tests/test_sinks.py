"""Sink and massive-activation metrics against independent computations: numpy on hand-made tensors,
and a Llama whose layer-0 sink is built by hand, read back from transformers' own eager attention."""

import numpy as np
import pytest
import torch

from diffquant.profiler import profile_model
from diffquant.stats.sinks import LayerSinks, first_key_mass, norm_ratio

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


def _massive_reference(batches, valid):
    """Plain numpy: per sequence max‖h_t‖ / median‖h_t‖ over valid tokens; their mean; the largest with its row,
    position, channel of largest |value| and norm (the first of equal ratios)."""
    ratios, best = [], None
    for i, h in enumerate(batches):
        n = np.linalg.norm(h.numpy(), axis=-1)
        for b in range(h.shape[0]):
            ok = np.flatnonzero(valid[b].numpy())
            r = n[b, ok].max() / np.median(n[b, ok])
            ratios.append(r)
            if best is None or r > best["ratio"]:
                p = int(ok[n[b, ok].argmax()])
                best = {"ratio": r, "row": 3 * i + b, "position": p, "channel": int(np.abs(h[b, p].numpy()).argmax()),
                        "norm": float(n[b, p])}
    return float(np.mean(ratios)), best


def test_massive_activation_channel_is_that_of_the_largest_magnitude():
    """The massive token's channel is where |value| is largest, here a negative extreme (−80) in a token that also
    holds a large positive value (+30): numpy's argmax of |h| says channel 9, a signed argmax would say 2."""
    h = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(3))
    h[1, 5, 9], h[1, 5, 2] = -80.0, 30.0
    sinks = LayerSinks()
    sinks.add_hidden(h, None, row_offset=6)
    best = sinks.summary(diff=False)["massive_max"]
    n = np.linalg.norm(h.numpy(), axis=-1)
    assert (best["row"], best["position"], best["channel"]) == (7, 5, 9)
    assert best["ratio"] == pytest.approx(n[1].max() / np.median(n[1]), rel=1e-5)
    assert best["norm"] == pytest.approx(float(n[1, 5]), rel=1e-6)


@pytest.mark.parametrize("peak", [0, 3])  # the largest ratio in the first shard's batches, or the second's
def test_sink_statistics_merge_over_two_shards(peak):
    """Two shards fed disjoint halves of the batches (the profiler's ranks), merged: the first-key masses, value
    and massive-activation ratios and the largest massive activation equal one LayerSinks fed everything and a
    plain numpy computation (the merge keeps the larger maximum, wherever it sits)."""
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(3, 10, 16, generator=g) for _ in range(4)]
    batches[peak][2, 6, 11] = -120.0
    valid = torch.ones(3, 10, dtype=torch.bool)
    valid[0, :4] = False  # left padding in each batch's first sequence
    probs = [torch.softmax(torch.randn(3, 4, 10, 10, generator=g), -1) for _ in range(4)]
    mask = torch.ones(10, 10, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    one, shards = LayerSinks(), [LayerSinks(), LayerSinks()]
    for i, (h, p) in enumerate(zip(batches, probs)):
        for s in (one, shards[i >= 2]):
            s.add_hidden(h, valid, row_offset=3 * i)
            s.add_values(h, valid)
            s.add_mass("probs", p, mask)
    merged = shards[0].merge(shards[1]).summary(diff=False)
    ratio, best = _massive_reference(batches, valid)
    values = [np.linalg.norm(h[b].numpy(), axis=-1)[valid[b].numpy()] for h in batches for b in range(3)]
    mass, queries = np.zeros(4), 0
    for p in probs:
        for b in range(3):
            keys = np.flatnonzero(valid[b].numpy())
            for q in keys[1:]:  # the first valid token's own row is not counted
                mass += p[b, :, q, keys[0]].numpy()
                queries += 1
    for out in (merged, one.summary(diff=False)):
        assert out["massive_ratio"] == pytest.approx(ratio, rel=1e-5)
        assert out["massive_max"]["ratio"] == pytest.approx(best["ratio"], rel=1e-5)
        assert {k: out["massive_max"][k] for k in ("row", "position", "channel")} == \
            {k: best[k] for k in ("row", "position", "channel")}
        assert out["massive_max"]["norm"] == pytest.approx(best["norm"], rel=1e-6)
        assert out["value_ratio"] == pytest.approx(np.mean([v[0] / np.median(v[1:]) for v in values]), rel=1e-5)
        np.testing.assert_allclose(out["first_mass"], mass / queries, rtol=1e-6)
    assert best["row"] == 3 * peak + 2 and best["channel"] == 11
