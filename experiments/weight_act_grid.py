"""Weight × activation grid: W 8/6/4 × A 8/6/4 (per-channel weights, per-token dynamic Linear inputs)
on a matched pair; perplexity per cell, heatmaps per model.

    python -m experiments.weight_act_grid [--quick] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Settings:
    preset: str = "tiny"  # paper: 3B (the paper has no W×A grid; this asks whether DIFF helps beyond logits)
    corpus: str = "kjv"
    train_tokens: int = 600_000
    eval_tokens: int = 16_384
    bits: list[int] = field(default_factory=lambda: [8, 6, 4])
    seeds: list[int] = field(default_factory=lambda: [0])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", default="runs/wa_grid")
    p.add_argument("--pairs", default=None, help="folder of trained pairs, reused when their settings match (default: OUT/pairs)")
    a = p.parse_args(argv)
    s = Settings(seeds=a.seeds)
    if a.quick:
        s.train_tokens, s.eval_tokens, s.bits = 20_000, 1024, [8, 4]
    run(s, Path(a.out), Path(a.pairs) if a.pairs else None)


def run(s: Settings, out: Path, pairs: Path | None = None) -> None:
    from experiments.pairs import device, sweep_pair, trained_pairs, validation_text

    from diffquant.lab import atomic_write_text, fmt_ms, markdown, start_run

    dev = device()
    out = start_run(out, s, dev)
    val = validation_text(s.corpus)
    groups: dict[tuple, list[float]] = {}
    for seed, folder in zip(s.seeds, trained_pairs(s.preset, s.corpus, s.train_tokens, s.seeds, pairs or out / "pairs")):
        for r in sweep_pair(folder, dev, val, ["ppl"], s.eval_tokens, out / f"seed{seed}", wa=s.bits):
            if r["kind"] == "wa":
                groups.setdefault((r["model"], r["wbits"]), {}).setdefault(r["bits"], []).append(r["ppl"])
    body = [[m, f"W{w}", *[fmt_ms(v[a]) for a in s.bits]] for (m, w), v in sorted(groups.items())]
    table = (f"Perplexity, W×A grid, {s.preset} pair, {s.train_tokens:,} training tokens, seeds {s.seeds}.\n\n"
             + markdown(["model", "weights", *[f"A{a}" for a in s.bits]], body))
    atomic_write_text(out / "wa_grid.md", table)
    print(table)


if __name__ == "__main__":
    main()
