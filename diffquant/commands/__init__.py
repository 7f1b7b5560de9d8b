"""Sub-command parsers, declared in one place from shared argument groups, so a flag means the same on
every command that takes it (model: --model --hub --device --dtype --device-map --batch-size --cache-dir;
data: --data --seq-len, and the tokens: --calib-tokens (calibration, the training split) and --eval-tokens
(evaluation, the validation split) wherever a command calibrates or evaluates, --tokens only where it means one
thing (profile: profiled tokens; train: training tokens); sites: one glob grammar; the recipe: --recipe, or
--fix (repeatable) --solver --scheme). Help texts list the registries themselves (diffquant/catalog.py), never a
hand-typed copy. Each command's module is imported only when it runs, so `diffquant --help` never loads torch.

Renamed flags stay one release as refusals that name the new spelling (`RENAMED`)."""

from __future__ import annotations

import argparse
import importlib

from diffquant.catalog import choices
from diffquant.commands.common import CALIB_WINDOWS

SEQ_LEN = 256  # tokens per window on every command that reads windows (train: the preset's context by default)
RENAMED = {  # dest of an old flag: (its spelling, what to write now)
    "old_mitigate": ("--mitigate", "--fix (repeat it for a chain of fixes, applied in order)"),
    "old_weights": ("--weights", "--solver"),
    "old_calib_batches": ("--calib-batches", "--calib-tokens (calibration tokens, not windows: windows × --seq-len)"),
    "old_tokens": ("--tokens", "--eval-tokens (held-out tokens evaluated) or --calib-tokens (training-split tokens "
                               "the recipe calibrates on)"),
}


def _lazy(module: str, name: str):
    def run(args):
        validate(args)  # one-line errors at once, before torch and transformers load (seconds)
        from diffquant.designs import register_auto_classes
        from diffquant.paths import removed_if_failed

        register_auto_classes()  # the command line starts without them (diffquant/__init__.py)
        with removed_if_failed(getattr(args, "out", None)):
            return getattr(importlib.import_module(module), name)(args)

    return run


def validate(args) -> None:
    """Checks of the arguments every command shares that need no heavy module."""
    from diffquant.errors import DiffquantError

    for key, (old, new) in RENAMED.items():
        if getattr(args, key, None) is not None:
            if key == "old_tokens" and not hasattr(args, "eval_tokens"):  # lm-eval: its tasks are what it evaluates
                new = new.partition(" or ")[2]
            raise DiffquantError(f"{old} is gone from {args.command}: use {new}")
    for key in ("tokens", "eval_tokens", "calib_tokens", "seq_len", "batch_size", "k", "track_points"):
        value = getattr(args, key, None)
        if value is not None and value <= 0:
            raise DiffquantError(f"--{key.replace('_', '-')} must be positive, got {value}")
    _check_context(args)
    if getattr(args, "data", None) and args.command not in ("data",):
        from diffquant.data.windows import check_source

        check_source(args.data)
    if getattr(args, "dtype", None) is not None:
        from diffquant.models.load import check_dtype

        check_dtype(args.dtype)
    if getattr(args, "preset", None) is not None:
        from diffquant.models.presets import get_preset

        get_preset(args.preset)
    if getattr(args, "design", None):
        from diffquant.designs import get

        for key in split_list(args.design):
            get(key)
    if getattr(args, "sites", None):
        from diffquant.taps.sites import site_globs

        site_globs(args.sites)
    schemes = split_list(getattr(args, "scheme", None)) if not getattr(args, "list", False) else []
    for name in schemes:
        from diffquant.quant.numerics.scheme import get_scheme

        get_scheme(name)
    for text in split_list(getattr(args, "fix", None)):
        from diffquant.quant.algorithms.mitigate import parse

        parse(text)
    if getattr(args, "recipe", None):
        _check_recipe(args)
    for key in ("metrics", "track_metrics"):
        if getattr(args, key, None):
            from diffquant.stats.metric_sets import parse

            parse(getattr(args, key))
    for text in split_list(getattr(args, "solver", None)):
        from diffquant.quant.algorithms.solvers import parse as parse_solver

        parse_solver(text)
    for key in ("bits", "wa_grid"):
        if getattr(args, key, None):
            from diffquant.sweeps import parse_bits

            parse_bits(getattr(args, key))
    for g in split_list(getattr(args, "granularity", None)):
        from diffquant.quant.numerics.granularity import parse_granularity

        parse_granularity(g)


