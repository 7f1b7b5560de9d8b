"""`diffquant quantize`: simulate a scheme or build a real low-bit model, save it, and measure it."""

from __future__ import annotations

import tempfile
from pathlib import Path

from diffquant.errors import DiffquantError
from diffquant.paths import atomic_write_json, atomic_write_text

RECIPE_FILE = "recipe.yaml"  # beside what quantize wrote: the recipe it ran

def list_text() -> str:
    """`quantize --list`: the recipe's registries (diffquant/catalog.py), and which backends work here."""
    from diffquant.quant.checkpoints.backends import backend_status
    from diffquant.catalog import entries

    reg = entries()
    status = {"fake": "available", **backend_status()}
    lines = []
    for registry, heading in (("schemes", "schemes (--scheme)"),
                              ("fixes", "fixes (--fix, repeatable: applied in order before the solver and the "
                                        "scheme, preserving the float model)"),
                              ("solvers", "weight solvers (--solver, after the fixes, on calibration windows of the "
                                          "training split)"), ("backends", "backends (--backend)")):
        lines.append(heading + ":")
        width = max(len(n) for n, _ in reg[registry])
        lines += [f"  {n:<{width}}  {doc}" + (f" [{status[n]}]" if registry == "backends" else "")
                  for n, doc in reg[registry]]
    from diffquant.quant.checkpoints.export import refused

    lines.append("export (--export compressed-tensors: the simulated model, every weight bit-identical); refused:")
    lines += [f"  {k:<28} {v}" for k, v in refused().items()]
    return "\n".join(lines)


def _source_reference(model: str, hub: bool) -> dict:
    """How a saved scheme names its float model: a folder or file by absolute path, else as given."""
    path = Path(model)
    return {"model": str(path.resolve()) if path.exists() else model, "hub": hub}


def _sizes(folder: Path) -> str:
    files = sorted(f for f in folder.iterdir() if f.is_file())
    return ", ".join(f"{f.name} ({_human(f.stat().st_size)})" for f in files)


