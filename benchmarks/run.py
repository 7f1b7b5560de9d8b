"""diffquant benchmarks: ratios measured within one run (never timed unit tests), printed and saved as JSON.

    python benchmarks/run.py [--quick] [--out benchmarks/results-cpu.json]

Each figure is the median of several repeats after a warm-up. Targets (issue 8) are printed beside them.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from diffquant.models.presets import PRESETS, build_pair
from diffquant.profile import StatsObserver
from diffquant.quant import granularity as G
from diffquant.quant import math as Q
from diffquant.quant.formats import Format
from diffquant.taps import tapped

LINEAR_INPUT_SITES = ["*.attn_in", "*.attn_out", "*.mlp_in", "*.down_in", "final_norm"]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device, repeats=5, warmup=1) -> float:
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_profiler(model, ids, device) -> dict:
    model.set_attn_implementation("sdpa")
    fwd = lambda: model(ids, use_cache=False)  # noqa: E731
    with torch.inference_mode():
        plain = timeit(fwd, device)
        with tapped(model, {p: StatsObserver() for p in ["*.hidden", *LINEAR_INPUT_SITES]}):
            module_taps = timeit(fwd, device)
        with tapped(model, {p: StatsObserver(compile=True) for p in ["*.hidden", *LINEAR_INPUT_SITES]}):
            t0 = time.perf_counter()
            fwd()  # compiles once per activation shape
            compile_s = time.perf_counter() - t0
            compiled_taps = timeit(fwd, device)
        model.set_attn_implementation("eager")
        eager = timeit(fwd, device)
        model.set_attn_implementation("sdpa")
        with tapped(model, {"*.attn_logits": StatsObserver()}):
            logits_taps = timeit(fwd, device)
    return {"forward_s": plain, "hidden_and_linear_inputs_ratio": module_taps / plain,
            "hidden_and_linear_inputs_ratio_compiled": compiled_taps / plain, "compile_s": compile_s, "target_1": 1.15,
            "eager_s": eager, "attn_logits_vs_eager_ratio": logits_taps / eager, "target_2": 1.5}


def bench_fake_quant(device, mb: int = 64) -> dict:
    x = torch.randn(mb * 1024 * 1024 // 4 // 4096, 4096, device=device)
    dims = ("pos", "channel")
    fmt = Format("int", 8)
    clone = timeit(lambda: x.clone(), device)
    out = {"tensor_mb": mb, "clone_s": clone, "clone_GBps": 2 * x.numel() * 4 / clone / 1e9}
    for name, gran, target in (("per_tensor", G.PerTensor(), 3), ("per_token", G.PerToken(), 4),
                               ("per_group128", G.PerGroup(128), 4)):
        t = timeit(lambda: Q.dynamic_fake_quantize(x, fmt, gran, dims), device)
        out[name] = {"s": t, "ratio_vs_clone": t / clone, "target": target, "GBps": 2 * x.numel() * 4 / t / 1e9}
    return out


def bench_diff_vs_baseline(spec_name: str, device, batch: int, seq: int, rounds: int = 5) -> dict:
    """Tokens/s of the matched pair with SDPA; the two models are timed in alternation, so machine noise
    hits both alike, and each figure is the median over rounds."""
    pair = dict(zip(("baseline", "diff"), build_pair(PRESETS[spec_name])))
    ids = torch.randint(0, PRESETS[spec_name].vocab, (batch, seq), device=device)
    steps = {}
    for label, model in pair.items():
        model.to(device).set_attn_implementation("sdpa")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt):
            loss = model(ids, labels=ids, use_cache=False).loss
            opt.zero_grad()
            loss.backward()
            opt.step()

        def infer(model=model):
            with torch.inference_mode():
                model(ids, use_cache=False)

        steps[label] = (infer, step)
    times = {label: {"inference": [], "training": []} for label in pair}
    for _ in range(rounds):
        for label, (infer, step) in steps.items():
            times[label]["inference"].append(timeit(infer, device, repeats=1))
            times[label]["training"].append(timeit(step, device, repeats=1))
    out = {label: {f"{k}_tok_s": ids.numel() / statistics.median(v) for k, v in t.items()} for label, t in times.items()}
    out["inference_ratio"] = out["diff"]["inference_tok_s"] / out["baseline"]["inference_tok_s"]
    out["training_ratio"] = out["diff"]["training_tok_s"] / out["baseline"]["training_tok_s"]
    out["target"] = 0.85
    return out


def bench_sweep(model, seqs, device) -> dict:
    from diffquant.evaluate import language_modeling
    from diffquant.quant.scheme import get_scheme, quantize_

    plain = timeit(lambda: language_modeling(model, seqs), device, repeats=3)

    def sweep():
        for b in (16, 8, 6, 4):
            if b == 16:
                language_modeling(model, seqs)
                continue
            handle = quantize_(model, get_scheme(f"logits-int{b}"))
            language_modeling(model, seqs)
            handle.remove()

    t = timeit(sweep, device, repeats=2)
    return {"plain_eval_s": plain, "four_bit_sweep_s": t, "ratio_vs_four_plain": t / (4 * plain), "target": 1.1}


MEMORY_CHILD = """
import sys, torch
from diffquant.models.presets import PRESETS, build_pair
from diffquant.profile import profile_model
mode, n = sys.argv[1], int(sys.argv[2])
model = build_pair(PRESETS["tiny"])[1]
ids = torch.randint(0, 4096, (n, 128))
if mode == "stream":
    profile_model(model, ids, ["*.hidden", "*.attn_logits"], batch_size=4, progress=False)
