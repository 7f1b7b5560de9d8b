"""Shared by the experiments: train (or reuse) matched pairs for several seeds."""

from __future__ import annotations

from pathlib import Path

import torch

from diffquant.training import TrainConfig, train_pair


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def validation_text(corpus: str) -> str:
    """The held-out split of a corpus (never trained on)."""
    from diffquant.data.corpora import load_text, split

    return split(load_text(corpus)[0])[1]


def trained_pairs(preset: str, corpus: str, tokens: int, seeds: list[int], root: Path, needle_fraction: float = 0.0,
                  batch_size: int = 16, lr: float = 3e-3, track: bool = False) -> list[Path]:
    """One trained pair folder per seed under root (resumed if already there); `track` writes emergence.json."""
    folders = []
    for seed in seeds:
        folder = root / (f"{preset}-{corpus}-{tokens}-s{seed}" + (f"-n{needle_fraction}" if needle_fraction else "")
                         + ("-track" if track else ""))
        cfg = TrainConfig(preset=preset, corpus=corpus, tokens=tokens, seed=seed, batch_size=batch_size, lr=lr,
                          needle_fraction=needle_fraction, eval_every=100, save_every=200, track=track)
        train_pair(cfg, folder, device(), resume=(folder / "train_config.json").exists())
        folders.append(folder)
    return folders


def sweep_pair(folder: Path, dev: str, val: str, evals: list[str], eval_tokens: int, out: Path, sites=(),
               bits=(), granularities=("tensor",), wa=None) -> list[dict]:
    """Load a trained pair and run sweep cells on it (results and figures in `out`)."""
    from diffquant.data.tokens import encode, sequences
    from diffquant.models.load import load_pair
    from diffquant.report.sweep_plots import plot_sweep
    from diffquant.sweeps import Evaluator, build_cells, run_cells

    models = load_pair(folder, dev)
    evalset = sequences(encode(models["DIFF"][1], val), 256, eval_tokens)
    evaluators = {label: Evaluator(evals, evalset, tok, val, {}) for label, (_, tok) in models.items()}
    cells = build_cells(list(models), list(sites), list(bits), list(granularities), wa, None, {})
    out.mkdir(parents=True, exist_ok=True)
    rows = run_cells(models, cells, evaluators, out, progress=False)
    plot_sweep(rows, out)
    return rows
