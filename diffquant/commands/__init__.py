"""Sub-command parsers, declared in one place. Each command's module is imported only when it runs,
so `diffquant --help` never loads torch."""

from __future__ import annotations

import importlib


def _lazy(module: str, name: str):
    def run(args):
        validate(args)  # one-line errors at once, before torch and transformers load (seconds)
        return getattr(importlib.import_module(module), name)(args)

    return run


def validate(args) -> None:
    """Checks of the arguments every command shares that need no heavy module."""
    from diffquant.errors import DiffquantError

    for key in ("tokens", "seq_len", "batch_size", "k", "calib_batches", "track_points"):
        value = getattr(args, key, None)
        if value is not None and value <= 0:
            raise DiffquantError(f"--{key.replace('_', '-')} must be positive, got {value}")
    _check_context(args)
    for key in ("data", "corpus"):
        if getattr(args, key, None):
            from diffquant.data.windows import check_source

            check_source(getattr(args, key))
    if getattr(args, "preset", None) is not None:
        from diffquant.models.presets import get_preset

        get_preset(args.preset)
    if getattr(args, "arch", None):
        from diffquant.designs import get

        for part in args.arch:
            for key in filter(None, (a.strip() for a in part.split(","))):
                get(key)
    if getattr(args, "scheme", None) and args.func is not None and not getattr(args, "list", False):
        from diffquant.quant.scheme import get_scheme

        get_scheme(args.scheme)
    for text in (getattr(args, "mitigate", None) or "").split(","):
        if text.strip():
            from diffquant.quant.mitigate import parse

            parse(text)
    for key in ("metrics", "track_metrics"):
        if getattr(args, key, None):
            from diffquant.stats.metric_sets import parse

            parse(getattr(args, key))
    for text in (getattr(args, "weights", None) or "").split(","):
        if text.strip():
            from diffquant.quant.solvers import parse as parse_solver

            parse_solver(text)
    for key in ("bits", "wa_grid"):
        if getattr(args, key, None):
            from diffquant.sweep import parse_bits

            parse_bits(getattr(args, key))
    if getattr(args, "granularity", None):
        from diffquant.quant.granularity import parse_granularity

        for g in args.granularity.split(","):
            parse_granularity(g)

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


LONG_CONTEXT_HELP = "run windows longer than the model's context (RoPE models may extrapolate)"
CORPUS_HELP = ("corpus name (kjv, gcide, wordnet, pydoc, linuxdoc, debian-mix), local text file/folder, hf:NAME[:CONFIG], "
               "or a synthetic token corpus synth:bb / synth:markov[:key=value,...] (default kjv)")
METRICS_HELP = ("the papers' metric sets to compute too, comma-separated: diff-table5, sun2024, gu2024, "
                "bondarenko2023, bondarenko2023-linear (docs/metrics.md; default none)")


def _profile(sub) -> None:
    p = sub.add_parser("profile", help="activation statistics and the paper's Table 5 for one or more models")
    p.add_argument("--model", action="append", required=True,
                   help="directory, .gguf, zoo name (smollm2-135m) or preset (tiny:diff); repeat for several; "
                        "LABEL=SOURCE names it")
    p.add_argument("--data", default="kjv", help=CORPUS_HELP)
    p.add_argument("--tokens", type=int, default=65536, help="tokens to profile per model (default 65536)")
    p.add_argument("--seq-len", type=int, default=256, help="sequence length (default 256)")
    p.add_argument("--allow-long-context", action="store_true", help=LONG_CONTEXT_HELP)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--sites", nargs="+", default=["*.attn_logits", "*.hidden"],
                   help="site globs (default: logits, hidden); attn_logits, attn_probs and attn_map compute their "
                        "layers' attention explicitly (T × T in query blocks), the other layers keep their kernel")
    p.add_argument("--k", type=int, default=100, help="top-k kept per site (default 100)")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16, fp16 or auto")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--device-map", default=None, help="'auto' to spread a large model over devices (accelerate)")
    p.add_argument("--hub", action="store_true", help="allow hub ids (needs network)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--force", action="store_true", help="overwrite an output folder that holds results")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--compile", action="store_true",
                   help="fuse the statistics with torch.compile (one-off compile, then several times faster)")
    p.add_argument("--no-sinks", action="store_true",
                   help="skip the attention-sink and massive-activation metrics (on by default; where no attention "
                        "site is profiled they cost one more call of each layer's own attention kernel, or, with "
                        "padding or an eager model, its explicit T × T attention in query blocks)")
    p.add_argument("--metrics", default="", help=METRICS_HELP)
    p.set_defaults(func=_lazy("diffquant.commands.profile", "run_cli"))


