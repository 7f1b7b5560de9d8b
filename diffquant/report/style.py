"""One name and one colour per model kind, in every table and plot: designs from the design registry, zoo models
from the zoo (grey)."""

from __future__ import annotations

from diffquant.designs import DESIGNS
from diffquant.models.zoo import ZOO, zoo_entry

ZOO_COLOR = "#7f7f7f"
_SPARE = ("#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def display(label: str) -> str:
    """The report name of an architecture key, a zoo name or alias, or a label ("baseline" -> "Transformer",
    "smollm2-135m" -> "SmolLM2-135M-Instruct (Q4_1 → fp32)"). A zoo alias followed by a qualifier keeps it
    ("SmolLM2-135M (demo)" -> "SmolLM2-135M-Instruct (Q4_1 → fp32) (demo)")."""
    if label in DESIGNS:
        return DESIGNS[label].display
    head, _, rest = label.partition(" ")
    entry = zoo_entry(label) or zoo_entry(head)
    if entry is None:
        return label
    return entry.display + ("" if zoo_entry(label) else f" {rest}")


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
