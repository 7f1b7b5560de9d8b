import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from diffquant import DiffquantError
from diffquant.quant.numerics import granularity as G
from diffquant.quant.numerics import math as Q
from diffquant.quant.numerics.config import QuantConfig, int_config
from diffquant.quant.numerics.fake import FakeQuant
from diffquant.quant.numerics.formats import NF4_VALUES, Format, grid, parse_format
from diffquant.quant.numerics.scheme import SCHEME_PRESETS, QuantScheme, calibrate, get_scheme, attach_scheme
from diffquant.taps.sites import POINTS, Site
from diffquant.taps.tap import TapContext

HIDDEN = ("batch", "pos", "channel")


def np_sym(x: np.ndarray, bits: int, axis) -> np.ndarray:
    """Symmetric absmax reference: scale = max|x| / (2^(b-1) - 1), round half to even."""
    qmax = 2 ** (bits - 1) - 1
    amax = np.abs(x).max(axis=axis, keepdims=True)
    scale = np.where(amax > 0, amax / qmax, 1.0)
    return np.clip(np.round(x / scale), -qmax, qmax) * scale


def np_asym(x: np.ndarray, bits: int, axis) -> np.ndarray:
    qmax = 2**bits - 1
    lo = np.minimum(x.min(axis=axis, keepdims=True), 0)
    hi = np.maximum(x.max(axis=axis, keepdims=True), 0)
    scale = np.where(hi > lo, (hi - lo) / qmax, 1.0)
    zero = np.clip(np.round(-lo / scale), 0, qmax)
    return (np.clip(np.round(x / scale) + zero, 0, qmax) - zero) * scale


def np_nf4(x: np.ndarray, axis) -> np.ndarray:
    """NF4 reference: scale = max|x| (the grid's largest magnitude is 1), each x / scale to the nearest of QLoRA's 16
    values (no value here lies on a midpoint), times the scale."""
    amax = np.abs(x).max(axis=axis, keepdims=True)
    scale = np.where(amax > 0, amax, 1.0)
    values = np.array(NF4_VALUES, dtype=np.float64)
    nearest = values[np.abs((x / scale)[..., None] - values).argmin(-1)]
    return (nearest * scale).astype(np.float32)


# dynamic scales never span sequences: the batch axis (0) is never reduced
CASES = [(G.PerTensor(), (1, 2)), (G.PerToken(), -1), (G.PerChannel(), (1,))]


@pytest.mark.parametrize("gran,axis", CASES)
@pytest.mark.parametrize("bits", [2, 4, 6, 8, 16])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int_matches_numpy(gran, axis, bits, symmetric):
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(bits)) * 3
    got = Q.dynamic_fake_quantize(x, Format("int", bits, symmetric), gran, HIDDEN)
    ref = (np_sym if symmetric else np_asym)(x.numpy(), bits, axis)  # float32, as the model runs
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)


def test_group_matches_numpy():
    x = torch.randn(2, 3, 12)
    got = Q.dynamic_fake_quantize(x, Format("int", 4), G.PerGroup(4), HIDDEN)
    ref = np_sym(x.numpy().reshape(2, 3, 3, 4), 4, -1).reshape(2, 3, 12)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("fmt", ["int", "nf4"])
def test_ragged_last_group(symmetric, fmt):
    """Groups of 5 over 12 channels: [0:5], [5:10] and a ragged [10:12], each with its own scale."""
    if fmt == "nf4" and not symmetric:
        return
    x = torch.randn(2, 3, 12) * 3
    f = Format("int", 4, symmetric) if fmt == "int" else Format("nf4")
    got = Q.dynamic_fake_quantize(x, f, G.PerGroup(5), HIDDEN)
    parts = [x[..., a:b] for a, b in ((0, 5), (5, 10), (10, 12))]
    if fmt == "int":
        ref = np.concatenate([(np_sym if symmetric else np_asym)(p.numpy(), 4, -1) for p in parts], -1)
    else:
        ref = np.concatenate([np_nf4(p.numpy(), -1) for p in parts], -1)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)
    # a group larger than the row is one group per row: per token
    torch.testing.assert_close(Q.dynamic_fake_quantize(x, f, G.PerGroup(128), HIDDEN),
                               Q.dynamic_fake_quantize(x, f, G.PerToken(), HIDDEN))


