"""One name (models/describe.py's `display`) and one colour per model kind, in every table and plot: designs from the design registry, zoo models
from the zoo (grey)."""

from __future__ import annotations

from diffquant.designs import DESIGNS
from diffquant.models.describe import display  # noqa: F401  (the report name; reports import it from here)
from diffquant.models.zoo import ZOO

ZOO_COLOR = "#7f7f7f"
_SPARE = ("#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def color(label: str) -> str:
    """The colour of a model kind (the design registry's; zoo models grey); labels that name none get a stable
    spare colour. A label such as "DIFF s1" (a seed) takes its kind's colour."""
    name = display(label)
    known = {**{e.display: ZOO_COLOR for e in ZOO.values()}, **{d.display: d.color for d in DESIGNS.values()}}
    for kind, c in known.items():
        if name == kind or name.startswith(kind + " "):
            return c
    return _SPARE[sum(map(ord, name)) % len(_SPARE)]


def integer_ticks(ax, axis: str = "x") -> None:
    from matplotlib.ticker import MaxNLocator

    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))
