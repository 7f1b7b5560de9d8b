"""KV-cache sites and schemes, each checked against a computation written here in plain torch."""

import pytest
import torch

from diffquant import DiffquantError
from diffquant.models.matrix import FAMILIES
from diffquant.quant.numerics import granularity as G
from diffquant.quant.numerics.config import QuantConfig
from diffquant.quant.numerics.formats import Format
from diffquant.quant.algorithms.kv_cache import decode_greedy, decode_logits, write_once_cache
from diffquant.quant.numerics.scheme import QuantScheme, get_scheme, attach_scheme
from diffquant.taps import attach, site_table
from diffquant.taps.sites import site_docs

T = 14


@pytest.fixture(scope="module")
def llama_gqa():
    return FAMILIES["llama"].build()  # 4 query heads, 2 KV heads, head_dim 16


@pytest.fixture(scope="module")
def ids():
    return torch.randint(3, 500, (2, T), generator=torch.Generator().manual_seed(0))


def observe(model, ids, sites=("*.k_cache", "*.v_cache"), scheme=None):
    """{site: tensor} the sites see; with a scheme, (before its quantizers, after them) in the same forward."""
    before, after = {}, {}
    record = lambda seen: {s: lambda x, ctx: seen.__setitem__(ctx.site.name, x.clone()) for s in sites}  # noqa: E731
    first = attach(model, record(before))
    handle = attach_scheme(model, scheme) if scheme is not None else None
    last = attach(model, record(after)) if scheme is not None else None
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in (last, handle, first):
            if h is not None:
                h.remove()
    return before if scheme is None else (before, after)