def test_matches_torch_fake_quantize_per_tensor_and_channel():
    x = torch.randn(16, 32) * 2
    fmt = Format("int", 8, symmetric=False)
    lo, hi = Q.value_range(x, (0, 1), None, False)
    scale, zero = Q.qparams(lo, hi, fmt)
    ours = Q.fake_quantize(x, scale, zero, fmt)
    theirs = torch.fake_quantize_per_tensor_affine(x, float(scale), int(zero), 0, 255)
    assert (ours - theirs).abs().max() <= 1e-6
    fmt = Format("int", 8)
    lo, hi = Q.value_range(x, (1,), None, True)
    scale, zero = Q.qparams(lo, hi, fmt)
    ours = Q.fake_quantize(x, scale, zero, fmt)
    theirs = torch.fake_quantize_per_channel_affine(x, scale.flatten(), zero.flatten().int(), 0, -127, 127)
    assert (ours - theirs).abs().max() <= 1e-6


def test_float_grids():
    assert grid("nf4").tolist() == pytest.approx(sorted(NF4_VALUES))
    assert grid("fp4_e2m1").tolist() == [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert float(grid("fp8_e4m3").max()) == 448.0 and float(grid("fp8_e5m2").max()) == 57344.0
    x = torch.randn(1000) * 100
    fmt = Format("fp8_e4m3")
    y = Q.quantize(x, torch.tensor(1.0), torch.tensor(0.0), fmt)
    # nearest representable value (ties aside): compare with a brute-force search of the grid
    g = grid("fp8_e4m3")
    nearest = g[(x.clamp(-448, 448)[:, None] - g[None]).abs().argmin(1)]
    assert ((y - nearest).abs() <= 1e-6).float().mean() > 0.999


@pytest.mark.parametrize("name", ["fp4_e2m1", "nf4"])
def test_small_float_formats_round_to_nearest(name):
    x = (torch.rand(500, generator=torch.Generator().manual_seed(1)) * 2.4 - 1.2)  # no exact ties
    fmt = Format(name)
    y = Q.dynamic_fake_quantize(x, fmt, G.PerTensor(), ("channel",))
    scale = x.abs().max() / fmt.qmax
    g = grid(name) * scale
    brute = g[(x[:, None] - g[None]).abs().argmin(1)]
    assert torch.allclose(y, brute, atol=1e-6)


floats = st.lists(st.floats(-1e3, 1e3, allow_nan=False, width=32), min_size=1, max_size=64)


@settings(max_examples=60, deadline=None)
@given(floats, st.integers(2, 16), st.booleans())
def test_properties(values, bits, symmetric):
    x = torch.tensor(values, dtype=torch.float32)
    fmt = Format("int", bits, symmetric)
    lo, hi = Q.value_range(x, (0,), None, symmetric)
    scale, zero = Q.qparams(lo, hi, fmt)
    y = Q.fake_quantize(x, scale, zero, fmt)
    assert torch.all((y - x).abs() <= scale / 2 * (1 + 1e-4) + 1e-6)  # within half a step inside the range
    assert torch.equal(Q.fake_quantize(y, scale, zero, fmt), y) or torch.allclose(
        Q.fake_quantize(y, scale, zero, fmt), y, rtol=0, atol=float(scale) * 1e-3)  # idempotent
    z = Q.fake_quantize(torch.zeros(3), scale, zero, fmt)
    assert torch.equal(z, torch.zeros(3))  # zero is exact


def test_error_decreases_with_bits():
    x = torch.randn(20000, generator=torch.Generator().manual_seed(0))
    errs = [float(((Q.dynamic_fake_quantize(x, Format("int", b), G.PerTensor(), ("channel",)) - x) ** 2).mean())
            for b in range(2, 17)]
    assert all(a >= b for a, b in zip(errs, errs[1:]))


def test_ste_gradient():
    x = torch.randn(4, 8, requires_grad=True)
    Q.dynamic_fake_quantize(x, Format("int", 4), G.PerToken(), HIDDEN).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))



PRECISION = {torch.bfloat16: 8, torch.float16: 11}  # significant bits


