"""Recipe steps as registered types: one class per kind of fix or weight solver owns everything about it, so a new
step is its class and one `register` call, and nothing else in diffquant tests its type or its label.

A step class declares

    words           the first word of each spelling it reads (`smoothquant` in `smoothquant:0.5`)
    docs            {spelling as a user types it: one line}: the help texts, `diffquant list`, `dq.registries()`
    from_text(word, arg)   the step a spelling reads as (arg: what follows the word, without its ':')
    label()         its spelling, which `from_text` reads back (recipe files and reports store it)
    export_refusal  why a compressed-tensors checkpoint cannot hold it, in one line (None: it can)
    solver_for(word, solver)  the weight solver it runs with where the command line named `solver` (a fix that
                    implies one, such as `quarot` → gptq, says so here)

and what it does: a fix `adjust`s the scheme, `apply`s itself and `replay`s its record (quant/algorithms/mitigate.py); a
solver gives the per-layer steps of `solve_weights_` (quant/algorithms/solvers.py). This is torchao's handler per config
class and lm-eval's registries: a registry raises on a duplicate name, lists the valid choices on a miss, and is
filled as each step's class is defined (`@FIXES.register`, torchao's `register_quantize_module_handler`);
quant/algorithms/__init__.py imports the modules that define diffquant's own, so the registries are whole wherever
one is read. No torch here: the command line's help reads these registries.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

from diffquant.errors import DiffquantError


class Step:
    """What every recipe step declares (see the module doc); subclasses are frozen dataclasses."""

    kind = ""  # "fix" or "solver": where a recipe keeps it
    words: tuple[str, ...] = ()
    docs: dict[str, str] = {}
    export_refusal: str | None = None

    @classmethod
    def from_text(cls, word: str, arg: str) -> "Step":
        raise NotImplementedError

    def label(self) -> str:
        raise NotImplementedError

    def solver_for(self, word: str, solver: str) -> str:
        """The solver spelling this step runs with when spelt `word` and the command line named `solver`."""
        return solver


class Fix(Step):
    """A step that changes the model without changing its function (or, for Clip, only how the scheme finds its
    ranges): it says what it does to the scheme (`adjust`), applies itself into an `Applied` handle whose
    `remove()` undoes it bit-exactly (`apply`), and replays itself from its record without calibration data
    (`replay`)."""

    kind = "fix"
    needs_calibration = False

    def adjust(self, scheme):
        """The scheme this fix asks for (default: the scheme as it is)."""
        return scheme

    def apply(self, model, calibration, scheme, applied) -> None:
        """Change `model` in place, through `applied` (default: nothing)."""

    def replay(self, model, record: dict, applied) -> None:
        """Change `model` as `record` says, without calibration data (default: `apply` without it)."""
        self.apply(model, None, None, applied)


class Solver(Step):
    """A step that moves the weights onto their grid on calibration data (quant/algorithms/solvers.py's `solve_weights_`)."""

    kind = "solver"
    act_order = False  # columns solved in order of activation energy (exported as actorder "weight")
    fixes_scales = False  # the weights lie on scales the solver chose (GPTQ): the scheme keeps them static

    def layer_steps(self, model, table, configs: dict, by_layer: dict, solved, calibration) -> list:
        """[(modules(i) → {key: module whose input it needs}, apply(i, stats))]: what it does to each layer."""
        raise NotImplementedError


class LayerStep(NamedTuple):
    """A solver's work on each layer: the modules whose inputs it needs ({key: module} for layer i), what it does
    with their statistics, and whether it reads mean |x| (AWQ's scales) besides the Hessians."""

    modules: Callable[[int], dict]
    apply: Callable[[int, dict], None]
    mean_abs: bool = False


class Registry:
    """The step classes of one kind, by the first word of their spellings. `none` is the spelling of no step."""

    def __init__(self, kind: str, what: str, none: tuple[str, str]):
        self.kind, self.what, self.none = kind, what, none
        self._classes: list[type] = []
        self._by_word: dict[str, type] = {}

    def register(self, cls: type) -> type:
        """Add a step class (usable as a decorator); a word another class already reads is refused."""
        if getattr(cls, "kind", None) != self.kind:
            raise DiffquantError(f"{cls.__name__} is not a {self.what} step (subclass steps.{self.kind.title()})")
        taken = [w for w in cls.words if w in self._by_word or w == self.none[0]]
        if taken or not cls.words:
            raise DiffquantError(f"cannot register {cls.__name__}: " + (f"{', '.join(taken)} already names a "
                                 f"{self.what}" if taken else "it declares no words"))
        self._classes.append(cls)
        self._by_word.update({w: cls for w in cls.words})
        return cls

    def unregister(self, cls: type) -> None:
        self._classes.remove(cls)
        self._by_word = {w: c for w, c in self._by_word.items() if c is not cls}

    def classes(self) -> list[type]:
        return list(self._classes)

    def holds(self, step) -> bool:
        """Whether `step` is an instance of a registered class (exactly: a subclass registers itself)."""
        return type(step) in self._classes

    def docs(self) -> list[tuple[str, str]]:
        """[(spelling, one line)], no step first."""
        return [self.none, *((s, doc) for cls in self._classes for s, doc in cls.docs.items())]

    def parse(self, text: str):
        """The step `text` spells (None for the no-step spelling); a miss lists every spelling."""
        t = str(text).strip().lower()
        if t == self.none[0]:
            return None
        word = re.match(r"[^:+]*", t).group()
        arg = t[len(word):].removeprefix(":")
        cls = self._by_word.get(word)
        if cls is not None:
            try:
                return cls.from_text(word, arg)
            except ValueError:
                pass
        raise DiffquantError(f"unknown {self.what} {text!r}; choose one of: {', '.join(s for s, _ in self.docs())}")

    def word(self, text: str) -> str:
        """The first word of a spelling (what `solver_for` is told)."""
        return re.match(r"[^:+]*", str(text).strip().lower()).group()


def number(x: float) -> str:
    """`x` as a label writes it: short (0.5) where that reads back exactly, else every digit."""
    return f"{x:g}" if float(f"{x:g}") == x else repr(float(x))


FIXES = Registry("fix", "fix", ("none", "no transform"))
SOLVERS = Registry("solver", "weight solver", ("rtn", "round to nearest (the scheme's own quantizer)"))
