"""One name and one colour per model kind, in every table and plot."""

from __future__ import annotations

DISPLAY: dict[str, str] = {}  # architecture key -> the name reports use (filled by diffquant.designs)
COLORS: dict[str, str] = {}  # display name -> colour (zoo models: grey, filled on first use)
ZOO_COLOR = "#7f7f7f"
_SPARE = ("#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def register(key: str, display: str, color: str) -> None:
    """Add a model kind (a design) to the tables and plots."""
    DISPLAY[key] = display
    COLORS[display] = color


def display(label: str) -> str:
    """The report name of an architecture key, a zoo name or alias, or a label ("baseline" -> "Transformer",
    "smollm2-135m" -> "SmolLM2-135M-Instruct (Q4_1 → fp32)"). A zoo alias followed by a qualifier keeps it
    ("SmolLM2-135M (demo)" -> "SmolLM2-135M-Instruct (Q4_1 → fp32) (demo)")."""
    import diffquant.designs  # noqa: F401 - fills DISPLAY and COLORS
    from diffquant.models.zoo import zoo_entry

    if label in DISPLAY:
        return DISPLAY[label]
    head, _, rest = label.partition(" ")
    entry = zoo_entry(label) or zoo_entry(head)
    if entry is None:
        return label
    COLORS.setdefault(entry.display, ZOO_COLOR)
    return entry.display + ("" if zoo_entry(label) else f" {rest}")


def color(label: str) -> str:
    """The colour of a model kind; labels that name none get a stable spare colour. A label such as
    "DIFF s1" (a seed) takes its kind's colour."""
    name = display(label)
    for known, c in COLORS.items():
        if name == known or name.startswith(known + " "):
            return c
    return _SPARE[sum(map(ord, name)) % len(_SPARE)]


def integer_ticks(ax, axis: str = "x") -> None:
    from matplotlib.ticker import MaxNLocator

    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(MaxNLocator(integer=True))