def _check_recipe(args) -> None:
    """A recipe file holds every step: it goes with no --fix, --solver or --scheme (quantize, lm-eval), and it
    reads as a recipe (a diffquant recipe, or an llm-compressor recipe YAML)."""
    from diffquant.errors import DiffquantError
    from diffquant.quant.recipe import load_recipe

    if args.command != "sweep":
        given = [f for f, key in (("--fix", "fix"), ("--solver", "solver"), ("--scheme", "scheme"))
                 if getattr(args, key, None)]
        if given:
            raise DiffquantError(f"--recipe holds the fixes, the solver and the scheme; drop {', '.join(given)} "
                                 "(or edit the recipe file)")
    for path in [args.recipe] if isinstance(args.recipe, str) else args.recipe:
        load_recipe(path)


def split_list(value) -> list[str]:
    """A flag's list: space-separated (nargs="+"), comma-separated, or both."""
    if not value:
        return []
    parts = value if isinstance(value, (list, tuple)) else [value]
    return [x.strip() for part in parts for x in str(part).split(",") if x.strip()]


def _check_context(args) -> None:
    """Refuse a window longer than a model is built for, read from its files without loading it."""
    models, seq_len = getattr(args, "model", None), getattr(args, "seq_len", None)
    if not models or not seq_len or getattr(args, "allow_long_context", False):
        return
    from diffquant.commands.common import parse_model_args
    from diffquant.errors import DiffquantError
    from diffquant.models.context import context_length

    for _, source in parse_model_args([models] if isinstance(models, str) else models):
        positions, where = context_length(source, getattr(args, "cache_dir", None))
        if positions is not None and seq_len > positions:
            raise DiffquantError(f"--seq-len {seq_len:,} is longer than {source}'s context of {positions:,} positions "
                                 f"({where}); RoPE models may extrapolate past it: pass --allow-long-context to run "
                                 "anyway")


# ---------------------------------------------------------------- shared argument groups

MODEL_HELP = ("a zoo name (" + choices("zoo") + "), a save_pretrained folder, a folder `diffquant quantize` wrote, "
              "a .gguf file, a preset PRESET:DESIGN with random weights (e.g. tiny:diff), or a hub id with --hub")


def model_args(p, *, several: bool = False, required: bool = True, batch_size: int | None = 8,
               dtype: bool = True) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", action="append" if several else "store", required=required,
                   help=MODEL_HELP + ("; repeat for several, LABEL=SOURCE names one" if several else ""))
    g.add_argument("--hub", action="store_true", help="allow a Hugging Face hub id for --model (downloads)")
    g.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:N or mps (default: cuda when this machine has it); a device this machine "
                        "lacks is refused before any work")
    if dtype:
        g.add_argument("--dtype", default="fp32", help="the model's precision: fp32, bf16, fp16 or auto (default fp32)")
        g.add_argument("--device-map", default=None,
                       help="'auto' spreads a model too large for one device over several (accelerate)")
    if batch_size is not None:
        g.add_argument("--batch-size", type=int, default=batch_size,
                       help=f"sequences per forward pass (default {batch_size})")
    g.add_argument("--cache-dir", default=None, help="where corpora, tasks and zoo models are cached (default $DIFFQUANT_CACHE, else "
                        "$XDG_CACHE_HOME/diffquant, else ~/.cache/diffquant)")


def data_args(p, *, what: str, tokens: tuple[int, str] | None = None, eval_tokens: int | None = None,
              calib_tokens: bool = False, seq_len: int | None = SEQ_LEN) -> None:
    """--data and --seq-len, and the token budgets a command has: `tokens` (default, what they are) where
    --tokens means one thing, `eval_tokens` and `calib_tokens` where a command evaluates or calibrates (there
    --tokens would be ambiguous, and is refused with a hint)."""
    g = p.add_argument_group("data")
    g.add_argument("--data", "--corpus", dest="data", default="kjv",
                   help=f"{what}: a corpus ({choices('corpora')}) (default kjv)")
    if tokens is not None:
        g.add_argument("--tokens", type=int, default=tokens[0], help=f"{tokens[1]} (default {tokens[0]:,})")
    else:
        g.add_argument("--tokens", dest="old_tokens", default=None, help=argparse.SUPPRESS)
    if eval_tokens is not None:
        g.add_argument("--eval-tokens", type=int, default=eval_tokens,
                       help=f"held-out tokens evaluated, from the validation split (default {eval_tokens:,})")
    if calib_tokens:
        g.add_argument("--calib-tokens", type=int, default=None,
                       help=f"calibration tokens from the training split, for static scales, fixes and solvers "
                            f"(default {CALIB_WINDOWS} windows: {CALIB_WINDOWS} × --seq-len)")
        g.add_argument("--calib-batches", dest="old_calib_batches", default=None, help=argparse.SUPPRESS)
    g.add_argument("--seq-len", type=int, default=seq_len,
                   help=f"tokens per window (default {seq_len if seq_len else 'the preset' + chr(39) + 's'})")
    g.add_argument("--allow-long-context", action="store_true",
                   help="run windows longer than the model's context (RoPE models may extrapolate)")


