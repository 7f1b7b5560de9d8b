"""quant/numerics/fake.py's FakeQuant piece by piece, against grids and searches written out here: the flash kernel's
scale function, the export's weight grid, a dynamic range over query blocks, static calibration (min-max, EMA with
momentum ≠ 0.5, the clipping search on the tensor and on its readers' outputs, percentile), kept windows, fixed and
saved scales (issue 50's mutants of the module)."""

import pytest
import torch

from diffquant import DiffquantError
from diffquant.quant.numerics import granularity as G
from diffquant.quant.numerics.config import QuantConfig
from diffquant.quant.numerics.fake import MSE_ALPHAS, FakeQuant
from diffquant.quant.numerics.formats import Format
from diffquant.taps.context import TapContext
from diffquant.taps.sites import POINTS, Site

INT8, INT4 = Format("int", 8), Format("int", 4)


def _ctx(point="hidden", valid=None):
    return TapContext(Site(f"layers.0.{point}", 0, POINTS[point]), valid=valid)


def _round_sym(x, amax, qmax):
    """Symmetric absmax round trip written out: scale = amax / qmax (1 where amax is 0), round half to even."""
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return torch.clamp(torch.round(x / scale), -qmax, qmax) * scale


@pytest.mark.parametrize("gran, dims", [(G.PerTensor(), (1, 2)), (G.PerHead(), (2,)), (G.PerToken(), ())])
def test_kernel_scales_are_the_row_maxima_over_what_one_scale_covers(gran, dims):
    """absmax [batch, head, q] → each row's scale: the max over the rows sharing its scale (a sequence, a sequence's
    head, the row itself) / 127, expanded back to [batch, head, q]; a row of zeros gets scale 1."""
    absmax = torch.rand(2, 3, 5, generator=torch.Generator().manual_seed(0)) * 10
    absmax[1, 2, 4] = 40.0
    absmax[0] = 0.0
    scales = FakeQuant(QuantConfig(INT8, gran)).kernel_scales()
    got = scales(absmax)
    hi = absmax.amax(dim=dims, keepdim=True) if dims else absmax
    want = torch.where(hi > 0, hi / 127, torch.ones_like(hi)).expand(2, 3, 5)
    assert got.shape == (2, 3, 5) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("config", [
    QuantConfig(INT8, G.PerTensor(), dynamic=False), QuantConfig(Format("int", 8, False), G.PerTensor()),
    QuantConfig(Format("int", 4, False, minmax=True), G.PerToken()), QuantConfig(Format("fp8_e4m3"), G.PerTensor()),
    QuantConfig(INT8, G.PerToken(), hadamard=True), QuantConfig(INT8, G.PerToken(), keep_first=1),
    QuantConfig(INT8, G.PerToken(), keep_last=2), QuantConfig(INT8, G.PerChannel()), QuantConfig(INT8, G.PerGroup(4))],
    ids=["static", "asymmetric", "minmax", "fp8", "hadamard", "keep-first", "keep-last", "channel", "group"])
def test_kernel_scales_refuse_what_the_flash_kernel_cannot_apply(config):
    assert FakeQuant(config).kernel_scales() is None


def test_kernel_scales_not_while_calibrating():
    q = FakeQuant(QuantConfig(INT8, G.PerTensor()))
    assert q.kernel_scales() is not None
    q.calibrating = True
    assert q.kernel_scales() is None


