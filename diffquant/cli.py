"""diffquant's command line: find a model's activation outliers, measure how many bits it survives, and
quantize it (each command's code is imported only when it runs)."""

from __future__ import annotations

import argparse
import sys

from diffquant import __version__
from diffquant.commands import info
from diffquant.errors import DiffquantError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffquant", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Find a model's activation outliers, measure how many bits it survives, and quantize it.\n\n"
                    "  diffquant profile --model smollm2-135m --out runs/profile     # where the outliers are\n"
                    "  diffquant sweep --model smollm2-135m --bits 16,8,6,4 --out runs/sweep   # bits vs accuracy\n"
                    "  diffquant quantize --model smollm2-135m --scheme w8a8-static --out runs/q\n"
                    "  diffquant list                                                  # every registry\n\n"
                    "`diffquant COMMAND --help` describes each command.")
    parser.add_argument("--version", action="version", version=f"diffquant {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--verbose", action="store_true",
                        help="let third-party libraries print their warnings, load messages and progress bars")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("env", help="versions, device, usable backends and attention implementations")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=info.env)

    p = sub.add_parser("models", help="matched DIFF/baseline presets with parameter counts, and the offline zoo")
    p.set_defaults(func=info.models)

    p = sub.add_parser("sites", help="list site names (for a model, or the point table)")
    p.add_argument("--model", help="preset (tiny:diff), zoo name, directory (a save_pretrained folder, or a "
                                   "compressed-tensors one such as llm-compressor writes: its weights dequantized) or .gguf")
    p.add_argument("--select", nargs="+", help="glob(s) such as '*.attn_logits'")
    p.add_argument("--hub", action="store_true", help="allow a hub id (needs network)")
    p.add_argument("--device", default=None, help="where the model loads: cpu, cuda, cuda:N or mps (default: cuda "
                                                  "when this machine has it)")
    p.add_argument("--dtype", default="fp32", help="the model's precision: fp32, bf16, fp16 or auto (default fp32)")
    p.set_defaults(func=info.sites)

    from diffquant import commands

    commands.register(sub)
    return parser


def _terminate(signum, frame):
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: finally-blocks run, partial work stays consistent


def main(argv: list[str] | None = None) -> int:
    import signal

    if threading_main():
        signal.signal(signal.SIGTERM, _terminate)
        if hasattr(signal, "SIGPIPE"):
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `diffquant ... | head` ends quietly, like other tools
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verbose:
        quiet_third_party()
    from diffquant.allocator import keep_freed_memory

    keep_freed_memory()  # faster CPU forwards; see diffquant/allocator.py
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        args.func(args)
    except DiffquantError as e:
        if args.debug:
            raise
        print(f"diffquant: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        resume = " (use --resume to continue)" if hasattr(args, "resume") else ""
        print(f"diffquant: interrupted; what was written so far is complete{resume}", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one clear line unless --debug
        if args.debug:
            raise
        print(f"diffquant: error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
        return 1
    return 0


THIRD_PARTY = ("torch", "torchao", "transformers", "bitsandbytes", "optimum", "accelerate", "lm_eval", "datasets",
               "huggingface_hub", "matplotlib")


def quiet_third_party() -> None:
    """No library chatter on stdout/stderr: transformers' load bars and advice, torchao's missing-CUDA-kernel
    lines and torch's deprecation notes (diffquant's own progress bars and warnings stay). Set before those
    libraries load, which read some of it at import."""
    import logging
    import os
    import warnings

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for name in THIRD_PARTY + ("torch.utils._pytree",):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="(" + "|".join(THIRD_PARTY) + r")(\.|$)")


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
