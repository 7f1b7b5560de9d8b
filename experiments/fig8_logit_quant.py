"""Figure 8 analog: quantize only the attention logits (dynamic absmax) at 16/8/6/4 bits and measure
held-out perplexity of a matched pair, for each granularity and several seeds.

    python -m experiments.fig8_logit_quant [--quick] [--seeds 0 1 2] [--granularity tensor head token]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Settings:
    preset: str = "tiny"  # paper: 3B
    corpus: str = "kjv"
    train_tokens: int = 600_000  # paper: 350B
    eval_tokens: int = 16_384  # held-out tokens per cell (paper: HellaSwag zero-shot)
    bits: list[int] = field(default_factory=lambda: [16, 8, 6, 4])  # the paper's x axis
    granularity: list[str] = field(default_factory=lambda: ["tensor", "head", "token"])  # the paper does not say
    seeds: list[int] = field(default_factory=lambda: [0])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--granularity", nargs="+", default=["tensor", "head", "token"])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--out", default="runs/fig8")
    p.add_argument("--pairs", default=None, help="folder of trained pairs, reused when their settings match (default: OUT/pairs)")
    a = p.parse_args(argv)
    s = Settings(preset=a.preset, seeds=a.seeds, granularity=a.granularity)
    if a.quick:
        s.train_tokens, s.eval_tokens, s.granularity = 20_000, 1024, s.granularity[:1]
    run(s, Path(a.out), Path(a.pairs) if a.pairs else None)


def run(s: Settings, out: Path, pairs: Path | None = None) -> list[dict]:
    from experiments.pairs import device, sweep_pair, trained_pairs, validation_text

    from diffquant.lab import atomic_write_text, fmt_ms, markdown, start_run

    dev = device()
    out = start_run(out, s, dev)
    val = validation_text(s.corpus)
    all_rows = []
    for seed, folder in zip(s.seeds, trained_pairs(s.preset, s.corpus, s.train_tokens, s.seeds, pairs or out / "pairs")):
        rows = sweep_pair(folder, dev, val, ["ppl"], s.eval_tokens, out / f"seed{seed}", ["attn_logits"], s.bits,
                          s.granularity)
        all_rows += [{**r, "seed": seed} for r in rows]
    groups: dict[tuple, list[float]] = {}
    for r in all_rows:
        groups.setdefault((r["model"], r["granularity"], r["bits"]), []).append(r["ppl"])
    body = [[m, g, *[fmt_ms(groups[(m, g, b)]) for b in s.bits]]
            for m, g in sorted({(k[0], k[1]) for k in groups})]
    table = (f"Perplexity with attention logits quantized (dynamic absmax), {s.preset} pair, {s.train_tokens:,} "
             f"training tokens, seeds {s.seeds}. Paper (3B, HellaSwag acc): DIFF 66.2/66.3/66.0/58.8, Transformer "
             f"63.4/62.7/58.9/33.9 at 16/8/6/4 bits.\n\n" + markdown(["model", "granularity", *[f"{b}-bit" for b in s.bits]], body))
    atomic_write_text(out / "fig8.md", table)
    print(table)
    return all_rows


if __name__ == "__main__":
    main()