def _data(sub) -> None:
    p = sub.add_parser("data", help="fetch and describe corpora (kjv, gcide, wordnet, pydoc, linuxdoc, debian-mix)")
    p.add_argument("action", choices=["fetch", "info", "list"])
    p.add_argument("name", nargs="?", default="kjv", help="corpus name, local file/folder, or hf:NAME")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--tokenizer", default=None, help="a model folder whose tokenizer counts the tokens (info)")
    p.set_defaults(func=_lazy("diffquant.data.cli", "run_cli"))


def _quantize(sub) -> None:
    p = sub.add_parser("quantize", help="apply a quantization scheme (simulated or real low-bit) and save the model")
    p.add_argument("--list", action="store_true", help="list scheme presets and backends usable here")
    p.add_argument("--model", help="directory, zoo name, .gguf or preset")
    p.add_argument("--scheme", default=None, help="preset name or .json/.yaml file (default: the backend's own)")
    p.add_argument("--backend", default="fake", help="fake (simulation) or a real backend (see --list)")
    p.add_argument("--data", default="kjv", help="corpus for calibration and the metric gap: " + CORPUS_HELP)
    p.add_argument("--tokens", type=int, default=8192, help="evaluation tokens (default 8192)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--allow-long-context", action="store_true", help=LONG_CONTEXT_HELP)
    p.add_argument("--calib-batches", type=int, default=16, help="calibration batches for static scales")
    p.add_argument("--mitigate", default="none",
                   help="a function-preserving fix applied first: none, smoothquant[:ALPHA], rotate[:SEED], clip:mse, "
                        "clip:percentile:P (see --list)")
    p.add_argument("--weights", default="rtn",
                   help="how the weights reach their grid, after the mitigation: rtn (round to nearest), gptq, "
                        "gptq:act-order (calibrated on --calib-batches windows of the training split; see --list)")
    p.add_argument("--save-weights", action="store_true",
                   help="simulated schemes: also save a full copy of the float weights (default: the scheme and a "
                        "reference to --model, a few kB)")
    p.add_argument("--out", help="output folder")
    p.add_argument("--force", action="store_true")
    p.add_argument("--hub", action="store_true")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=_lazy("diffquant.quant.cli", "run_cli"))


