"""Rival outlier fixes side by side: DIFF, gated attention, clipped softmax and learned sinks against the
baseline, trained identically (same data order, seed, tokens, schedule and hyper-parameters, written down
before any run and tuned for no design) for three seeds, in two settings:

- demo: the demo's setting (tiny preset, 600K KJV tokens, lr 3e-3 and weight decay 0.1: TrainConfig's
  defaults, not the result of a sweep);
- regime: the setting experiments/emergence.py chose: the first in which the baseline reaches the outlier
  regime or, when none does (as in docs/emergence/search.md: none did), the one whose curves extrapolate to
  it soonest.

    python experiments/rivals.py [--quick] [--only demo|regime] [--seeds 0 1 2] [--out docs/rivals]

Per design: held-out loss, the Table 5 analog, sink rate, and the perplexity cost of int4 attention logits
and of W8A8, each mean ± 95% t-interval over seeds, on the same held-out sequences.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from emergence import QUICK, SEARCH, choose, regime  # noqa: E402

ARCHS = ("baseline", "diff", "gated", "clipsoftmax", "sink")
SCHEMES = ("logits-int4", "w8a8")
DEMO = dict(preset="tiny", corpus="kjv", seq_len=256, batch_size=16, lr=3e-3, weight_decay=0.1, tokens=600_000)


def regime_setting(search_json: Path) -> tuple[str, dict]:
    """The setting experiments/emergence.py chose (see `choose`)."""
    name = choose(SEARCH, json.loads(search_json.read_text())["results"])
    return name, SEARCH[name]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", choices=["demo", "regime"])
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2 (--quick: 0 1)")
    p.add_argument("--archs", nargs="+", default=list(ARCHS))
    p.add_argument("--out", default="docs/rivals")
    p.add_argument("--runs", default="runs", help="checkpoints: RUNS/rivals/demo, and RUNS/emergence/<setting> (shared "
                                                  "with experiments/emergence.py, whose seed-0 baseline it reuses)")
    p.add_argument("--search", default="docs/emergence/search.json")
    a = p.parse_args(argv)
    a.seeds = a.seeds or ([0, 1] if a.quick else [0, 1, 2])
    out, root = Path(a.out), (Path(a.out) / "runs" if a.quick else Path(a.runs))
    from diffquant.runs import start_run

    start_run(out, vars(a), "cpu")
    settings = {}
    if a.quick:
        settings["demo"] = ("quick", next(iter(QUICK.values())))
    else:
        if a.only != "regime":
            settings["demo"] = ("demo", DEMO)
        if a.only != "demo":
            settings["regime"] = regime_setting(Path(a.search))
    n_eval = 8 if a.quick else 64
    for which, (name, overrides) in settings.items():
        runs = root / ("emergence" if which == "regime" else "rivals")
        regime(name, overrides, tuple(a.archs), a.seeds, runs, out / which, n_eval, SCHEMES)
        print(f"## {which}: {name}\n")
        print((out / which / "results.md").read_text())


if __name__ == "__main__":
    main()
