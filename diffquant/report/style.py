"""One name and one colour per model kind, in every table and plot."""

from __future__ import annotations

DISPLAY: dict[str, str] = {}  # architecture key -> the name reports use (filled by diffquant.designs)
COLORS = {"SmolLM2-135M": "#7f7f7f", "smollm2-135m": "#7f7f7f"}
_SPARE = ("#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22")


def register(key: str, display: str, color: str) -> None:
    """Add a model kind (a design) to the tables and plots."""
    DISPLAY[key] = display
    COLORS[display] = color


def display(label: str) -> str:
    """The report name of an architecture key or a label ("baseline" -> "Transformer")."""
    import diffquant.designs  # noqa: F401 - fills DISPLAY and COLORS

    return DISPLAY.get(label, label)


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
