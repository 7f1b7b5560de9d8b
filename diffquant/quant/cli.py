"""`diffquant quantize`: simulate a scheme or build a real low-bit model, save it, and measure it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from diffquant import DiffquantError
from diffquant.paths import atomic_write_json

SCHEME_FILE = "diffquant_scheme.json"


def list_text() -> str:
    from diffquant.quant.backends import BACKENDS, backend_status
    from diffquant.quant.scheme import PRESETS

    lines = ["schemes:"]
    lines += [f"  {s.name:<12} {s.description}" for s in PRESETS.values()]
    lines.append("backends:")
    lines.append(f"  {'fake':<15} diffquant's exact simulation of any scheme (always available)")
    status = backend_status()
    lines += [f"  {b.name:<15} {b.description}; simulated by '{b.simulated_by}' [{status[b.name]}]"
              for b in BACKENDS.values()]
    return "\n".join(lines)


def save_fake(model, tokenizer, attachment, out: Path) -> None:
    """The float model, its tokenizer and the scheme (with static scales), applied again on load.
    The attachment is removed first, so the float weights (not their parametrizations) are saved."""
    scales = {name: q.state() for name, q in attachment.quantizers.items() if q.state()}
    attachment.remove()
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    atomic_write_json(out / SCHEME_FILE, {"scheme": attachment.scheme.to_dict(), "scales": scales})


def apply_saved_scheme(model, folder: Path):
    """Re-attach a scheme saved by `save_fake`; returns the attachment."""
    from diffquant.quant.scheme import QuantScheme, quantize_

    data = json.loads((folder / SCHEME_FILE).read_text())
    attachment = quantize_(model, QuantScheme.from_dict(data["scheme"]))
    for name, state in data.get("scales", {}).items():
        attachment.quantizers[name].load_state(state)
    return attachment


def run_cli(args) -> None:
    if args.list:
        print(list_text())
        return
    if not args.model or not args.out:
        raise DiffquantError("quantize needs --model and --out (or --list)")
    from diffquant.data.corpora import load_text, split
    from diffquant.data.tokens import encode, sequences
    from diffquant.evaluate import language_modeling
    from diffquant.models.load import load_model
    from diffquant.profile import prepare_out
    from diffquant.quant import backends
    from diffquant.quant.scheme import calibrate, get_scheme, quantize_

    real = args.backend != "fake"
    backend = backends.require(args.backend) if real else None
    scheme = get_scheme(args.scheme or (backend.simulated_by if real else "w8a8"))
    out = prepare_out(args.out, args.force, "quantize.json")
    model, tokenizer = load_model(args.model, hub=args.hub, cache=args.cache_dir)
    if tokenizer is None:
        raise DiffquantError(f"{args.model} has no tokenizer, needed for calibration and evaluation data")
    text, _ = load_text(args.data, args.cache_dir)
    train, val = split(text)
    calib = sequences(encode(tokenizer, train[: 200_000]), args.seq_len, args.calib_batches * args.seq_len)
    evalset = sequences(encode(tokenizer, val), args.seq_len, args.tokens)
    result = {"model": args.model, "scheme": scheme.to_dict(), "backend": args.backend, "data": args.data}
    result["fp"] = language_modeling(model, evalset)
    result["fp_bytes"] = backends.serialized_bytes(model)
    attachment = quantize_(model, scheme)
    calibrate(model, attachment, calib.split(8))
    result["simulated"] = language_modeling(model, evalset)
    if not real:
        save_fake(model, tokenizer, attachment, out)
    else:
        attachment.remove()
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            qmodel = backends.load_real(args.backend, tmp, calib[:8])
        result["real"] = language_modeling(qmodel, evalset)
        result["real_bytes"] = backends.serialized_bytes(qmodel)
        result["gap_loss_real_minus_simulated"] = result["real"]["loss"] - result["simulated"]["loss"]
        backends.save_real(qmodel, args.backend, out)
        tokenizer.save_pretrained(out)
    atomic_write_json(out / "quantize.json", result)
    print(summary_text(result))
    print(f"saved to {out} (load it with diffquant --model {out})")


def summary_text(r: dict) -> str:
    lines = [f"{r['model']}: scheme {r['scheme']['name']}, backend {r['backend']}",
             f"  fp          loss {r['fp']['loss']:.4f}  ppl {r['fp']['ppl']:.3f}  size {r['fp_bytes']:,} B",
             f"  simulated   loss {r['simulated']['loss']:.4f}  ppl {r['simulated']['ppl']:.3f}"]
    if "real" in r:
        lines.append(f"  real        loss {r['real']['loss']:.4f}  ppl {r['real']['ppl']:.3f}  size {r['real_bytes']:,} B"
                     f"  (real - simulated loss: {r['gap_loss_real_minus_simulated']:+.4f})")
    return "\n".join(lines)