@pytest.mark.parametrize("config", [QuantConfig(INT4, G.PerChannel(0)), QuantConfig(INT4, G.PerGroup(3)),
                                    QuantConfig(Format("int", 4, False), G.PerGroup(3))], ids=["channel", "group", "asym"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_grid_codes_dequantize_to_the_simulated_weight(config, dtype):
    """Codes [out, in] (a ragged last group of 2 cut off), scales as grouped: the codes are the integers of w / scale
    (+ zero) written out here, and dequantized they are the weight the forward quantizes (same bits)."""
    w = (torch.randn(4, 8, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    q = FakeQuant(config)
    codes, scale, zero = q.weight_grid(w)
    assert codes.shape == (4, 8) and codes.dtype == torch.float32
    group = config.granularity.size if isinstance(config.granularity, G.PerGroup) else 8
    wf = w.float()
    s = scale.reshape(4, -1).repeat_interleave(group, dim=1)[:, :8]
    z = zero.reshape(4, -1).repeat_interleave(group, dim=1)[:, :8]
    for g0 in range(0, 8, group):  # the scales: absmax (symmetric) or min/max with 0 (asymmetric) of each group
        blk = wf[:, g0:g0 + group]
        if config.format.symmetric:
            want = blk.abs().amax(dim=1) / 7
        else:
            want = (blk.amax(dim=1).clamp_min(0) - blk.amin(dim=1).clamp_max(0)) / 15
        torch.testing.assert_close(s[:, g0], want, rtol=1e-6, atol=0)
    if config.format.symmetric:
        want_codes = torch.clamp(torch.round(wf / s), -7, 7)
    else:
        want_codes = torch.clamp(torch.round(wf / s) + z, 0, 15)
    assert torch.equal(codes, want_codes)
    from diffquant.quant.numerics import math as Q
    from diffquant.taps.sites import WEIGHT_DIMS

    simulated = Q.dynamic_fake_quantize(w, config.format, config.granularity, WEIGHT_DIMS)
    deq = Q.dequantize(Q.grouped(codes, config.granularity, WEIGHT_DIMS)[0], scale, zero, config.format)
    deq = deq.flatten(-2)[..., :8] if config.granularity.group_size else deq
    assert torch.equal(deq.to(dtype), simulated)


def test_weight_grid_of_a_static_quantizer_uses_its_scales():
    w = torch.tensor([[1.0, -2.0, 3.0, 0.5], [0.25, 0.5, -1.0, 4.0]])
    q = FakeQuant(QuantConfig(INT4, G.PerChannel(0), dynamic=False))
    with pytest.raises(DiffquantError, match="static weight quantizer used before calibration; run calibrate"):
        q.weight_grid(w)
    q.fix(torch.tensor([[0.5], [1.0]]), torch.zeros(2, 1))
    codes, scale, zero = q.weight_grid(w)
    assert torch.equal(codes, torch.tensor([[2.0, -4.0, 6.0, 1.0], [0.0, 0.0, -1.0, 4.0]]))  # 0.25 and 0.5: ties to 0
    assert torch.equal(scale, torch.tensor([[0.5], [1.0]])) and torch.equal(zero, torch.zeros(2, 1))


def test_fixed_scales_outlast_calibration_and_need_a_static_quantizer():
    q = FakeQuant(QuantConfig(INT8, G.PerTensor(), dynamic=False))
    q.fix(torch.tensor(0.5), torch.tensor(0.0))
    q.start_calibration()
    assert not q.calibrating and q.fixed
    q.finish_calibration()
    assert float(q.scale) == 0.5
    x = torch.tensor([[[0.26, -1.0, 100.0]]])
    assert torch.equal(q(x, _ctx()), torch.tensor([[[0.5, -1.0, 63.5]]]))  # codes 1 (0.52 → 1), −2, 127
    with pytest.raises(DiffquantError, match="fixed scales need a static quantizer"):
        FakeQuant(QuantConfig(INT8, G.PerTensor())).fix(torch.tensor(1.0), torch.tensor(0.0))


def test_state_round_trip_and_an_empty_state():
    q = FakeQuant(QuantConfig(INT8, G.PerChannel(), dynamic=False))
    assert q.state() == {}
    q.load_state({})
    assert q.scale is None and q.zero is None
    q.fix(torch.tensor([[[0.5, 0.25, 2.0]]]), torch.tensor([[[0.0, 1.0, 3.0]]]))
    state = q.state()
    assert state == {"scale": [[[0.5, 0.25, 2.0]]], "zero": [[[0.0, 1.0, 3.0]]], "shape": [1, 1, 3]}
    other = FakeQuant(QuantConfig(INT8, G.PerChannel(), dynamic=False))
    other.load_state(state)
    assert torch.equal(other.scale, q.scale) and torch.equal(other.zero, q.zero)


def test_a_dynamic_range_over_query_blocks():
    """Logits of one call in two query blocks: the per-tensor range is read from both blocks first, and each block
    is quantized with the scale of the whole call (not its own); after the call the range is forgotten."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 6, 6, generator=g)
    logits[1, 0, 4, 1] = 9.0  # the second sequence's largest, in the second block
    q = FakeQuant(QuantConfig(INT8, G.PerTensor()))
    ctx = _ctx("attn_logits")
    assert q.needs_range(ctx)
    q.start_range()
    for block in (logits[:, :, :3], logits[:, :, 3:]):
        q.observe_range(block, ctx)
    blocks = [q(block, ctx) for block in (logits[:, :, :3], logits[:, :, 3:])]
    q.end_range()
    amax = logits.abs().amax(dim=(1, 2, 3), keepdim=True)  # per sequence: dynamic scales never span sequences
    torch.testing.assert_close(torch.cat(blocks, dim=2), _round_sym(logits, amax, 127), rtol=0, atol=0)
    assert q._range is None
    torch.testing.assert_close(q(logits[:, :, :3], ctx), _round_sym(logits[:, :, :3],
                                                                   logits[:, :, :3].abs().amax(dim=(1, 2, 3),
                                                                                               keepdim=True), 127))


def test_a_range_leaves_out_masked_logits_and_asymmetric_ranges_keep_both_ends():
    logits = torch.tensor([[[[1.0, -2.0], [3.0, 50.0]]]])  # 50 masked
    valid = torch.tensor([[[[True, True], [True, False]]]])
    q = FakeQuant(QuantConfig(Format("int", 8, False), G.PerTensor()))
    q.start_range()
    q.observe_range(logits[:, :, :1], _ctx("attn_logits", valid[:, :, :1]))
    q.observe_range(logits[:, :, 1:], _ctx("attn_logits", valid[:, :, 1:]))
    lo, hi = q._range
    assert float(lo) == -2.0 and float(hi) == 3.0


@pytest.mark.parametrize("config, point, needs", [
    (QuantConfig(INT8, G.PerTensor()), "attn_logits", True), (QuantConfig(INT8, G.PerHead()), "attn_logits", True),
    (QuantConfig(INT8, G.PerToken()), "attn_logits", False), (QuantConfig(INT8, G.PerTensor()), "hidden", False),
    (QuantConfig(INT8, G.PerTensor(), dynamic=False), "attn_logits", False)])
def test_needs_range_only_where_a_dynamic_scale_spans_query_positions(config, point, needs):
    assert FakeQuant(config).needs_range(_ctx(point)) is needs


def test_needs_no_range_while_calibrating():
    q = FakeQuant(QuantConfig(INT8, G.PerTensor()))
    q.calibrating = True
    assert q.needs_range(_ctx("attn_logits")) is False


def _calibrated(config, batches, valid=None, gram=None):
    q = FakeQuant(config)
    if gram is not None:
        q.gram = gram
    q.start_calibration()
    assert q.calibrating
    for b in batches:
        assert q(b, _ctx(valid=valid)) is None
    q.finish_calibration()
    assert not q.calibrating
    return q


def _clip_search(batches, lo, hi, fmt, valid=None, gram=None):
    """The clipping ratio of least squared error summed over the batches, from MSE_ALPHAS, written out."""
    qmax = 2 ** (fmt.bits - 1) - 1
    best = None
    for alpha in MSE_ALPHAS.tolist():
        amax = torch.tensor(max(abs(lo), abs(hi)) * alpha)
        err = 0.0
        for b in batches:
            e = _round_sym(b, amax, qmax) - b
            if valid is not None:
                e = torch.where(valid, e, 0.0)
            err += float(((e @ gram) * e).sum() if gram is not None else (e * e).sum())
        if best is None or err < best[0]:
            best = (err, alpha)
    return best[1]


def test_mse_calibration_sums_its_errors_over_batches_and_leaves_masked_values_out():
    """Heavy-tailed batches: the clipping ratio of least error over both batches (the second alone would choose
    another), the masked position (a large value) in neither the range nor the error."""
    g = torch.Generator().manual_seed(5)
    b1 = torch.randn(2, 16, 8, generator=g) * 0.5
    b1[1, 3, :3] = torch.tensor([9.0, -7.0, 6.0])  # a heavy tail (seeded: the suite's order must not change it)
    b2 = torch.randn(2, 16, 8, generator=g)
    b1[0, 0, 0] = b2[0, 0, 0] = 500.0  # masked
    valid = torch.ones(2, 16, 1, dtype=torch.bool)
    valid[0, 0] = False
    q = _calibrated(QuantConfig(INT4, G.PerTensor(), dynamic=False, calibration="mse"), [b1, b2], valid)
    seen = torch.cat([b1[valid.expand_as(b1)], b2[valid.expand_as(b2)]])
    lo, hi = float(seen.min()), float(seen.max())
    alpha = _clip_search([b1, b2], lo, hi, INT4, valid.expand_as(b1))
    assert alpha != _clip_search([b2], lo, hi, INT4, valid.expand_as(b1))
    assert float(q.scale) == pytest.approx(max(-lo, hi) * alpha / 7, rel=1e-6)


def test_output_calibration_weighs_errors_by_the_readers_gram():
    g = torch.Generator().manual_seed(6)
    b = torch.randn(2, 16, 8, generator=g)
    b[..., 0] *= 6
    w = torch.randn(5, 8, generator=g)
    w[:, 0] = 0.0  # the readers ignore the outlier channel: clipping it costs them nothing
    gram = w.T @ w
    q = _calibrated(QuantConfig(INT4, G.PerTensor(), dynamic=False, calibration="output"), [b], gram=gram)
    lo, hi = float(b.min()), float(b.max())
    alpha = _clip_search([b], lo, hi, INT4, gram=gram)
    assert alpha != _clip_search([b], lo, hi, INT4)
    assert float(q.scale) == pytest.approx(max(-lo, hi) * alpha / 7, rel=1e-6)
    with pytest.raises(DiffquantError, match="output-error calibration needs the readers' weights"):
        _calibrated(QuantConfig(INT4, G.PerTensor(), dynamic=False, calibration="output"), [b])


def test_static_calibration_edges():
    with pytest.raises(DiffquantError, match="calibration saw no data for a static quantizer"):
        _calibrated(QuantConfig(INT8, G.PerTensor(), dynamic=False), [])
    with pytest.raises(DiffquantError, match="calibration saw no data"):
        _calibrated(QuantConfig(INT8, G.PerTensor(), dynamic=False, calibration="percentile"), [])
    with pytest.raises(DiffquantError, match="calibration batches differ in shape"):
        _calibrated(QuantConfig(INT8, G.PerGroup(4), dynamic=False), [torch.ones(1, 2, 8), torch.ones(1, 3, 8)])
    q = FakeQuant(QuantConfig(INT8, G.PerTensor(), dynamic=False))
    with pytest.raises(DiffquantError, match="layers.0.hidden: static quantizer used before calibration"):
        q(torch.ones(1, 2, 3), _ctx())
    dynamic = FakeQuant(QuantConfig(INT8, G.PerTensor()))
    dynamic.start_calibration()
    assert not dynamic.calibrating  # a dynamic quantizer has nothing to calibrate
    ema = _calibrated(QuantConfig(INT8, G.PerTensor(), dynamic=False, calibration="ema", ema_momentum=0.7),
                      [torch.full((1, 2, 2), 1.0), torch.full((1, 2, 2), 3.0)])
    assert float(ema.scale) == pytest.approx((0.7 * 1.0 + 0.3 * 3.0) / 127, rel=1e-6)
    again = _calibrated(QuantConfig(INT8, G.PerTensor(), dynamic=False), [torch.full((1, 2, 2), 9.0)])
    again.start_calibration()  # a second calibration starts from nothing
    assert again.scale is None and again._lo is None
    for b in [torch.full((1, 2, 2), 2.0)]:
        again(b, _ctx())
    again.finish_calibration()
    assert float(again.scale) == pytest.approx(2.0 / 127)


def test_kept_windows_pass_through_bit_exact():
    """keep_first 2 and keep_last 1 of 6 positions: those come back as they were; the others are quantized with a
    scale from them alone; a mask is cut to the quantized span; a sequence shorter than the windows is untouched."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, 4, generator=g)
    x[:, 0] = 100.0  # a sink the scale must not see
    valid = torch.ones(2, 6, 1, dtype=torch.bool)
    valid[1, 3] = False
    q = FakeQuant(QuantConfig(INT8, G.PerToken(), keep_first=2, keep_last=1))
    y = q(x, _ctx(valid=valid))
    assert torch.equal(y[:, :2], x[:, :2]) and torch.equal(y[:, 5:], x[:, 5:]) and torch.equal(y[1, 3], x[1, 3])
    mid = x[:, 2:5]
    want = _round_sym(mid, mid.abs().amax(dim=-1, keepdim=True), 127)
    assert torch.equal(y[0, 2:5], want[0]) and torch.equal(y[1, [2, 4]], want[1, [0, 2]])
    assert q(x[:, :3], _ctx()) is None  # 3 positions: all kept
    tensor = FakeQuant(QuantConfig(INT8, G.PerTensor(), keep_first=1))
    y = tensor(x, _ctx())
    torch.testing.assert_close(y[:, 1:], _round_sym(x[:, 1:], x[:, 1:].abs().amax(dim=(1, 2), keepdim=True), 127),
                               rtol=0, atol=0)


def _round_asym(x, lo, hi, qmax):
    """Asymmetric round trip written out: the range widened to hold 0, zero point round(−lo / scale)."""
    lo, hi = torch.clamp(lo, max=0.0), torch.clamp(hi, min=0.0)
    scale = torch.where(hi > lo, (hi - lo) / qmax, torch.ones_like(hi))
    zero = torch.clamp(torch.round(-lo / scale), 0, qmax)
    return (torch.clamp(torch.round(x / scale) + zero, 0, qmax) - zero) * scale


def test_static_asymmetric_and_grouped_quantizers_apply_their_own_grid():
    """Calibrated on positive values only (the range still holds 0, the zero point is not 0), per group of 4 channels:
    the forward is the grid written out here, each group with its own scale and zero point."""
    g = torch.Generator().manual_seed(8)
    batch = torch.rand(2, 5, 8, generator=g) * torch.tensor([1.0, 2, 3, 4, 5, 6, 7, 8]) + 0.5
    asym = _calibrated(QuantConfig(Format("int", 8, False), G.PerTensor(), dynamic=False), [batch])
    assert float(asym.zero) == 0.0  # lo clamped to 0: all values positive
    x = batch - 1.0
    torch.testing.assert_close(asym(x, _ctx()), _round_asym(x, torch.tensor(0.0), batch.max(), 255), rtol=0, atol=0)
    shifted = _calibrated(QuantConfig(Format("int", 8, False), G.PerGroup(4), dynamic=False), [batch - 3.0])
    y = shifted(batch - 3.0, _ctx())
    groups = (batch - 3.0).reshape(2, 5, 2, 4)
    lo = groups.amin(dim=3, keepdim=True)  # a static group scale covers one run of 4 values (of this batch shape)
    hi = groups.amax(dim=3, keepdim=True)
    assert (shifted.zero != 0).any()
    torch.testing.assert_close(y, _round_asym(groups, lo, hi, 255).reshape(2, 5, 8), rtol=0, atol=0)


def test_an_asymmetric_range_over_query_blocks_keeps_its_zero_point():
    logits = torch.rand(1, 2, 4, 4, generator=torch.Generator().manual_seed(9)) * 6 - 1  # mostly positive
    q = FakeQuant(QuantConfig(Format("int", 8, False), G.PerTensor()))
    ctx = _ctx("attn_logits")
    q.start_range()
    q.observe_range(logits[:, :, :2], ctx)
    q.observe_range(logits[:, :, 2:], ctx)
    got = torch.cat([q(logits[:, :, :2], ctx), q(logits[:, :, 2:], ctx)], dim=2)
    q.end_range()
    torch.testing.assert_close(got, _round_asym(logits, logits.min(), logits.max(), 255), rtol=0, atol=0)


def test_mse_calibration_per_channel_picks_a_ratio_for_each_channel():
    """Per-channel static scales: each channel's clipping ratio from its own error (a heavy-tailed channel is clipped,
    a uniform one is not)."""
    g = torch.Generator().manual_seed(10)
    heavy = torch.randn(4, 64, 1, generator=g)
    heavy[0, 0, 0] = 9.0  # one far value (seeded: the suite's order must not change the data)
    flat = torch.rand(4, 64, 1, generator=g) * 2 - 1
    flat[0, 0, 0] = 1.0
    x = torch.cat([heavy, flat], dim=-1)
    q = _calibrated(QuantConfig(INT4, G.PerChannel(), dynamic=False, calibration="mse"), [x])
    alphas = []
    for c in range(2):
        col = x[..., c:c + 1]
        amax = float(col.abs().max())
        alphas.append(_clip_search([col], -amax, amax, INT4))
        assert float(q.scale.flatten()[c]) == pytest.approx(amax * alphas[-1] / 7, rel=1e-6), c
    assert alphas[0] < 0.9 < alphas[1]  # the channel with a far value is clipped, the uniform one is not


def test_percentile_calibration_leaves_masked_values_out_and_an_all_masked_site_keeps_scale_one():
    x = torch.arange(1, 101, dtype=torch.float32).reshape(1, 100, 1)
    valid = torch.ones(1, 100, 1, dtype=torch.bool)
    valid[0, 90:] = False  # 91..100 never seen
    q = _calibrated(QuantConfig(INT8, G.PerTensor(), dynamic=False, calibration="percentile", percentile=100.0),
                    [x], valid)
    assert float(q.scale) * 127 == pytest.approx(90.0, rel=0.01)
    none = _calibrated(QuantConfig(INT8, G.PerTensor(), dynamic=False, calibration="percentile"), [x],
                       torch.zeros(1, 100, 1, dtype=torch.bool))
    assert float(none.scale) == 1.0 and float(none.zero) == 0.0


def test_output_calibration_without_the_readers_weights_is_one_clear_error():
    q = FakeQuant(QuantConfig(INT4, G.PerTensor(), dynamic=False, calibration="output"))
    q.start_calibration()
    with pytest.raises(DiffquantError, match="output-error calibration needs the readers' weights"):
        q(torch.randn(1, 4, 8), _ctx())


def test_min_max_ranges_leave_zero_out_static_and_over_query_blocks():
    """A min-max format's range is the valid values' own [min, max] (its zero is the float offset min), not widened to
    contain 0: static calibration over two batches, and a dynamic per-tensor range read over two query blocks."""
    minmax = Format("int", 4, False, minmax=True)
    b1, b2 = torch.full((1, 2, 4), 3.0), torch.full((1, 2, 4), 3.0)
    b1[0, 0, 1], b2[0, 1, 2] = 2.0, 5.5
    q = _calibrated(QuantConfig(minmax, G.PerTensor(), dynamic=False), [b1, b2])
    assert float(q.scale) == pytest.approx((5.5 - 2.0) / 15) and float(q.zero) == 2.0
    logits = torch.tensor([[[[4.0, 6.0], [3.0, 50.0]], [[5.0, 4.5], [7.0, 3.5]]]])  # [1, 2, 2, 2]; 50 masked
    valid = torch.tensor([[[[True, True], [True, False]]]])
    d = FakeQuant(QuantConfig(minmax, G.PerTensor()))
    d.start_range()
    d.observe_range(logits[:, :, :1], _ctx("attn_logits", valid[:, :, :1]))
    d.observe_range(logits[:, :, 1:], _ctx("attn_logits", valid[:, :, 1:]))
    lo, hi = d._range
    assert float(lo) == 3.0 and float(hi) == 7.0
    a = FakeQuant(QuantConfig(Format("int", 8, False), G.PerTensor()))  # not min-max: the range contains 0
    a.start_range()
    a.observe_range(logits[:, :, :1], _ctx("attn_logits", valid[:, :, :1]))
    a.observe_range(logits[:, :, 1:], _ctx("attn_logits", valid[:, :, 1:]))
    lo, hi = a._range
    assert float(lo) == 0.0 and float(hi) == 7.0


def test_static_per_head_logit_scales_read_the_heads_axis():
    """A static per-head scale of the logits ([batch, head, q, k]: the site's dims name the head axis): each head's
    max |logit| over both batches / 127."""
    g = torch.Generator().manual_seed(12)
    batches = [torch.randn(2, 3, 4, 4, generator=g) * torch.tensor([1.0, 5.0, 0.5])[:, None, None] for _ in range(2)]
    q = FakeQuant(QuantConfig(INT8, G.PerHead(), dynamic=False))
    q.start_calibration()
    for b in batches:
        q(b, _ctx("attn_logits"))
    q.finish_calibration()
    amax = torch.stack([b.abs().amax(dim=(0, 2, 3)) for b in batches]).amax(0)
    torch.testing.assert_close(q.scale.flatten(), amax / 127, rtol=1e-6, atol=0)
    assert q.scale.shape == (1, 3, 1, 1)


def test_a_hadamard_quantizer_names_its_site_when_no_matrix_exists():
    q = FakeQuant(QuantConfig(INT8, G.PerToken(), hadamard=True))
    with pytest.raises(DiffquantError, match="layers.0.down_in: no Hadamard matrix of order 10"):
        q(torch.ones(1, 2, 10), _ctx("down_in"))


def test_static_scales_where_the_range_reads_the_sites_dims():
    """A static per-head scale of masked probabilities (the mask grouped by the site's dims too), EMA of a symmetric
    range that is lopsided (the EMA of max |x|, not of the two ends), and a clipping search per group of 4 channels (one
    ratio per group, scales shaped as the groups)."""
    g = torch.Generator().manual_seed(14)
    probs = torch.rand(2, 3, 4, 4, generator=g) * torch.tensor([1.0, 5.0, 0.5])[:, None, None]
    valid = (torch.arange(4)[None, :] <= torch.arange(4)[:, None])[None, None]
    probs[0, 1, 0, 3] = 90.0  # masked
    q = FakeQuant(QuantConfig(INT8, G.PerHead(), dynamic=False))
    q.start_calibration()
    q(probs, _ctx("attn_probs", valid))
    q.finish_calibration()
    amax = probs.masked_fill(~valid, 0.0).amax(dim=(0, 2, 3))
    torch.testing.assert_close(q.scale.flatten(), amax / 127, rtol=1e-6, atol=0)
    b1, b2 = torch.tensor([[[1.0, -3.0]]]), torch.tensor([[[5.0, -1.0]]])
    ema = _calibrated(QuantConfig(INT8, G.PerTensor(), dynamic=False, calibration="ema", ema_momentum=0.7), [b1, b2])
    assert float(ema.scale) == pytest.approx((0.7 * 3.0 + 0.3 * 5.0) / 127, rel=1e-6)
    x = torch.randn(1, 3, 8, generator=g) * torch.tensor([1.0, 3.0, 0.2])[:, None]
    x[0, 1, 2] = 25.0
    groups = _calibrated(QuantConfig(INT4, G.PerGroup(4), dynamic=False, calibration="mse"), [x])
    assert groups.scale.shape == (1, 3, 2, 1)
    for p in range(3):
        for c in (0, 4):
            part = x[:, p:p + 1, c:c + 4]
            lo, hi = float(part.min()), float(part.max())
            alpha = _clip_search([part], lo, hi, INT4)
            assert float(groups.scale[0, p, c // 4, 0]) == pytest.approx(max(-lo, hi) * alpha / 7, rel=1e-6)


def test_clipping_search_of_tiny_values_leaves_masked_and_non_finite_errors_out():
    """Values of order 1e-10 (each ratio's squared error ~1e-21): a masked row and a NaN must add nothing to the
    errors, or they would swamp them and every ratio would tie."""
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(0)) * 1e-10
    valid = torch.tensor([1, 1, 1, 1, 0, 0], dtype=torch.bool).reshape(1, 6, 1)
    masked = _calibrated(QuantConfig(INT8, G.PerTensor(), dynamic=False, calibration="mse"), [x], valid)
    seen = x[valid.expand_as(x)]
    lo, hi = float(seen.min()), float(seen.max())
    alpha = _clip_search([x], lo, hi, INT8, valid.expand_as(x))
    assert float(masked.scale) == pytest.approx(max(-lo, hi) * alpha / 127, rel=1e-6)
    nan = x.clone()
    nan[0, 5, 0] = float("nan")
    q = _calibrated(QuantConfig(INT8, G.PerTensor(), dynamic=False, calibration="mse"), [nan])
    finite = nan.isfinite()
    lo, hi = float(nan[finite].min()), float(nan[finite].max())
    alpha = _clip_search([torch.where(finite, nan, 0.0)], lo, hi, INT8)
    assert float(q.scale) == pytest.approx(max(-lo, hi) * alpha / 127, rel=1e-6)


def test_weight_grid_of_a_bfloat16_weight_on_fixed_bfloat16_scales():
    """GPTQ fixes bfloat16 scales for a bfloat16 weight (gptq.solve): the codes are float32 integers of w / scale
    computed in float32, and dequantized they are the weight."""
    g = torch.Generator().manual_seed(15)
    scale = (torch.rand(8, 1, generator=g) * 0.2 + 0.01).to(torch.bfloat16)
    codes = torch.randint(-7, 8, (8, 64), generator=g).float()
    w = (codes * scale.float()).to(torch.bfloat16)
    q = FakeQuant(QuantConfig(INT4, G.PerChannel(0), dynamic=False))
    q.fix(scale, torch.zeros_like(scale))
    got, s, _ = q.weight_grid(w)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.clamp(torch.round(w.float() / scale.float()), -7, 7))
    assert torch.equal((got * s.float()).to(torch.bfloat16), w)
