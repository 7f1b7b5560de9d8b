"""GPTQ's settings as data (no torch), shared by the solver registry and the solver itself."""

from __future__ import annotations

from dataclasses import dataclass

from diffquant.errors import DiffquantError


@dataclass(frozen=True)
class GPTQ:
    damp: float = 0.01  # fraction of mean diag H added to the diagonal (the paper's 1%)
    block: int = 128  # columns per lazy batch (the paper's B = 128)
    act_order: bool = False  # columns in order of decreasing diag H (the reference's --act-order)

    def __post_init__(self) -> None:
        if not 0 <= self.damp < 1:
            raise DiffquantError(f"GPTQ dampening must be in [0, 1), got {self.damp}")
        if self.block < 1:
            raise DiffquantError(f"GPTQ block size must be positive, got {self.block}")

    def label(self) -> str:
        return "gptq" + (":act-order" if self.act_order else "")
