"""No statistic or quantizer leans on torch's default device. Each runs here with the default device set to "meta" (a
device that computes nothing, where most mixes with a real device raise) on inputs on the CPU, and must give the
numbers it gives with the CPU default. (Statistics moved or merged onto meta: tests/test_site_stats.py.)

This is the CPU's stand-in for the case a GPU run has (the model on cuda, the default device the CPU) and for a
user's `torch.set_default_device("cuda")` beside a model on the CPU: a tensor made without `device=` or a `.to(dev)`
left out computes the same numbers on a machine with one device, so only this tells them apart here (issue 50's
placement mutants)."""

from contextlib import contextmanager

import pytest
import torch

from diffquant.quant.numerics import granularity as G
from diffquant.quant.numerics.config import QuantConfig
from diffquant.quant.numerics.fake import FakeQuant, rotation
from diffquant.quant.numerics.formats import Format
from diffquant.stats import metric_sets as M
from diffquant.stats.site_stats import SiteStats
from diffquant.taps.attention import Visible, first_key_taps
from diffquant.taps.context import TapContext
from diffquant.taps.sites import POINTS, Site

INT4 = Format("int", 4)


@contextmanager
def default_device_meta():
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(before)


def test_the_stand_in_raises_on_a_mix():
    """What the tests below rely on: a tensor made without a device lands on meta, and meta beside CPU raises."""
    with default_device_meta():
        assert torch.zeros(2).device.type == "meta"
        with pytest.raises(RuntimeError):
            torch.ones(2, device="cpu") + torch.zeros(2)


def activations():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 6, 8, generator=g) * 3
    x[1, 4, 2] = -40.0  # past the LLM.int8 threshold of 6 (its channel counts)
    valid = torch.ones(2, 6, 1, dtype=torch.bool)
    valid[0, :2] = False
    return x, valid


def _site_stats(kernels, x, valid):
    s = SiteStats(("batch", "pos", "channel"), k=4, device="cpu", kernels=kernels)
    s.update(x, valid)
    s.update(x[:, :3] * 0.5, None)
    return s


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_site_statistics_on_the_inputs_device(kernels):
    x, valid = activations()  # made before: the inputs are on the CPU
    want = _site_stats(kernels, x, valid).summary()
    with default_device_meta():
        got = _site_stats(kernels, x, valid).summary()
    assert got == want


def test_sequence_norms_on_the_inputs_device():
    x, valid = activations()
    ctx = TapContext(Site("layers.0.hidden", 0, POINTS["hidden"]))
    want = M.SequenceNorms()
    want.add("hidden", x, ctx)
    want.add("hidden", x, ctx.with_valid(valid))
    with default_device_meta():
        got = M.SequenceNorms()
        got.add("hidden", x, ctx)
        got.add("hidden", x, ctx.with_valid(valid))
    assert got.summary() == want.summary()


def test_a_rotation_is_made_where_asked():
    h = rotation(8, torch.float64, "meta", "layers.0.mlp_down")
    assert h.device.type == "meta" and h.dtype == torch.float64 and h.shape == (8, 8)


def _ctx(point="hidden"):
    return TapContext(Site(f"layers.0.{point}", 0, POINTS[point]))


@pytest.mark.parametrize("calibration, fmt, gran", [
    ("minmax", Format("int", 4, False), G.PerChannel()), ("mse", Format("int", 4, False), G.PerChannel()),
    ("output", INT4, G.PerTensor()), ("percentile", INT4, G.PerTensor())])