def _train(sub) -> None:
    p = sub.add_parser("train", help="train matched models (baseline, DIFF, rival designs) on identical data")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--corpus", default="kjv", help=CORPUS_HELP)
    p.add_argument("--tokens", type=int, default=1_000_000, help="training tokens per model")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=None, help="training window (default: the preset's)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--schedule", default="cosine", choices=["cosine", "linear", "constant"],
                   help="decay after warm-up (default cosine, to min-lr-ratio × lr)")
    p.add_argument("--warmup-frac", type=float, default=0.05, help="linear warm-up share of the steps (default 0.05)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr (default 0.1)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of matrices (default 0.1)")
    p.add_argument("--bos", action="store_true",
                   help="start every training and validation window with a BOS token (text corpora; synthetic "
                        "corpora always have one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=200)
    p.add_argument("--arch", nargs="+", default=["baseline", "diff"],
                   help="designs to train, space- or comma-separated (see `diffquant models`)")
    p.add_argument("--track", action="store_true",
                   help="profile every model on a fixed held-out batch at log-spaced steps (emergence.json, plots)")
    p.add_argument("--track-points", type=int, default=16, help="log-spaced tracking points (default 16)")
    p.add_argument("--track-metrics", default="", help="with --track: " + METRICS_HELP)
    p.add_argument("--needle-fraction", type=float, default=0.0, help="fraction of training text made of needles")
    p.add_argument("--device", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--force", action="store_true")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=_lazy("diffquant.commands.train", "run_cli"))


def _sweep(sub) -> None:
    p = sub.add_parser("sweep", help="evaluate models at every bit-width / granularity / site (resumable)")
    p.add_argument("--model", action="append", required=True, help="LABEL=SOURCE or SOURCE; repeat")
    p.add_argument("--sites", default="attn_logits", help="comma-separated points (default attn_logits)")
    p.add_argument("--bits", default="16,8,6,4", help="activation bit-widths; 16 = the model's own precision")
    p.add_argument("--granularity", default="tensor", help="comma-separated: tensor,head,token,channel,group:G")
    p.add_argument("--eval", default="ppl", help="comma-separated: ppl, needle, mc:TASK (BIG-bench name or .jsonl)")
    p.add_argument("--wa-grid", default=None, help="bit-widths for a weight × activation grid, e.g. 8,6,4")
    p.add_argument("--per-layer", type=int, default=None, help="BITS: quantize one layer at a time (sensitivity)")
    p.add_argument("--schemes", default="", help="comma-separated whole-model schemes evaluated beside the "
                                                 "bit-width cells, e.g. w8a8-static,w4a16 (presets or files)")
    p.add_argument("--kurtosis-tokens", type=int, default=0,
                   help="profile attention logits and hidden states on this many held-out tokens and draw their "
                        "kurtosis per layer beside the accuracy figure (default 0: none)")
    p.add_argument("--mitigate", default="none",
                   help="comma-separated fixes applied before each scheme, one more sweep axis: none, "
                        "smoothquant[:ALPHA], rotate[:SEED], clip:mse, clip:percentile:P (calibrated on the training "
                        "split)")
    p.add_argument("--weights", default="rtn",
                   help="comma-separated weight solvers for the --wa-grid cells, one more axis: rtn, gptq, "
                        "gptq:act-order (calibrated on 16 windows of the training split)")
    p.add_argument("--data", default="kjv", help=CORPUS_HELP)
    p.add_argument("--tokens", type=int, default=16384, help="held-out tokens for ppl (default 16384)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--allow-long-context", action="store_true", help=LONG_CONTEXT_HELP)
    p.add_argument("--mc-limit", type=int, default=200, help="examples per multiple-choice task")
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true", help="continue a sweep in --out")
    p.add_argument("--force", action="store_true", help="discard results in --out and start again")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--compile", action="store_true",
                   help="fuse each fake quantizer with torch.compile (a few seconds per bit-width, then faster)")
    p.set_defaults(func=_lazy("diffquant.commands.sweep", "run_cli"))


def _plot(sub) -> None:
    p = sub.add_parser("plot", help="redraw all figures of a profile/sweep/demo folder from its saved results")
    p.add_argument("folder")
    p.set_defaults(func=_lazy("diffquant.report.plot_cli", "run_cli"))


def _demo(sub) -> None:
    p = sub.add_parser("demo", help="train, profile, sweep and report end to end (offline; about 10 min on a quiet "
                                    "2-core CPU with the corpus and SmolLM2 cached, see the README)")
    p.add_argument("--out", default="runs/demo", help="report folder (default runs/demo)")
    p.add_argument("--quick", action="store_true", help="tiny budgets: the same pipeline in a few minutes")
    p.add_argument("--force", action="store_true", help="overwrite an existing report folder")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=_lazy("diffquant.demo", "run_cli"))



def _lm_eval(sub) -> None:
    p = sub.add_parser("lm-eval", help="run lm-eval tasks on a model with a quantization scheme applied")
    p.add_argument("--model", required=True)
    p.add_argument("--scheme", default="fp", help="preset or .json/.yaml (default fp: none)")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include-path", default=None, help="folder of local lm-eval task YAMLs")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--out", required=True)
    p.add_argument("--hub", action="store_true")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=_lazy("diffquant.lm_eval_adapter", "run_cli"))


def register(sub) -> None:
    for add in (_profile, _quantize, _train, _sweep, _plot, _data, _demo, _lm_eval):
        add(sub)
