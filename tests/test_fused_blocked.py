"""One softmax per DIFF layer (the fused forward) and attention in query blocks, each against the plain
computation: transformers' two-call DiffLlama, and the unblocked tapped attention."""

import copy

import pytest
import torch

from diffquant.models.fused import fuse
from diffquant.models.presets import PRESETS, build
from diffquant.profiler import profile_model
from diffquant.quant.numerics.config import int_config
from diffquant.quant.numerics import granularity as G
from diffquant.quant.numerics.scheme import QuantScheme, attach_scheme
from diffquant.taps import attention as A, tapped


def _pair(kv_heads=None):
    from transformers import DiffLlamaConfig, DiffLlamaForCausalLM

    torch.manual_seed(0)
    cfg = DiffLlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=kv_heads or 4)
    two_call = DiffLlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # λ away from its init, so the differential map matters
        for layer in two_call.model.layers:
            for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
                getattr(layer.self_attn, name).normal_(0, 0.5)
    fused = copy.deepcopy(two_call)
    fuse(fused)
    return two_call, fused


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_fused_equals_two_calls(kv_heads):
    two, fused = _pair(kv_heads)
    ids = torch.randint(0, 512, (3, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, :6] = 0
    mask[2, 15:] = 0
    with torch.no_grad():
        for m in (None, mask):
            a, b = two(ids, attention_mask=m).logits, fused(ids, attention_mask=m).logits
            valid = torch.ones_like(mask, dtype=torch.bool) if m is None else m.bool()
            assert (a - b)[valid].abs().max().item() <= 1e-5
    kw = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        g1, g2 = two.generate(ids[:, :8], **kw), fused.generate(ids[:, :8], **kw)
    assert torch.equal(g1.sequences, g2.sequences)
    assert max((x - y).abs().max().item() for x, y in zip(g1.scores, g2.scores)) <= 1e-5


def test_fused_training_step_equals_two_calls():
    two, fused = _pair()
    two.train()
    fused.train()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(2))
    la, lb = two(ids, labels=ids).loss, fused(ids, labels=ids).loss
    la.backward()
    lb.backward()
    assert abs(la.item() - lb.item()) <= 1e-5
    for (n, p), (_, q) in zip(two.named_parameters(), fused.named_parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), n


def test_fused_taps_see_each_logit_once_with_the_same_values():
    two, fused = _pair(2)
    ids = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(3))
    a = profile_model(two, ids, ["*.attn_logits"], progress=False, sinks=True)
    b = profile_model(fused, ids, ["*.attn_logits"], progress=False, sinks=True)
    sa, sb = a.pooled("attn_logits").summary(full=False), b.pooled("attn_logits").summary(full=False)
    assert sa["count"] == sb["count"] == 2 * 2 * 4 * 13 * 14 // 2
    assert sa["absmax"] == pytest.approx(sb["absmax"], rel=1e-6)
    for layer in (0, 1):
        ma, mb = a.sink_summary()["layers"][layer], b.sink_summary()["layers"][layer]
        assert ma["first_mass_map"] == pytest.approx(mb["first_mass_map"], rel=1e-5)
    got = {}
    with tapped(fused, {"layers.1.attn_map": lambda x, c: got.setdefault("map", []).append(x.clone()),
                        "layers.1.lambda": lambda x, c: got.setdefault("lam", []).append(x.clone())}), torch.no_grad():
        fused(ids)
    assert len(got["map"]) == len(got["lam"]) == 1


CASES = {"baseline": None, "diff": None, "sink": None, "clipsoftmax": None}


@pytest.mark.parametrize("arch", list(CASES))
def test_blocks_equal_the_whole(arch, monkeypatch):
    """Statistics, sink metrics and quantized outputs are the same whether attention runs in query blocks."""
    model = build(PRESETS["micro"], arch, seed=4)
    ids = torch.randint(0, 512, (2, 23), generator=torch.Generator().manual_seed(5))
    schemes = [QuantScheme(f"l4-{g}", (("*.attn_logits", int_config(4, G.parse_granularity(g))),))
               for g in ("tensor", "head", "token", "channel")]

    def run():
        prof = profile_model(model, ids, ["*.attn_logits", "*.attn_probs"], progress=False, sinks=True, k=20)
        outs = []
        for s in schemes:
            h = attach_scheme(model, s)
            with torch.no_grad():
                outs.append(model(ids).logits)
            h.remove()
        return prof, outs

    whole, whole_out = run()
    monkeypatch.setenv("DIFFQUANT_ATTN_BLOCK", "5")  # 23 queries: blocks of 5, the last one of 3
    blocks, blocks_out = run()
    for name, s in whole.sites.items():
        a, b = s.summary(), blocks.sites[name].summary()
        for key in ("count", "absmax", "top", "quantiles", "passes", "nonfinite", "position_absmax", "channel_absmax"):
            assert a[key] == pytest.approx(b[key], rel=1e-6), (name, key)
        assert a["kurtosis"] == pytest.approx(b["kurtosis"], rel=1e-6)
        assert a["pass_kurtosis_mean"] == pytest.approx(b["pass_kurtosis_mean"], rel=1e-5)
        assert [e["value"] for e in a["topk"]] == pytest.approx([e["value"] for e in b["topk"]], rel=1e-6)
        where = lambda top: sorted((round(e["value"], 5), e["batch"], e["head"], e["q_pos"], e["k_pos"], e["token_id"])  # noqa: E731
                                   for e in top if abs(e["value"]) > abs(top[-1]["value"]) * (1 + 1e-5))  # ties at the cut
        assert where(a["topk"]) == where(b["topk"])
    sw, sb = whole.sink_summary(), blocks.sink_summary()
    for layer, a in sw["layers"].items():
        b = sb["layers"][layer]
        for key in ("first_mass", "first_mass_map"):
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-5)
        assert (a["sink"], a.get("sink_map")) == (b["sink"], b.get("sink_map"))
    for x, y in zip(whole_out, blocks_out):
        assert (x - y).abs().max().item() <= 1e-5
