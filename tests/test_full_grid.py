"""The full-range symmetric integer grid (compressed-tensors' and transformers' int8: −128..127 at absmax/127.5), beside
the default ±127 at absmax/127 (vLLM's kernels): codes, scales and the round trip against a hand computation, and its
spelling round-trips."""

import pytest
import torch

from diffquant.quant.numerics import granularity as G
from diffquant.quant.numerics import math as Q
from diffquant.quant.numerics.config import QuantConfig
from diffquant.quant.numerics.formats import Format, parse_format


@pytest.mark.parametrize("bits", [8, 4])
def test_full_range_codes_and_scale_by_hand(bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(6, 40, generator=g) * 3
    x[0, 0], x[1, 1] = x.abs().max() * 1.5, -x.abs().max() * 1.5  # both signs reach the range's ends
    fmt = parse_format(f"int{bits}-full")
    assert fmt == Format("int", bits, True, False, True) and fmt.label() == f"int{bits}-full"
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    y = Q.dynamic_fake_quantize(x, fmt, G.PerToken(), ("pos", "channel"))
    absmax = x.abs().amax(dim=-1, keepdim=True)
    scale = absmax / ((2**bits - 1) / 2)  # compressed-tensors: max(|min|, |max|) / ((q_max − q_min) / 2)
    codes = torch.clamp(torch.round(x / scale), lo, hi)
    assert torch.equal(y, codes * scale)
    assert codes.min() == lo and codes.max() == hi  # −absmax rounds to the lowest code, +absmax to the highest
    default = Q.dynamic_fake_quantize(x, parse_format(f"int{bits}"), G.PerToken(), ("pos", "channel"))
    q = 2 ** (bits - 1) - 1
    assert torch.equal(default, torch.clamp(torch.round(x / (absmax / q)), -q, q) * (absmax / q))
    assert not torch.equal(default, y)


def test_full_range_round_trips_as_data_and_is_refused_where_it_means_nothing():
    config = QuantConfig(parse_format("int8-full"), G.PerTensor(), dynamic=False)
    assert QuantConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="symmetric integer"):
        Format("int", 8, False, False, True)
    with pytest.raises(ValueError, match="symmetric integer"):
        Format("fp8_e4m3", full=True)
