"""Post-training fixes: function preservation, exact removal, the math against independent computations,
composition with schemes, refusals, and the CLI round trip."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from diffquant import DiffquantError
from diffquant.models.matrix import FAMILIES
from diffquant.quant.numerics.hadamard import hadamard, orthogonal
from diffquant.quant.algorithms.mitigate import Clip, Rotate, SmoothQuant, adjust_scheme, apply_record, mitigate_, parse
from diffquant.quant.numerics.scheme import calibrate, get_scheme, attach_scheme

ROOT = Path(__file__).resolve().parent.parent

SUPPORTED_FAMILIES = ("llama", "diffllama", "diffllama-gqa", "qwen2", "qwen3", "mistral", "smollm3", "gated",
                      "clipsoftmax", "sink", "baseline-headnorm", "diff-gain", "gated-nobias", "diff-nonorm")


def _ids(n=4, t=16, seed=0):
    return torch.randint(3, 512, (n, t), generator=torch.Generator().manual_seed(seed))


def _with_random_norms(model):
    """Random norm gains and a few large embedding channels, so folding and smoothing have work to do."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.copy_(torch.rand_like(p) * 1.5 + 0.25)
        model.get_input_embeddings().weight[:, :3] *= 20
    return model


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
@pytest.mark.parametrize("mitigation,tol", [(SmoothQuant(0.5), 1e-4), (SmoothQuant(0.8), 1e-4), (Rotate(), 1e-3)])
def test_preserves_the_float_model_and_removes_exactly(family, mitigation, tol):
    model = _with_random_norms(FAMILIES[family].build())
    ids = _ids()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(ids).logits
        applied = mitigate_(model, mitigation, _ids(seed=1))
        out = model(ids).logits
        changed = any(not torch.equal(before[k], v) for k, v in model.state_dict().items() if k in before)
        applied.remove()
        back = model(ids).logits
    assert changed
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= tol
    assert torch.equal(back, ref)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("alpha", [0.5, 0.8])  # 0.8: α and 1 − α differ, so a swap of the two shows
def test_smoothquant_scales_follow_the_paper(alpha):
    """s = max|X|^α / max|W|^(1−α) per channel, with max|X| read by plain hooks here, and the smoothed
    activations equal X / s."""
    model = _with_random_norms(FAMILIES["llama"].build())
    calib = _ids(seed=1)
    layer = model.model.layers[1]
    seen = {}
    hooks = [layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("attn", []).append(a[0])),
             layer.mlp.gate_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("mlp", []).append(a[0])),
             layer.mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("down", []).append(a[0]))]
    with torch.no_grad():
        model(calib)
    for h in hooks:
        h.remove()
    x = {k: torch.cat([t.reshape(-1, t.shape[-1]) for t in v]).abs().amax(0).double() for k, v in seen.items()}
    with torch.no_grad():
        w = {"attn": torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                layer.self_attn.v_proj.weight]).abs().amax(0).double(),
             "mlp": torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]).abs().amax(0).double(),
             "down": layer.mlp.down_proj.weight.abs().amax(0).double()}
    applied = mitigate_(model, SmoothQuant(alpha), calib)
    try:
        got = applied.record["scales"]["1"]
        for ours, theirs in (("attn_in", "attn"), ("mlp_in", "mlp"), ("down_in", "down")):
            ref = x[theirs] ** alpha / w[theirs] ** (1 - alpha)
            np.testing.assert_allclose(got[ours], ref.numpy(), rtol=1e-5)
        after = []
        h = layer.self_attn.q_proj.register_forward_pre_hook(lambda m, a: after.append(a[0]))
        with torch.no_grad():
            model(calib)
        h.remove()
        torch.testing.assert_close(after[0].double(), seen["attn"][0].double() / torch.tensor(got["attn_in"]),
                                   rtol=1e-5, atol=1e-6)
    finally:
        applied.remove()


def test_hadamard_orders_and_orthogonality():
    for n in (4, 12, 20, 28, 36, 64, 176, 256, 576, 768, 1536):
        h = hadamard(n)
        assert h is not None and torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64)), n
    assert hadamard(688) is None and hadamard(6) is None
    for n in (576, 688):
        q, kind = orthogonal(n, seed=3)
        assert kind == ("hadamard" if n == 576 else "random")
        assert (q @ q.T - torch.eye(n, dtype=torch.float64)).abs().max() < 1e-12