SITES_HELP = ("site globs, space- or comma-separated: layers.{i}.POINT or *.POINT, or a bare POINT for every layer's "
              "(points: " + ", ".join(n.removeprefix("*.") for n in choices("sites").split(", ")) + "; see "
              "`diffquant sites`)")


def recipe_args(p, *, several: bool) -> None:
    """--recipe, or --fix, --solver, --scheme: the steps of a recipe (diffquant/quant/recipe.py). On a sweep each
    value is one alternative (a cell axis) and each --recipe one cell; elsewhere the --fix flags chain, in order."""
    g = p.add_argument_group("recipe (fixes → weight solver → scheme)")
    g.add_argument("--recipe", action="append" if several else "store", default=None,
                   help="a recipe file: diffquant's (JSON/YAML, as `quantize` writes recipe.yaml to its --out, or "
                        "dq.Recipe.save) or an llm-compressor recipe YAML (its recipe.yaml included)"
                        + ("; repeat for several, each one cell" if several else "; it holds every step, so no "
                           "--fix, --solver or --scheme with it"))
    if several:
        g.add_argument("--scheme", "--schemes", dest="scheme", default=None,
                       help=f"scheme presets ({choices('schemes')}) or .json/.yaml files, comma-separated: each one "
                            "whole-model cell")
        g.add_argument("--fix", action="append", default=None,
                       help=f"fixes to compare, comma-separated or repeated: each one alternative applied before every "
                            f"quantized cell ({choices('fixes')}); a chain of fixes is a --recipe file")
        g.add_argument("--solver", default=None,
                       help=f"weight solvers to compare on the --wa-grid cells, comma-separated: {choices('solvers')}")
    else:
        g.add_argument("--scheme", default=None,
                       help=f"a scheme preset ({choices('schemes')}) or a .json/.yaml file")
        g.add_argument("--fix", action="append", default=None,
                       help=f"a function-preserving fix, applied before the solver and the scheme; repeat for a chain, "
                            f"applied in order (--fix smoothquant:0.5 --fix rotate): {choices('fixes')}")
        g.add_argument("--solver", default=None,
                       help=f"how the weights reach their grid, after the fixes (default rtn, or the one a fix implies): "
                            f"{choices('solvers')}")
    g.add_argument("--mitigate", dest="old_mitigate", default=None, help=argparse.SUPPRESS)
    g.add_argument("--weights", dest="old_weights", default=None, help=argparse.SUPPRESS)


def kernels_arg(p, what: str) -> None:
    from diffquant.kernels import CHOICES

    p.add_argument("--kernels", default="auto", choices=CHOICES,
                   help=f"the kernels that compute {what}: triton (CUDA; pip install 'diffquant[gpu]'), torch, or auto "
                        "(default: triton on CUDA where it is installed, torch elsewhere); reports record which ran")


def out_args(p, *, required: bool = True, resume: bool = False) -> None:
    p.add_argument("--out", required=required, help="output folder")
    p.add_argument("--force", action="store_true", help="overwrite an output folder that holds results")
    if resume:
        p.add_argument("--resume", action="store_true", help="continue the run in --out")


def _parser(sub, name: str, help: str, example: str):
    return sub.add_parser(name, help=help, description=f"{help[0].upper()}{help[1:]}.\n\nexample:\n  {example}",
                          formatter_class=argparse.RawDescriptionHelpFormatter)


METRICS_HELP = f"the papers' metric sets to compute too, comma-separated: {choices('metric sets')} (docs/metrics.md)"


# ---------------------------------------------------------------- the commands


def _profile(sub) -> None:
    p = _parser(sub, "profile", "activation statistics and the paper's Table 5 for one or more models",
                "diffquant profile --model smollm2-135m --data kjv --tokens 65536 --out runs/profile")
    model_args(p, several=True)
    data_args(p, tokens=(65536, "tokens profiled"), what="profiled on its validation split")
    p.add_argument("--sites", nargs="+", default=["*.attn_logits", "*.hidden"],
                   help=SITES_HELP + " (default *.attn_logits *.hidden); attn_logits, attn_probs and attn_map compute "
                        "their layers' attention explicitly (T × T in query blocks), the other layers keep their kernel")
    p.add_argument("--k", type=int, default=100, help="top-k kept per site (default 100)")
    p.add_argument("--metrics", default="", help=METRICS_HELP)
    p.add_argument("--no-sinks", action="store_true",
                   help="skip the attention-sink and massive-activation metrics (on by default; where no attention "
                        "site is profiled they cost one more call of each layer's own attention kernel, or, with "
                        "padding or an eager model, its explicit T × T attention in query blocks)")
    p.add_argument("--compile", action="store_true",
                   help="fuse the statistics with torch.compile (one-off compile, then several times faster)")
    kernels_arg(p, "the statistics and the tapped attention")
    p.add_argument("--no-plots", action="store_true")
    out_args(p)
    p.set_defaults(func=_lazy("diffquant.commands.profile", "run_cli"))


