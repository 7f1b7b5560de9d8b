"""The public API, `import diffquant as dq`: load, profile, quantize, evaluate, sweep, plot.

Each function is the code the command line runs (the CLI parses its flags and calls these), so a result made
in Python and one made by `diffquant <command>` are the same computation.

    model, tok = dq.load("smollm2-135m")                                # a zoo name, folder, .gguf or preset
    held_out = dq.windows("kjv", tok, split="validation", seq_len=256, tokens=8192)
    prof = dq.profile(model, held_out, sites=["*.attn_logits", "*.hidden"])
    with dq.quantize_(model, [dq.SmoothQuant(alpha=0.5), dq.GPTQ(), "w8a8-static"], calibration=train) as q:
        print(dq.perplexity(model, held_out)["ppl"])
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from diffquant.allocator import keep_freed_memory
from diffquant.errors import DiffquantError
from diffquant.profiler import ModelProfile as Profile
from diffquant.quant.algorithms.gptq_config import GPTQ
from diffquant.quant.algorithms.mitigate import Clip, Rotate, SmoothQuant
from diffquant.quant.recipe import Quantized, Recipe, quantize_
from diffquant.quant.numerics.scheme import QuantScheme
from diffquant.quant.algorithms.solvers import AWQ

__all__ = ["load", "load_pair", "windows", "profile", "Profile", "quantize_", "Recipe", "Quantized", "SmoothQuant",
           "Rotate", "Clip", "GPTQ", "AWQ", "QuantScheme", "scheme", "perplexity", "multiple_choice", "sweep",
           "plot_sweep", "train", "registries", "keep_freed_memory"]


def load(source: str, *, device: str | None = None, dtype: str = "fp32", device_map=None, hub: bool = False,
         cache_dir: str | None = None):
    """(model, tokenizer) of a zoo name (`smollm2-135m`), a save_pretrained folder, a compressed-tensors folder
    (llm-compressor's or `--export`'s: weights dequantized to their exact grid, what it held in every report), a
    `.gguf` file, a folder `diffquant quantize` wrote, a preset `tiny:diff` (random weights, byte tokenizer), or a
    hub id with `hub=True` (the only case that downloads). `device` "cpu", "cuda", "cuda:1" (default: CUDA when
    there is one); `dtype` fp32, bf16, fp16 or auto. transformers' hub kernels stay off (`use_kernels=False`)."""
    from diffquant.models.load import load_model
    from diffquant.models.placement import resolve_device

    device = None if device_map else resolve_device(device)
    return load_model(source, dtype=dtype, device=device, device_map=device_map, hub=hub, cache=cache_dir)


def windows(data: str, tokenizer, *, split: str = "validation", seq_len: int = 256, tokens: int = 65536,
            cache_dir: str | None = None):
    """[n, seq_len] token ids of a corpus split: kjv, gcide, wordnet, pydoc, linuxdoc, debian-mix (offline
    Debian sources), a local text file or folder, hf:NAME (online), or synth:bb / synth:markov. Calibration
    belongs to split="train", evaluation to split="validation"."""
    from diffquant.data.windows import corpus_windows

    return corpus_windows(data, tokenizer, split, seq_len, tokens, cache_dir)


def profile(model, windows, sites: Iterable[str] = ("*.attn_logits", "*.hidden"), *, batch_size: int = 8,
            k: int = 100, sinks: bool = True, metrics: Iterable[str] = (), compile: bool = False,
            kernels: str = "auto", label: str = "model", progress: bool = False) -> "Profile":
    """Streaming statistics of `sites` (globs over `layers.{i}.{point}`; `diffquant sites` lists the points) on
    `windows`: moments, kurtosis, top-k with locations, |x| histogram and quantiles, per-channel maxima; with
    `sinks` (the command line's default too) the attention-sink and massive-activation metrics; `metrics` the
    papers' metric sets (diff-table5, sun2024, gu2024, bondarenko2023, bondarenko2023-linear). Returns a
    Profile: `.table()`, `.save(folder)` (report, figures, and the profile itself), `Profile.load(folder)`,
    `.merge(other)`. `kernels`: "auto" (Triton on CUDA where it is installed, `pip install 'diffquant[gpu]'`;
    torch elsewhere), "triton" or "torch"; the report records which one computed each site.

    On CPU under Linux, call `dq.keep_freed_memory()` once first, as the command line does: glibc then reuses
    freed memory instead of mapping fresh pages for every large tensor (benchmarks/run.py's `smollm2` section: the
    plain eager forward of a 2,048-token SmolLM2 window took 16.9 CPU-s without it and 9.6 with it). It changes the
    process's malloc settings for good, which is why the API leaves it to you."""
    from diffquant.profiler import profile_model

    return profile_model(model, windows, list([sites] if isinstance(sites, str) else sites), batch_size=batch_size,
                         k=k, sinks=sinks, metrics=metrics, compile=compile, label=label, progress=progress,
                         kernels=kernels)


def scheme(name: str) -> QuantScheme:
    """A scheme preset (`diffquant quantize --list`) or a .json/.yaml scheme file."""
    from diffquant.quant.numerics.scheme import get_scheme

    return get_scheme(name)