def _human(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def run_cli(args) -> None:
    if args.list:
        print(list_text())
        return
    if not args.model or not args.out:
        raise DiffquantError("quantize needs --model and --out (or --list)")
    from diffquant.data.windows import corpus_windows
    from diffquant.paths import fix_modes
    from diffquant.commands.common import calib_tokens, command_recipe, load_models, prepare_out
    from diffquant.quant.checkpoints import backends
    from diffquant.quant.recipe import quantize_
    from diffquant.quant.numerics.scheme import plan
    from diffquant.stats.intervals import paired

    real = args.backend != "fake"
    backend = backends.require(args.backend) if real else None
    recipe = command_recipe(args, backend.simulated_by if real else "w8a8")
    if real and (recipe.fixes or recipe.solver is not None):
        raise DiffquantError("fixes and weight solvers apply to simulated schemes (--backend fake); real backends "
                             "quantize the float weights as they are")
    export = getattr(args, "export", None)
    if export and (real or args.save_weights):
        raise DiffquantError("--export writes the simulated model (--backend fake) as its own checkpoint; it does not "
                             "go with a real --backend or --save-weights")
    out = prepare_out(args.out, args.force, "quantize.json")
    from diffquant.stopwatch import Stopwatch

    clock = Stopwatch(say=True)  # each stage's seconds, printed as it finishes and kept in quantize.json
    ((_, (model, tokenizer)),) = load_models(args).items()
    clock.lap("load model")
    plan(model, recipe.adjusted_scheme())  # a scheme that cannot apply is refused here, before any evaluation
    if export:  # a recipe the format cannot hold is refused before any data, calibration or solving
        from diffquant.quant.recipe import check_export

        check_export(model, recipe)
    calib = corpus_windows(args.data, tokenizer, "train", args.seq_len, calib_tokens(args), args.cache_dir,
                           chars=200_000)
    evalset = corpus_windows(args.data, tokenizer, "validation", args.seq_len, args.eval_tokens, args.cache_dir)
    clock.lap("data")
    from diffquant.evaluate import input_device

    device, dtype = input_device(model), model.dtype  # the float, simulated and real passes all run here
    result = {"model": args.model, "scheme": recipe.adjusted_scheme().to_dict(), "backend": args.backend,
              "data": args.data, "recipe": recipe.to_dict(), "fixes": [f.label() for f in recipe.fixes],
              "solver": recipe.solver.label() if recipe.solver else "rtn",
              "calibration": {"split": "train", "sequences": len(calib), "tokens": int(calib.numel())},
              "device": str(device), "dtype": str(dtype).removeprefix("torch.")}
    if getattr(model, "_diffquant_source_quantization", None):  # a compressed-tensors checkpoint, dequantized
        result["source_quantization"] = model._diffquant_source_quantization
    if getattr(model, "_diffquant_caveat", None):  # weights quantized before diffquant saw them (models/load.py)
        result["source_caveat"] = model._diffquant_caveat
    if real:  # refused here, before any evaluation, where the kernels cannot run this model
        for note in backends.check(args.backend, model, device):
            print(note, flush=True)
    if not real and args.save_weights:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        fix_modes(out)
        clock.lap("save float weights")
    result["fp"] = _evaluate(model, evalset, "float", args.batch_size)
    result["fp_bytes"] = backends.serialized_bytes(model)
    clock.lap("evaluate float")
    q = quantize_(model, recipe, calib, progress=True)
    clock.add(q.seconds)  # printed by quantize_ as each step finished
    result["fix_records"] = q.record["fixes"]
    result["solver_record"] = q.record["weights"]
    result["simulated"] = _evaluate(model, evalset, q.scheme.name, args.batch_size)
    result["simulated"]["paired_loss_change"] = paired(result["fp"].pop("per_sequence_loss"),
                                                       result["simulated"].pop("per_sequence_loss"))
    clock.lap("evaluate simulated")
    if not real:  # what ran, as a file `--recipe` reruns
        recipe.save(out / RECIPE_FILE)
    if export:
        result["export"] = q.export(out, tokenizer)
        clock.lap("export")
    elif not real:  # the scheme, and a reference to the float model unless its weights were copied
        q.save(out, None if args.save_weights else _source_reference(args.model, args.hub))
        clock.lap("save")
    else:
        q.remove()
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            qmodel = backends.load_real(args.backend, tmp, calib[:8], device=device, dtype=dtype)
        result["real_kernels"] = backends.kernels(qmodel, args.backend)
        result["real"] = _evaluate(qmodel, evalset, args.backend, args.batch_size)
        result["real"].pop("per_sequence_loss")
        result["real_bytes"] = backends.serialized_bytes(qmodel)
        result["gap_loss_real_minus_simulated"] = result["real"]["loss"] - result["simulated"]["loss"]
        backends.save_real(qmodel, args.backend, out)
        tokenizer.save_pretrained(out)
        clock.lap("real backend")
    result["seconds"] = {**clock.seconds, "total": clock.total()}  # stages in order; their sum is within the total
    atomic_write_json(out / "quantize.json", result)
    if export:
        atomic_write_text(out / "README.md", model_card(result))
    print(summary_text(result))
    print(f"wrote {out}: {_sizes(out)}")
    if export:
        for note in result["export"]["notes"]:
            print(f"note: {note}")
        print(f"load it with transformers' AutoModelForCausalLM.from_pretrained({str(out)!r}) (compressed-tensors "
              f"installed; vLLM serves it too), or as --model {out} in any diffquant command")
        return
    print(f"use it as --model {out} in any diffquant command (profile, sweep, quantize, lm-eval), or "
          f"diffquant.models.load.load_model({str(out)!r}) in Python"
          + ("" if real or args.save_weights else f"; it applies the scheme to {args.model}, which must stay where it is"))


def model_card(r: dict) -> str:
    """README.md of an exported folder: what it is, how it was made and measured, and the source's caveat."""
    lines = [f"# {r['model']}, {r['scheme']['name']} (compressed-tensors)", "",
             f"Written by `diffquant quantize` from `{r['model']}`: recipe `{r['recipe']}`, calibrated on "
             f"{r['calibration']['tokens']:,} tokens of {r['data']}'s training split.", "", "```", summary_text(r), "```",
             "", "Load it with `transformers.AutoModelForCausalLM.from_pretrained(this folder)` (compressed-tensors "
             "installed), or serve it with vLLM; quantize.json holds every number above."]
    if r.get("source_caveat"):
        lines += ["", f"**Caveat.** {r['source_caveat']}."]
    return "\n".join(lines) + "\n"


def _evaluate(model, evalset, what: str, batch_size: int) -> dict:
    from diffquant.evaluate import language_modeling

    print(f"evaluating {what} on {evalset.numel():,} tokens", flush=True)
    return language_modeling(model, evalset, batch_size=batch_size, progress=True)


def summary_text(r: dict) -> str:
    """The command's printout: loss ± its 95% t-interval over sequences, perplexity with the exponential of that
    interval, and the paired loss change (t-interval)."""
    from diffquant.stats.intervals import fmt_interval, fmt_pm, half95

    d = r["simulated"]["paired_loss_change"]
    change = f"  (loss change {d['mean']:+.4f}, 95% paired t-interval [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}])" \
        if d.get("ci95") else ""
    n = f"{r['fp']['tokens']:,} tokens, {r['fp']['sequences']} sequences"

    def loss_ppl(m: dict) -> str:
        return (f"loss {fmt_pm(m['loss'], half95(m['loss_se'], m['sequences']), 4)}  "
                f"ppl {fmt_interval(m['ppl'], m.get('ppl_ci95'), 4)}")

    lines = [f"{r['model']}: scheme {r['scheme']['name']}, backend {r['backend']}; held-out {n}; 95% t-intervals over "
             "sequences (perplexity: the exponential of the loss interval)",
             f"  fp          {loss_ppl(r['fp'])}  size {r['fp_bytes']:,} B",
             f"  simulated   {loss_ppl(r['simulated'])}{change}"]
    if r.get("source_caveat") and r["scheme"]["weights"]:
        lines.append(f"  caveat      {r['source_caveat']}")
    if "export" in r:
        e = r["export"]
        lines.append(f"  exported    {e['format']} ({e['quantization_config']['format']}), {e['safetensors_bytes']:,} B of "
                     f"safetensors ({e['safetensors_bytes'] / r['fp_bytes']:.1%} of the float model's size); every "
                     "weight bit-identical to the simulated one")
    if "real" in r:
        lines.append(f"  real        loss {r['real']['loss']:.4f}  ppl {r['real']['ppl']:.3f}  size {r['real_bytes']:,} B"
                     f"  (real - simulated loss: {r['gap_loss_real_minus_simulated']:+.4f})")
        if "real_kernels" in r:
            lines.append(f"  real kernels on {r['real_kernels']['device']}: {r['real_kernels']['computes']}")
    return "\n".join(lines)