def _int8_grid_f32(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Symmetric int8 quantize-dequantize computed in float32 by numpy."""
    return (np.clip(np.round(x / scale), -127, 127) * scale).astype(np.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_fake_quant_is_the_float32_grid_rounded_once(dtype):
    """A bf16/fp16 tensor fake-quantized at 8 bits is the float32 computation (numpy here) cast once to its
    dtype, within 2^-p·|q·s| of the float32 grid point (p its significant bits), for dynamic scales and for a
    static scale that clamps, also on a tensor that requires grad (weights always do: the straight-through form
    x + (y − x) put clamped values off the grid by most of a step in bf16) and with a gradient still the identity."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 16, 64, generator=g) * torch.logspace(-1, 2, 64)).to(dtype)
    x32 = x.float().numpy()
    scale = (np.abs(x32).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    ref32 = _int8_grid_f32(x32, scale)
    y = Q.dynamic_fake_quantize(x, Format("int", 8), G.PerToken(), HIDDEN)
    assert y.dtype == dtype and torch.equal(y, torch.from_numpy(ref32).to(dtype))
    bound = 2.0 ** -PRECISION[dtype] * np.abs(ref32)
    assert (np.abs(y.float().numpy() - ref32) <= bound).all()
    assert (np.abs(y.float().numpy() - ref32) <= 0.5 * scale).all()  # the error bound in steps: 127/256 < 1/2
    static = np.float32(np.abs(x32).max() / 4 / 127)  # clamps the largest values
    ref32 = _int8_grid_f32(x32, static)
    w = x.clone().requires_grad_()
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            y = Q.fake_quantize(w, torch.tensor(static), torch.tensor(0.0), Format("int", 8), G.PerTensor())
        assert torch.equal(y, torch.from_numpy(ref32).to(dtype)), grad
    Q.fake_quantize(w, torch.tensor(static), torch.tensor(0.0), Format("int", 8), G.PerTensor()).float().sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))


