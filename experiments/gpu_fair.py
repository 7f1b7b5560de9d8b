"""The fair comparison of experiments/fair_rivals.py at the `small` preset (25.4M parameters with its 66-symbol
vocabulary) on one GPU, within `--minutes` (8) of an H200 including start-up, fully offline: it trains on generated
Bigram-Backcopy sequences (no corpus, no hub), so the first time a GPU is at hand it runs unchanged.

Plan: 8 designs × (3 rates + 4 more seeds) = 56 runs. At start it measures, on the machine, every design's
training tokens/s and the seconds of a tracking snapshot (8 a run), a run's measurement (32 held-out sequences,
every scheme, calibration) and a checkpoint write, and gives each model the tokens that make the whole plan fit
the minutes left (plan.json); it prints the estimate before training and refuses, in one line, a plan whose
tracking, measurement and checkpoints alone would not fit. `--quick` runs the same pipeline on CPU on micro
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
RESERVE_S = 20  # the results, figures and report after the last cell


def main(argv=None) -> None:
    t0 = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="runs/gpu_fair")
    p.add_argument("--minutes", type=float, default=8.0, help="the whole run, start-up included (default 8)")
    a = p.parse_args(argv)
    from pairs import device

    e = EXPERIMENTS["quick"] if a.quick else SMALL
    out = Path(a.out)
    dev = device()
    if not a.quick and dev == "cpu":
        print("no GPU: the small-preset comparison would take days here; use --quick, or fair_rivals.py on CPU")
    left = max(0.0, a.minutes * 60 - (time.perf_counter() - t0) - RESERVE_S)
    doc = run(e, out, out / "runs", left / 3600, dev)
    print((out / "results.md").read_text())
    print(f"total {time.perf_counter() - t0:.0f} s of the {a.minutes:g} min allowed; {doc['plan']['runs']} runs; "
          f"everything under {out}")


if __name__ == "__main__":
    from diffquant.errors import DiffquantError

    try:
        main()
    except DiffquantError as err:  # one line, not a traceback
        raise SystemExit(f"gpu_fair: {err}") from None
