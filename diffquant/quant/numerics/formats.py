"""Number formats: what values a quantized number can take.

Integer formats are described by their bit-width and symmetry; float formats by a table of
representable magnitudes (scaled so the largest is the format's max). The arithmetic lives in
`quant/numerics/math.py`; nothing else rounds or computes scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from diffquant.errors import DiffquantError

if TYPE_CHECKING:
    import torch

# NF4 (QLoRA, Dettmers et al. 2023): quantiles of N(0, 1) normalised to [-1, 1]
NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
FP4_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class Format:
    """`int` (with bits, symmetric) or one of the float formats."""

    name: str = "int"
    bits: int = 8
    symmetric: bool = True
    minmax: bool = False  # asymmetric int: the exact [min, max] range and a float offset (KIVI's and quanto's
    # KV-cache quantizers), rather than a range widened to contain 0 with an integer zero point
    full: bool = False  # symmetric int on the full signed range, −2^(b−1)..2^(b−1)−1, scale absmax / ((2^b − 1)/2):
    # compressed-tensors' grid (what transformers' loader computes: int8 −128..127 at absmax/127.5), where the
    # default grid is ±(2^(b−1) − 1) at absmax/qmax (vLLM's int8 kernels, absmax/127)

    def __post_init__(self) -> None:
        if self.minmax and (self.name != "int" or self.symmetric):
            raise ValueError("min-max (float offset) quantization is an asymmetric integer format")
        if self.full and (self.name != "int" or not self.symmetric):
            raise ValueError("the full-range grid is a symmetric integer format")
        if self.name not in FORMATS:
            raise ValueError(f"unknown format {self.name!r}; choose one of: {', '.join(FORMATS)}")
        if self.name == "int":
            if isinstance(self.bits, bool) or not isinstance(self.bits, int):
                raise ValueError(f"bits must be an integer from 2 to 16, got {self.bits!r}")
            if not 2 <= self.bits <= 16:
                raise ValueError(f"integer formats have 2 to 16 bits, got {self.bits}")
        else:
            object.__setattr__(self, "bits", FORMATS[self.name])
            if not self.symmetric:
                raise ValueError(f"{self.name} is a symmetric format")

    @property
    def is_int(self) -> bool:
        return self.name == "int"

    @property
    def qmax(self) -> float:
        """Largest representable magnitude of the unscaled format."""
        if self.is_int:
            return float(2 ** (self.bits - 1) - 1) if self.symmetric else float(2**self.bits - 1)
        return float(grid(self.name).abs().max())

    @property
    def qmin(self) -> float:
        """Smallest integer code: -qmax for symmetric formats (−2^(b−1) on the full range), 0 for asymmetric ones."""
        if self.full:
            return -float(2 ** (self.bits - 1))
        return -self.qmax if self.symmetric else 0.0

    @property
    def half_span(self) -> float:
        """What a symmetric scale divides max |x| by: qmax, or (2^b − 1)/2 on the full range (absmax lands half a
        step past the largest code: +absmax rounds to qmax, −absmax to qmin)."""
        return (2**self.bits - 1) / 2 if self.full else self.qmax

    def label(self) -> str:
        if not self.is_int:
            return self.name
        return f"int{self.bits}" + ("-full" if self.full else "" if self.symmetric else "-minmax" if self.minmax
                                    else "-asym")


FORMATS = {"int": None, "fp8_e4m3": 8, "fp8_e5m2": 8, "fp4_e2m1": 4, "nf4": 4}


@lru_cache(maxsize=None)
def grid(name: str) -> "torch.Tensor":
    """Sorted representable values of a float format (float32, CPU)."""
    import torch

    if name == "nf4":
        values = torch.tensor(NF4_VALUES)
    elif name == "fp4_e2m1":
        m = torch.tensor(FP4_E2M1_MAGNITUDES)
        values = torch.cat([-m.flip(0)[:-1], m])
    elif name in ("fp8_e4m3", "fp8_e5m2"):
        dtype = torch.float8_e4m3fn if name == "fp8_e4m3" else torch.float8_e5m2
        values = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        values = values[torch.isfinite(values)].unique()
    else:
        raise DiffquantError(f"{name} has no value grid")
    return values.sort().values


def parse_format(text: str) -> Format:
    """`int8`, `int8-full` (the full signed range, compressed-tensors' grid), `int4-asym`, `uint4`, `int4-minmax`
    (float offset, exact range), `fp8_e4m3`, `fp8` (= e4m3), `fp4`, `nf4`."""
    t = text.strip().lower()
    aliases = {"fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2", "fp4": "fp4_e2m1"}
    t = aliases.get(t, t)
    if t in FORMATS and t != "int":
        return Format(t)
    minmax, full = t.endswith("-minmax"), t.endswith("-full")
    symmetric = not (t.endswith("-asym") or minmax or t.startswith("uint"))
    digits = t.removesuffix("-asym").removesuffix("-minmax").removesuffix("-full").removeprefix("uint").removeprefix("int")
    if not digits.isdigit():
        raise DiffquantError(f"unknown format {text!r}: use int2..int16, int8-full, int4-asym, int4-minmax, fp8_e4m3, "
                             "fp8_e5m2, fp4_e2m1 or nf4")
    try:
        return Format("int", int(digits), symmetric, minmax, full)
    except ValueError as e:
        raise DiffquantError(str(e)) from None
