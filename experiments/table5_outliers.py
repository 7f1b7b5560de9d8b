"""Table 5 analog: largest |activation| of a matched DIFF/baseline pair, over several seeds.

    python -m experiments.table5_outliers [--quick] [--seeds 0 1 2] [--out runs/table5]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Settings:
    preset: str = "tiny"  # 5.26M parameters: trains on 2 CPU cores in minutes (paper: 3B)
    corpus: str = "kjv"  # offline, public domain
    train_tokens: int = 600_000  # per model, token-matched (paper: 350B)
    profile_tokens: int = 65_536  # held-out tokens profiled (paper: 0.4M)
    seeds: list[int] = field(default_factory=lambda: [0])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--out", default="runs/table5")
    p.add_argument("--pairs", default=None, help="folder of trained pairs, reused when their settings match (default: OUT/pairs)")
    a = p.parse_args(argv)
    s = Settings(preset=a.preset, seeds=a.seeds)
    if a.tokens:
        s.train_tokens = a.tokens
    if a.quick:
        s.train_tokens, s.profile_tokens = 20_000, 1024
    run(s, Path(a.out), Path(a.pairs) if a.pairs else None)


def run(s: Settings, out: Path, pairs: Path | None = None) -> None:
    from experiments.pairs import device, trained_pairs, validation_text

    import diffquant as dq
    from diffquant.lab import (TABLE5_RANKS, atomic_write_text, encode, fmt_ms, markdown, sequences, start_run,
                               write_report)

    dev = device()
    out = start_run(out, s, dev)
    val = validation_text(s.corpus)
    per_seed: dict[tuple[str, str], dict[str, list[float]]] = {}
    for seed, folder in zip(s.seeds, trained_pairs(s.preset, s.corpus, s.train_tokens, s.seeds, pairs or out / "pairs")):
        profiles = [dq.profile(model, sequences(encode(tok, val), 256, s.profile_tokens), label=label, sinks=False)
                    for label, (model, tok) in dq.load_pair(folder, designs=("baseline", "diff"), device=dev).items()]
        write_report(profiles, out / f"seed{seed}")
        for prof in profiles:
            for kind in ("attn_logits", "hidden"):
                summ = prof.pooled(kind).summary(full=False)
                d = per_seed.setdefault((prof.label, kind), {})
                for r in TABLE5_RANKS:
                    d.setdefault(r, []).append(summ["top"][r])
                d.setdefault("median", []).append(summ["quantiles"]["median"])
                d.setdefault("kurtosis", []).append(summ["kurtosis"])
    header = ["model", "activation", *TABLE5_RANKS, "median", "kurtosis"]
    rows = [[m, k, *[fmt_ms(v[c]) for c in (*TABLE5_RANKS, "median", "kurtosis")]] for (m, k), v in per_seed.items()]
    table = (f"Table 5 analog: {s.preset} pair, {s.train_tokens:,} training tokens each, {s.profile_tokens:,} tokens "
             f"profiled, seeds {s.seeds} (mean ± sd). Paper: 3B parameters, 350B tokens.\n\n" + markdown(header, rows))
    atomic_write_text(out / "table5.md", table)
    print(table)


if __name__ == "__main__":
    main()
