"""The ablation designs (baseline-headnorm, diff-gain, gated-nobias) and Guo et al.'s one-head preset: neutral
settings give the parent model, each formula equals a plain-torch computation at o_proj's input, and the
parameter counts stay matched."""

import math

import pytest
import torch

from diffquant.models.presets import PRESETS, build


def _ids(b=2, t=12):
    return torch.randint(0, 512, (b, t), generator=torch.Generator().manual_seed(5))


def _common(model):
    common = model.config.to_dict()
    for k in ("model_type", "architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        common.pop(k, None)
    return common


def _o_proj_inputs(model, ids):
    """The input of every layer's o_proj (recorded by a plain forward pre-hook)."""
    seen = {}
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, i=i: seen.__setitem__(i, a[0].detach()))
             for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    return logits, seen


def _q_proj_input(model, ids, layer=0):
    seen = {}
    h = model.model.layers[layer].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0]))
    with torch.no_grad():
        model(ids)
    h.remove()
    return seen["x"]


def _rms(x, eps):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_headnorm_off_is_the_baseline_and_on_is_its_formula():
    from diffquant.designs import headnorm

    baseline = build(PRESETS["micro"], "baseline")
    ids = _ids()
    for on in (False, True):
        model = headnorm.HeadNormForCausalLM(headnorm.HeadNormConfig(head_norm=on, **_common(baseline))).eval()
        assert not model.load_state_dict(baseline.state_dict(), strict=True).missing_keys
        logits, got = _o_proj_inputs(model, ids)
        base_logits, base = _o_proj_inputs(baseline, ids)
        if not on:
            assert (logits - base_logits).abs().max().item() <= 1e-5
            continue
        # layer 0 sees the same input in both models: its o_proj input is (1 − λ_init(0))·RMSNorm per head of the
        # baseline's, λ_init(0) = 0.8 − 0.6 = 0.2
        d = model.config.hidden_size // model.config.num_attention_heads
        heads = base[0].reshape(*base[0].shape[:-1], -1, d)
        want = (1 - 0.2) * _rms(heads, model.config.rms_norm_eps)
        assert torch.allclose(got[0], want.reshape(base[0].shape), atol=1e-5)
        assert math.isclose(model.model.layers[1].self_attn.scale, 1 - (0.8 - 0.6 * math.exp(-0.3)))


def test_diff_gain_of_ones_is_diff_and_a_gain_scales_the_normalised_output():
    from diffquant.designs import diffgain

    diff = build(PRESETS["micro"], "diff")
    model = build(PRESETS["micro"], "diff-gain")
    missing, unexpected = model.load_state_dict(diff.state_dict(), strict=False)
    assert not unexpected and all("groupnorm.weight" in k for k in missing) and missing
    assert isinstance(model.config, diffgain.DiffGainConfig)
    ids = _ids()
    logits, _ = _o_proj_inputs(model, ids)
    diff_logits, want = _o_proj_inputs(diff, ids)
    assert (logits - diff_logits).abs().max().item() <= 1e-5  # gain of ones: DIFF exactly
    g = torch.rand(2 * model.model.layers[0].self_attn.head_dim, generator=torch.Generator().manual_seed(1)) + 0.5
    with torch.no_grad():
        model.model.layers[0].self_attn.groupnorm.weight.copy_(g)
    _, got = _o_proj_inputs(model, ids)
    # (1 − λ_init)·RMSNorm(x)·g: DIFF's o_proj input (no gain) times g per channel of each differential head
    heads = want[0].reshape(*want[0].shape[:-1], -1, g.numel())
    assert torch.allclose(got[0], (heads * g).reshape(want[0].shape), atol=1e-5)


def test_diff_gain_is_treated_as_diff_by_the_taps():
    from diffquant.taps.sites import is_diff

    assert is_diff(build(PRESETS["micro"], "diff-gain"))


def test_gated_nobias_is_gated_with_zero_bias_and_its_formula():
    from diffquant.designs import gated

    parent = build(PRESETS["micro"], "gated")
    with torch.no_grad():
        for layer in parent.model.layers:
            layer.self_attn.gate.bias.zero_()
    nobias = gated.GatedForCausalLM(gated.GatedConfig(**{**_common(parent), "gate_bias": False})).eval()
    missing, unexpected = nobias.load_state_dict(parent.state_dict(), strict=False)
    assert not missing and all(k.endswith("gate.bias") for k in unexpected) and unexpected
    assert nobias.model.layers[0].self_attn.gate.bias is None
    ids = _ids()
    logits, got = _o_proj_inputs(nobias, ids)
    parent_logits, _ = _o_proj_inputs(parent, ids)
    assert (logits - parent_logits).abs().max().item() <= 1e-5
    # formula: the plain softmax attention output (a baseline with the same q/k/v/o) ⊙ σ(X·W_gᵀ), X = q_proj's input
    _, plain = _o_proj_inputs(_same_attention_baseline(nobias), ids)
    x = _q_proj_input(nobias, ids)
    want = plain[0] * torch.sigmoid(x @ nobias.model.layers[0].self_attn.gate.weight.T)
    assert torch.allclose(got[0], want, atol=1e-5)


