"""Where diffquant's profile spends its CPU time beyond the model's forward, per statistic, on the cost cases of
benchmarks/peers.py (SmolLM2-135M-Instruct): the 150 token sites `hidden`, `attn_in`, `attn_out`, `mlp_in`,
`down_in` of all 30 layers on one batch of 8 windows of 256 tokens, and (`--logits`) the attention logits of all 30
layers on one window of 2,048 tokens.

    python -m benchmarks.peers_breakdown            # token sites; run benchmarks/peers.py once first (model folder)
    python -m benchmarks.peers_breakdown --logits   # attention logits: the "breakdown_logits" entry

One thread. Each figure is the least CPU time over ROUNDS rounds (the machine is shared), in CPU-seconds per
2,048 tokens: the bare forward, the forward with no-op taps on the sites (hooks alone), the whole profile, and
`SiteStats.update` taken apart on the activations of one batch, recorded once and fed to each part in turn. The
parts that commit ebaa11f rewrote are timed in both forms, the formulas before it kept here as `before_*`, so that
the record shows what changed (the histogram bins: now one shift of |x|'s bit pattern, before a shift and a mask of
x's); both give bit-identical statistics (tests/test_stats.py). Result: the "breakdown" entry of
benchmarks/peers.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks import peers  # noqa: E402
from diffquant.models.load import load_model  # noqa: E402
from diffquant.paths import atomic_write_json  # noqa: E402
from diffquant.profiler import profile_model  # noqa: E402
from diffquant.stats import site_stats  # noqa: E402
from diffquant.stats.histogram import AbsHistogram, abs_magnitude_bins, magnitude_bins  # noqa: E402
from diffquant.stats.moments import sum64  # noqa: E402
from diffquant.stats.topk import TopK  # noqa: E402
from diffquant.taps import tapped  # noqa: E402

ROUNDS = 5
THRESHOLD = 6.0


def before_moments(x):
    s1 = sum64(x)
    d = x - (s1 / x.numel()).to(x.dtype)
    d2 = d * d
    return sum64(d2), sum64(d2 * d), sum64(d2 * d2)


def moments(x):
    s1 = sum64(x)
    d = x - (s1 / x.numel()).to(x.dtype)
    d2 = d * d
    return sum64(d2), sum64(d.mul_(d2)), sum64(d2.mul_(d2))


def before_hits(a):
    return (a >= THRESHOLD).sum(dim=(0, 1))


def hits(a):
    below = (a - THRESHOLD).view(torch.int32).bitwise_right_shift_(31)
    return (a.shape[0] * a.shape[1] + below.sum(dim=(0, 1), dtype=torch.int32)).long()


def least_cpu(fn, rounds: int = ROUNDS) -> float:
    best = float("inf")
    for _ in range(rounds):
        c = time.process_time()
        fn()
        best = min(best, time.process_time() - c)
    return best


LOGIT_TOKENS = 2048


def logits_breakdown() -> dict:
    """The attention-logit profile of one 2,048-token window against the model's plain forwards, end to end (least
    CPU time over ROUNDS), and per operator: torch.profiler's self CPU time of the profile (with the sink metrics,
    as `dq.profile` runs it) less that of the same forward with no-op taps on the logits (the same explicit
    attention in the same blocks), the operators that grew most with their share of what the statistics add and
    their extra calls per forward. Uses only the public profiler, so the same script measures
    any revision of the code (PYTHONPATH)."""
    from torch.profiler import ProfilerActivity, profile as trace

    folder, tokenizer = peers.export_model()
    model, _ = load_model(str(folder))
    ids = torch.from_numpy(np.load(peers.windows(tokenizer, LOGIT_TOKENS, LOGIT_TOKENS, part="all")))

    def forward(impl):
        def run():
            model.set_attn_implementation(impl)
            try:
                with torch.inference_mode():
                    model(ids, use_cache=False, logits_to_keep=1)
            finally:
                model.set_attn_implementation("sdpa")
        return run

    def noop_taps():
        with tapped(model, {"*.attn_logits": lambda x, ctx: None}), torch.inference_mode():
            model(ids, use_cache=False, logits_to_keep=1)

    def logit_profile(sinks):
        return lambda: profile_model(model, ids, ["*.attn_logits"], batch_size=1, k=100, progress=False, sinks=sinks)

    cases = {"plain forward (SDPA)": forward("sdpa"), "plain forward (eager attention)": forward("eager"),
             "explicit attention, no-op taps on the logits": noop_taps,
             "logit statistics": logit_profile(False), "logit statistics and sink metrics": logit_profile(True)}
    for fn in cases.values():
        fn()  # warm-up
    whole = {name: least_cpu(fn) for name, fn in cases.items()}

    def self_times(fn):
        with trace(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        return {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}

    # against the forward with no-op taps on the logits: the same explicit attention in the same query blocks, so
    # what grows is the statistics' own work (against transformers' eager forward, its attention's ops would mix in)
    base = "explicit attention, no-op taps on the logits"
    plain, stats = self_times(cases[base]), self_times(cases["logit statistics and sink metrics"])
    extra = {k: stats.get(k, (0.0, 0))[0] - plain.get(k, (0.0, 0))[0] for k in stats.keys() | plain.keys()}
    added = sum(v for v in extra.values() if v > 0)
    top = sorted(extra.items(), key=lambda kv: -kv[1])[:14]
    eager = whole["plain forward (eager attention)"]
    return {"model": peers.MODEL_LABEL, "tokens": int(ids.numel()), "layers": model.config.num_hidden_layers,
            "heads": model.config.num_attention_heads, "threads": 1, "rounds": ROUNDS, "revision": _revision(),
            "started": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg()[0],
            "end_to_end_cpu_s": whole,
            "ratio_to_eager": {name: v / eager for name, v in whole.items()},
            "traced_s": {base: sum(v for v, _ in plain.values()),
                         "logit statistics and sink metrics": sum(v for v, _ in stats.values())},
            "added_against": base,
            "added_by_op": {k: {"s": round(v, 3), "share": round(v / added, 3),
                                "calls": stats.get(k, (0, 0))[1] - plain.get(k, (0, 0))[1]} for k, v in top if v > 0}}


def _revision() -> str:
    """The git revision of the diffquant code imported (which may be another checkout than this script's)."""
    import subprocess

    import diffquant

    out = subprocess.run(["git", "-C", str(Path(diffquant.__file__).parent), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or f"not a git checkout ({Path(diffquant.__file__).parent})"


def main() -> None:
    torch.set_num_threads(1)
    if "--logits" in sys.argv[1:]:
        key = sys.argv[sys.argv.index("--key") + 1] if "--key" in sys.argv else "breakdown_logits"
        record = logits_breakdown()
        results = json.loads(peers.RESULTS.read_text()) if peers.RESULTS.is_file() else {}
        results[key] = record
        atomic_write_json(peers.RESULTS, results)
        print(json.dumps(record, indent=1))
        return
    if not (peers.MODEL_DIR / "config.json").is_file():
        raise SystemExit(f"no model folder at {peers.MODEL_DIR}: run `python -m benchmarks.peers --sizes 8192 --attn` first")
    model, _ = load_model(str(peers.MODEL_DIR))
    cfg = model.config
    windows = peers.SCRATCH / "kjv-all-256x8192.npy"
    if not windows.is_file():
        raise SystemExit(f"no token windows at {windows}: run `python -m benchmarks.peers --sizes 8192 --attn` first")
    ids = torch.from_numpy(np.load(windows)[:8])
    sites = peers.site_names(peers.TOKEN_POINTS, cfg.num_hidden_layers)

    def forward():
        with torch.inference_mode():
            model(ids, use_cache=False, logits_to_keep=1)

    def noop_taps():
        with tapped(model, {s: (lambda x, ctx: None) for s in sites}), torch.inference_mode():
            model(ids, use_cache=False, logits_to_keep=1)

    def profile():
        profile_model(model, ids, sites, batch_size=8, k=100, progress=False)

    forward()
    whole = {"bare forward": least_cpu(forward), "forward with no-op taps": least_cpu(noop_taps),
             "profile (forward, taps, statistics)": least_cpu(profile)}
    acts = []
    with tapped(model, {s: (lambda x, ctx: acts.append(x.detach().clone())) for s in sites}), torch.inference_mode():
        model(ids, use_cache=False, logits_to_keep=1)
    absx = [x.abs() for x in acts]
    rowmax = [a.amax(dim=-1) for a in absx]
    bins = [magnitude_bins(x) for x in acts]
    hist, tops = AbsHistogram(), [TopK(100, 3) for _ in acts]
    stats = [site_stats.SiteStats(site_stats.TOKEN_DIMS, 100) for _ in acts]

    def each(fn):
        return lambda: [fn(i) for i in range(len(acts))]

    parts = {
        "SiteStats.update, everything": each(lambda i: stats[i].update(acts[i], None, ids, 0)),
        "full-tensor passes (_passes), all": each(lambda i: site_stats._passes(acts[i], None, False, 2, 1, THRESHOLD)),
        "kurtosis and mean: moments to the 4th": each(lambda i: moments(acts[i])),
        "before: kurtosis and mean: moments to the 4th": each(lambda i: before_moments(acts[i])),
        "top-k prefilter and inf-norm: |x|, row maxima": each(lambda i: acts[i].abs().amax(dim=-1)),
        "per-channel absmax": each(lambda i: absx[i].amax(dim=(0, 1))),
        "LLM.int8 hits per channel": each(lambda i: hits(absx[i])),
        "before: LLM.int8 hits per channel": each(lambda i: before_hits(absx[i])),
        "histogram: bins": each(lambda i: abs_magnitude_bins(absx[i])),
        "before: histogram: bins": each(lambda i: magnitude_bins(acts[i])),
        "histogram: bincount": each(lambda i: hist.add_bins(bins[i])),
        "top-k with locations": each(lambda i: tops[i].add(acts[i], None, site_stats.TOKEN_DIMS, ids, 0, rowmax[i])),
    }
    parts = {name: least_cpu(fn) for name, fn in parts.items()}
    record = {"model": peers.MODEL_LABEL, "tokens": int(ids.numel()), "sites": len(sites),
              "values_per_batch": int(sum(x.numel() for x in acts)), "threads": 1, "rounds": ROUNDS,
              "started": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg()[0],
              "end_to_end_cpu_s": whole, "update_parts_cpu_s": parts}
    results = json.loads(peers.RESULTS.read_text()) if peers.RESULTS.is_file() else {}
    results["breakdown"] = record
    atomic_write_json(peers.RESULTS, results)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