def test_static_scales_follow_the_activation(calibration, fmt, gran):
    """A static quantizer calibrated on the CPU applies its scales on the device the activation is on (meta here),
    and calibrates the same scales with the default device elsewhere."""
    x, _ = activations()
    gram = torch.randn(8, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    gram = gram @ gram.T

    def calibrated():
        q = FakeQuant(QuantConfig(fmt, gran, dynamic=False, calibration=calibration))
        q.gram = gram
        q.start_calibration()
        q(x, _ctx())
        q.finish_calibration()
        return q

    q = calibrated()
    with default_device_meta():
        elsewhere = calibrated()
    assert torch.equal(elsewhere.scale, q.scale) and torch.equal(elsewhere.zero, q.zero)
    y = q(x.to("meta"), _ctx())
    assert y.device.type == "meta" and y.shape == x.shape
    codes, scale, zero = q.weight_grid(torch.randn(5, 8, device="meta"))  # a weight quantizer's grid likewise
    assert {codes.device.type, scale.device.type, zero.device.type} == {"meta"}


def test_a_hadamard_quantizer_rotates_on_the_activations_device():
    x, _ = activations()
    q = FakeQuant(QuantConfig(INT4, G.PerToken(), hadamard=True))
    want = q(x, _ctx("down_in"))
    with default_device_meta():
        got = q(x, _ctx("down_in"))
    assert torch.equal(got, want)


def test_visible_keys_on_the_device_asked():
    pad = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 1]])
    cases = [Visible(None, 3, 5), Visible(None, 3, 5, causal=False), Visible(pad, 3, 5, window=2),
             Visible(pad, 3, 5)]
    want = [(v.rows("cpu"), v.rows("cpu", (1, 3), 4), v.keys("cpu")) for v in cases]
    with default_device_meta():
        got = [(v.rows("cpu"), v.rows("cpu", (1, 3), 4), v.keys("cpu")) for v in cases]
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert (a is None and b is None) or torch.equal(a, b)
    four = Visible(pad[:, None, None, -3:].expand(2, 1, 3, 3).bool(), 3, 3)
    with default_device_meta():
        assert torch.equal(four.keys("cpu"), pad[:, -3:].bool()[:, None, :, None])


def test_first_key_rows_on_the_masses_device():
    class FirstKey:
        def first_key(self, mass, rows, ctx):
            self.rows = rows

    tap = FirstKey()
    with default_device_meta():
        first_key_taps({"attn_probs": [(tap, _ctx("attn_probs"))]}, torch.rand(1, 2, 3, device="cpu"), 4)
    assert tap.rows.device.type == "cpu" and tap.rows.tolist() == [True, True, True]


@pytest.mark.parametrize("mitigation", ["smoothquant:0.8", "rotate:1"])
def test_a_fix_replays_onto_a_model_on_another_device(mitigation):
    """A record made on the CPU (SmoothQuant's scales, the rotation's seed) replayed onto the same model on meta: every
    scale and matrix moved to the weights' device, every weight left there, and a forward through the online
    Hadamard before down_proj runs there."""
    import copy

    from diffquant.models.matrix import Family
    from diffquant.quant.algorithms.mitigate import SmoothQuant, apply_record, mitigate_, parse

    biased = Family("llama-bias", "LlamaConfig", "LlamaForCausalLM",  # every bias a fix folds: attention and MLP
                    dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True))
    model = biased.build()
    calibration = torch.randint(3, 512, (2, 8), generator=torch.Generator().manual_seed(1))
    fix = parse(mitigation)
    record = mitigate_(copy.deepcopy(model), fix, calibration if isinstance(fix, SmoothQuant) else None).record
    elsewhere = copy.deepcopy(model).to("meta")
    with torch.no_grad():
        applied = apply_record(elsewhere, record)
        assert {p.device.type for p in elsewhere.parameters()} == {"meta"}
        logits = elsewhere(calibration.to("meta")).logits
    assert logits.device.type == "meta" and logits.shape == (2, 8, model.config.vocab_size)
    applied.remove()


def test_the_online_hadamard_follows_its_input():
    """down_proj's online rotation applies H (float64) in x's dtype, and runs on meta. (Whether H follows x to its
    device is not seen here: a matmul of meta by CPU tensors does not check their devices.)"""
    from diffquant.quant.algorithms.mitigate import _online
    from diffquant.quant.numerics.hadamard import orthogonal

    H, _ = orthogonal(8, 3)
    hook = _online(H)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    (y, extra) = hook(None, (x, "kept"))
    assert extra == "kept" and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), (x.double() @ H.double()).float(), atol=0.05, rtol=0.02)
    (y,) = hook(None, (x.float().to("meta"),))
    assert y.device.type == "meta" and y.dtype == torch.float32


def test_a_padding_mask_moves_to_the_rows_device():
    """flash-attention's [batch, key] padding mask joins the rows on the device asked for (meta here), and the
    differential map's rows are made on its probabilities' device."""
    from diffquant.taps.attention import _differential_map

    pad = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert Visible(pad, 2, 4).rows("meta").device.type == "meta"
    assert Visible(pad, 2, 4, window=2).rows("meta", (1, 2), 3).device.type == "meta"

    seen = []
    probs = torch.rand(1, 2, 2, 4, generator=torch.Generator().manual_seed(9))
    with default_device_meta():
        _differential_map({"attn_map": [(lambda x, c: seen.append(c.valid), _ctx("attn_map"))]}, probs,
                          torch.tensor(0.3, device="cpu"), Visible(None, 2, 4), (0, 2))
    assert seen[0].device.type == "cpu"
