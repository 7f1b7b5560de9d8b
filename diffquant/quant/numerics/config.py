"""QuantConfig: one quantizer as data (frozen, validated, JSON round-trip)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffquant.quant.numerics import granularity as G
from diffquant.quant.numerics.formats import Format, parse_format

CALIBRATIONS = ("minmax", "ema", "percentile", "mse", "output")


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize one site: format, granularity, and dynamic or calibrated (static) scales."""

    format: Format = field(default_factory=Format)
    granularity: G.Granularity = field(default_factory=G.PerTensor)
    dynamic: bool = True
    calibration: str = "minmax"
    percentile: float = 99.99
    ema_momentum: float = 0.9
    keep_first: int = 0  # positions kept in full precision at the start (attention sinks; sites with a pos dim)
    keep_last: int = 0  # ... and at the end (KIVI's residual window of recent tokens)
    hadamard: bool = False  # quantize x·H (H: normalised Hadamard over the last dim), give back Q(x·H)·Hᵀ

    def __post_init__(self) -> None:
        for name in ("keep_first", "keep_last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.format, Format):
            raise ValueError(f"format must be a Format, got {self.format!r}")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"unknown calibration {self.calibration!r}; choose one of: {', '.join(CALIBRATIONS)}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        if not 0 <= self.ema_momentum < 1:
            raise ValueError(f"ema_momentum must be in [0, 1), got {self.ema_momentum}")
        if not isinstance(self.hadamard, bool):
            raise ValueError(f"hadamard must be true or false, got {self.hadamard!r}")
        if not self.dynamic:
            if isinstance(self.granularity, G.PerToken):
                raise ValueError("static (calibrated) scales cannot be per token: tokens differ between batches")
            if self.granularity.position_run:
                raise ValueError("static (calibrated) scales cannot cover runs of positions (kv-channel:G)")
            if self.calibration == "percentile" and not (isinstance(self.granularity, G.PerTensor)
                                                         and self.format.symmetric):
                raise ValueError("percentile calibration supports symmetric per-tensor scales only")
            if self.calibration == "output" and not isinstance(self.granularity, G.PerTensor):
                raise ValueError("output-error calibration supports per-tensor activation scales only")

    def quantized_span(self, length: int) -> tuple[int, int]:
        """[start, end) of the positions quantized in a sequence of `length`: all but the first `keep_first`
        and the last `keep_last` (an empty span when they cover it)."""
        start = min(self.keep_first, length)
        return start, max(start, length - self.keep_last)

    def label(self) -> str:
        mode = "dyn" if self.dynamic else self.calibration
        keep = (f"/sink{self.keep_first}" if self.keep_first else "") + (f"/recent{self.keep_last}"
                                                                           if self.keep_last else "")
        basis = "/hadamard" if self.hadamard else ""
        return f"{self.format.label()}/{G.label(self.granularity)}/{mode}{keep}{basis}"

    def to_dict(self) -> dict:
        out = {"format": self.format.label(), "granularity": G.to_dict(self.granularity), "dynamic": self.dynamic,
               "calibration": self.calibration, "percentile": self.percentile, "ema_momentum": self.ema_momentum}
        out.update({k: getattr(self, k) for k in ("keep_first", "keep_last", "hadamard") if getattr(self, k)})
        return out

    @staticmethod
    def from_dict(d: dict) -> "QuantConfig":
        known = {"format", "granularity", "dynamic", "calibration", "percentile", "ema_momentum", "bits", "keep_first",
                 "keep_last", "hadamard"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown quantizer keys {sorted(unknown)}; known: {sorted(known)}")
        fmt = d.get("format", "int8")
        if "bits" in d:
            fmt = f"int{d['bits']}" if fmt in ("int", "int8") else fmt
        return QuantConfig(
            format=parse_format(str(fmt)),
            granularity=G.from_dict(d.get("granularity", "tensor")),
            dynamic=bool(d.get("dynamic", True)),
            calibration=d.get("calibration", "minmax"),
            percentile=float(d.get("percentile", 99.99)),
            ema_momentum=float(d.get("ema_momentum", 0.9)),
            keep_first=int(d.get("keep_first", 0)),
            keep_last=int(d.get("keep_last", 0)),
            hadamard=bool(d.get("hadamard", False)),
        )


def int_config(bits: int, granularity: G.Granularity | None = None, **kw) -> QuantConfig:
    """Symmetric absmax integer quantizer (the paper's setting by default: dynamic, per tensor)."""
    return QuantConfig(Format("int", bits), granularity or G.PerTensor(), **kw)
