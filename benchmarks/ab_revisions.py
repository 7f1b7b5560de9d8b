"""Two revisions of diffquant timed against each other, interleaved, each round a fresh process per revision.

    git worktree add /tmp/before <commit>
    python -m benchmarks.ab_revisions /tmp/before            # that checkout against this one, 3 rounds
    python -m benchmarks.ab_revisions /tmp/before --rounds 5

On a shared two-core machine the same profile's CPU time moves by 10-30% from one process to the next (seen
2026-12-05: 11.0 to 14.3 CPU-s for one unchanged profile), more than most single changes make; only rounds that
alternate the two revisions in fresh processes, under the same load, compare them. Each process loads
SmolLM2-135M-Instruct as benchmarks/peers.py exports it (from this checkout), warms up, then times the
attention-logit profile of one 2,048-token KJV window with and without the sink metrics, and the hidden-state and
Linear-input profile of 8 × 256 tokens: one thread, glibc's malloc tuned as the command line tunes it, CPU time.
Prints each round and the medians; nothing is written.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from benchmarks import peers

ROOT = Path(__file__).resolve().parent.parent

CHILD = r'''
import json, time
import numpy as np, torch
torch.set_num_threads(1)
from diffquant.allocator import keep_freed_memory
keep_freed_memory()
from diffquant.models.load import load_model
from diffquant.profiler import profile_model
model, _ = load_model(ARGS["model"])
window = torch.from_numpy(np.load(ARGS["window"]))
batch = torch.from_numpy(np.load(ARGS["batch"])[:8])
token_sites = ["*.hidden", "*.attn_in", "*.attn_out", "*.mlp_in", "*.down_in"]
cases = {"attention logits": lambda: profile_model(model, window, ["*.attn_logits"], batch_size=1, progress=False),
         "attention logits and sinks": lambda: profile_model(model, window, ["*.attn_logits"], batch_size=1,
                                                             progress=False, sinks=True),
         "hidden and Linear inputs": lambda: profile_model(model, batch, token_sites, batch_size=8, progress=False)}
cases["attention logits"]()  # warm-up
out = {}
for name, run in cases.items():
    start = time.process_time()
    run()
    out[name] = time.process_time() - start
print("RESULT", json.dumps(out))
'''


def one(root: Path, args: dict) -> dict:
    """One process on `root`'s diffquant (the model and token files come from this checkout's benchmarks/.peers)."""
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    out = peers.run_code(sys.executable, CHILD, args, env, root)
    if "error" in out:
        raise SystemExit(f"{root}: the profile failed: {out['error']}")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path, help="the other checkout (a git worktree at the revision to compare)")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    if not (a.before / "diffquant" / "__init__.py").is_file():
        raise SystemExit(f"{a.before}: not a diffquant checkout (no diffquant/__init__.py)")
    folder, tokenizer = peers.export_model()
    args = {"model": str(folder), "window": str(peers.windows(tokenizer, 2048, 2048, part="all")),
            "batch": str(peers.windows(tokenizer, 256, 8192, part="all"))}
    trees = {"before": a.before.resolve(), "this checkout": ROOT}
    seen: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(a.rounds):
        for name, root in trees.items():
            seen[name].append(one(root, args))
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in seen[name][-1].items())
                  + f" CPU-s (load {os.getloadavg()[0]:.1f})", flush=True)
    for case in seen["before"][0]:
        before, after = (statistics.median(run[case] for run in seen[name]) for name in trees)
        print(f"{case}: median {before:.2f} -> {after:.2f} CPU-s ({after / before:.2f}x)")


if __name__ == "__main__":
    main()