def perplexity(model, windows, *, batch_size: int = 8, positions=None) -> dict:
    """Loss, perplexity (with its 95% interval over sequences), next-token accuracy and per-sequence losses.
    `positions` ([n, seq_len − 1] bool, aligned with the targets windows[:, 1:]) also reports the loss at those
    predictions alone (`positions_loss`, `positions_tokens`): a task's answer tokens, say, whose loss the mean over
    every token would hide."""
    from diffquant.evaluate import language_modeling

    return language_modeling(model, windows, batch_size=batch_size, positions=positions)


def multiple_choice(model, tokenizer, examples: list[dict]) -> dict:
    """Zero-shot multiple-choice accuracy scored as lm-eval does (`acc`, `acc_norm`, Wilson intervals)."""
    from diffquant.evaluate import multiple_choice as mc

    return mc(model, tokenizer, examples)


def sweep(models: dict, data: str, out, *, sites: Iterable[str] = ("attn_logits",),
          bits: Iterable[int] = (16, 8, 6, 4), granularities: Iterable[str] = ("tensor",),
          schemes: Iterable[str] = (), fixes: Iterable[str] = ("none",), weights: Iterable[str] = ("rtn",),
          wa_grid: Iterable[int] | None = None, per_layer: int | None = None, evals: Iterable[str] = ("ppl",),
          seq_len: int = 256, tokens: int = 16384, kurtosis_tokens: int = 0, mc_limit: int = 200,
          cache_dir: str | None = None, compile: bool = False, kernels: str = "auto",
          progress: bool = False, recipes: Iterable = (), calib_tokens: int | None = None) -> list[dict]:
    """Evaluate every cell (model × site × bits × granularity, whole-model schemes, a weight × activation grid,
    per-layer sensitivity; × fixes × weight solvers; one per recipe file of `recipes`) of `models` ({label:
    (model, tokenizer)}) on `tokens` held-out tokens of the validation split of `data`, calibrated on
    `calib_tokens` of its training split (default 16 windows), resumably into `out` (cells.jsonl,
    results.csv/json); returns the rows."""
    from diffquant.sweeps import run_sweep

    return run_sweep(models, data, Path(out), sites=list(sites), bits=list(bits), granularities=list(granularities),
                     schemes=list(schemes), fixes=list(fixes), weights=list(weights),
                     wa_grid=list(wa_grid) if wa_grid else None, per_layer=per_layer, evals=list(evals),
                     seq_len=seq_len, tokens=tokens, kurtosis_tokens=kurtosis_tokens, mc_limit=mc_limit,
                     cache=cache_dir, compile=compile, progress=progress, kernels=kernels, calib_tokens=calib_tokens,
                     recipes=[str(r) for r in recipes])


def plot_sweep(rows: list[dict], out) -> list[Path]:
    """The sweep's figures: metric versus bit-width per site and granularity (the paper's Figure 8), the
    weight × activation grid, per-layer sensitivity, and accuracy versus bits beside each model's kurtosis
    per layer (when the sweep measured `kurtosis_tokens`)."""
    from diffquant.report.sweep_plots import plot_sweep as plot

    return plot(rows, Path(out))


def train(out, *, preset: str = "tiny", designs: Iterable[str] = ("baseline", "diff"), data: str = "kjv",
          tokens: int = 1_000_000, resume: bool = False, device: str | None = None, dtype: str = "auto",
          progress: bool = False, **settings) -> dict:
    """Train matched models of `designs` (`dq.registries()["designs"]`) at `preset` on identical data: the same
    batches in the same order, the same schedule and token budget; checkpoints in out/<design>, resumable.
    `settings` are diffquant.training.TrainConfig's (lr, batch_size, seq_len, schedule, weight_decay, seed, track,
    ...). `dtype`: the forward's precision, auto (bf16 autocast on CUDA, fp32 elsewhere), fp32 or bf16 (autocast on
    the CPU too); weights and optimizer state stay fp32. Returns the run's metrics; `dq.load_pair(out)` loads the
    models."""
    from diffquant.models.placement import resolve_device
    from diffquant.training import TrainConfig, train_pair

    try:
        cfg = TrainConfig(preset=preset, archs=tuple(designs), corpus=data, tokens=tokens, **settings)
    except ValueError as e:
        raise DiffquantError(str(e)) from None
    return train_pair(cfg, out, resolve_device(device), resume=resume, progress=progress, dtype=dtype)


def load_pair(folder, designs: Iterable[str] | None = None, device: str | None = None) -> dict:
    """{display name: (model, tokenizer)} of the designs `dq.train` saved in `folder` (default: all of them)."""
    from diffquant.models.load import load_pair as pair

    if designs is None:
        designs = [p.name for p in sorted(Path(folder).iterdir()) if (p / "config.json").is_file()]
    return pair(folder, device, tuple(designs))


def registries() -> dict[str, list[str]]:
    """Every name the API and the command line accept, by registry (what `diffquant list` prints)."""
    from diffquant.catalog import names

    return names()
