"""GPTQ's settings as data (no torch): the registered solver step (quant/algorithms/steps.py); the algorithm is quant/algorithms/gptq.py."""

from __future__ import annotations

from dataclasses import dataclass

from diffquant.errors import DiffquantError
from diffquant.quant.algorithms.steps import SOLVERS, Solver, number


@SOLVERS.register
@dataclass(frozen=True)
class GPTQ(Solver):
    damp: float = 0.01  # fraction of mean diag H added to the diagonal (the paper's 1%)
    block: int = 128  # columns per lazy batch (the paper's B = 128)
    act_order: bool = False  # columns in order of decreasing diag H (the reference's --act-order)
    static_groups: bool = False  # group scales from the float weight before any update (llm-compressor's; with
    # act-order always), not as each group is reached (the reference's lazy groups, AutoGPTQ's default)
    fixes_scales = True
    words = ("gptq",)
    docs = {"gptq[:act-order]": "GPTQ (Frantar et al. 2022): Hessian-weighted error feedback, layer by layer on "
                                "calibration data; act-order: columns by decreasing activation energy (:damp=D, "
                                ":block=B: other dampening and lazy-batch sizes than 0.01 and 128; :static-groups: "
                                "group scales from the float weight, as llm-compressor computes them)"}

    @classmethod
    def from_text(cls, word: str, arg: str) -> "GPTQ":
        """`gptq[:act-order][:static-groups][:damp=D][:block=B]`: the label of any settings reads back to them."""
        options = dict(damp=0.01, block=128, act_order=False, static_groups=False)
        for part in filter(None, arg.split(":")):
            key, eq, value = part.partition("=")
            if part in ("act-order", "static-groups"):
                options[part.replace("-", "_")] = True
            elif eq and key in ("damp", "block"):
                options[key] = float(value) if key == "damp" else int(value)
            else:
                raise ValueError(part)
        return cls(**options)

    def __post_init__(self) -> None:
        if not 0 <= self.damp < 1:
            raise DiffquantError(f"GPTQ dampening must be in [0, 1), got {self.damp}")
        if self.block < 1:
            raise DiffquantError(f"GPTQ block size must be positive, got {self.block}")

    def label(self) -> str:
        return ("gptq" + (":act-order" if self.act_order else "") + (":static-groups" if self.static_groups else "")
                + (f":damp={number(self.damp)}" if self.damp != 0.01 else "")
                + (f":block={self.block}" if self.block != 128 else ""))

    def layer_steps(self, model, table, configs, by_layer, solved, calibration) -> list:
        from diffquant.quant.algorithms.gptq import layer_step

        return [layer_step(table, configs, by_layer, self, solved)]