def _quantize(sub) -> None:
    p = _parser(sub, "quantize", "apply a recipe (fixes, weight solver, scheme), measure it and save the model "
                                 "with the recipe it ran (recipe.yaml, which --recipe reruns)",
                "diffquant quantize --model smollm2-135m --fix smoothquant:0.5 --solver gptq --scheme w8a8-static "
                "--out runs/q\n  diffquant quantize --model smollm2-135m --recipe runs/q/recipe.yaml --out runs/q2")
    p.add_argument("--list", action="store_true", help="list schemes, fixes, solvers and backends usable here")
    model_args(p, required=False)
    data_args(p, eval_tokens=8192, calib_tokens=True,
              what="calibration (training split) and evaluation (validation split)")
    recipe_args(p, several=False)
    p.add_argument("--backend", default="fake", help=f"fake (the simulation) or a real low-bit backend: "
                                                     f"{', '.join(choices('backends').split(', ')[1:])}")
    p.add_argument("--save-weights", action="store_true",
                   help="simulated schemes: also save a full copy of the float weights (default: the scheme and a "
                        "reference to --model, a few kB)")
    p.add_argument("--export", choices=["compressed-tensors"], default=None,
                   help="write the simulated model to --out as a checkpoint others load: compressed-tensors "
                        "(transformers' from_pretrained, vLLM; pip install 'diffquant[export]')")
    out_args(p, required=False)
    p.set_defaults(func=_lazy("diffquant.commands.quantize", "run_cli"))


def _train(sub) -> None:
    p = _parser(sub, "train", "train matched models (baseline, DIFF, rival designs) on identical data",
                "diffquant train --preset tiny --data kjv --tokens 600000 --design baseline,diff --out runs/pair")
    p.add_argument("--preset", default="tiny", help=f"model shape: {choices('model presets')} (default tiny)")
    p.add_argument("--design", "--arch", dest="design", nargs="+", default=["baseline", "diff"],
                   help=f"designs to train, space- or comma-separated: {choices('designs')}")
    data_args(p, tokens=(1_000_000, "training tokens"), seq_len=None,
              what="trained on its training split, validated on the rest")
    g = p.add_argument_group("optimisation")
    g.add_argument("--batch-size", type=int, default=16, help="sequences per forward pass and step (default 16)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    g.add_argument("--schedule", default="cosine", choices=["cosine", "linear", "constant"],
                   help="decay after warm-up (default cosine, to min-lr-ratio × lr)")
    g.add_argument("--warmup-frac", type=float, default=0.05, help="linear warm-up share of the steps (default 0.05)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr (default 0.1)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of matrices (default 0.1)")
    g.add_argument("--seed", type=int, default=0)
    p.add_argument("--bos", action="store_true",
                   help="start every training and validation window with a BOS token (text corpora; synthetic "
                        "corpora always have one)")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--track", action="store_true",
                   help="profile every model on a fixed held-out batch at log-spaced steps (emergence.json, plots)")
    p.add_argument("--track-points", type=int, default=16, help="log-spaced tracking points (default 16)")
    p.add_argument("--track-metrics", default="", help="with --track: " + METRICS_HELP)
    kernels_arg(p, "the --track profiles")
    p.add_argument("--needle-fraction", type=float, default=0.0, help="fraction of training text made of needles")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when this machine has it; "
                                                  "under torchrun each rank its LOCAL_RANK)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="the forward's precision (weights and optimizer state stay fp32): auto is bf16 autocast on "
                        "CUDA and fp32 elsewhere; bf16 autocasts on the CPU too (default auto)")
    p.add_argument("--cache-dir", default=None, help="where corpora are cached (default $DIFFQUANT_CACHE, else $XDG_CACHE_HOME/diffquant, "
                        "else ~/.cache/diffquant)")
    out_args(p, resume=True)
    p.set_defaults(func=_lazy("diffquant.commands.train", "run_cli"))


