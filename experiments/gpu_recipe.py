"""GPU recipe: on one H200, train the `small` matched pair token-matched (33.7M parameters each) with outlier
tracking (`train --track`: emergence.json and curves at 33.7M parameters), profile both (Table 5 analog, sinks)
and run the Figure 8 sweep, all under one folder, in about 10 minutes.
`--quick` runs the same pipeline on CPU with tiny budgets (the test suite does).

    python experiments/gpu_recipe.py --out runs/gpu        # on a GPU
    python experiments/gpu_recipe.py --quick --out /tmp/g  # anywhere
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


@dataclass
class Settings:
    preset: str = "small"  # 33.7M parameters (paper: 3B)
    corpus: str = "debian-mix"  # 70 MB of text, so 20M tokens are not many epochs of KJV
    train_tokens: int = 20_000_000  # per model; sized for ~4 min each on an H200 (not yet measured there)
    batch_size: int = 64  # x 512 tokens = 32K tokens per step
    lr: float = 2e-3
    profile_tokens: int = 262_144
    eval_tokens: int = 65_536
    bits: list[int] = field(default_factory=lambda: [16, 8, 6, 4])
    granularity: list[str] = field(default_factory=lambda: ["tensor", "head", "token"])
    seeds: list[int] = field(default_factory=lambda: [0])


QUICK = dict(preset="micro", corpus="kjv", train_tokens=8192, batch_size=8, profile_tokens=512, eval_tokens=512,
             granularity=["tensor"])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="runs/gpu")
    p.add_argument("--pairs", default=None, help="folder of trained pairs, reused when their settings match (default: OUT/pairs)")
    a = p.parse_args(argv)
    s = Settings(**QUICK) if a.quick else Settings()
    run(s, Path(a.out), Path(a.pairs) if a.pairs else None)


def run(s: Settings, out: Path, pairs: Path | None = None) -> None:
    from pairs import device, trained_pairs, validation_text

    from diffquant.data.tokens import encode, sequences
    from diffquant.models.load import load_pair
    from diffquant.paths import atomic_write_json
    from diffquant.profiler import profile_model
    from diffquant.report.profile_report import write_report
    from diffquant.report.sweep_plots import plot_sweep
    from diffquant.runs import start_run
    from diffquant.sweeps import Evaluator, build_cells, run_cells, summary_table

    dev = device()
    out = start_run(out, s, dev)
    t0 = time.perf_counter()
    folder = trained_pairs(s.preset, s.corpus, s.train_tokens, s.seeds[:1], pairs or out / "pairs", batch_size=s.batch_size,
                           lr=s.lr, track=True)[0]
    t_train = time.perf_counter() - t0
    import json

    from diffquant.report.emergence_plots import plot_emergence

    (out / "emergence").mkdir(exist_ok=True)
    plot_emergence(json.loads((folder / "emergence.json").read_text()), out / "emergence")
    val = validation_text(s.corpus)
    models = load_pair(folder, dev)
    val_ids = encode(models["DIFF"][1], val)
    from diffquant.models.presets import get_preset

    seq_len = get_preset(s.preset).seq_len
    profiles = [profile_model(m, sequences(val_ids, seq_len, s.profile_tokens), label=label, batch_size=32, sinks=True)
                for label, (m, _) in models.items()]
    write_report(profiles, out / "profile")
    evalset = sequences(val_ids, seq_len, s.eval_tokens)
    evaluators = {label: Evaluator(["ppl"], evalset, t, val, {}) for label, (_, t) in models.items()}
    cells = build_cells(list(models), ["attn_logits"], s.bits, s.granularity, None, None, {})
    (out / "fig8").mkdir(exist_ok=True)
    rows = run_cells(models, cells, evaluators, out / "fig8")
    plot_sweep(rows, out / "fig8")
    atomic_write_json(out / "timing.json", {"train_s": t_train, "total_s": time.perf_counter() - t0})
    print((out / "profile" / "table5.md").read_text())
    print(summary_table(rows))
    print(f"total {time.perf_counter() - t0:.0f} s; everything under {out}")


if __name__ == "__main__":
    main()
