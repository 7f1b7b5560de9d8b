"""The outlier regime: one definition, read by every experiment and report that says whether a model is in it.

A model is in the outlier regime when, on held-out sequences, its hidden states' largest |value| is at least
HIDDEN_RATIO times their median |value| (the decoder layers' outputs; pooled over layers when a model is measured
once, the worst layer on a tracked curve), or when at least SINK_RATE of its attention heads are sinks (Gu et al.
2024's Sink₁: a head whose first-token share is at least ε = 0.3; DIFF's heads are counted per differential head,
stats/sinks.py). The two thresholds were fixed before the emergence search (experiments/emergence.py) ran: 100×
the median is the ratio half of Sun et al.'s "massive activation" (> 100 and > 1000× the median) at the scale of
the models trained here, and half the heads sinking is Gu et al.'s "sinks have emerged".

Before this module, three texts said "outlier regime" with three meanings (the emergence search's thresholds,
experiments/regime.py's first-token share and residual-peak growth, the fair comparison's sink rate and
max‖h‖/median‖h‖); they now all read this one, and name it where they use it (`NAME`). regime.py still reports
issue 27's own criteria, fixed before its run, under that name and not as the outlier regime.
"""

from __future__ import annotations

HIDDEN_RATIO = 100.0  # hidden top-1 / median, at or above
SINK_RATE = 0.5  # share of heads that are sinks (Sink₁, ε = 0.3), at or above
NAME = (f"the outlier regime (diffquant.stats.outlier_regime: hidden top-1/median ≥ {HIDDEN_RATIO:g} or sink rate "
        f"≥ {SINK_RATE:g})")


def reached(stats: dict) -> bool:
    """Whether measurements {"hidden_ratio": top-1/median of the hidden states, "sink_rate": share of sink heads}
    are in the outlier regime; a missing or None value counts as 0 (not measured is not reached)."""
    return (stats.get("hidden_ratio") or 0) >= HIDDEN_RATIO or (stats.get("sink_rate") or 0) >= SINK_RATE