def test_hadamard_quantizer_rotates_in_float32():
    """A hadamard KV quantizer on bf16 keys: Q(x·H)·Hᵀ in float32, cast to bf16 once (it rotated in bf16)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 2, 8, 16, generator=g) * 3).bfloat16()
    h = torch.tensor([[1.0]])
    while h.shape[0] < 16:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    h = h / 4  # the normalised Sylvester matrix of order 16 (entries ±1/4, exact)
    r = x.float() @ h
    lo, hi = r.amin(-1, keepdim=True), r.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    ref = ((((r - lo) / s).round().clamp(0, 15) * s + lo) @ h.T).bfloat16()
    q = FakeQuant(QuantConfig(Format("int", 4, False, minmax=True), G.PerToken(), hadamard=True))
    assert torch.equal(q(x, TapContext(Site("layers.0.k_cache", 0, POINTS["k_cache"]))), ref)

def _logit_ctx(valid):
    return TapContext(Site("layers.0.attn_logits", 0, POINTS["attn_logits"]), valid=valid)


@pytest.mark.parametrize("poison", [1e4, float("inf"), float("nan")])
@pytest.mark.parametrize("symmetric,gran,axis", [(True, G.PerTensor(), (1, 2, 3)), (False, G.PerTensor(), (1, 2, 3)),
                                                 (True, G.PerToken(), -1), (False, G.PerHead(), (2, 3))])
def test_logit_scale_from_valid_positions_only(poison, symmetric, gran, axis):
    x = torch.randn(2, 3, 6, 6)
    valid = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    poisoned = x.masked_fill(~valid, poison)
    y = FakeQuant(QuantConfig(Format("int", 4, symmetric), gran))(poisoned, _logit_ctx(valid))
    ref = (np_sym if symmetric else np_asym)(x.masked_fill(~valid, 0).numpy(), 4, axis)
    v = valid.expand_as(y)
    np.testing.assert_allclose(y[v].numpy(), ref[v.numpy()], rtol=1e-5, atol=1e-6)
    assert torch.equal(y[~v], poisoned[~v]) or poison != poison and bool(y[~v].isnan().all())  # masked as they were


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_keep_masked_is_exact(dtype):
    """The lerp fast path gives exactly torch.where's result; non-finite inputs take where itself."""
    valid = torch.rand(1, 3, 40, 40) > 0.4
    x = (torch.randn(2, 3, 40, 40) * torch.logspace(-6, 4, 40)).to(dtype)
    y = (x * 1.37).round()
    assert torch.equal(Q.keep_masked(y, x, valid), torch.where(valid, y, x))
    x[0, 0, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    out, ref = Q.keep_masked(y, x, valid), torch.where(valid, y, x)
    assert torch.equal(out.nan_to_num(), ref.nan_to_num()) and torch.equal(out.isnan(), ref.isnan())


def test_per_head_granularity():
    x = torch.randn(2, 4, 5, 5)
    y = Q.dynamic_fake_quantize(x, Format("int", 4), G.PerHead(), POINTS["attn_logits"].dims)
    ref = np_sym(x.numpy(), 4, (2, 3))  # per head of each sequence
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(DiffquantError, match="head dimension"):
        Q.dynamic_fake_quantize(torch.randn(2, 3, 4), Format("int", 4), G.PerHead(), HIDDEN)


def test_bad_input():
    for bits in (0, 1, 33, "four", 4.0, True):
        with pytest.raises(ValueError):
            Format("int", bits)
    with pytest.raises(ValueError, match="positive integer"):
        G.PerGroup(0)
    with pytest.raises(DiffquantError):
        parse_format("four")
    with pytest.raises(ValueError, match="per token"):
        QuantConfig(granularity=G.PerToken(), dynamic=False)
    with pytest.raises(DiffquantError, match="unknown scheme"):
        get_scheme("w3a3-magic")


def _static(calibration, batches, bits=8, **kw):
    q = FakeQuant(QuantConfig(Format("int", bits), G.PerTensor(), dynamic=False, calibration=calibration, **kw))
    ctx = TapContext(Site("layers.0.hidden", 0, POINTS["hidden"]))
    q.start_calibration()
    for b in batches:
        assert q(b, ctx) is None
    q.finish_calibration()
    return q


def test_static_calibrations():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(4, 8, 16, generator=g) * (i + 1) for i in range(3)]
    q = _static("minmax", batches)
    assert float(q.scale) == pytest.approx(max(float(b.abs().max()) for b in batches) / 127, rel=1e-6)
    q = _static("ema", batches, ema_momentum=0.8)  # 0.8: m and 1 − m differ, so a swap of the two shows
    running = None
    for b in batches:  # the first batch's range, then range ← m·range + (1 − m)·batch range
        m = float(b.abs().max())
        running = m if running is None else 0.8 * running + 0.2 * m
    assert float(q.scale) == pytest.approx(running / 127, rel=1e-6)
    asym = FakeQuant(QuantConfig(Format("int", 8, False), G.PerTensor(), dynamic=False, calibration="ema",
                                 ema_momentum=0.7))
    ctx = TapContext(Site("layers.0.hidden", 0, POINTS["hidden"]))
    asym.start_calibration()
    lo = hi = None
    for b in batches:  # asymmetric: both ends move, each range widened to contain 0
        asym(b + 1.0, ctx)
        blo, bhi = min(float((b + 1.0).min()), 0.0), max(float((b + 1.0).max()), 0.0)
        lo, hi = (blo, bhi) if lo is None else (0.7 * lo + 0.3 * blo, 0.7 * hi + 0.3 * bhi)
    asym.finish_calibration()
    assert float(asym.scale) == pytest.approx((hi - lo) / 255, rel=1e-6)
    assert float(asym.zero) == round(-lo / ((hi - lo) / 255))
    q = _static("percentile", batches, percentile=99.0)
    ref = float(torch.quantile(torch.cat([b.flatten() for b in batches]).abs(), 0.99))
    assert float(q.scale) * 127 == pytest.approx(ref, rel=0.01)
    torch.manual_seed(0)
    heavy = [torch.distributions.StudentT(2.0).sample((16, 32, 16)) for _ in range(3)]
    qm, qx = _static("mse", heavy, bits=4), _static("minmax", heavy, bits=4)
    ctx = TapContext(Site("layers.0.hidden", 0, POINTS["hidden"]))
    err = lambda q: sum(float(((q(b, ctx) - b) ** 2).sum()) for b in heavy)  # noqa: E731
    assert float(qm.scale) < float(qx.scale) and err(qm) <= err(qx)


def test_scheme_round_trip(tmp_path):
    for scheme in SCHEME_PRESETS.values():
        assert QuantScheme.from_dict(json.loads(json.dumps(scheme.to_dict()))) == scheme
    (tmp_path / "s.yaml").write_text("name: mine\nactivations:\n  '*.attn_logits': {format: int5, granularity: head}\n"
                                     "weights:\n  'layers.*.mlp.*.weight': {format: nf4, granularity: {kind: group, size: 32}}\n")
    s = get_scheme(str(tmp_path / "s.yaml"))
    assert s.activations[0][1].format == Format("int", 5) and s.weights[0][1].granularity == G.PerGroup(32)
    (tmp_path / "bad.json").write_text('{"activations": {"*.hidden": {"format": "int8", "colour": 1}}}')
    with pytest.raises(DiffquantError, match="unknown quantizer keys"):
        get_scheme(str(tmp_path / "bad.json"))


