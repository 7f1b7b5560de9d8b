"""Shared by the experiments: train (or reuse) matched pairs for several seeds."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import diffquant as dq
from diffquant.lab import TrainConfig, train_pair


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def worker_device(worker: int, devices: int) -> str:
    """The device of worker K of `--worker K/N`: GPU K mod the visible GPUs (each on its own where there are
    enough), the CPU where there is none."""
    return f"cuda:{worker % devices}" if devices else "cpu"


def seconds(fn, device: str) -> float:
    """Wall time of fn(), the device's queued work included."""
    import time

    sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def train_rate(preset: str, arch: str, batch_size: int, seq_len: int, vocab: int | None, device: str,
               steps: int = 2) -> float:
    """Training tokens/s of one design as `train` runs it (forward with bf16 autocast on CUDA, backward, AdamW
    step), over `steps` steps after one warm-up step, on random token ids."""
    from diffquant.lab import build_model, get_preset

    spec = get_preset(preset)
    model = build_model(spec, arch, vocab=vocab, seq_len=seq_len).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab or spec.vocab, (batch_size, seq_len), device=device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=str(device).startswith("cuda")):
            loss = model(ids, labels=ids, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    step()
    return ids.numel() * steps / seconds(lambda: [step() for _ in range(steps)], device)


def fit_or_refuse(estimate: dict[str, float], minutes: float, what: str, hint: str) -> None:
    """Print the estimated time of a plan, part by part, before anything long starts; refuse (one line) a plan
    that will not fit `minutes`."""
    total = sum(estimate.values())
    parts = ", ".join(f"{k} {v / 60:.1f}" for k, v in estimate.items())
    print(f"{what}: estimated {total / 60:.1f} min ({parts}), measured on this machine; the plan allows {minutes:.1f}",
          flush=True)
    if total > minutes * 60:
        raise dq.DiffquantError(f"{what} would take about {total / 60:.1f} min, more than the {minutes:.1f} allowed: "
                                f"{hint}")


def validation_text(corpus: str) -> str:
    """The held-out split of a corpus (never trained on)."""
    from diffquant.lab import load_text, split_corpus

    return split_corpus(load_text(corpus)[0])[1]


def trained_pairs(preset: str, corpus: str, tokens: int, seeds: list[int], root: Path, needle_fraction: float = 0.0,
                  batch_size: int = 16, lr: float = 3e-3, track: bool = False) -> list[Path]:
    """One trained pair folder per seed under root (resumed if already there); `track` writes emergence.json."""
    folders = []
    for seed in seeds:
        name = re.sub(r"[^A-Za-z0-9._-]", "_", corpus)  # synth:bb:vocab=65 -> synth_bb_vocab_65
        folder = root / (f"{preset}-{name}-{tokens}-s{seed}" + (f"-n{needle_fraction}" if needle_fraction else "")
                         + ("-track" if track else ""))
        cfg = TrainConfig(preset=preset, corpus=corpus, tokens=tokens, seed=seed, batch_size=batch_size, lr=lr,
                          needle_fraction=needle_fraction, eval_every=100, save_every=200, track=track)
        train_pair(cfg, folder, device(), resume=(folder / "train_config.json").exists())
        folders.append(folder)
    return folders


def sweep_pair(folder: Path, dev: str, val: str, evals: list[str], eval_tokens: int, out: Path, sites=(),
               bits=(), granularities=("tensor",), wa=None, needle_examples: int = 20) -> list[dict]:
    """Load a trained pair and run sweep cells on it (results and figures in `out`)."""
    from diffquant.lab import Evaluator, build_cells, encode, run_cells, sequences

    models = dq.load_pair(folder, designs=("baseline", "diff"), device=dev)
    evalset = sequences(encode(models["DIFF"][1], val), 256, eval_tokens)
    evaluators = {label: Evaluator(evals, evalset, tok, val, {}, needle_examples)
                  for label, (_, tok) in models.items()}
    cells = build_cells(list(models), list(sites), list(bits), list(granularities), wa, None, {})
    out.mkdir(parents=True, exist_ok=True)
    rows = run_cells(models, cells, evaluators, out, progress=False)
    dq.plot_sweep(rows, out)
    return rows
