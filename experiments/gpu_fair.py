"""The fair comparison of experiments/fair_rivals.py at the `small` preset (33.7M parameters) on one GPU,
within about 8 minutes of an H200 including start-up, fully offline: it trains on generated
Bigram-Backcopy sequences (no corpus, no hub), so the first time a GPU is at hand it runs unchanged.

Budget: `--budget-minutes` (default 4.5) of training for the whole comparison (8 designs × (3 rates + 4
more seeds) = 56 runs); the tokens per model follow from the tokens/s measured on the machine at start
(plan.json; not yet measured on an H200), the rest of the 8 minutes is start-up, tracking (8 snapshots a run)
and measurement (32 held-out sequences, 5 schemes, per run): 56 runs make that overhead large, so the first
GPU run should be read for its timing (printed at the end) and `--budget-minutes` set from it. `--quick` runs the same pipeline on CPU on micro
settings (the test suite runs it with networking disabled).

    python experiments/gpu_fair.py --out runs/gpu_fair           # on a GPU
    python experiments/gpu_fair.py --quick --out /tmp/gf          # anywhere, offline
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fair_rivals import EXPERIMENTS, GUO_TRAIN, Experiment, run  # noqa: E402

# The small preset (width 512, 8 layers, 8 heads, 512-token windows) on Guo et al.'s task and optimiser
# (see fair_rivals.GUO_NOTES); vocabulary 65 symbols + BOS like theirs; 64 × 513 tokens per step.
SMALL = Experiment("small-bb", dict(GUO_TRAIN, preset="small", seq_len=513, batch_size=64, save_every=100),
                   tokens=200_000_000, lrs=(3e-4, 1e-3, 3e-3), eval_sequences=32,
                   calibration_sequences=16, track_points=8,
                   notes={"scale": "small preset, 8 heads per layer (DIFF: 4 differential heads), not Guo's one head"})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="runs/gpu_fair")
    p.add_argument("--budget-minutes", type=float, default=4.5)
    a = p.parse_args(argv)
    from pairs import device

    t0 = time.perf_counter()
    e = EXPERIMENTS["quick"] if a.quick else SMALL
    out = Path(a.out)
    dev = device()
    if not a.quick and dev == "cpu":
        print("no GPU: the small-preset comparison would take days here; use --quick, or fair_rivals.py on CPU")
    doc = run(e, out, out / "runs", (1.0 if a.quick else a.budget_minutes / 60), dev)
    print((out / "results.md").read_text())
    print(f"total {time.perf_counter() - t0:.0f} s; {doc['plan']['runs']} runs; everything under {out}")


if __name__ == "__main__":
    main()
