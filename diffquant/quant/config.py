"""QuantConfig: one quantizer as data (frozen, validated, JSON round-trip)."""

from __future__ import annotations

from dataclasses import dataclass, field

from diffquant.quant import granularity as G
from diffquant.quant.formats import Format, parse_format

CALIBRATIONS = ("minmax", "ema", "percentile", "mse")


@dataclass(frozen=True)
class QuantConfig:
    """How to quantize one site: format, granularity, and dynamic or calibrated (static) scales."""

    format: Format = field(default_factory=Format)
    granularity: G.Granularity = field(default_factory=G.PerTensor)
    dynamic: bool = True
    calibration: str = "minmax"
    percentile: float = 99.99
    ema_momentum: float = 0.9

    def __post_init__(self) -> None:
        if not isinstance(self.format, Format):
            raise ValueError(f"format must be a Format, got {self.format!r}")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"unknown calibration {self.calibration!r}; choose one of: {', '.join(CALIBRATIONS)}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        if not 0 <= self.ema_momentum < 1:
            raise ValueError(f"ema_momentum must be in [0, 1), got {self.ema_momentum}")
        if not self.dynamic:
            if isinstance(self.granularity, G.PerToken):
                raise ValueError("static (calibrated) scales cannot be per token: tokens differ between batches")
            if self.calibration == "percentile" and not (isinstance(self.granularity, G.PerTensor)
                                                         and self.format.symmetric):
                raise ValueError("percentile calibration supports symmetric per-tensor scales only")

    def label(self) -> str:
        mode = "dyn" if self.dynamic else self.calibration
        return f"{self.format.label()}/{G.label(self.granularity)}/{mode}"

    def to_dict(self) -> dict:
        return {"format": self.format.label(), "granularity": G.to_dict(self.granularity), "dynamic": self.dynamic,
                "calibration": self.calibration, "percentile": self.percentile, "ema_momentum": self.ema_momentum}

    @staticmethod
    def from_dict(d: dict) -> "QuantConfig":
        known = {"format", "granularity", "dynamic", "calibration", "percentile", "ema_momentum", "bits"}
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
        )


def int_config(bits: int, granularity: G.Granularity | None = None, **kw) -> QuantConfig:
    """Symmetric absmax integer quantizer (the paper's setting by default: dynamic, per tensor)."""
    return QuantConfig(Format("int", bits), granularity or G.PerTensor(), **kw)
