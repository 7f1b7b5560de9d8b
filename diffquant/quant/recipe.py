"""A Recipe: how a float model becomes a quantized one, as data, and the one pipeline that runs it.

A recipe is an ordered list of steps, applied in that order (llm-compressor's `recipe=[...modifiers]`):

    fixes    function-preserving transforms of the model (quant/algorithms/mitigate.py: SmoothQuant, Rotate, Clip), any
             number, each applied to the model as the previous ones left it;
    solver   at most one weight solver (quant/algorithms/solvers.py: GPTQ, AWQ; none = round to nearest);
    scheme   exactly one QuantScheme, last (quant/numerics/scheme.py: which sites and weights are quantized, and how).

    Recipe([SmoothQuant(alpha=0.5), GPTQ(act_order=True), "w8a8-static"])

`quantize_(model, recipe, calibration)` runs any recipe in place: each fix adjusts the scheme and changes the
model, the solver moves the weights onto their grid, the scheme's fake quantizers attach (with the solver's
scales fixed), and static activation scales calibrate. It returns one handle, `Quantized`, a context manager
whose exit (or `remove()`) restores the float model bit-exactly. The command line (`quantize`, `sweep`,
`lm-eval`), the experiments and the notebook all call it: this is the only place the steps are sequenced.

A recipe saves to and loads from JSON or YAML as the steps' command-line spellings (`quantize` writes the one it
ran to its --out as recipe.yaml; `--recipe FILE` on quantize, sweep and lm-eval reads it back):

    fixes: [smoothquant:search]
    solver: gptq:act-order     # files written before round five say `weights:`, read the same
    scheme: w8a8-static        # a preset name, a scheme file, or the scheme itself (QuantScheme.to_dict)

`load_recipe` also reads an llm-compressor recipe YAML (quant/llmcompressor_recipe.py). Every step is a registered
type (quant/algorithms/steps.py): what a step is, how it is spelt and whether it exports is asked of the step, never tested
here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from diffquant.errors import DiffquantError
from diffquant.quant.algorithms import mitigate, solvers
from diffquant.quant.numerics.scheme import CALIBRATION_BATCH, QuantScheme, get_scheme
from diffquant.quant.algorithms.steps import FIXES, SOLVERS, Fix, Solver

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Recipe:
    scheme: QuantScheme
    fixes: tuple[Fix, ...] = ()
    solver: Solver | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, QuantScheme):
            raise DiffquantError(f"a recipe's scheme must be a QuantScheme (or a preset name), got {self.scheme!r}")
        bad = [f for f in self.fixes if not FIXES.holds(f)]
        if bad:
            raise DiffquantError(f"recipe fixes must be registered fix steps ({_names(FIXES)}), got {bad!r}")
        if self.solver is not None and not SOLVERS.holds(self.solver):
            raise DiffquantError(f"a recipe's weight solver must be a registered solver step ({_names(SOLVERS)}), "
                                 f"got {self.solver!r}")

    @staticmethod
    def of(steps) -> "Recipe":
        """A recipe from what a user writes: a Recipe, a scheme (QuantScheme, preset name or file), or a list of
        steps in order (fixes, then at most one solver, then the scheme last)."""
        if isinstance(steps, Recipe):
            return steps
        if isinstance(steps, (str, Path, QuantScheme)):
            return Recipe(_scheme(steps))
        steps = list(steps)
        if not steps:
            raise DiffquantError("an empty recipe: give at least a scheme, e.g. ['w8a8']")
        *before, last = steps
        if not isinstance(last, (str, Path, QuantScheme)):
            raise DiffquantError(f"a recipe ends with its scheme (a preset name or QuantScheme), got {last!r}")
        fixes, solver = [], None
        for step in before:
            if FIXES.holds(step):
                if solver is not None:
                    raise DiffquantError(f"{step.label()} comes after the weight solver {solver.label()}: fixes change "
                                         "the model before its weights are solved")
                fixes.append(step)
            elif SOLVERS.holds(step):
                if solver is not None:
                    raise DiffquantError(f"one weight solver per recipe, got {solver.label()} and {step.label()}")
                solver = step
            else:
                raise DiffquantError(f"unknown recipe step {step!r}: fixes ({_names(FIXES)}), a solver "
                                     f"({_names(SOLVERS)}) and the scheme last")
        return Recipe(_scheme(last), tuple(fixes), solver)

    @property
    def steps(self) -> list:
        return [*self.fixes, *([self.solver] if self.solver else []), self.scheme]

    @property
    def needs_calibration(self) -> bool:
        """Whether `quantize_` needs calibration windows: a fix that measures, a solver, or static scales."""
        scheme = self.adjusted_scheme()
        return (any(f.needs_calibration for f in self.fixes) or self.solver is not None
                or any(not c.dynamic for _, c in (*scheme.activations, *scheme.weights)))

    def adjusted_scheme(self) -> QuantScheme:
        """The scheme as the fixes leave it (before the solver names it)."""
        scheme = self.scheme
        for fix in self.fixes:
            scheme = fix.adjust(scheme)
        return scheme

    def label(self) -> str:
        return " → ".join([*(f.label() for f in self.fixes), *([self.solver.label()] if self.solver else []),
                           self.scheme.name])

    def to_dict(self) -> dict:
        from diffquant.quant.numerics.scheme import SCHEME_PRESETS

        scheme = self.scheme.name if SCHEME_PRESETS.get(self.scheme.name) == self.scheme else self.scheme.to_dict()
        return {"fixes": [f.label() for f in self.fixes], "solver": self.solver.label() if self.solver else "rtn",
                "scheme": scheme}

    @staticmethod
    def from_dict(d: dict) -> "Recipe":
        """The recipe of `to_dict`'s mapping; `weights` is the solver's name in files written before round five.
        A solver given is taken as it is; with none given, the fixes' implied one (`quarot` → gptq) runs."""
        unknown = set(d) - {"fixes", "solver", "weights", "scheme"}
        if unknown or "scheme" not in d or ("solver" in d and "weights" in d):
            raise DiffquantError(f"a recipe has 'scheme' and optionally 'fixes' and 'solver'; got keys {sorted(d)}")
        fixes = d.get("fixes") or []
        scheme = d["scheme"]
        scheme = QuantScheme.from_dict(scheme) if isinstance(scheme, dict) else scheme
        solver = d.get("solver", d.get("weights"))
        if solver is not None:
            steps = [f for f in map(FIXES.parse, [fixes] if isinstance(fixes, str) else fixes) if f is not None]
            return Recipe(_scheme(scheme), tuple(steps), SOLVERS.parse(solver))
        return from_cli(fixes, None, scheme)

    def save(self, path) -> Path:
        from diffquant.paths import atomic_write_text

        path = Path(path)
        doc = self.to_dict()
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            atomic_write_text(path, yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
        else:
            atomic_write_text(path, json.dumps(doc, indent=2) + "\n")
        return path

    @staticmethod
    def load(path) -> "Recipe":
        """A recipe file: diffquant's (as `save` writes it) or llm-compressor's recipe YAML, told apart by content."""
        path = Path(path)
        if not path.is_file():
            raise DiffquantError(f"recipe file {path} does not exist")
        try:
            if path.suffix.lower() in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(path.read_text())
            else:
                data = json.loads(path.read_text())
        except Exception as e:  # noqa: BLE001 - either library's parse error
            raise DiffquantError(f"cannot parse {path}: {e}") from None
        from diffquant.quant import llmcompressor_recipe

        if llmcompressor_recipe.is_llmcompressor(data):
            return Recipe.of(llmcompressor_recipe.read(data, path.stem))
        if not isinstance(data, dict):
            raise DiffquantError(f"{path} must hold a mapping with 'scheme' (and 'fixes', 'solver'), or an "
                                 "llm-compressor recipe")
        return Recipe.from_dict(data)


def _scheme(scheme) -> QuantScheme:
    return scheme if isinstance(scheme, QuantScheme) else get_scheme(str(scheme))


def _names(registry) -> str:
    return ", ".join(s for s, _ in registry.docs()[1:])


def from_cli(fixes, solver: str | None, scheme) -> Recipe:
    """The recipe the command line spells: `--fix` (one spelling or several, applied in order), `--solver` (None
    or rtn: none named) and `--scheme`. A fix may imply a solver where none is named (its `solver_for`: `quarot`
    is the rotation with GPTQ weights, `clip:output` clips the weights by the clip:output solver)."""
    texts = [fixes] if isinstance(fixes, str) else list(fixes)
    steps, solver = [], (solver or "rtn").strip().lower()
    for text in texts:
        fix = FIXES.parse(text)
        if fix is not None:
            solver = fix.solver_for(FIXES.word(text), solver)
            steps.append(fix)
    return Recipe(_scheme(scheme), tuple(steps), SOLVERS.parse(solver))


def load_recipe(path) -> Recipe:
    """A recipe file as `--recipe` reads it (see `Recipe.load`)."""
    return Recipe.load(path)


@dataclass
class Quantized:
    """A model quantized in place by `quantize_`: the steps' handles and their records. `remove()` (or leaving
    the `with` block) restores the float model bit-exactly; `save(folder)` writes the scheme, its static
    scales, the fixes' records and the solved weights, which `models.load.load_model(folder)` replays."""

    model: object
    recipe: Recipe
    scheme: QuantScheme  # the scheme as attached (adjusted by the fixes, named by the solver)
    attachment: object = None
    solved: object = None
    applied: list = field(default_factory=list)
    calibration_tokens: int = 0
    seconds: dict = field(default_factory=dict)  # wall seconds of each step, in order (`quantize_`)

    @property
    def quantizers(self) -> dict:
        return self.attachment.quantizers if self.attachment is not None else {}

    @property
    def record(self) -> dict:
        """What was done, as plain data: the recipe, each fix's record (scales, α searched), the solver's."""
        return {"recipe": self.recipe.to_dict(), "scheme": self.scheme.name,
                "fixes": [{k: v for k, v in a.record.items() if k != "scales"} for a in self.applied],
                "weights": self.solved.record if self.solved is not None else {"weights": "rtn"},
                "calibration_tokens": self.calibration_tokens, "seconds": dict(self.seconds)}

    removed: bool = False

    def remove(self) -> None:
        """Undo every step, last first (the records stay readable); a second call does nothing."""
        if self.removed:
            return
        if self.attachment is not None:
            self.attachment.remove()
        if self.solved is not None:
            self.solved.remove()
        for applied in reversed(self.applied):
            applied.remove()
        self.removed = True

    def __enter__(self) -> "Quantized":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def export(self, out, tokenizer=None, format: str = "compressed-tensors") -> dict:
        """Write exactly this simulated model as a compressed-tensors checkpoint (safetensors, config.json's
        quantization_config, the tokenizer) that transformers and vLLM load; every written weight is checked
        against the simulation first. What the format cannot hold is refused in one line (`check_export`)."""
        from diffquant.quant.checkpoints.export import export_compressed_tensors

        if format != "compressed-tensors":
            raise DiffquantError(f"unknown export format {format!r}; diffquant writes compressed-tensors")
        if self.removed or self.attachment is None:
            raise DiffquantError("this quantized model was removed; quantize it again to export it")
        return export_compressed_tensors(self.model, self.attachment, out, tokenizer, self.recipe.fixes,
                                         self.recipe.solver)

    def save(self, folder, source: dict | None = None) -> dict:
        """The scheme (with static scales), the fixes' records and the solved weights, into `folder`; `source`
        names the float model for a folder that holds no weights of its own."""
        from diffquant.quant.checkpoints.saved import save_scheme

        if self.removed or self.attachment is None:
            raise DiffquantError("this quantized model was removed; quantize it again to save it")
        return save_scheme(self.attachment, folder, source, [a.record for a in self.applied], self.solved)


def check_export(model, recipe) -> None:
    """Refuse, in one line and before any work, a recipe a compressed-tensors checkpoint cannot hold
    (quant/checkpoints/export.py: rotations, logit quantization, formats the format has no grid for, ...)."""
    from diffquant.quant.checkpoints.export import check

    recipe = Recipe.of(recipe)
    check(model, recipe.adjusted_scheme(), recipe.fixes, recipe.solver)


def quantize_(model, recipe, calibration: "torch.Tensor | None" = None, *, compile: bool = False,
              progress: bool = False) -> Quantized:
    """Quantize `model` in place by `recipe` (a Recipe, a list of steps, a scheme or a preset name) and return
    the handle (a context manager: leaving it restores the float model bit-exactly).

    `calibration` ([n, seq_len] token ids, from a training split, never the evaluation data) feeds the fixes
    that measure (SmoothQuant), the weight solver and the static activation scales; a recipe that needs it and
    gets none is refused before anything changes, as is a scheme that cannot apply to the model. `compile`
    fuses the fake quantizers with torch.compile. The handle's `seconds` holds each step's wall seconds (each
    fix, the solver, attaching, static scales); `progress` prints them as they finish and shows the solver's
    per-layer bar."""
    from diffquant.quant.numerics.scheme import attach_scheme, calibrate, plan
    from diffquant.stopwatch import Stopwatch

    recipe = Recipe.of(recipe)
    scheme = recipe.adjusted_scheme()
    plan(model, scheme)  # a scheme that cannot apply is refused here, before any work
    if recipe.needs_calibration and (calibration is None or calibration.numel() == 0):
        raise DiffquantError(f"recipe {recipe.label()} needs calibration windows (a training split): pass "
                             "calibration=token ids [n, seq_len]")
    device = model.get_input_embeddings().weight.device
    calib = calibration.to(device) if calibration is not None else None
    q = Quantized(model, recipe, scheme, calibration_tokens=0 if calibration is None else int(calibration.numel()))
    clock = Stopwatch(say=progress)  # each step's seconds into q.seconds as it finishes (printed with progress)
    q.seconds = clock.seconds
    try:
        scheme = recipe.scheme
        for fix in recipe.fixes:
            scheme = fix.adjust(scheme)
            q.applied.append(mitigate.mitigate_(model, fix, calib, scheme))
            clock.lap(f"fix {fix.label()}")
        q.solved = solvers.solve_weights_(model, recipe.solver, scheme, calib, progress=progress)
        if recipe.solver is not None:
            clock.lap(f"solver {recipe.solver.label()}")
        q.scheme = q.solved.scheme(scheme)
        q.attachment = attach_scheme(model, q.scheme, compile)
        q.solved.install(q.attachment)
        clock.lap("attach")
        calibrate(model, q.attachment, calib.split(CALIBRATION_BATCH) if calib is not None else ())
        clock.lap("static scales")
    except BaseException:
        q.remove()
        raise
    return q


def load_quantized(model, folder) -> Quantized:
    """Re-attach a scheme saved by `save_scheme` to `model` (after replaying its fixes and putting back the
    solved weights); returns the `Quantized` handle, whose `remove()` restores the float model. Folders saved
    before recipes held one fix under "mitigation"."""
    from diffquant.quant.algorithms.mitigate import apply_record
    from diffquant.quant.numerics.scheme import SCHEME_FILE, attach_scheme

    data = json.loads((Path(folder) / SCHEME_FILE).read_text())
    records = data.get("fixes") or ([data["mitigation"]] if data.get("mitigation") else [])
    fixes = [apply_record(model, r) for r in records]
    solved = None
    if data.get("weights"):
        from diffquant.quant.algorithms.solvers import load_solved

        solved = load_solved(model, folder, data["weights"])
    scheme = QuantScheme.from_dict(data["scheme"])
    attachment = attach_scheme(model, scheme)
    for name, state in data.get("scales", {}).items():
        attachment.quantizers[name].load_state(state)
    recipe = Recipe(scheme, tuple(f for f in (FIXES.parse(r["mitigation"]) for r in records) if f is not None),
                    SOLVERS.parse(data["weights"]["weights"]) if data.get("weights") else None)
    return Quantized(model, recipe, scheme, attachment, solved, fixes)