def test_rotation_spreads_a_massive_channel():
    """The residual stream after rotation: the same norms, no single channel holding the outlier."""
    model = _with_random_norms(FAMILIES["llama"].build())
    ids = _ids()
    with torch.no_grad():
        h0 = model(ids, output_hidden_states=True).hidden_states[1]
        applied = mitigate_(model, Rotate(), None)
        h1 = model(ids, output_hidden_states=True).hidden_states[1]
        applied.remove()
    torch.testing.assert_close(h1.norm(dim=-1), h0.norm(dim=-1), rtol=1e-4, atol=1e-5)
    assert h1.abs().amax() < 0.5 * h0.abs().amax()


def test_tied_embeddings_are_untied_and_retied():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = _with_random_norms(LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                             num_hidden_layers=2, num_attention_heads=4,
                                                             tie_word_embeddings=True)).eval())
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
        applied = mitigate_(model, Rotate(), None)
        out = model(ids).logits
        applied.remove()
        back = model(ids).logits
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-3
    assert torch.equal(back, ref) and model.lm_head.weight is model.get_input_embeddings().weight


def test_composes_with_schemes_and_record_replays():
    model = _with_random_norms(FAMILIES["diffllama"].build())
    ids, calib = _ids(), _ids(seed=1)

    def quantized_logits(applied):
        handle = attach_scheme(model, get_scheme("w8a8-static"))
        calibrate(model, handle, calib.split(2))
        with torch.no_grad():
            logits = model(ids).logits
        handle.remove()
        applied.remove()
        return logits

    for text in ("smoothquant:0.5", "rotate"):
        applied = mitigate_(model, parse(text), calib)
        record = json.loads(json.dumps(applied.record))
        a = quantized_logits(applied)
        b = quantized_logits(apply_record(model, record))
        assert torch.equal(a, b), text


def test_clip_changes_the_scheme_only():
    s = adjust_scheme(get_scheme("w8a8-static"), Clip("mse"))
    assert all(c.calibration == "mse" and not c.dynamic for _, c in s.activations + s.weights)
    p = adjust_scheme(get_scheme("w8a8-static"), parse("clip:percentile:99.9"))
    assert all(c.calibration == "percentile" and c.percentile == 99.9 for _, c in p.activations)
    d = adjust_scheme(get_scheme("w8a8"), Clip("mse"))
    assert all(c.dynamic for _, c in d.activations)  # dynamic activations keep their per-token ranges
    model = FAMILIES["llama"].build()
    applied = mitigate_(model, Clip("mse"), None)
    assert applied.record == {"mitigation": "clip:mse"}
    # the MSE-clipped static weight scale is never worse (squared error) than min-max on that weight
    w = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    errs = {}
    h = attach_scheme(model, adjust_scheme(get_scheme("w8a16"), Clip("mse")))
    calibrate(model, h, [_ids(1)])
    errs["mse"] = float(((model.model.layers[0].mlp.down_proj.weight.detach() - w) ** 2).sum())
    h.remove()
    h = attach_scheme(model, get_scheme("w8a16"))
    errs["minmax"] = float(((model.model.layers[0].mlp.down_proj.weight.detach() - w) ** 2).sum())
    h.remove()
    assert errs["mse"] <= errs["minmax"] * (1 + 1e-6)


def test_refusals():
    with pytest.raises(DiffquantError, match="pre-RMSNorm SwiGLU decoder"):
        mitigate_(FAMILIES["gpt2"].build(), Rotate(), None)
    with pytest.raises(DiffquantError, match="calibration data"):
        mitigate_(FAMILIES["llama"].build(), SmoothQuant(), None)
    for bad in ("smoothquant:2", "rotate:x", "clip:median", "magic"):
        with pytest.raises(DiffquantError):
            parse(bad)


