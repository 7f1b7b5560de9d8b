"""`diffquant quantize`: simulate a scheme or build a real low-bit model, save it, and measure it."""

from __future__ import annotations

import tempfile
from pathlib import Path

from diffquant.errors import DiffquantError
from diffquant.paths import atomic_write_json

def list_text() -> str:
    from diffquant.quant.backends import BACKENDS, backend_status
    from diffquant.quant.mitigate import DOCS
    from diffquant.quant.scheme import PRESETS
    from diffquant.quant.solvers import DOCS as SOLVERS

    lines = ["schemes:"]
    lines += [f"  {s.name:<12} {s.description}" for s in PRESETS.values()]
    lines.append("mitigations (--mitigate, applied before the scheme, preserving the float model):")
    lines += [f"  {k:<28} {v}" for k, v in DOCS.items()]
    lines.append("weight solvers (--weights, after the mitigation, on calibration windows of the training split):")
    lines += [f"  {k:<28} {v}" for k, v in SOLVERS.items()]
    lines.append("backends:")
    lines.append(f"  {'fake':<15} diffquant's exact simulation of any scheme (always available)")
    status = backend_status()
    lines += [f"  {b.name:<15} {b.description}; simulated by '{b.simulated_by}' [{status[b.name]}]"
              for b in BACKENDS.values()]
    from diffquant.quant.export import REFUSED

    lines.append("export (--export compressed-tensors: the simulated model, every weight bit-identical); refused:")
    lines += [f"  {k:<28} {v}" for k, v in REFUSED.items()]
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
    from diffquant.models.load import load_model
    from diffquant.paths import fix_modes
    from diffquant.commands.common import prepare_out
    from diffquant.quant import backends
    from diffquant.quant.saved import save_scheme
    from diffquant.quant.scheme import calibrate, get_scheme, quantize_
    from diffquant.stats.intervals import paired

    from diffquant.quant.mitigate import adjust_scheme, mitigate_, parse, weights_for
    from diffquant.quant import solvers

    real = args.backend != "fake"
    backend = backends.require(args.backend) if real else None
    mitigation = parse(args.mitigate)
    solver = solvers.parse(weights_for(mitigation, args.weights))
    if real and (mitigation is not None or solver is not None):
        raise DiffquantError("--mitigate and --weights apply to simulated schemes (--backend fake); real backends "
                             "quantize the float weights as they are")
    export = getattr(args, "export", None)
    if export and (real or args.save_weights):
        raise DiffquantError("--export writes the simulated model (--backend fake) as its own checkpoint; it does not "
                             "go with a real --backend or --save-weights")
    scheme = adjust_scheme(get_scheme(args.scheme or (backend.simulated_by if real else "w8a8")), mitigation)
    out = prepare_out(args.out, args.force, "quantize.json")
    model, tokenizer = load_model(args.model, hub=args.hub, cache=args.cache_dir)
    if tokenizer is None:
        raise DiffquantError(f"{args.model} has no tokenizer, needed for calibration and evaluation data")
    if export:  # a recipe the format cannot hold is refused before any data, calibration or solving
        from diffquant.quant.export import check
        from diffquant.quant.gptq_config import GPTQ

        act_order = isinstance(solver, GPTQ) and solver.act_order
        check(model, scheme, mitigation and mitigation.label(), act_order)
    calib = corpus_windows(args.data, tokenizer, "train", args.seq_len, args.calib_batches * args.seq_len,
                           args.cache_dir, chars=200_000)
    evalset = corpus_windows(args.data, tokenizer, "validation", args.seq_len, args.tokens, args.cache_dir)
    result = {"model": args.model, "scheme": scheme.to_dict(), "backend": args.backend, "data": args.data,
              "mitigation": args.mitigate, "weights": weights_for(mitigation, args.weights),
              "calibration": {"split": "train", "sequences": len(calib), "tokens": int(calib.numel())}}
    if getattr(model, "_diffquant_source_quantization", None):  # a compressed-tensors checkpoint, dequantized
        result["source_quantization"] = model._diffquant_source_quantization
    quantize_(model, scheme).remove()  # a scheme that cannot apply is refused here, before any evaluation
    if not real and args.save_weights:
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        fix_modes(out)
    result["fp"] = _evaluate(model, evalset, "float")
    result["fp_bytes"] = backends.serialized_bytes(model)
    applied = mitigate_(model, mitigation, calib, scheme)
    result["mitigation_record"] = {k: v for k, v in applied.record.items() if k != "scales"}
    solved = solvers.solve_weights_(model, solver, scheme, calib)
    result["weights_record"] = solved.record
    attachment = quantize_(model, solved.scheme(scheme))
    solved.install(attachment)
    calibrate(model, attachment, calib.split(8))
    result["simulated"] = _evaluate(model, evalset, scheme.name)
    result["simulated"]["paired_loss_change"] = paired(result["fp"].pop("per_sequence_loss"),
                                                       result["simulated"].pop("per_sequence_loss"))
    if export:
        from diffquant.quant.export import export_compressed_tensors

        result["export"] = export_compressed_tensors(model, attachment, out, tokenizer,
                                                     mitigation and mitigation.label(), act_order)
    elif not real:  # the scheme, and a reference to the float model unless its weights were copied
        save_scheme(attachment, out, None if args.save_weights else _source_reference(args.model, args.hub),
                    applied.record, solved)
    else:
        attachment.remove()
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            qmodel = backends.load_real(args.backend, tmp, calib[:8])
        result["real"] = _evaluate(qmodel, evalset, args.backend)
        result["real"].pop("per_sequence_loss")
        result["real_bytes"] = backends.serialized_bytes(qmodel)
        result["gap_loss_real_minus_simulated"] = result["real"]["loss"] - result["simulated"]["loss"]
        backends.save_real(qmodel, args.backend, out)
        tokenizer.save_pretrained(out)
    atomic_write_json(out / "quantize.json", result)
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


def _evaluate(model, evalset, what: str) -> dict:
    from diffquant.evaluate import language_modeling

    print(f"evaluating {what} on {evalset.numel():,} tokens", flush=True)
    return language_modeling(model, evalset, progress=True)


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
    if "export" in r:
        e = r["export"]
        lines.append(f"  exported    {e['format']} ({e['quantization_config']['format']}), {e['safetensors_bytes']:,} B of "
                     f"safetensors ({e['safetensors_bytes'] / r['fp_bytes']:.1%} of the float model's size); every "
                     "weight bit-identical to the simulated one")
    if "real" in r:
        lines.append(f"  real        loss {r['real']['loss']:.4f}  ppl {r['real']['ppl']:.3f}  size {r['real_bytes']:,} B"
                     f"  (real - simulated loss: {r['gap_loss_real_minus_simulated']:+.4f})")
    return "\n".join(lines)