def rope(x, theta=10000.0):
    """Plain rotate-half RoPE of [batch, head, pos, d] at positions 0..pos-1."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(x.shape[2], dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rot * sin


def projections(model, ids, layer=0):
    """k_proj and v_proj outputs as [batch, kv_head, pos, d], read with plain forward hooks."""
    attn = model.model.layers[layer].self_attn
    out = {}
    hooks = [getattr(attn, n).register_forward_hook(lambda m, a, y, n=n: out.__setitem__(n, y.detach().clone()))
             for n in ("k_proj", "v_proj")]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    d = model.config.head_dim
    return {n: y.view(*y.shape[:2], -1, d).transpose(1, 2) for n, y in out.items()}


def minmax(x, bits, reduce):
    """Hand min-max quantizer with a float offset (KIVI, quanto): q = round((x − min)/s), x̂ = q·s + min."""
    qmax = 2 ** bits - 1
    lo, hi = x.amin(dim=reduce, keepdim=True), x.amax(dim=reduce, keepdim=True)
    scale = (hi - lo) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round((x - lo) / scale), 0, qmax) * scale + lo


def asym(x, bits, reduce):
    """Hand asymmetric min-max quantizer (range widened to contain 0) over the dims `reduce`."""
    qmax = 2 ** bits - 1
    lo = x.amin(dim=reduce, keepdim=True).clamp(max=0)
    hi = x.amax(dim=reduce, keepdim=True).clamp(min=0)
    scale = (hi - lo) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, qmax)
    return (torch.clamp(torch.round(x / scale) + zero, 0, qmax) - zero) * scale


def test_cache_key_is_rope_of_k_proj_and_value_is_v_proj(llama_gqa, ids):
    seen = observe(llama_gqa, ids)
    ref = projections(llama_gqa, ids)
    k, v = seen["layers.0.k_cache"], seen["layers.0.v_cache"]
    assert k.shape == (2, 2, T, 16)  # each of the 2 KV heads once, not the 4 query heads
    assert torch.allclose(k, rope(ref["k_proj"]), atol=1e-5)
    assert torch.equal(v, ref["v_proj"])


def test_sites_listed_and_declared():
    table = [row[0] for row in site_docs()]
    assert "k_cache" in table and "v_cache" in table
    assert dict((r[0], r[1]) for r in site_docs())["k_cache"] == "[batch, kv_head, pos, dim]"


def test_diff_k1_k2_split_matches_diffllama_internals(ids):
    """transformers' two-call DiffLlama passes (Q, K, V1) and (Q, K, V2) to the attention function; the fused
    model's k_cache is that K, v_cache heads split into V1 | V2 as transformers chunks them, and the
    differential map built from K1 = first half of the KV heads equals diffquant's attn_map."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from diffquant.models.fused import fuse
    from diffquant.taps.attention import diff_lambda

    calls = []

    def capture(module, q, k, v, mask, **kw):
        if module.layer_idx == 0:
            calls.append((q.clone(), k.clone(), v.clone()))
        return sdpa_attention_forward(module, q, k, v, mask, **kw)

    AttentionInterface.register("kv_capture_test", capture)
    two_call = FAMILIES["diffllama-gqa"].build()
    two_call.set_attn_implementation("kv_capture_test")
    with torch.no_grad():
        two_call(ids)
    (q, k, v1), (q2, k2, v2) = calls
    assert torch.equal(q, q2) and torch.equal(k, k2)

    fused = FAMILIES["diffllama-gqa"].build()
    fuse(fused)
    seen = observe(fused, ids, ("layers.0.k_cache", "layers.0.v_cache", "layers.0.attn_map"))
    kc, vc = seen["layers.0.k_cache"], seen["layers.0.v_cache"]
    kvh, heads = kc.shape[1], q.shape[1]
    assert kvh == 2 and heads == 4
    assert torch.allclose(kc, k, atol=1e-6)
    assert torch.allclose(vc[:, : kvh // 2].repeat(1, 2, 1, 1), v1, atol=1e-6)
    assert torch.allclose(vc[:, kvh // 2:].repeat(1, 2, 1, 1), v2, atol=1e-6)
    n_rep = heads // kvh
    k1 = kc[:, : kvh // 2].repeat_interleave(n_rep, dim=1)
    k2_ = kc[:, kvh // 2:].repeat_interleave(n_rep, dim=1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    scale = q.shape[-1] ** -0.5

    def softmax(qh, kh):
        return torch.softmax((qh @ kh.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf")), -1)

    lam = diff_lambda(fused.model.layers[0].self_attn)
    a = softmax(q[:, : heads // 2], k1) - lam * softmax(q[:, heads // 2:], k2_)
    assert torch.allclose(seen["layers.0.attn_map"].masked_fill(~causal, 0), a, atol=1e-5)


def test_sink_aware_keeps_first_tokens_bit_exact_and_quantizes_the_rest(llama_gqa, ids):
    fp, q = observe(llama_gqa, ids, scheme=get_scheme("kv4-sink1"))
    for name in ("layers.0.k_cache", "layers.1.v_cache"):
        x, y = fp[name], q[name]
        assert torch.equal(y[:, :, :1], x[:, :, :1])
        assert torch.allclose(y[:, :, 1:], minmax(x[:, :, 1:], 4, (-1,)), atol=1e-6)
        assert not torch.equal(y, x)


def test_kivi_channel_runs_and_recent_window(llama_gqa, ids):
    k = QuantConfig(Format("int", 2, False, minmax=True), G.KVChannel(4), keep_first=1, keep_last=3)
    v = QuantConfig(Format("int", 3, False), G.PerGroup(8), keep_last=3)
    scheme = QuantScheme("kivi-test", (("*.k_cache", k), ("*.v_cache", v)))
    fp, q = observe(llama_gqa, ids, scheme=scheme)
    x, y = fp["layers.1.k_cache"], q["layers.1.k_cache"]
    assert torch.equal(y[:, :, :1], x[:, :, :1]) and torch.equal(y[:, :, T - 3:], x[:, :, T - 3:])
    for start in range(1, T - 3, 4):  # runs of 4 positions from the sink on; the last one ragged
        end = min(start + 4, T - 3)
        assert torch.allclose(y[:, :, start:end], minmax(x[:, :, start:end], 2, (2,)), atol=1e-6)
    x, y = fp["layers.0.v_cache"], q["layers.0.v_cache"]
    groups = x[:, :, : T - 3].unflatten(-1, (2, 8))
    assert torch.allclose(y[:, :, : T - 3], asym(groups, 3, (-1,)).flatten(-2), atol=1e-6)
    assert torch.equal(y[:, :, T - 3:], x[:, :, T - 3:])


def test_per_head_counts_each_kv_head_once(llama_gqa, ids):
    scheme = QuantScheme("kh", (("*.k_cache", QuantConfig(Format("int", 4, False), G.PerHead())),))
    fp, q = observe(llama_gqa, ids, scheme=scheme)
    x, y = fp["layers.0.k_cache"], q["layers.0.k_cache"]
    assert x.shape[1] == llama_gqa.config.num_key_value_heads
    assert torch.allclose(y, asym(x, 4, (2, 3)), atol=1e-6)  # one scale per (sequence, KV head)


def test_quantized_cache_changes_the_model_output_and_remove_restores(llama_gqa, ids):
    with torch.no_grad():
        ref = llama_gqa(ids).logits
        handle = attach_scheme(llama_gqa, get_scheme("k4v2"))
        out = llama_gqa(ids).logits
        handle.remove()
        again = llama_gqa(ids).logits
    assert (out - ref).abs().max() > 1e-3
    assert torch.equal(again, ref)


@pytest.mark.parametrize("family", ["llama", "diffllama-gqa"])
def test_decode_time_equals_prefill_time_for_per_token_scales(family, ids):
    """Per-token scales, no recent window: each entry is quantized once when written, as in one prefill
    forward, so the logits agree (to float rounding: no value of these small models lies within float noise
    of a rounding boundary; one that did would make the two runs part); a recent window makes them differ,
    as it must."""
    from diffquant.models.fused import fuse

    model = FAMILIES[family].build()
    fuse(model)
    scheme = get_scheme("k4v2")
    handle = attach_scheme(model, scheme)
    with torch.no_grad():
        prefill = model(ids).logits
    handle.remove()
    assert torch.allclose(decode_logits(model, ids, scheme, prompt=5), prefill, atol=1e-5)
    window = QuantScheme("w", (("*.k_cache", QuantConfig(Format("int", 2, False), G.PerToken(), keep_last=4)),))
    handle = attach_scheme(model, window)
    with torch.no_grad():
        prefill = model(ids).logits
    handle.remove()
    assert not torch.allclose(decode_logits(model, ids, window, prompt=5), prefill, atol=1e-3)


def test_decode_greedy_generation_matches_prefill_quantization(llama_gqa, ids):
    scheme = get_scheme("kv4-sink1")
    new = decode_greedy(llama_gqa, ids[:, :6], scheme, 8)
    full = torch.cat([ids[:, :6], new], dim=1)
    handle = attach_scheme(llama_gqa, scheme)
    with torch.no_grad():
        teacher = llama_gqa(full).logits[:, 5:-1].argmax(-1)
    handle.remove()
    assert torch.equal(teacher, new)


def test_write_once_cache_quantizes_runs_once_when_complete(llama_gqa, ids):
    """kv-channel:4 keys after a sink of 1: after 11 tokens, runs [1, 5) and [5, 9) are quantized, each from
    its float keys alone; positions 9, 10 wait in full precision."""
    k = QuantConfig(Format("int", 2, False, minmax=True), G.KVChannel(4), keep_first=1)
    scheme = QuantScheme("runs", (("*.k_cache", k),))
    cache = write_once_cache(llama_gqa, scheme)
    with torch.no_grad():
        llama_gqa(ids[:, :3], cache=cache, use_cache=True)
        for t in range(3, 11):
            llama_gqa(ids[:, t:t + 1], cache=cache, use_cache=True)
    float_keys = observe(llama_gqa, ids[:, :11])["layers.0.k_cache"]  # layer 0: float inputs
    stored = cache.layers[0].keys
    assert torch.equal(stored[:, :, :1], float_keys[:, :, :1])
    for start in (1, 5):
        assert torch.allclose(stored[:, :, start:start + 4], minmax(float_keys[:, :, start:start + 4], 2, (2,)),
                              atol=1e-5)
    assert torch.allclose(stored[:, :, 9:], float_keys[:, :, 9:], atol=1e-5)


def test_refused_where_attention_is_not_tapped():
    bloom = FAMILIES["bloom"].build()
    with pytest.raises(DiffquantError, match="AttentionInterface") as err:
        attach_scheme(bloom, get_scheme("kv4-sink1"))
    assert "\n" not in str(err.value)


def test_keep_windows_need_a_position_dim(llama_gqa):
    scheme = QuantScheme("bad", (("*.attn_logits", QuantConfig(keep_first=1)),))
    with pytest.raises(DiffquantError, match="no pos dimension"):
        attach_scheme(llama_gqa, scheme)


def test_scheme_round_trip_and_label():
    for name in ("kv8", "kv4", "k4v2", "kv4-sink1", "kivi2", "kvquant4-sink1", "kv4-had", "k4v2-had", "kv4-g128"):
        scheme = get_scheme(name)
        assert QuantScheme.from_dict(scheme.to_dict()) == scheme
    assert G.parse_granularity("kv-channel:32") == G.KVChannel(32)
    assert get_scheme("kvquant4-sink1").activations[0][0] == "*.k"  # pre-RoPE keys, stated by the site


def test_cache_sites_on_a_fused_qkv_family():
    phi3 = FAMILIES["phi3"].build()
    assert "layers.0.k_cache" in site_table(phi3).sites
    handle = attach(phi3, {"*.k_cache": lambda x, ctx: None})
    handle.remove()


@pytest.mark.parametrize("family", ["llama", "diffllama-gqa"])
def test_simulation_matches_transformers_quanto_cache(family, quanto_kernels):
    """transformers' QuantizedCache (quanto backend: min-max groups along the head dim, axis 0, a residual
    of 4 tokens re-quantized with the cache when full) against diffquant's simulation of the same rule:
    the same logits at every decode step."""
    pytest.importorskip("optimum.quanto")
    from transformers.cache_utils import QuantizedCache

    from diffquant.models.fused import fuse
    from diffquant.quant.algorithms.kv_cache import residual_requant_cache

    model = FAMILIES[family].build()
    fuse(model)
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(1))
    cfg = QuantConfig(Format("int", 2, False, minmax=True), G.PerGroup(8))
    scheme = QuantScheme("q2", (("*.k_cache", cfg), ("*.v_cache", cfg)))
    real = decode_logits(model, ids, None, 6, QuantizedCache("quanto", model.config, nbits=2, q_group_size=8,
                                                               residual_length=4))
    sim = decode_logits(model, ids, scheme, 6, residual_requant_cache(model, scheme, 4))
    with torch.no_grad():
        fp = model(ids).logits
    assert torch.allclose(real, sim, atol=1e-5)
    assert (real - fp).abs().max() > 1e-3  # the real cache does quantize


def test_kv_channel_is_per_channel_and_kv_head_over_the_sequence(llama_gqa, ids):
    cfg = QuantConfig(Format("int", 3, False, minmax=True), G.KVChannel())
    fp, q = observe(llama_gqa, ids, scheme=QuantScheme("kc", (("*.k_cache", cfg),)))
    x, y = fp["layers.0.k_cache"], q["layers.0.k_cache"]
    assert torch.allclose(y, minmax(x, 3, (2,)), atol=1e-6)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A micro DIFF checkpoint and a Bloom one (attention outside AttentionInterface), with byte tokenizers."""
    from diffquant.data.tokens import byte_tokenizer

    root = tmp_path_factory.mktemp("kv")
    (root / "c.txt").write_text("\n".join(f"and the {w} went unto the city of {v}." for w, v in
                                          zip(["men", "women", "kings"] * 40, ["david", "judah"] * 60)))
    for name in ("diffllama-gqa", "bloom"):
        FAMILIES[name].build().save_pretrained(root / name)
        byte_tokenizer().save_pretrained(root / name)
    return root


def test_quantize_cli_with_a_kv_scheme_and_refusal(saved, tmp_path, capsys):
    from diffquant.cli import main
    from diffquant.models.load import load_model

    args = ["--scheme", "kv4-sink1", "--data", str(saved / "c.txt"), "--eval-tokens", "128", "--seq-len", "32"]
    assert main(["quantize", "--model", str(saved / "diffllama-gqa"), *args, "--out", str(tmp_path / "q")]) == 0
    model, _ = load_model(str(tmp_path / "q"))
    assert {n for n in model._diffquant_quant.quantizers if n.endswith("_cache")} == {
        f"layers.{i}.{p}" for i in range(2) for p in ("k_cache", "v_cache")}
    capsys.readouterr()
    assert main(["quantize", "--model", str(saved / "bloom"), *args, "--out", str(tmp_path / "b")]) != 0
    err = capsys.readouterr().err  # after the loader's progress bars: one line says why
    assert len([line for line in err.splitlines() if "AttentionInterface" in line]) == 1
    assert "Traceback" not in err


def test_profile_counts_each_kv_head_once(llama_gqa, ids):
    from diffquant.profiler import profile_model

    prof = profile_model(llama_gqa, ids, ["*.k_cache"], batch_size=2)
    cfg = llama_gqa.config
    assert prof.pooled("k_cache").summary(full=False)["count"] == (
        ids.numel() * cfg.num_key_value_heads * cfg.head_dim * cfg.num_hidden_layers)  # not num_attention_heads


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_kv4_sink1_on_every_family_or_refused(name):
    """The architecture matrix: families whose attention goes through AttentionInterface take kv4-sink1
    (the output changes, removing it restores it exactly, the first position is untouched); the others are
    refused before anything is attached."""
    from diffquant.models.fused import fuse
    from diffquant.taps.sites import DIFF_MODEL_TYPES, supports_attention_interface

    model = FAMILIES[name].build()
    if model.config.model_type in DIFF_MODEL_TYPES:  # DiffLlama and the designs built on it
        with pytest.raises(DiffquantError, match="fused forward"):  # refused before anything is attached
            attach_scheme(model, get_scheme("kv4-sink1"))
        fuse(model)  # as diffquant's loaders do
    x = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(x).logits
    if not supports_attention_interface(model):
        with pytest.raises(DiffquantError, match="AttentionInterface"):
            attach_scheme(model, get_scheme("kv4-sink1"))
        return
    handle = attach_scheme(model, get_scheme("kv4-sink1"))
    with torch.no_grad():
        out = model(x).logits
    handle.remove()
    with torch.no_grad():
        again = model(x).logits
    assert torch.isfinite(out).all() and (out - ref).abs().max() > 1e-6
    assert torch.allclose(out[:, 0], ref[:, 0], atol=1e-5)  # position 0 sees only its own (kept) key and value
    assert torch.equal(again, ref)


def test_needle_through_a_quantized_cache():
    """Needle scores decoded through copies of one prefilled write-once cache equal, per continuation, a
    decode of the whole sequence through a fresh cache; with every entry kept in full precision they equal
    the plain forward written out here; at int2 the cache changes them."""
    import random

    from diffquant.data import needle
    from diffquant.data.tokens import byte_tokenizer
    from diffquant.quant.numerics.scheme import kv_config, kv_scheme

    model, tok = FAMILIES["llama"].build().eval(), byte_tokenizer()
    hay = "\n".join(f"line {i} of the haystack, words and more words" for i in range(80))
    ex = needle.make_example(hay.splitlines(), 3, 1, random.Random(0), context_chars=100)
    prefix = tok(ex.context + ex.queries[0][0], add_special_tokens=False)["input_ids"]
    conts = [tok(f" {n}", add_special_tokens=False)["input_ids"] for n in ex.numbers]
    kept = kv_scheme("kept", kv_config(2, sink=10_000), kv_config(2, sink=10_000), "every token kept")
    int2 = kv_scheme("int2", kv_config(2), kv_config(2), "int2 per token")

    def score(logits, cont):
        lp = torch.log_softmax(logits[0, len(prefix) - 1:-1].float(), -1)
        return float(lp.gather(-1, torch.tensor(cont)[:, None]).sum())

    with torch.inference_mode():
        plain = [score(model(torch.tensor([prefix + c])).logits, c) for c in conts]
        fresh = [score(decode_logits(model, torch.tensor([prefix + c]), int2, len(prefix)), c) for c in conts]
        greedy = decode_greedy(model, torch.tensor([prefix]), int2, 4)[0].tolist()
        got_int2, greedy_int2 = needle._through_cache(model, prefix, conts, 4, torch.device("cpu"), int2)
        got_kept, _ = needle._through_cache(model, prefix, conts, 4, torch.device("cpu"), kept)
    assert got_int2 == pytest.approx(fresh, abs=1e-4) and greedy_int2 == greedy
    assert got_kept == pytest.approx(plain, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(got_int2, plain)) > 1e-3
    a = needle.needle_accuracy(model, tok, hay, n_needles=3, n_queries=1, examples=2, kv_scheme=kept, context_chars=100)
    b = needle.needle_accuracy(model, tok, hay, n_needles=3, n_queries=1, examples=2, context_chars=100)
    assert a["per_query"] == b["per_query"] and a["queries"] == 2


def walsh(n):
    """Sylvester's normalised Hadamard matrix of order n (a power of 2), built here by hand."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def test_hadamard_cache_quantizes_each_head_in_a_hadamard_basis(llama_gqa, ids):
    """kv4-had: y = minmax(x·H)·Hᵀ per token and KV head, H the normalised Hadamard of the head dim; in float
    the rotation is invisible: (q·H)·(k·H)ᵀ = q·kᵀ, so a 16-bit hadamard cache keeps the logits."""
    fp, q = observe(llama_gqa, ids, scheme=get_scheme("kv4-had"))
    h = walsh(16)
    for name in ("layers.0.k_cache", "layers.1.v_cache"):
        x, y = fp[name], q[name]
        assert torch.allclose(y, minmax(x @ h, 4, (-1,)) @ h.T, atol=1e-5)
        assert not torch.allclose(y, minmax(x, 4, (-1,)), atol=1e-3)  # not the unrotated quantizer
    wide = QuantConfig(Format("int", 16, False, minmax=True), G.PerToken(), hadamard=True)
    with torch.no_grad():
        ref = llama_gqa(ids).logits
        handle = attach_scheme(llama_gqa, QuantScheme("k16-had", (("*.k_cache", wide), ("*.v_cache", wide))))
        out = llama_gqa(ids).logits
        handle.remove()
    assert torch.allclose(out, ref, atol=1e-3)


def test_hadamard_keeps_sinks_bit_exact_decodes_as_prefill_and_is_refused_off_the_cache(llama_gqa, ids):
    cfg = QuantConfig(Format("int", 4, False, minmax=True), G.PerToken(), keep_first=1, hadamard=True)
    scheme = QuantScheme("kv4-had-sink1", (("*.k_cache", cfg), ("*.v_cache", cfg)))
    fp, q = observe(llama_gqa, ids, scheme=scheme)
    x, y = fp["layers.0.k_cache"], q["layers.0.k_cache"]
    assert torch.equal(y[:, :, :1], x[:, :, :1])
    new = decode_greedy(llama_gqa, ids[:, :6], scheme, 6)
    handle = attach_scheme(llama_gqa, scheme)
    with torch.no_grad():
        teacher = llama_gqa(torch.cat([ids[:, :6], new], dim=1)).logits[:, 5:-1].argmax(-1)
    handle.remove()
    assert torch.equal(teacher, new)
    assert QuantConfig.from_dict(cfg.to_dict()) == cfg and cfg.label().endswith("/hadamard")
    for bad in (QuantScheme("bad", (("*.attn_logits", QuantConfig(hadamard=True)),)),
                QuantScheme("bad", (("*.attn_in", QuantConfig(hadamard=True)),)),
                QuantScheme("bad", (), (("*.q_proj.weight", QuantConfig(hadamard=True)),))):
        with pytest.raises(DiffquantError, match="hadamard quantizers are for the KV cache"):
            attach_scheme(llama_gqa, bad)


def test_hadamard_leaves_masked_positions_as_they_were(llama_gqa, ids):
    """Left padding: the padded positions of a hadamard cache come back bit-exact (not as x·H·Hᵀ)."""
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    seen = {}
    first = attach(llama_gqa, {"layers.0.v_cache": lambda x, ctx: seen.__setitem__("before", x.clone())})
    handle = attach_scheme(llama_gqa, get_scheme("kv4-had"))
    last = attach(llama_gqa, {"layers.0.v_cache": lambda x, ctx: seen.__setitem__("after", x.clone())})
    try:
        with torch.no_grad():
            llama_gqa(ids, attention_mask=mask)
    finally:
        for h in (last, handle, first):
            h.remove()
    before, after = seen["before"], seen["after"]
    assert torch.equal(after[0, :, :3], before[0, :, :3])
    assert not torch.equal(after[0, :, 3:], before[0, :, 3:])