def test_identity_and_removal_are_exact(micro_pair):
    ids = torch.randint(0, 512, (2, 12))
    for model in micro_pair:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            ref = model(ids).logits
            a = attach_scheme(model, SCHEME_PRESETS["fp"])
            assert torch.equal(model(ids).logits, ref)
            a.remove()
            a = attach_scheme(model, SCHEME_PRESETS["w8a8"])
            assert not torch.equal(model(ids).logits, ref)
            a.remove()
            assert torch.equal(model(ids).logits, ref)
        after = model.state_dict()
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("gran", ["tensor", "head", "channel"])
def test_dynamic_scales_do_not_depend_on_batch_size(micro_pair, gran):
    """logits-int4 with per-tensor, per-head or per-channel dynamic scales: batch 1 and batch 8 give the same
    perplexity, and the same logits for every sequence."""
    from diffquant.evaluate import language_modeling

    model = micro_pair[0]
    seqs = torch.randint(0, 512, (8, 24), generator=torch.Generator().manual_seed(3))
    seqs[3, :] = seqs[3, :] % 7  # one sequence with very different logits, to make sharing visible
    a = attach_scheme(model, QuantScheme("l4", (("*.attn_logits", int_config(4, G.parse_granularity(gran))),)))
    try:
        one = language_modeling(model, seqs, batch_size=1)
        eight = language_modeling(model, seqs, batch_size=8)
        with torch.no_grad():
            together = model(seqs).logits
            alone = torch.cat([model(seqs[i:i + 1]).logits for i in range(8)])
    finally:
        a.remove()
    assert one["loss"] == pytest.approx(eight["loss"], rel=1e-6)
    assert (together - alone).abs().max().item() <= 1e-5


def test_edited_weight_is_requantized(micro_pair):
    """An edit through `.data` (which no version counter sees) reaches the next forward."""
    import copy

    model = copy.deepcopy(micro_pair[0])
    ids = torch.randint(0, 512, (1, 8))
    a = attach_scheme(model, SCHEME_PRESETS["w8a16"])
    try:
        with torch.no_grad():
            model(ids)
            lin = model.model.layers[0].mlp.down_proj
            lin.parametrizations.weight.original.data.mul_(2)
            edited = model(ids).logits
        a.remove()
        a = attach_scheme(model, SCHEME_PRESETS["w8a16"])
        with torch.no_grad():
            fresh = model(ids).logits
    finally:
        a.remove()
    assert torch.equal(edited, fresh)


def test_16_bit_int_quantizer_is_nearly_exact(micro_pair):
    ids = torch.randint(0, 512, (1, 12))
    model = micro_pair[1]
    with torch.no_grad():
        ref = model(ids).logits
        a = attach_scheme(model, QuantScheme("x", (("*.attn_logits", int_config(16)),)))
        out = model(ids).logits
        a.remove()
    assert (out - ref).abs().max() < 1e-4


def test_lambda_and_norms_stay_full_precision(micro_pair):
    model = micro_pair[1]
    a = attach_scheme(model, SCHEME_PRESETS["w4a8"])  # group 128 over width 64 and 176: ragged groups
    try:
        for name, module in model.named_modules():
            if hasattr(module, "parametrizations"):
                assert isinstance(module, torch.nn.Linear), name
        attn = model.model.layers[0].self_attn
        assert isinstance(attn.lambda_q1, torch.nn.Parameter) and not hasattr(attn, "parametrizations")
        assert not hasattr(model.lm_head, "parametrizations")
    finally:
        a.remove()