def test_cli_quantize_with_mitigation_round_trip(tmp_path, capsys):
    from diffquant.cli import main
    from diffquant.models.load import load_model

    model = FAMILIES["llama"].build()
    model.save_pretrained(tmp_path / "m")
    from diffquant.data.tokens import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path / "m")
    (tmp_path / "c.txt").write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(3000)))
    out = tmp_path / "q"
    assert main(["quantize", "--model", str(tmp_path / "m"), "--scheme", "w8a8-static", "--fix", "smoothquant:0.5",
                 "--data", str(tmp_path / "c.txt"), "--eval-tokens", "512", "--seq-len", "32", "--calib-tokens", "128",
                 "--out", str(out)]) == 0
    saved = json.loads((out / "diffquant_scheme.json").read_text())
    assert saved["fixes"][0]["mitigation"] == "smoothquant:0.5" and "scales" in saved["fixes"][0]
    result = json.loads((out / "quantize.json").read_text())
    loaded, tok = load_model(str(out))
    from diffquant.data.corpora import split
    from diffquant.data.tokens import encode, sequences
    from diffquant.evaluate import language_modeling

    evalset = sequences(encode(tok, split((tmp_path / "c.txt").read_text())[1]), 32, 512)
    assert language_modeling(loaded, evalset)["loss"] == pytest.approx(result["simulated"]["loss"], rel=1e-6)
    assert main(["quantize", "--list"]) == 0 and "smoothquant" in capsys.readouterr().out


def test_mitigations_experiment_evaluates_each_pair_on_its_own_corpus(tmp_path):
    """A pair trained on a synthetic corpus is scored on that corpus's held-out windows (not on KJV through a
    tokenizer that has never seen English), a text-trained pair on its own validation text."""
    from dataclasses import replace

    from conftest import load_script_module

    from diffquant.data.corpora import split
    from diffquant.data.tokens import encode
    from diffquant.training import TrainConfig, prepare_data

    exp = load_script_module("experiments/mitigations.py", "mitigations_experiment")

    synth = TrainConfig(preset="micro", corpus="synth:bb", tokens=4096, batch_size=4, seq_len=32, archs=("baseline",))
    data = prepare_data(synth, tmp_path / "s")
    seqs, calib, corpus, val = exp.held_out_and_calibration(data.tokenizer, (synth, tmp_path / "s"), 640)
    ref = prepare_data(replace(synth, eval_tokens=640), tmp_path / "s")
    assert corpus == "synth:bb" and val is None and seqs.shape == (20, 32)
    assert torch.equal(seqs, ref.val) and torch.equal(calib, ref.train[:16])
    assert int(seqs.max()) < data.vocab  # the synthetic vocabulary, not KJV through an unknown-token map

    text = "".join(f"Line {i} of a small corpus about rivers and hills.\n" for i in range(3000))
    (tmp_path / "t.txt").write_text(text)
    plain = TrainConfig(preset="micro", corpus=str(tmp_path / "t.txt"), tokens=4096, batch_size=4, seq_len=32,
                        archs=("baseline",))
    tok = prepare_data(plain, tmp_path / "p").tokenizer
    seqs, calib, corpus, val = exp.held_out_and_calibration(tok, (plain, tmp_path / "p"), 640)
    assert val == split(text)[1] and corpus == str(tmp_path / "t.txt")
    ids = encode(tok, val)
    assert seqs[0].tolist() == list(ids[:32]) and seqs[1].tolist() == list(ids[32:64])


def _hooked(model, names, ids):
    """{module path: (input, output)} of the named modules in one forward, by plain hooks."""
    seen = {}
    mods = dict(model.named_modules())
    hooks = [mods[n].register_forward_hook(lambda m, a, y, n=n: seen.__setitem__(n, (a[0].clone(), y.clone())))
             for n in names]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen2", "diff-gain"])
