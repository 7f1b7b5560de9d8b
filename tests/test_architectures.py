"""The architecture matrix: every family of `diffquant.models.matrix`, each checked against an
independent computation written here (logit counts and maxima from our own q·kᵀ with our own causal or
windowed mask, hidden maxima from `output_hidden_states`), plus exact removal of every scheme."""

import pytest
import torch
import transformers
from packaging import version
from transformers import AttentionInterface

from diffquant import DiffquantError
from diffquant.models.matrix import FAMILIES, VOCAB
from diffquant.profiler import profile_model
from diffquant.quant.numerics.scheme import get_scheme, attach_scheme
from diffquant.taps import site_table, tapped

B, T = 2, 12
# Families whose attention does not go through AttentionInterface, as transformers' release notes say:
# Falcon moved onto it in 5.25.0; Bloom computes ALiBi attention in its own module.
NO_INTERFACE = {"bloom"} | ({"falcon"} if version.parse(transformers.__version__) < version.parse("5.25.0") else set())
_probe: dict = {}


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention computed from scratch with our own causal (or windowed) mask, for unpadded input:
    records the count and max of |q·kᵀ·scaling| (softcapped) over the allowed positions."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    rep = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(rep, dim=1).float(), value.repeat_interleave(rep, dim=1).float()
    logits = (query.float() @ k.transpose(-1, -2)) * scaling
    if kwargs.get("softcap"):
        logits = torch.tanh(logits / kwargs["softcap"]) * kwargs["softcap"]
    i = torch.arange(query.shape[2])[:, None]
    j = torch.arange(key.shape[2])[None, :]
    allowed = j <= i
    if kwargs.get("sliding_window"):
        allowed = allowed & (i - j < kwargs["sliding_window"])
    if _probe.get("last_q") is not query:  # DiffLlama calls twice per layer with the same Q and K
        _probe["last_q"] = query
        vals = logits.abs()[allowed.expand_as(logits)]
        _probe["count"] += vals.numel()
        _probe["max"] = max(_probe["max"], float(vals.max()))
    e = torch.exp(logits - logits.amax(-1, keepdim=True)).masked_fill(~allowed, 0.0)
    denominator = e.sum(-1, keepdim=True)
    if kwargs.get("s_aux") is not None:  # a sink logit in the denominator only
        denominator = denominator + torch.exp(kwargs["s_aux"].float()[None, :, None, None] - logits.amax(-1, keepdim=True))
    probs = e / denominator
    if kwargs.get("clip_softmax") is not None:
        zeta, gamma = kwargs["clip_softmax"]
        probs = torch.clamp((zeta - gamma) * probs + gamma, 0, 1).masked_fill(~allowed, 0.0)
    return (probs @ v).to(query.dtype).transpose(1, 2).contiguous(), probs


AttentionInterface.register("matrix_reference", _reference_attention)


def _reference_logits(model, ids):
    """Count and max |logit| by the test's own attention."""
    _probe.update(count=0, max=0.0, last_q=None)
    original = model.config._attn_implementation
    model.set_attn_implementation("matrix_reference")
    try:
        with torch.no_grad():
            model(ids)
    finally:
        model.set_attn_implementation(original)
    return _probe["count"], _probe["max"]


def _window(model, layer):
    """The sliding window of a layer as transformers' configs document it (None: full causal)."""
    c = model.config
    types = getattr(c, "layer_types", None)
    if types is not None:
        return c.sliding_window if types[layer] == "sliding_attention" else None
    return getattr(c, "sliding_window", None)


def _expected_count(model):
    maps = model.config.num_attention_heads
    total = 0
    for layer in range(model.config.num_hidden_layers):
        w = _window(model, layer) or T
        total += sum(min(i + 1, w) for i in range(T))
    return B * maps * total


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, FAMILIES[request.param].build()


def _ids():
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))


def test_logit_count_and_top1(family):
    name, model = family
    ids = _ids()
    if name in NO_INTERFACE:
        with pytest.raises(DiffquantError, match="not through transformers' AttentionInterface.*points: attn_in"):
            profile_model(model, ids, ["*.attn_logits"], progress=False)
        return
    count, top1 = _reference_logits(model, ids)
    prof = profile_model(model, ids, ["*.attn_logits"], progress=False)
    pooled = prof.pooled("attn_logits").summary(full=False)
    assert count == _expected_count(model)
    assert pooled["count"] == count
    assert pooled["absmax"] == pytest.approx(top1, rel=1e-5)


def test_hidden_top1(family):
    name, model = family
    ids = _ids()
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    prof = profile_model(model, ids, ["*.hidden"], progress=False)
    layers = model.config.num_hidden_layers
    for i in range(layers - 1):  # the last entry has the final norm applied in most families
        assert prof.sites[f"layers.{i}.hidden"].summary(full=False)["absmax"] == pytest.approx(
            float(states[i + 1].abs().max()), rel=1e-6)


def test_taps_leave_output_unchanged(family):
    name, model = family
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
        sites = [s.name for s in site_table(model) if not s.is_weight]
        fired = []
        with tapped(model, {s: (lambda x, ctx: fired.append(ctx.site.name)) for s in sites}):
            out = model(ids).logits
    assert sorted(fired) == sorted(sites)  # each activation site fires exactly once
    assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("scheme", ["w8a8", "logits-int4", "w4a16", "nf4"])
