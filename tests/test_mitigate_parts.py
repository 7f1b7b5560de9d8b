"""quant/algorithms/mitigate.py's edges (issue 50's mutants): every spelling and label of the fixes and their bounds,
the solver each asks for, the schemes they adjust; biases folded by SmoothQuant and the rotation (a Llama with
attention and MLP biases); a dead input channel's scale; the rotation's seeded matrices, its record, its online
Hadamard ahead of any other hook; the head norm's gain; records replayed and handles removed twice."""

import pytest
import torch

from diffquant import DiffquantError
from diffquant.models.matrix import FAMILIES, Family
from diffquant.quant.algorithms.mitigate import (Applied, Clip, Rotate, SmoothQuant, adjust_scheme, apply_record,
                                                 mitigate_, parse)
from diffquant.quant.numerics.hadamard import orthogonal
from diffquant.quant.numerics.scheme import get_scheme

BIASED = Family("llama-bias", "LlamaConfig", "LlamaForCausalLM",
                dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True))


def _ids(n=4, t=16, seed=0):
    return torch.randint(3, 512, (n, t), generator=torch.Generator().manual_seed(seed))


def _randomised(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm gains and biases: away from 1 and 0
                p.copy_(torch.rand_like(p) * 1.5 + 0.25)
        model.get_input_embeddings().weight[:, :3] *= 20
    return model


def test_spellings_labels_and_bounds():
    assert parse("smoothquant") == SmoothQuant(0.5) and parse("smoothquant:0.7") == SmoothQuant(0.7)
    assert parse("smoothquant:search") == SmoothQuant(None)
    assert [SmoothQuant(a).label() for a in (None, 0.5, 0.0, 1.0)] == ["smoothquant:search", "smoothquant:0.5",
                                                                        "smoothquant:0", "smoothquant:1"]
    for alpha in (-0.1, 1.1):
        with pytest.raises(DiffquantError, match=r"smoothquant's alpha must be in \[0, 1\]"):
            SmoothQuant(alpha)
    assert parse("rotate") == Rotate(0) and parse("rotate:3") == Rotate(3) and parse("quarot:2") == Rotate(2)
    assert [Rotate(s).label() for s in (0, 1, 3)] == ["rotate", "rotate:1", "rotate:3"]
    assert parse("clip") == Clip("mse") and parse("clip:output") == Clip("output")
    assert parse("clip:percentile:99.9") == Clip("percentile", 99.9)
    assert [c.label() for c in (Clip(), Clip("output"), Clip("percentile", 99.9), Clip("percentile", 100.0))] == [
        "clip:mse", "clip:output", "clip:percentile:99.9", "clip:percentile:100"]
    for p in (0.5, 100.0):
        Clip("percentile", p)
    for p in (0.0, -1.0, 100.5):
        with pytest.raises(DiffquantError, match=r"clip percentile must be in \(0, 100\]"):
            Clip("percentile", p)
    with pytest.raises(DiffquantError, match="clip takes mse, percentile:P or output, got 'max'"):
        Clip("max")


def test_the_solver_each_fix_asks_for():
    quarot = Rotate()
    assert quarot.solver_for("quarot", "rtn") == "gptq" and quarot.solver_for("quarot", "gptq") == "gptq"
    assert quarot.solver_for("quarot", "gptq:act-order") == "gptq:act-order"
    assert quarot.solver_for("rotate", "awq") == "awq" and quarot.solver_for("rotate", "rtn") == "rtn"
    with pytest.raises(DiffquantError, match="quarot is the rotation with GPTQ weights; --solver awq does not go"):
        quarot.solver_for("quarot", "awq")
    assert Clip("output").solver_for("clip", "rtn") == "clip:output"
    assert Clip("output").solver_for("clip", "gptq") == "gptq" and Clip().solver_for("clip", "rtn") == "rtn"


def test_the_schemes_fixes_adjust():
    scheme = get_scheme("w8a8-static")
    assert adjust_scheme(scheme, None) is scheme
    clipped = adjust_scheme(scheme, Clip())
    assert clipped.name == f"{scheme.name}+clip:mse"
    assert all(c.calibration == "mse" and not c.dynamic for _, c in clipped.weights)
    out = adjust_scheme(scheme, Clip("output"))
    assert out.name == f"{scheme.name}+clip:output" and out.weights == scheme.weights
    plain = get_scheme("w8a8")  # no cache quantized: the rotation leaves the scheme as it is
    assert Rotate().adjust(plain) is plain


def test_smoothquant_needs_calibration_and_takes_a_single_token():
    model = FAMILIES["llama"].build()
    for calibration in (None, torch.zeros(0, 4, dtype=torch.long)):
        with pytest.raises(DiffquantError, match="smoothquant needs calibration data"):
            mitigate_(model, SmoothQuant(0.5), calibration)
    applied = mitigate_(model, SmoothQuant(0.5), torch.tensor([[7]]))
    assert applied.record["calibration_tokens"] == 1
    applied.remove()


@pytest.mark.parametrize("fix, tol", [(SmoothQuant(0.8), 1e-4), (Rotate(2), 1e-3)])
def test_biases_are_folded_with_the_weights(fix, tol):
    """A Llama with biases on q/k/v/o and gate/up/down: SmoothQuant divides up_proj's (and v_proj's) bias by the
    scales, the rotation turns o_proj's and down_proj's; the float function is kept, the biases did change."""
    model = _randomised(BIASED.build())
    ids = _ids()
    biases = {n: p.clone() for n, p in model.named_parameters() if n.endswith(".bias")}
    with torch.no_grad():
        ref = model(ids).logits
        applied = mitigate_(model, fix, _ids(seed=1))
        out = model(ids).logits
    moved = {n for n, p in model.named_parameters() if n.endswith(".bias") and not torch.equal(p, biases[n])}
    want = ({"mlp.up_proj.bias", "self_attn.v_proj.bias"} if isinstance(fix, SmoothQuant)
            else {"self_attn.o_proj.bias", "mlp.down_proj.bias", "self_attn.v_proj.bias"})
    assert {n.split(".", 3)[3] for n in moved} == want
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= tol
    applied.remove()
    assert all(torch.equal(p, biases[n]) for n, p in model.named_parameters() if n.endswith(".bias"))


def test_a_dead_input_channel_keeps_scale_one():
    """An input channel that is 0 on every calibration token (max |X| = 0): its scale is 1, not max|X|^α/… = 0
    clamped to 1e-5, which would divide the norm's gain by 1e-5."""
    model = FAMILIES["llama"].build()
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[5] = 0.0  # attn_in channel 5 is 0 everywhere
    applied = mitigate_(model, SmoothQuant(0.5), _ids(seed=2))
    scales = applied.record["scales"]["0"]["attn_in"]
    assert scales[5] == 1.0 and all(s != 1.0 for i, s in enumerate(scales) if i != 5)
    applied.remove()


def test_rotation_matrices_are_the_seeded_draws_its_record_names():
    """rotate:SEED: the residual stream by orthogonal(hidden, SEED), down_proj's input by orthogonal(inter, SEED + 1),
    the value heads by orthogonal(head_dim, SEED + 2); the record says the seed and each matrix's kind."""
    model = FAMILIES["llama"].build()
    embed = model.get_input_embeddings().weight.detach().double().clone()
    down = model.model.layers[0].mlp.down_proj.weight.detach().double().clone()
    applied = mitigate_(model, Rotate(3))
    Q, kind = orthogonal(64, 3)
    H, hkind = orthogonal(128, 4)
    _, vkind = orthogonal(16, 5)
    torch.testing.assert_close(model.get_input_embeddings().weight.double(), (embed @ Q).float().double())
    rotated_down = model.model.layers[0].mlp.down_proj.weight.double()
    torch.testing.assert_close(rotated_down, (Q.T @ down @ H).float().double(), atol=1e-5, rtol=1e-5)
    assert applied.record == {"mitigation": "rotate:3", "seed": 3,
                              "matrices": {"residual": kind, "down_in": hkind, "v_o": vkind}}
    applied.remove()


def test_the_online_hadamard_runs_before_any_other_hook_on_down_proj():
    """A tap registered on down_proj's input before the rotation sees the rotated input x·H (the rotation's hook
    is put first), which is what the rotated weight reads: x from the same model unrotated, times H."""
    model = FAMILIES["llama"].build()
    down = model.model.layers[0].mlp.down_proj
    ids = _ids(n=1, t=6)
    seen = []
    handle = down.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    with torch.no_grad():
        model(ids)
        applied = mitigate_(model, Rotate())
        model(ids)
    handle.remove()
    applied.remove()
    H, _ = orthogonal(128, 1)
    plain, turned = seen[0].double(), seen[1].double()
    assert not torch.allclose(turned, plain, atol=1e-3)
    torch.testing.assert_close(turned, plain @ H, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, attr", [("diff-gain", "groupnorm"), ("baseline-headnorm", "head_norm")])
def test_a_head_norms_gain_is_folded_into_o_proj_before_the_values_turn(family, attr):
    """DIFF's groupnorm with a gain (diff-gain), and a head norm spelt head_norm given a gain here (the shipped
    design's has none): the gain goes into o_proj's columns, the norm is left weightless, the function is kept."""
    model = FAMILIES[family].build()
    for layer in model.model.layers:
        norm = getattr(layer.self_attn, attr)
        if norm.weight is None:
            setattr(layer.self_attn, attr, torch.nn.RMSNorm(norm.normalized_shape, eps=norm.eps))
    model = _randomised(model)
    norm = getattr(model.model.layers[0].self_attn, attr)
    assert not torch.equal(norm.weight, torch.ones_like(norm.weight))
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
        applied = mitigate_(model, Rotate())
        out = model(ids).logits
    assert torch.equal(norm.weight, torch.ones_like(norm.weight))
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-3
    applied.remove()


def test_records_replay_and_handles_remove_twice():
    model = FAMILIES["llama"].build()
    ids = _ids()
    with torch.no_grad():
        applied = mitigate_(model, SmoothQuant(0.8), _ids(seed=1))
        want = model(ids).logits
        record = applied.record
        assert record["alpha"] == 0.8 and record["calibration_tokens"] == 64
        assert record["mitigation"] == "smoothquant:0.8" and set(record["scales"]) == {"0", "1"}
        applied.remove()
        again = apply_record(model, record)
        assert again.record == record and again.mitigation == SmoothQuant(0.8)
        assert torch.equal(model(ids).logits, want)
        again.remove()
        turned = apply_record(model, {"mitigation": "rotate:1"})
        assert turned.record["mitigation"] == "rotate:1" and turned.record["seed"] == 1
        turned.remove()
    nothing = apply_record(model, {"mitigation": None})
    assert nothing.mitigation is None and nothing.record == {"mitigation": None}
    head = model.lm_head.weight
    assert head is not model.get_input_embeddings().weight  # this model's head is its own
    applied = Applied(model, None)
    applied.remove()
    applied.remove()
    assert model.lm_head.weight is head  # a second remove() does not tie what was never tied


def test_why_o_projs_input_is_not_smoothed_word_for_word():
    from diffquant.quant.algorithms.mitigate import _value_blocked

    assert _value_blocked(FAMILIES["llama"].build().model.layers[0]) is None
    assert _value_blocked(FAMILIES["diffllama"].build().model.layers[0]) == (
        "a norm over each head's output (DIFF, head-norm) does not commute with per-channel scales")
    assert _value_blocked(FAMILIES["diff-nonorm"].build().model.layers[0]) == (
        "DIFF's o_proj input concatenates two value halves per differential head, not v_proj's head blocks")
    layer = FAMILIES["llama"].build().model.layers[0]
    attn = layer.self_attn
    attn.o_proj = torch.nn.Linear(attn.o_proj.in_features + attn.head_dim, attn.o_proj.out_features)  # a wider input
    assert _value_blocked(layer) == "o_proj's input is not one head_dim block per attention head"


def test_a_dead_value_channel_keeps_scale_one():
    """A value channel that is 0 for every token (its v_proj row is 0): o_proj's input is 0 there in every query head
    that reads that KV head, and its scale is 1."""
    model = FAMILIES["llama"].build()
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.v_proj.weight[3] = 0.0  # KV head 0, channel 3
    applied = mitigate_(model, SmoothQuant(0.5), _ids(seed=3))
    scales = applied.record["scales"]["0"]["attn_out"]
    d = attn.head_dim
    readers = attn.o_proj.in_features // (attn.v_proj.out_features // d) // d  # query heads per KV head
    dead = [h * d + 3 for h in range(readers)]
    assert all(scales[i] == 1.0 for i in dead) and all(s != 1.0 for i, s in enumerate(scales) if i not in dead)
    applied.remove()


def test_the_search_calibrates_a_scheme_with_static_activations_only(monkeypatch):
    """smoothquant:search calibrates each trial where any quantizer of the scheme is static, also when none is
    dynamic (a scheme of static activation scales alone, no weights): two α here, the search's own loop, on a model of
    one layer."""
    from diffquant.quant.algorithms import mitigate
    from diffquant.quant.numerics import granularity as G
    from diffquant.quant.numerics.config import QuantConfig
    from diffquant.quant.numerics.formats import Format
    from diffquant.quant.numerics.scheme import QuantScheme

    monkeypatch.setattr(mitigate, "ALPHAS", (0.3, 0.7))
    static = QuantScheme("a8-static", (("*.attn_in", QuantConfig(Format("int", 8), G.PerTensor(), dynamic=False)),))
    one_layer = Family("llama-1", "LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, num_hidden_layers=1))
    model = _randomised(one_layer.build())  # one layer: the search reads layers[0] only
    applied = mitigate_(model, parse("smoothquant:search"), _ids(4, 8, seed=2), static)
    search = applied.record["search"]
    assert search["alphas"] == [0.3, 0.7] and search["scheme"] == "a8-static" and search["scored_tokens"] == 32
    assert applied.record["alpha"] == [0.3, 0.7][min(range(2), key=lambda i: search["loss"][i])]


def test_a_tied_head_replayed_and_removed_is_tied_again():
    """The rotation unties a tied head (the two then differ); a replayed record's handle ties it back on remove()."""
    model = FAMILIES["llama"].build()
    model.lm_head.weight = model.get_input_embeddings().weight
    applied = apply_record(model, {"mitigation": "rotate:2"})
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    applied.remove()
    assert model.lm_head.weight is model.get_input_embeddings().weight