def _same_attention_baseline(model):
    """A Llama with `model`'s embeddings, norms and attention projections (layer 0's attention input is then the
    same; the MLP width may differ, so only layer 0's o_proj input is comparable)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    common = _common(model)
    for k in ("gate", "gate_bias"):
        common.pop(k, None)
    base = LlamaForCausalLM(LlamaConfig(**common)).eval()
    base.load_state_dict({k: v for k, v in model.state_dict().items() if "gate." not in k}, strict=True)
    return base


def test_guo_preset_one_head_of_full_width_for_every_design():
    spec = PRESETS["guo"]
    assert (spec.hidden, spec.layers, spec.seq_len) == (256, 3, 257)
    with torch.device("meta"):
        base, diff = build(spec, "baseline", vocab=66), build(spec, "diff", vocab=66)
        gain = build(spec, "diff-gain", vocab=66)
    assert base.config.num_attention_heads == 1 and base.config.head_dim == 256
    # one differential head: two softmax maps of width 128, a value and output of width 256
    assert diff.config.num_attention_heads == 2 and diff.config.head_dim == 128
    assert gain.config.num_attention_heads == 2
    assert diff.model.layers[0].self_attn.groupnorm.normalized_shape == (256,)
    n = {a: sum(p.numel() for p in m.parameters()) for a, m in (("baseline", base), ("diff", diff))}
    assert n["diff"] - n["baseline"] == 3 * 4 * 128  # λ_q1, λ_k1, λ_q2, λ_k2 of width 128 per layer
    assert spec.parameters("baseline", vocab=66) == n["baseline"]


def test_one_head_needs_two_maps():
    from diffquant.models.presets import ModelSpec

    with pytest.raises(ValueError, match="heads must be 2"):
        ModelSpec("x", hidden=64, layers=1, heads=4, ffn=64, vocab=10, seq_len=8, one_head=True)


def test_betas_reach_adamw_and_survive_a_json_round_trip(tmp_path):
    import json
    from dataclasses import asdict

    from diffquant.training import TrainConfig

    cfg = TrainConfig(betas=(0.9, 0.99), grad_clip=0.0)
    assert json.loads(json.dumps(asdict(cfg)))["betas"] == [0.9, 0.99]
    with pytest.raises(ValueError, match="betas"):
        TrainConfig(betas=(0.9, 1.2))


def test_diff_nonorm_with_norm_is_diff_and_without_is_its_formula():
    """diff-nonorm (issue 42): head_norm=True is DIFF exactly; without the norm, layer 0's o_proj input is
    (1 − λ_init(0))·(A1 − λ·A2)·V, computed here in plain torch from DiffLlama's weights (both maps from q/k
    chunks, V at width 2d shared), never through the design's own code."""
    from diffquant.designs import diffnonorm

    diff = build(PRESETS["micro"], "diff")
    ids = _ids()
    for on in (True, False):
        model = diffnonorm.DiffNoNormForCausalLM(diffnonorm.DiffNoNormConfig(head_norm=on, **_common(diff))).eval()
        assert model.load_state_dict(diff.state_dict(), strict=True)
        logits, got = _o_proj_inputs(model, ids)
        diff_logits, _ = _o_proj_inputs(diff, ids)
        if on:
            assert (logits - diff_logits).abs().max().item() <= 1e-5
            continue
        assert (logits - diff_logits).abs().max().item() > 1e-3  # the norm is gone
        assert is_parameter_free_change(model, diff)
        attn = model.model.layers[0].self_attn
        x = _q_proj_input(model, ids)
        b, t, _ = x.shape
        h, d = model.config.num_attention_heads, attn.head_dim
        q = (x @ attn.q_proj.weight.T).view(b, t, h, d).transpose(1, 2)
        k = (x @ attn.k_proj.weight.T).view(b, t, h, d).transpose(1, 2)
        v = (x @ attn.v_proj.weight.T).view(b, t, h, d).transpose(1, 2)
        pos = torch.arange(t)
        inv = 1.0 / (model.config.rope_parameters["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
        rot = lambda z: z * ang.cos() + torch.cat([-z[..., d // 2:], z[..., :d // 2]], -1) * ang.sin()  # noqa: E731
        q, k = rot(q), rot(k)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        a = torch.softmax((q @ k.transpose(-1, -2) / math.sqrt(d)).masked_fill(~causal, float("-inf")), -1)
        lam = (torch.exp((attn.lambda_q1 * attn.lambda_k1).sum()) - torch.exp((attn.lambda_q2 * attn.lambda_k2).sum())
               + attn.lambda_init)
        half = h // 2
        v2 = torch.cat([v[:, :half], v[:, half:]], dim=-1)  # each differential head reads V of width 2d
        out = (a[:, :half] - lam * a[:, half:]) @ v2  # [b, half, t, 2d]
        want = (1 - attn.lambda_init) * out.transpose(1, 2).reshape(b, t, -1)
        assert torch.allclose(got[0], want, atol=1e-5), (got[0] - want).abs().max()


def is_parameter_free_change(model, parent) -> bool:
    return sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in parent.parameters())


def test_diff_nonorm_is_treated_as_diff_by_the_taps():
    from diffquant.taps.sites import is_diff

    assert is_diff(build(PRESETS["micro"], "diff-nonorm"))


def test_diff_frozen_keeps_lambda_at_lambda_init_through_training_and_reloading(tmp_path):
    """diff-frozen (issue 49): freeze_lambda=False is diff-gain exactly; frozen, every layer's λ is λ_init (0.8 −
    0.6·exp(−0.3·l), computed here) at initialisation, after AdamW steps that move every parameter, and after a
    save and reload."""
    from transformers import AutoModelForCausalLM

    from diffquant.designs import difffrozen
    from diffquant.models.fused import layer_lambdas

    gain = build(PRESETS["micro"], "diff-gain")
    free = difffrozen.DiffFrozenForCausalLM(difffrozen.DiffFrozenConfig(freeze_lambda=False, **_common(gain))).eval()
    assert free.load_state_dict(gain.state_dict(), strict=True)
    ids = _ids()
    assert (_o_proj_inputs(free, ids)[0] - _o_proj_inputs(gain, ids)[0]).abs().max().item() <= 1e-5
    want = [0.8 - 0.6 * math.exp(-0.3 * layer) for layer in range(PRESETS["micro"].layers)]
    model = build(PRESETS["micro"], "diff-frozen").train()
    assert layer_lambdas(model) == pytest.approx(want, abs=1e-7)
    assert layer_lambdas(gain) != pytest.approx(want, abs=1e-3)  # DIFF's λ starts elsewhere (random λ vectors)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())  # training moved everything else
    assert not any("lambda" in n for n, _ in model.named_parameters())
    assert layer_lambdas(model) == pytest.approx(want, abs=1e-7)
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(again).__name__ == "DiffFrozenForCausalLM" and layer_lambdas(again) == pytest.approx(want, abs=1e-7)
    assert not any(p.requires_grad is False for p in again.parameters())  # nothing else frozen


def test_baseline_diffnorm_is_diffs_norm_on_pairs_of_heads_with_a_gain():
    """baseline-diffnorm (issue 49): with groups of one head and no gain it is baseline-headnorm; as registered,
    layer 0's o_proj input is (1 − 0.2)·RMSNorm over adjacent pairs of heads (2d channels) times the gain,
    computed here from the baseline's o_proj input."""
    from diffquant.designs import headnorm

    baseline = build(PRESETS["micro"], "baseline")
    one = headnorm.HeadNormForCausalLM(headnorm.HeadNormConfig(head_norm_group=1, head_norm_gain=False,
                                                               **_common(baseline))).eval()
    hn = build(PRESETS["micro"], "baseline-headnorm")
    assert one.load_state_dict(hn.state_dict(), strict=True)
    ids = _ids()
    assert (_o_proj_inputs(one, ids)[0] - _o_proj_inputs(hn, ids)[0]).abs().max().item() <= 1e-5
    model = build(PRESETS["micro"], "baseline-diffnorm")
    missing, unexpected = model.load_state_dict(baseline.state_dict(), strict=False)
    assert not unexpected and missing and all("head_norm.weight" in k for k in missing)
    d = baseline.config.hidden_size // baseline.config.num_attention_heads
    g = torch.rand(2 * d, generator=torch.Generator().manual_seed(3)) + 0.5
    with torch.no_grad():
        model.model.layers[0].self_attn.head_norm.weight.copy_(g)
    _, got = _o_proj_inputs(model, ids)
    _, base = _o_proj_inputs(baseline, ids)
    pairs = base[0].reshape(*base[0].shape[:-1], -1, 2 * d)  # heads 2j and 2j + 1: contiguous 2d channels
    want = (1 - 0.2) * _rms(pairs, model.config.rms_norm_eps) * g
    assert torch.allclose(got[0], want.reshape(base[0].shape), atol=1e-5)
    with pytest.raises(ValueError, match="must divide"):
        headnorm.HeadNormConfig(head_norm_group=3, **_common(baseline))