else:  # naive: keep every activation, then topk / quantile over the concatenation
    from diffquant.taps import tapped
    kept = []
    with tapped(model, {"*.hidden": lambda x, ctx: kept.append(x.detach().clone())}), torch.inference_mode():
        for i in range(0, n, 4):
            model(ids[i:i + 4], use_cache=False)
    a = torch.cat([k.flatten() for k in kept]).abs()
    torch.topk(a, 100); torch.quantile(a[:16_000_000], torch.tensor([0.5, 0.99]))
print([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
"""


def bench_memory(n_small: int) -> dict:
    def peak(mode, n):
        out = subprocess.run([sys.executable, "-c", MEMORY_CHILD, mode, str(n)], capture_output=True, text=True,
                             check=True).stdout
        return int(out.strip().splitlines()[-1]) / 1024  # MiB

    s1, s10 = peak("stream", n_small), peak("stream", 10 * n_small)
    n1, n10 = peak("naive", n_small), peak("naive", 10 * n_small)
    return {"tokens": [n_small * 128, 10 * n_small * 128], "stream_peak_mib": [s1, s10],
            "stream_increase": s10 / s1 - 1, "target": 0.05, "naive_peak_mib": [n1, n10], "naive_increase": n10 / n1 - 1}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset = "micro" if a.quick else "tiny"
    model = build_pair(PRESETS[preset])[0].to(device).eval()
    ids = torch.randint(0, PRESETS[preset].vocab, (4 if a.quick else 8, 128 if a.quick else 256), device=device)
    results = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor() or "cpu",
               "threads": torch.get_num_threads(), "torch": torch.__version__, "preset": preset}
    print(f"device {results['device']}, preset {preset}")
    results["profiler"] = bench_profiler(model, ids, device)
    print("profiler overhead", json.dumps(results["profiler"], indent=1))
    results["fake_quant"] = bench_fake_quant(device, 8 if a.quick else 64)
    print("fake quant", json.dumps(results["fake_quant"], indent=1))
    results["diff_vs_baseline"] = bench_diff_vs_baseline(preset, device, 4 if a.quick else 8, 128 if a.quick else 256)
    print("DIFF vs baseline", json.dumps(results["diff_vs_baseline"], indent=1))
    results["sweep"] = bench_sweep(model, ids.cpu(), device)
    print("sweep", json.dumps(results["sweep"], indent=1))
    if device.type == "cpu":
        results["memory"] = bench_memory(4 if a.quick else 16)
        print("memory", json.dumps(results["memory"], indent=1))
    out = Path(a.out or f"benchmarks/results-{device.type}.json")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
