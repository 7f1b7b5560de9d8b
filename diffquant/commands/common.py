"""Argument handling the sub-commands share: model labels, output folders, the recipe and calibration budget."""

from __future__ import annotations

from pathlib import Path

from diffquant.errors import DiffquantError

CALIB_WINDOWS = 16  # --calib-tokens' default, in windows of --seq-len (the 16 calibration batches of Bondarenko et al.)


def parse_model_args(values: list[str]) -> list[tuple[str, str]]:
    """(label, source) per --model: LABEL=SOURCE, else the zoo model's exact name (SmolLM2-135M-Instruct (Q4_1 →
    fp32), as every report names it) or the folder's name."""
    from diffquant.models.zoo import ALIASES, ZOO

    out = []
    for v in values:
        label, sep, source = v.partition("=")
        default = ZOO[ALIASES[v]].display if v in ALIASES else (Path(v).name or v)
        out.append((label, source) if sep and source else (default, v))
    labels = [label for label, _ in out]
    if len(set(labels)) != len(labels):
        raise DiffquantError(f"model labels must differ, got {labels}; name them LABEL=SOURCE")
    return out


def prepare_out(out: str | Path, force: bool, marker: str) -> Path:
    """Create the output folder; refuse one that already holds results unless --force."""
    path = Path(out)
    if (path / marker).exists() and not force:
        raise DiffquantError(f"{path} already holds results ({marker}); pass --force to overwrite or choose another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".diffquant-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise DiffquantError(f"cannot write to {path}: {e.strerror}") from None
    return path


def site_points(value) -> list[str]:
    from diffquant.taps.sites import site_points as points

    return points(value)


def load_models(args) -> dict[str, tuple]:
    """{label: (model, tokenizer)} of every --model, placed by --device / --dtype / --device-map (one line for a
    device this machine lacks, before anything loads), each with its tokenizer (refused without one)."""
    from diffquant.models.load import load_model
    from diffquant.models.placement import resolve_device

    device = None if getattr(args, "device_map", None) else resolve_device(args.device)
    models = {}
    for label, source in parse_model_args(args.model if isinstance(args.model, list) else [args.model]):
        model, tokenizer = load_model(source, dtype=getattr(args, "dtype", "fp32"), device=device,
                                      device_map=getattr(args, "device_map", None), hub=args.hub,
                                      cache=args.cache_dir)
        if tokenizer is None:
            raise DiffquantError(f"{source} has no tokenizer files; pass a folder that holds them (diffquant train "
                                 "saves them with every checkpoint)")
        models[model_label(label, source, model)] = (model, tokenizer)
    return models


def model_label(label: str, source: str, model) -> str:
    """The report name of a loaded --model: a compressed-tensors folder named by default (its folder's name) is
    named as a GGUF model is, with what it held and what it runs in."""
    held = getattr(model, "_diffquant_source_quantization", None)
    if not held or label != Path(source).name:
        return label
    from diffquant.quant.checkpoints.compressed import label as held_label

    return f"{label} {held_label(held, next(model.parameters()).dtype)}"


def command_recipe(args, default_scheme: str):
    """The recipe a command line spells: its --recipe file, else its --fix (in order), --solver and --scheme."""
    from diffquant.quant.recipe import from_cli, load_recipe

    if args.recipe:
        return load_recipe(args.recipe)
    return from_cli(args.fix or [], args.solver, args.scheme or default_scheme)


def calib_tokens(args) -> int:
    """--calib-tokens, by default CALIB_WINDOWS windows of --seq-len."""
    return args.calib_tokens if args.calib_tokens is not None else CALIB_WINDOWS * args.seq_len