def _sweep(sub) -> None:
    p = _parser(sub, "sweep", "evaluate models at every bit-width, granularity, site, scheme and fix (resumable)",
                "diffquant sweep --model smollm2-135m --sites attn_logits --bits 16,8,6,4 --granularity tensor,head "
                "--out runs/sweep")
    model_args(p, several=True)
    data_args(p, eval_tokens=16384, calib_tokens=True,
              what="evaluated on its validation split, calibrated on its training split")
    p.add_argument("--sites", nargs="+", default=["attn_logits"],
                   help=SITES_HELP + "; each point is quantized in every layer (default attn_logits)")
    p.add_argument("--bits", default="16,8,6,4", help="activation bit-widths; 16 = the model's own precision")
    p.add_argument("--granularity", default="tensor", help=f"comma-separated: {choices('granularities')}")
    recipe_args(p, several=True)
    p.set_defaults(scheme="")
    p.add_argument("--eval", default="ppl",
                   help="comma-separated: ppl, needle, mc:TASK. TASK: wordnet:nouns (built offline from Debian's "
                        "WordNet), a BIG-bench name (fetched once, 358 MB), or your .jsonl file, one example a line: "
                        '{"input": "Q: ...", "target_scores": {"right answer": 1, "wrong answer": 0}}')
    p.add_argument("--wa-grid", default=None, help="bit-widths for a weight × activation grid, e.g. 8,6,4")
    p.add_argument("--per-layer", type=int, default=None, help="BITS: quantize one layer at a time (sensitivity)")
    p.add_argument("--kurtosis-tokens", type=int, default=0,
                   help="profile attention logits and hidden states on this many held-out tokens and draw their "
                        "kurtosis per layer beside the accuracy figure (default 0: none)")
    p.add_argument("--mc-limit", type=int, default=200, help="examples per multiple-choice task")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="fuse each fake quantizer with torch.compile (a few seconds per bit-width, then faster)")
    kernels_arg(p, "the tapped attention (quantized logits) and the --kurtosis-tokens profile")
    out_args(p, resume=True)
    p.set_defaults(func=_lazy("diffquant.commands.sweep", "run_cli"))


def _lm_eval(sub) -> None:
    p = _parser(sub, "lm-eval", "run lm-eval tasks on a model quantized by a recipe",
                "diffquant lm-eval --model smollm2-135m --tasks hellaswag --scheme w8a8 --hub --out runs/lm")
    model_args(p)
    data_args(p, calib_tokens=True, what="calibration (training split) for static scales, fixes, solvers")
    recipe_args(p, several=False)
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", default=None, help="folder of local lm-eval task YAMLs")
    p.add_argument("--limit", type=int, default=None)
    out_args(p)
    p.set_defaults(func=_lazy("diffquant.commands.lm_eval", "run_cli"))


def _plot(sub) -> None:
    p = _parser(sub, "plot", "redraw all figures of a profile, sweep or demo folder from its saved results",
                "diffquant plot runs/sweep")
    p.add_argument("folder")
    p.set_defaults(func=_lazy("diffquant.commands.plot", "run_cli"))


def _data(sub) -> None:
    p = _parser(sub, "data", f"fetch and describe corpora ({', '.join(choices('corpora').split(', ')[:6])})",
                "diffquant data fetch kjv")
    p.add_argument("action", choices=["fetch", "info", "list"])
    p.add_argument("name", nargs="?", default="kjv", help="corpus name, local file/folder, or hf:NAME")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--tokenizer", default=None, help="a model folder whose tokenizer counts the tokens (info)")
    p.set_defaults(func=_lazy("diffquant.commands.data", "run_cli"))


def _demo(sub) -> None:
    p = _parser(sub, "demo", "train, profile, sweep and report end to end (offline; it prints its plan and the "
                             "time of each step first)", "diffquant demo --quick")
    p.add_argument("--out", default="runs/demo", help="report folder (default runs/demo)")
    p.add_argument("--quick", action="store_true", help="tiny budgets: the same pipeline in a few minutes")
    p.add_argument("--force", action="store_true", help="overwrite an existing report folder")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=_lazy("diffquant.commands.demo", "run_cli"))


def _list(sub) -> None:
    p = _parser(sub, "list", "every registry: schemes, fixes, solvers, backends, sites, designs, metric sets, "
                             "corpora, granularities, presets, zoo", "diffquant list")
    p.set_defaults(func=lambda args: print(__import__("diffquant.catalog", fromlist=["text"]).text()))


def register(sub) -> None:
    for add in (_profile, _quantize, _train, _sweep, _lm_eval, _plot, _data, _demo, _list):
        add(sub)