def test_scheme_applies_and_removes_exactly(family, scheme):
    name, model = family
    ids = _ids()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(ids).logits
    if scheme == "logits-int4" and name in NO_INTERFACE:
        with pytest.raises(DiffquantError, match="cannot apply.*AttentionInterface"):
            attach_scheme(model, get_scheme(scheme))
        return
    handle = attach_scheme(model, get_scheme(scheme))
    with torch.no_grad():
        quantized = model(ids).logits
    handle.remove()
    with torch.no_grad():
        after = model(ids).logits
    assert not torch.equal(quantized, ref)  # the scheme did something
    assert torch.equal(after, ref)
    state = model.state_dict()
    assert state.keys() == before.keys() and all(torch.equal(state[k], before[k]) for k in before)


def _np_rows(w: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Symmetric absmax per row of a 2-D weight, written out by hand."""
    qmax = 2 ** (bits - 1) - 1
    scale = w.abs().amax(dim=1, keepdim=True) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w / scale).round().clamp(-qmax, qmax) * scale


def test_conv1d_weights_quantized_per_output_channel():
    model = FAMILIES["gpt2"].build()
    stored = model.transformer.h[0].attn.c_attn.weight.detach().clone()  # [in, out]
    handle = attach_scheme(model, get_scheme("w8a16"))
    try:
        seen = model.transformer.h[0].attn.c_attn.weight.detach()
        assert seen.shape == stored.shape
        torch.testing.assert_close(seen, _np_rows(stored.t()).t(), rtol=0, atol=1e-7)
        quantized = [s for s in site_table(model) if s.is_weight and s.name.startswith("layers.")]
        assert len(quantized) == 8 and all(s.layout == "conv1d" for s in quantized)
    finally:
        handle.remove()


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_expert_weights_per_expert_and_channel_router_in_float(name):
    model = FAMILIES[name].build()
    mlp = model.model.layers[0].mlp
    experts = mlp.experts
    stored = experts.gate_up_proj.detach().clone()  # [expert, out, in]
    router = mlp.gate.weight.detach().clone()
    matrices = {n for n, p in model.named_parameters() if p.dim() >= 2}
    handle = attach_scheme(model, get_scheme("w8a16"))
    try:
        seen = experts.gate_up_proj.detach()
        ref = torch.stack([_np_rows(stored[e]) for e in range(stored.shape[0])])
        torch.testing.assert_close(seen, ref, rtol=0, atol=1e-7)
        assert torch.equal(mlp.gate.weight, router)
        quantized = {f"{path}.{p}" for path, m in model.named_modules() if hasattr(m, "parametrizations")
                     for p in m.parametrizations}
        left = {n for n in matrices - quantized if not n.startswith(("model.embed_tokens", "lm_head"))}
        routers = {n for n in matrices if n.endswith((".mlp.gate.weight", ".shared_expert_gate.weight"))}
        assert left == routers and routers  # only the routers stay in float
    finally:
        handle.remove()


def test_moe_down_in_is_the_experts_down_input():
    """experts.down_in rows equal act(gate)·up of each (token, slot), computed here from the expert weights."""
    model = FAMILIES["mixtral"].build()
    ids = _ids()
    got, routes = {}, {}
    mlp = model.model.layers[1].mlp
    handle = mlp.gate.register_forward_hook(lambda m, a, out: routes.update(x=a[0].detach(), index=out[2]))

    def grab(x, ctx):
        got["x"] = x.detach().clone()

    try:
        with tapped(model, {"layers.1.experts.down_in": grab}), torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    x, index = routes["x"], routes["index"]
    w = mlp.experts.gate_up_proj.detach()
    assert got["x"].shape == (B, T, index.shape[1], w.shape[1] // 2)
    flat = got["x"].reshape(B * T, index.shape[1], -1)
    for tok in range(B * T):
        for slot in range(index.shape[1]):
            gate, up = (x[tok] @ w[index[tok, slot]].t()).chunk(2)
            torch.testing.assert_close(flat[tok, slot], torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-6)


def test_shared_expert_down_in_seen_per_token():
    model = FAMILIES["qwen2_moe"].build()
    got = []
    with tapped(model, {"*.shared_expert.down_in": lambda x, ctx: got.append(tuple(x.shape))}), torch.no_grad():
        model(_ids())
    assert got == [(B, T, 64)] * 2


def test_gemma2_some_layers_tapped():
    """Untapped layers of a softcapped eager model fall through to the explicit path, not SDPA."""
    model = FAMILIES["gemma2"].build()
    ids = _ids()
    with torch.no_grad():
        ref = model(ids).logits
    prof = profile_model(model, ids, ["layers.0.attn_logits"], progress=False)
    assert prof.sites["layers.0.attn_logits"].summary(full=False)["count"] == B * 4 * sum(min(i + 1, 5) for i in range(T))
    with tapped(model, {"layers.1.attn_probs": lambda x, ctx: None}), torch.no_grad():
        assert (model(ids).logits - ref).abs().max().item() <= 1e-5


def test_refusal_names_every_missing_site_before_any_forward():
    from diffquant.quant.numerics.config import int_config
    from diffquant.quant.numerics.scheme import QuantScheme

    model = FAMILIES["gpt2"].build()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    scheme = QuantScheme("x", (("*.q", int_config(8)), ("*.attn_map", int_config(8)), ("*.hidden", int_config(8))))
    with pytest.raises(DiffquantError, match=r"'\*\.q'.*fused projection \(attn\.c_attn\).*'\*\.attn_map'.*only in DIFF"):
        attach_scheme(model, scheme)
    assert calls == [] and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules() if m is not model)
    with pytest.raises(DiffquantError, match="per-head granularity needs a site with a head dimension"):
        from diffquant.quant.numerics import granularity as G
        attach_scheme(model, QuantScheme("h", (("*.hidden", int_config(8, G.PerHead())),)))
