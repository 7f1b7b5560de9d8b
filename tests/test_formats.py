"""Number formats against the definitions written out here: every integer variant's codes and scale divisor at
every width, the float formats' value grids enumerated from their bit layouts, the names the CLI accepts, and the
formats that do not exist (issue 50: quant/numerics/formats.py in the mutation check)."""

import pytest
import torch

from diffquant.errors import DiffquantError
from diffquant.quant.numerics.formats import Format, grid, parse_format


@pytest.mark.parametrize("bits", range(2, 17))
def test_integer_variants_at_every_width(bits):
    """(label, lowest code, highest code, what a symmetric scale divides max|x| by) of each spelling."""
    top = 2 ** (bits - 1) - 1
    want = {f"int{bits}": (f"int{bits}", -top, top, top),
            f"int{bits}-full": (f"int{bits}-full", -(top + 1), top, (2 ** bits - 1) / 2),
            f"int{bits}-asym": (f"int{bits}-asym", 0, 2 ** bits - 1, 2 ** bits - 1),
            f"uint{bits}": (f"int{bits}-asym", 0, 2 ** bits - 1, 2 ** bits - 1),
            f"INT{bits}-MinMax": (f"int{bits}-minmax", 0, 2 ** bits - 1, 2 ** bits - 1)}
    for text, (label, qmin, qmax, half) in want.items():
        f = parse_format(text)
        assert (f.label(), f.qmin, f.qmax, f.half_span, f.bits, f.is_int) == (label, qmin, qmax, half, bits, True), text
    assert parse_format(f"int{bits}-minmax").minmax and not parse_format(f"int{bits}-asym").minmax
    assert parse_format(f"int{bits}-full").full and parse_format(f"int{bits}").symmetric


def _minifloat(exp_bits: int, man_bits: int, bias: int, nan_top_mantissa_only: bool) -> set[float]:
    """Every finite value of a sign/exponent/mantissa float, from the layout: subnormals at exponent 0, the top
    exponent all NaN/inf (e5m2, IEEE-like) or only its all-ones mantissa NaN (e4m3fn)."""
    values = set()
    for e in range(2 ** exp_bits):
        for m in range(2 ** man_bits):
            if e == 2 ** exp_bits - 1 and (not nan_top_mantissa_only or m == 2 ** man_bits - 1):
                continue
            v = (m / 2 ** man_bits) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2 ** man_bits) * 2.0 ** (e - bias)
            values |= {v, -v}
    return values


def test_float_grids_are_every_finite_value_of_their_layout():
    e4m3, e5m2 = _minifloat(4, 3, 7, True), _minifloat(5, 2, 15, False)
    assert len(e4m3) == 253 and len(e5m2) == 247 and max(e4m3) == 448.0 and max(e5m2) == 57344.0
    fp4 = _minifloat(2, 1, 1, False) | {4.0, 6.0, -4.0, -6.0}  # e2m1 has no inf/NaN: its top exponent is values
    assert sorted(fp4) == [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6]
    for name, want in (("fp8_e4m3", e4m3), ("fp8_e5m2", e5m2), ("fp4_e2m1", fp4)):
        g = grid(name)
        assert g.dtype == torch.float32 and g.tolist() == sorted(want), name
    nf4 = grid("nf4").tolist()
    assert len(nf4) == 16 and nf4 == sorted(nf4) and (nf4[0], nf4[7], nf4[-1]) == (-1.0, 0.0, 1.0)


@pytest.mark.parametrize("text, name, bits, qmax", [("fp8", "fp8_e4m3", 8, 448.0), ("E4M3", "fp8_e4m3", 8, 448.0),
                                                     (" e5m2 ", "fp8_e5m2", 8, 57344.0), ("fp4", "fp4_e2m1", 4, 6.0),
                                                     ("fp4_e2m1", "fp4_e2m1", 4, 6.0), ("NF4", "nf4", 4, 1.0)])
def test_float_formats_by_every_name(text, name, bits, qmax):
    f = parse_format(text)
    assert (f.name, f.bits, f.qmax, f.qmin, f.half_span, f.label(), f.is_int) == (name, bits, qmax, -qmax, qmax, name,
                                                                                 False)
    assert Format(name, bits=3).bits == bits  # a float format's width is its own


@pytest.mark.parametrize("make, message", [
    (lambda: Format("int", 1), "integer formats have 2 to 16 bits, got 1"),
    (lambda: Format("int", 17), "integer formats have 2 to 16 bits, got 17"),
    (lambda: Format("int", True), "bits must be an integer from 2 to 16, got True"),
    (lambda: Format("int", 8.0), "bits must be an integer from 2 to 16, got 8.0"),
    (lambda: Format("nf4", symmetric=False), "nf4 is a symmetric format"),
    (lambda: Format("int", 8, True, True), "min-max (float offset) quantization is an asymmetric integer format"),
    (lambda: Format("fp8_e4m3", 8, False, True), "min-max (float offset) quantization is an asymmetric integer"),
    (lambda: Format("int", 8, False, False, True), "the full-range grid is a symmetric integer format"),
    (lambda: Format("fp4_e2m1", full=True), "the full-range grid is a symmetric integer format"),
    (lambda: Format("int8"), "unknown format 'int8'; choose one of: int, fp8_e4m3, fp8_e5m2, fp4_e2m1, nf4"),
])
def test_formats_that_do_not_exist(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value) == message or str(err.value).startswith(message)


@pytest.mark.parametrize("text", ["int", "intx", "int-asym", "fp16", "four", ""])
def test_names_that_are_not_formats(text):
    with pytest.raises(DiffquantError, match=f"unknown format {text!r}: use int2..int16, int8-full, int4-asym"):
        parse_format(text)


def test_widths_out_of_range_and_grids_of_integers_say_so():
    with pytest.raises(DiffquantError, match="^integer formats have 2 to 16 bits, got 1$"):
        parse_format("int1")
    with pytest.raises(DiffquantError, match="^integer formats have 2 to 16 bits, got 32$"):
        parse_format("uint32")
    with pytest.raises(DiffquantError, match="^int has no value grid$"):
        grid("int")
