"""One name and one colour per model kind, in every table and plot."""

from __future__ import annotations

from diffquant.designs import DESIGNS

OTHER_COLORS = {"SmolLM2-135M": "#7f7f7f", "smollm2-135m": "#7f7f7f"}  # model kinds that are not designs
_SPARE = ("#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def display(label: str) -> str:
    """The report name of an architecture key or a label ("baseline" -> "Transformer")."""
    design = DESIGNS.get(label)
    return design.display if design else label


def color(label: str) -> str:
    """The colour of a model kind (the design registry's, else OTHER_COLORS); labels that name none get a stable
    spare colour. A label such as "DIFF s1" (a seed) takes its kind's colour."""
    name = display(label)
    known_colors = {**OTHER_COLORS, **{d.display: d.color for d in DESIGNS.values()}}
    for known, c in known_colors.items():
        if name == known or name.startswith(known + " "):
            return c
    return _SPARE[sum(map(ord, name)) % len(_SPARE)]


def integer_ticks(ax, axis: str = "x") -> None:
    from matplotlib.ticker import MaxNLocator

    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))