def test_rotate_turns_every_value_head_and_the_o_proj_input(family):
    """After rotate, layer 1's v_proj output per KV head is the float one times H_v (the recorded seed's
    orthogonal(head_dim, seed + 2)), and o_proj's input per head is the float one times H_v (diff-gain: the
    head norm's gain, folded into o_proj, is missing from the o_proj input)."""
    model = _with_random_norms(FAMILIES[family].build())
    ids = _ids(2, 12)
    names = ["model.layers.1.self_attn.v_proj", "model.layers.1.self_attn.o_proj"]
    ref = _hooked(model, names, ids)
    attn = model.model.layers[1].self_attn
    gain = getattr(getattr(attn, "groupnorm", None), "weight", None)
    gain = None if gain is None else gain.detach().clone()
    applied = mitigate_(model, Rotate(seed=3), None)
    out = _hooked(model, names, ids)
    d = attn.head_dim
    H = orthogonal(d, 5)[0].float()
    v_ref, v_out = ref[names[0]][1].unflatten(-1, (-1, d)), out[names[0]][1].unflatten(-1, (-1, d))
    assert torch.allclose(v_out, v_ref @ H, atol=1e-4)
    o_ref = ref[names[1]][0]
    if gain is not None:
        o_ref = o_ref / gain.repeat(o_ref.shape[-1] // gain.numel())
    assert torch.allclose(out[names[1]][0].unflatten(-1, (-1, d)), o_ref.unflatten(-1, (-1, d)) @ H, atol=1e-4)
    assert applied.record["matrices"]["v_o"] == "hadamard"
    applied.remove()


def test_rotate_leaves_values_of_an_elementwise_gate_and_rotates_keys_in_the_cache():
    gated = FAMILIES["gated"].build()
    v = gated.model.layers[0].self_attn.v_proj.weight.detach().clone()
    applied = mitigate_(gated, Rotate(), None)
    assert applied.record["matrices"]["v_o"].startswith("not rotated: the elementwise output gate")
    residual = orthogonal(gated.config.hidden_size, 0)[0].to(v.dtype)
    assert torch.allclose(gated.model.layers[0].self_attn.v_proj.weight, v @ residual, atol=1e-5)  # gains are 1
    applied.remove()
    s = adjust_scheme(get_scheme("kv4-sink1"), Rotate())
    assert [(p, c.hadamard) for p, c in s.activations] == [("*.k_cache", True), ("*.v_cache", False)]
    assert adjust_scheme(get_scheme("w4a8"), Rotate()) == get_scheme("w4a8")


def test_quarot_is_rotate_with_gptq_weights():
    from diffquant.quant.algorithms.gptq_config import GPTQ
    from diffquant.quant.recipe import from_cli

    q = parse("quarot")
    assert q == Rotate(0) and parse("quarot:2") == Rotate(2)  # the rotation; the GPTQ half is a solver
    assert from_cli("quarot", "rtn", "w4a8").solver == GPTQ() and from_cli("quarot", "rtn", "w4a8").fixes == (q,)
    assert from_cli("quarot", "gptq:act-order", "w4a8").solver == GPTQ(act_order=True)
    assert from_cli("rotate", "rtn", "w4a8").solver is None and from_cli("none", "awq", "w4a8").fixes == ()
    with pytest.raises(DiffquantError, match="quarot is the rotation with GPTQ weights"):
        from_cli("quarot", "awq", "w4a8")
    model = _with_random_norms(FAMILIES["llama"].build())
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
        a = mitigate_(model, Rotate(), None)
        rotated = model(ids).logits
        sd_rotate = {k: v.clone() for k, v in model.state_dict().items()}
        a.remove()
        b = mitigate_(model, q, None)  # the same transform: the solver is the recipe's
        assert all(torch.equal(sd_rotate[k], v) for k, v in model.state_dict().items())
        b.remove()
    assert torch.allclose(rotated, ref, atol=1e-3 * ref.abs().max().item())


def _smooth_by_hand(model, absmax: dict, alpha: float) -> None:
    """SmoothQuant written out here, in place: per layer s = max|X|^α / max|W|^(1−α) per input channel of q/k/v,
    gate/up and down_proj (max|W| over the Linears reading X), X / s folded into the norms and up_proj's rows, W·s into
    the readers; o_proj's input through v_proj, one scale per KV-head channel (maxima over the query heads sharing
    it). `absmax`: per layer and point, max|X| per channel read by plain hooks on the float model."""
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for point, norm, readers in (("attn", layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj)),
                                         ("mlp", layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj)),
                                         ("down", None, (mlp.down_proj,))):
                w = torch.stack([r.weight.double().abs().amax(0) for r in readers]).amax(0)
                sc = absmax[i][point] ** alpha / w ** (1 - alpha)
                if norm is None:
                    mlp.up_proj.weight.copy_(mlp.up_proj.weight.double() / sc[:, None])
                else:
                    norm.weight.copy_(norm.weight.double() / sc)
                for r in readers:
                    r.weight.copy_(r.weight.double() * sc)
            d, kv = attn.head_dim, attn.v_proj.out_features // attn.head_dim
            x = absmax[i]["o"].view(kv, -1, d).amax(1)
            w = attn.o_proj.weight.double().abs().amax(0).view(kv, -1, d).amax(1)
            sc = x ** alpha / w ** (1 - alpha)  # [kv head, d]
            attn.v_proj.weight.copy_(attn.v_proj.weight.double() / sc.flatten()[:, None])
            per_query = sc[:, None, :].expand(kv, attn.o_proj.in_features // (kv * d), d).flatten()
            attn.o_proj.weight.copy_(attn.o_proj.weight.double() * per_query)


def test_smoothquant_search_applies_the_alpha_of_least_calibration_loss():
    """smoothquant:search scores every α of the grid by the scheme's loss on the calibration windows, recomputed here
    with each α's smoothing written out by hand (`_smooth_by_hand`, maxima read by plain hooks), and applies the
    argmin."""
    from diffquant.evaluate import language_modeling
    from diffquant.quant.algorithms.mitigate import ALPHAS

    model = _with_random_norms(FAMILIES["llama"].build())
    calib, ids = _ids(8, 16, seed=1), _ids()
    scheme = get_scheme("w8a8-static")
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        for point, module in (("attn", layer.self_attn.q_proj), ("mlp", layer.mlp.gate_proj),
                              ("down", layer.mlp.down_proj), ("o", layer.self_attn.o_proj)):
            hooks.append(module.register_forward_pre_hook(
                lambda m, a, key=(i, point): seen.__setitem__(key, a[0].reshape(-1, a[0].shape[-1]).abs().amax(0))))
    with torch.no_grad():
        model(calib)
    for h in hooks:
        h.remove()
    absmax = {i: {p: seen[i, p].double() for p in ("attn", "mlp", "down", "o")} for i in range(len(model.model.layers))}
    original = {k: v.clone() for k, v in model.state_dict().items()}

    def loss_with(alpha):
        _smooth_by_hand(model, absmax, alpha)
        handle = attach_scheme(model, scheme)
        calibrate(model, handle, calib.split(8))
        loss = language_modeling(model, calib)["loss"]
        handle.remove()
        model.load_state_dict(original)
        return loss

    by_hand = {a: loss_with(a) for a in ALPHAS}
    with torch.no_grad():
        ref = model(ids).logits
    applied = mitigate_(model, parse("smoothquant:search"), calib, scheme)
    best = min(by_hand, key=by_hand.get)
    assert applied.record["alpha"] == best and applied.record["mitigation"] == "smoothquant:search"
    assert applied.record["search"]["loss"] == pytest.approx([by_hand[a] for a in ALPHAS], rel=1e-6)
    assert {k: v for k, v in applied.record["search"].items() if k != "loss"} == {
        "alphas": list(ALPHAS), "scored_tokens": int(calib[:16].numel()), "scheme": scheme.name}
    assert len(set(by_hand.values())) == len(ALPHAS)  # the grid's losses differ: the argmin means something
    with torch.no_grad():
        out = model(ids).logits
    assert ((out - ref).abs().max() / ref.abs().max()).item() <= 1e-4
    applied.remove()
    with pytest.raises(DiffquantError, match="give the scheme"):
        mitigate_(model, parse("smoothquant:search"), calib)


@pytest.mark.parametrize("alpha", [0.5, 0.8])
def test_smoothquant_smooths_the_o_proj_input_through_v_proj_per_kv_head(alpha):
    """GQA (4 query heads on 2 KV heads): s per KV-head channel = (max|X| over the query heads sharing it)^α /
    (max|W_o| over them)^(1−α), read here by plain hooks; o_proj then sees X / s. DIFF is refused, said."""
    model = _with_random_norms(FAMILIES["llama"].build())
    calib = _ids(seed=1)
    attn = model.model.layers[1].self_attn
    seen = []
    h = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
    with torch.no_grad():
        model(calib)
    h.remove()
    d = attn.head_dim
    x = seen[0].reshape(-1, 4, d).abs().amax(0).double()  # [query head, d]
    w = attn.o_proj.weight.detach().abs().amax(0).double().view(4, d)
    group = lambda t: torch.stack([t[:2].amax(0), t[2:].amax(0)])  # noqa: E731 - query heads 0,1 → KV 0; 2,3 → 1
    s = (group(x) ** alpha / group(w) ** (1 - alpha)).repeat_interleave(2, 0).flatten()
    applied = mitigate_(model, SmoothQuant(alpha), calib)
    after = []
    h = attn.o_proj.register_forward_pre_hook(lambda m, a: after.append(a[0].clone()))
    with torch.no_grad():
        model(calib)
    h.remove()
    applied.remove()
    assert applied.record["o_proj_input"] == "smoothed through v_proj"
    np.testing.assert_allclose(applied.record["scales"]["1"]["attn_out"], s.numpy(), rtol=1e-5)
    torch.testing.assert_close(after[0].double(), seen[0].double() / s, rtol=1e-4, atol=1e-5)
    diff = mitigate_(_with_random_norms(FAMILIES["diffllama"].build()), SmoothQuant(0.5), calib)
    assert diff.record["o_proj_input"].startswith("not smoothed: a norm over each head's output")
    assert "attn_out" not in diff.record["scales"]["0"]


def test_clip_output_picks_the_range_of_least_reader_output_error():
    """A static per-tensor int4 scale on layer 1's down_proj input: clip:output chooses, among the clipping
    ratios, the one minimising ‖(X − Q(X))·W_downᵀ‖² (computed here with a hand int4 quantizer and the plain
    product), where clip:mse minimises ‖X − Q(X)‖²; a planted massive channel makes the two differ."""
    from diffquant.quant.numerics.config import QuantConfig
    from diffquant.quant.numerics.fake import MSE_ALPHAS
    from diffquant.quant.numerics.formats import Format
    from diffquant.quant.numerics.layout import reader_gram
    from diffquant.quant.recipe import from_cli
    from diffquant.quant.numerics.scheme import QuantScheme

    model = _with_random_norms(FAMILIES["llama"].build())
    down = model.model.layers[1].mlp.down_proj
    with torch.no_grad():
        down.weight[:, 5] *= 40  # the channel whose rare large inputs matter most to the output
    calib = _ids(8, 16, seed=1)
    seen = []
    h = down.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach().clone()))
    with torch.no_grad():
        model(calib)
    h.remove()
    x = seen[0].double()
    amax = x.abs().max()

    def q4(t, alpha):
        s = amax * alpha / 7
        return torch.clamp(torch.round(t / s), -7, 7) * s

    w = down.weight.detach().double()
    out_err = [float((((x - q4(x, a)) @ w.T) ** 2).sum()) for a in MSE_ALPHAS.double()]
    own_err = [float(((x - q4(x, a)) ** 2).sum()) for a in MSE_ALPHAS.double()]
    chosen = {}
    for method in ("output", "mse"):
        cfg = QuantConfig(Format("int", 4), dynamic=False, calibration=method)
        handle = attach_scheme(model, QuantScheme(method, (("layers.1.down_in", cfg),)))
        calibrate(model, handle, [calib])
        chosen[method] = float(handle.quantizers["layers.1.down_in"].scale) * 7 / float(amax)
        handle.remove()
    assert chosen["output"] == pytest.approx(float(MSE_ALPHAS[int(np.argmin(out_err))]), rel=1e-5)
    assert chosen["mse"] == pytest.approx(float(MSE_ALPHAS[int(np.argmin(own_err))]), rel=1e-5)
    assert chosen["output"] != pytest.approx(chosen["mse"])
    g = reader_gram(model, "layers.0.attn_in")
    a = model.model.layers[0].self_attn
    ref = sum(m.weight.double().T @ m.weight.double() for m in (a.q_proj, a.k_proj, a.v_proj))
    assert torch.allclose(g.double(), ref, rtol=1e-5)
    with pytest.raises(DiffquantError, match="Linear inputs"):
        reader_gram(model, "layers.0.attn_logits")
    s = adjust_scheme(get_scheme("w4a4-static"), parse("clip:output"))
    assert all(c.calibration == "output" for _, c in s.activations) and s.weights == get_scheme("w4a4-static").weights
    assert from_cli("clip:output", "rtn", "w4a4-static").solver.label() == "clip:output"
    assert from_cli("clip:output", "gptq", "w4a4-static").solver.label() == "gptq"