def test_quantization_aware_training_lowers_loss(micro_pair):
    import copy

    model = copy.deepcopy(micro_pair[0]).train()
    ids = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(0))
    a = attach_scheme(model, QuantScheme("w4", weights=(("layers.*.weight", int_config(4, G.PerChannel(0))),)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    a.remove()
    assert losses[-1] < losses[0] - 0.5


def test_static_scheme_needs_calibration(micro_pair):
    model = micro_pair[0]
    ids = torch.randint(0, 512, (2, 8))
    a = attach_scheme(model, SCHEME_PRESETS["w8a8-static"])
    try:
        with pytest.raises(DiffquantError, match="before calibration"):
            model(ids)
        calibrate(model, a, [ids, ids])
        with torch.no_grad():
            model(ids)
    finally:
        a.remove()


@pytest.mark.slow
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("gran", [G.PerTensor(), G.PerToken(), G.PerGroup(16)])
def test_compiled_fake_quant_is_bit_identical(symmetric, gran):
    """The fused (torch.compile) round trip gives exactly the eager quantize/dequantize result."""
    x = torch.randn(3, 10, 64) * torch.logspace(-3, 2, 64)
    fmt = Format("int", 4, symmetric)
    eager = Q.dynamic_fake_quantize(x, fmt, gran, HIDDEN)
    fused = Q.dynamic_fake_quantize(x, fmt, gran, HIDDEN, compiled=True)
    assert not Q._COMPILED_ROUNDTRIP.failed  # it really compiled here
    assert torch.equal(eager, fused)


def test_the_fused_round_trip_branch_against_a_plain_computation(monkeypatch):
    """fake_quantize(compiled=True) takes the fused round trip's branch. Here it runs through CompiledOrEager's own
    eager fallback (its path where compiling fails), so a fast test checks the branch itself against plain
    arithmetic: the scale, zero point and the format's range passed in order (asymmetric int4, both ends clamped),
    and the cast back to x's dtype (bfloat16). The compiled code against eager: the slow test above."""
    from diffquant.compiled import CompiledOrEager

    eager = CompiledOrEager(Q._int_roundtrip)
    eager.failed = True
    monkeypatch.setattr(Q, "_COMPILED_ROUNDTRIP", eager)
    x = (torch.randn(4, 40, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16)
    fmt = Format("int", 4, False)  # codes 0..15
    y = Q.fake_quantize(x, torch.tensor(0.25), torch.tensor(6.0), fmt, compiled=True)
    codes = torch.round(x.float() / 0.25) + 6
    assert (codes > 15).any() and (codes < 0).any()  # both ends of the range clamp
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, ((codes.clamp(0, 15) - 6) * 0.25).to(torch.bfloat16))


def test_compile_failure_falls_back_to_eager(monkeypatch):
    from diffquant.compiled import CompiledOrEager

    def broken(fn, **kw):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    fallback = CompiledOrEager(Q._int_roundtrip)
    x, scale, zero = torch.randn(5, 8), torch.tensor(0.1), torch.tensor(0.0)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        y = fallback(x, scale, zero, -7.0, 7.0)
    assert fallback.failed and torch.equal(y, Q.fake_quantize(x, scale, zero, Format("int", 4)))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eager from then on, without a second warning
        assert torch.equal(fallback(x, scale, zero, -7.0, 7.0), y)


@pytest.mark.parametrize("symmetric", [True, False])
def test_the_fused_round_trip_expression_matches_numpy(symmetric):
    """The one expression torch.compile fuses (`Q._int_roundtrip`), run eagerly with the scales `dynamic_qparams`
    takes, against numpy's quantize-dequantize (the compiled test is slow; this one says what it must compute)."""
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(8)) * 3 + 1.0
    fmt = Format("int", 4, symmetric)
    scale, zero = Q.dynamic_qparams(x, fmt, G.PerToken(), HIDDEN)
    got = Q._int_roundtrip(x, scale, zero, fmt.qmin, fmt.qmax)
    np.testing.assert_allclose(got.numpy(), (np_sym if symmetric else np_asym)(x.numpy(), 4, -1), rtol=1e-5, atol=1e-6)


def test_kv_channel_runs_of_one_position_scale_each_value_alone():
    """KIVI's per-channel keys in runs of G = 1 position: every (position, channel) has its own scale, so each value
    comes back as itself (to rounding); one scale per channel over all positions would not."""
    dims = ("batch", "kv_head", "pos", "dim")
    x = torch.randn(2, 2, 6, 8, generator=torch.Generator().manual_seed(9)) * torch.logspace(-2, 2, 6)[:, None]
    got = Q.dynamic_fake_quantize(x, Format("int", 4), G.KVChannel(1), dims)
    np.testing.assert_allclose(got.numpy(), x.numpy(), rtol=1e-6)


def test_kv_channel_runs_end_with_a_ragged_run():
    """Runs of 4 positions over 7: [0:4] and a ragged [4:7], each (run, channel) with its own absmax scale, against
    numpy per run."""
    dims = ("batch", "kv_head", "pos", "dim")
    x = torch.randn(2, 2, 7, 8, generator=torch.Generator().manual_seed(10)) * 3
    got = Q.dynamic_fake_quantize(x, Format("int", 4), G.KVChannel(4), dims)
    ref = np.concatenate([np_sym(x[:, :, a:b].numpy(), 4, 2) for a, b in ((0, 4), (4, 7))], axis=2)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("poison", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("fmt", [Format("int", 8), Format("int", 8, False), Format("int", 4, False, True)],
                         ids=["sym", "asym", "minmax"])
@pytest.mark.parametrize("spread", ["mixed", "small positive"])
def test_ranges_leave_out_non_finite_and_masked_values(poison, masked, fmt, spread):
    """One non-finite value (alone: +inf leaves the minimum finite, -inf the maximum) and, with a mask, a masked
    1000: per-tensor ranges from the finite valid values only, numpy's min and max of them (widened to contain 0
    except for min-max formats; values all in [0.2, 0.7] show the widening)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 6, 8, generator=g) * 2 + 0.5 if spread == "mixed" else torch.rand(2, 6, 8, generator=g) / 2 + 0.2
    x[0, 1, 2] = poison
    valid = None
    if masked:
        x[1, 5] = 1000.0
        valid = torch.ones(2, 6, 1, dtype=torch.bool)
        valid[1, 5] = False
    lo, hi = Q.value_range(x, (0, 1, 2), valid, fmt.symmetric, not fmt.minmax)
    keep = np.isfinite(x.numpy()) & (True if valid is None else valid.expand_as(x).numpy())
    v = x.numpy()[keep]
    if fmt.symmetric:
        want = (-np.abs(v).max(), np.abs(v).max())
    elif fmt.minmax:
        want = (v.min(), v.max())
    else:
        want = (min(v.min(), 0.0), max(v.max(), 0.0))
    assert (float(lo), float(hi)) == pytest.approx(want)


def test_a_constant_group_keeps_its_value_in_every_format():
    """A group whose values are all equal (a zero range: scale 0 would divide by zero) comes back as itself:
    symmetric and asymmetric integers, min-max, and a float format."""
    x = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [2.5, 2.5, 2.5, 2.5], [-1.0, -1.0, -1.0, -1.0]]])
    for fmt in (Format("int", 8), Format("int", 4, False), Format("int", 4, False, True), Format("nf4")):
        got = Q.dynamic_fake_quantize(x, fmt, G.PerToken(), HIDDEN)
        np.testing.assert_allclose(got.numpy(), x.numpy(), rtol=1e-6, err_msg=fmt.label())


def test_values_outside_a_static_range_saturate():
    """A static scale meets values beyond its range (calibrated on other data): integer codes clamp to the format's
    ends (symmetric, asymmetric with its zero point, min-max), fp8 to ±max (e4m3 has no infinity: an unclamped cast
    is NaN), nf4 to ±1; numpy's clip(round(x / s)) and the formats' ends written here."""
    x = torch.tensor([-50.0, -3.0, -0.4, 0.0, 0.7, 2.2, 60.0], dtype=torch.float64)
    s = torch.tensor(0.5, dtype=torch.float64)
    cases = [(Format("int", 4), torch.tensor(0.0, dtype=torch.float64), np.clip(np.round(x.numpy() / 0.5), -7, 7)),
             (Format("int", 4, False), torch.tensor(6.0, dtype=torch.float64),
              np.clip(np.round(x.numpy() / 0.5) + 6, 0, 15)),
             (Format("int", 4, False, True), torch.tensor(-1.0, dtype=torch.float64),
              np.clip(np.round((x.numpy() + 1.0) / 0.5), 0, 15)),
             (Format("fp8_e4m3"), torch.tensor(0.0, dtype=torch.float64), None),
             (Format("fp8_e5m2"), torch.tensor(0.0, dtype=torch.float64), None),
             (Format("nf4"), torch.tensor(0.0, dtype=torch.float64), None)]
    for fmt, zero, want in cases:
        q = Q.quantize(x.clone(), s if want is not None else 60 / (2 * fmt.qmax), zero, fmt)  # ±60: twice the max
        assert q.dtype == torch.float64, fmt.label()  # codes in x's dtype (GPTQ rounds float64 columns)
        if want is not None:
            assert q.tolist() == want.tolist(), fmt.label()
        else:
            assert float(q.max()) == fmt.qmax and float(q.min()) == -fmt.qmax, fmt.label()
            assert bool(torch.isfinite(q).all()), fmt.label()


@pytest.mark.parametrize("name,tie,even", [("fp8_e4m3", 1.1875, 1.25), ("fp8_e5m2", 1.375, 1.5)])
def test_fp8_rounds_ties_to_even(name, tie, even):
    """Halfway between two fp8 values (e4m3: 1.125 and 1.25; e5m2: 1.25 and 1.5) the cast rounds to the one with an
    even mantissa, as the OCP fp8 formats specify (worked by hand)."""
    q = Q.quantize(torch.tensor([tie, -tie]), torch.tensor(1.0), torch.tensor(0.0), Format(name))
    assert q.tolist() == [even, -even]


@pytest.mark.parametrize("fmt", [Format("nf4"), Format("int", 4, False, True)], ids=["nf4", "minmax"])
def test_fake_quantize_asked_to_fuse_a_format_it_cannot(fmt):
    """`compiled=True` fuses integer round trips only: nf4 and min-max still round as numpy does (per token)."""
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(12)) * 2
    scale, zero = Q.dynamic_qparams(x, fmt, G.PerToken(), HIDDEN)
    got = Q.fake_quantize(x, scale, zero, fmt, G.PerToken(), compiled=True, dims=HIDDEN)
    if fmt.name == "nf4":
        ref = np_nf4(x.numpy(), -1)
    else:
        lo, hi = x.numpy().min(-1, keepdims=True), x.numpy().max(-1, keepdims=True)
        s = (hi - lo) / 15
        ref = np.clip(np.round((x.numpy() - lo) / s), 0, 15) * s + lo
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-5, atol=1e-6)


def test_fake_quantize_of_an_infinity_with_autograd_on():
    """Outside no_grad, for a tensor that needs no gradient, nothing is added for the straight-through estimator: an
    infinite input saturates to the range's end (adding x − x.detach() would turn it into NaN)."""
    x = torch.tensor([0.5, float("inf"), -float("inf")])
    with torch.enable_grad():
        y = Q.fake_quantize(x, torch.tensor(0.01), torch.tensor(0.0), Format("int", 8))
    assert y.tolist() == pytest.approx([0.5, 1.27, -1.27])


@pytest.mark.parametrize("fmt", [Format("int", 8), Format("int", 4, False), Format("int", 4, False, True)],
                         ids=["sym", "asym", "minmax"])
def test_group_scales_leave_out_masked_values(fmt):
    """Groups of 4 over 10 channels (the last one ragged) with masked 1000s inside groups: each group's range from its
    valid values only (numpy per group), the valid values quantized with it; a mask broadcast over channels
    ([batch, pos, 1]) works with groups too."""
    x = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(13)) * 2
    valid = torch.ones(2, 3, 10, dtype=torch.bool)
    for b, p, c in ((0, 1, 2), (1, 2, 9), (1, 0, 5)):
        x[b, p, c], valid[b, p, c] = 1000.0, False
    got = Q.dynamic_fake_quantize(x, fmt, G.PerGroup(4), HIDDEN, valid).numpy()
    qmax = fmt.qmax
    for b in range(2):
        for p in range(3):
            for a, e in ((0, 4), (4, 8), (8, 10)):
                v, ok = x[b, p, a:e].numpy(), valid[b, p, a:e].numpy()
                if fmt.symmetric:
                    s = np.abs(v[ok]).max() / qmax
                    want = np.clip(np.round(v / s), -qmax, qmax) * s
                elif fmt.minmax:  # a group of one valid value has a zero range: scale 1
                    lo = v[ok].min()
                    s = (v[ok].max() - lo) / qmax or 1.0
                    want = np.clip(np.round((v - lo) / s), 0, qmax) * s + lo
                else:
                    lo, hi = min(v[ok].min(), 0), max(v[ok].max(), 0)
                    s = (hi - lo) / qmax
                    z = np.clip(np.round(-lo / s), 0, qmax)
                    want = (np.clip(np.round(v / s) + z, 0, qmax) - z) * s
                np.testing.assert_allclose(got[b, p, a:e][ok], want[ok], rtol=1e-5, atol=1e-5)
    tokens = torch.ones(2, 3, 1, dtype=torch.bool)
    tokens[1, 1] = False
    np.testing.assert_allclose(Q.dynamic_fake_quantize(x, fmt, G.PerGroup(4), HIDDEN, tokens).numpy()[0],
                               Q.dynamic_fake_quantize(x[:1], fmt, G.PerGroup(4), HIDDEN).numpy()[0])
