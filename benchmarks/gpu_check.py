"""The steps of benchmarks/gpu_check.sh (read its header first): prerequisites, then each step in a process of its own
under a time limit, and one JSON summary. `--step NAME` runs one step in this process (the orchestrator calls it so).

Steps, each a dict in the summary's "steps" with its status (ok, failed, timed out, skipped), seconds and findings:
- benchmarks: benchmarks/run.py's device sections (results-cuda.json: tokens/s and peak GPU memory of the forward,
  the profiles, DIFF vs the baseline, a sweep);
- bf16_profile: one model profiled in float32 and in bfloat16 on the device (hidden states, Linear inputs, attention
  logits), every statistic compared site by site (SmolLM2 or another folder in $GPU_CHECK_MODEL, else the `tiny`
  preset's random weights);
- backend: a real low-bit backend ($GPU_CHECK_BACKEND, torchao-int8wo) quantizing the `tiny` baseline, run on
  the device: its logits' signal-to-quantization-noise ratio against the float model's, the weight class and its
  device, tokens/s against the float forward;
- recipe: experiments/gpu_recipe.py for its first minutes (its estimate is printed first; the run is stopped at
  the step's limit, which is not a failure);
- index_add, site_kernel, flash, forward, kernel_time, diff_attention: the Triton kernels of issue 47
  (benchmarks/kernels_check.py): the histogram's bin-0 hypothesis, the fused site kernel's GB/s and contract, the flash
  kernel with statistics against SDPA and eager attention, the whole profiled forward (torch and Triton paths, eager
  and CUDA-graphed), kernel time against wall time, DIFF's attention in one kernel with 2d-wide values against SDPA.
  With --cpu-smoke they run under Triton's interpreter (TRITON_INTERPRET=1) on tiny shapes.

`--steps NAME ...` runs some steps only (`--steps kernels`: the six above, about 7 minutes on an H100). The summary
is written after every step, so a stop keeps what finished.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (import name, what for, minimum version); the first group is required
REQUIRED = [("torch", "everything", "2.4"), ("transformers", "models", "5.23"), ("safetensors", "checkpoints", None),
            ("tokenizers", "tokenizers", None), ("accelerate", "loading", None), ("numpy", "statistics", None),
            ("scipy", "statistics", None), ("matplotlib", "figures", None), ("tqdm", "progress", None),
            ("yaml", "schemes", None), ("filelock", "caches", None)]
# seconds per step on a GPU / in the CPU smoke run; the GPU total of each group stays under 8 minutes with start-up
LIMITS = {"benchmarks": (170, 120), "bf16_profile": (60, 60), "backend": (45, 60), "recipe": (150, 20),
          "index_add": (30, 60), "site_kernel": (60, 90), "flash": (60, 120), "forward": (150, 180),
          "kernel_time": (60, 120), "diff_attention": (30, 60)}
KERNEL_STEPS = ("index_add", "site_kernel", "flash", "forward", "kernel_time",
                "diff_attention")  # benchmarks/kernels_check.py


def _version(v: str) -> tuple:
    return tuple(int(p) for p in v.split("+")[0].split(".")[:2] if p.isdigit())


def prerequisites(smoke: bool, backend: str) -> tuple[list[str], bool]:
    """One line per prerequisite, and whether the required ones are all met."""
    lines, ok = [], True
    for name, why, minimum in REQUIRED:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            lines.append(f"MISSING {name} ({why}): {e}; carry its wheel in .whl/ (see gpu_check.sh)")
            ok = False
            continue
        version = getattr(module, "__version__", "?")
        if minimum and _version(version) < _version(minimum):
            lines.append(f"TOO OLD {name} {version} ({why}): diffquant needs >= {minimum}; carry a newer wheel in .whl/")
            ok = False
        else:
            lines.append(f"ok {name} {version}")
    try:
        import diffquant  # noqa: F401

        lines.append(f"ok diffquant from {Path(diffquant.__file__).parent}")
    except ImportError as e:
        lines.append(f"MISSING diffquant: {e}; run from the checkout (gpu_check.sh puts it on PYTHONPATH)")
        ok = False
    if ok:
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            lines.append(f"ok cuda: {torch.cuda.get_device_name(0)}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
        elif smoke:
            lines.append("ok cpu (--cpu-smoke: every step on CPU, tiny settings)")
        else:
            lines.append("MISSING cuda: torch sees no GPU; run with --cpu-smoke on a machine without one")
            ok = False
    from importlib.util import find_spec

    if find_spec("triton"):
        from importlib.metadata import version

        lines.append(f"ok triton {version('triton')} (the kernel steps)")
    else:
        lines.append("MISSING triton (the kernel steps are skipped): carry its wheel in .whl/")
    package = {"torchao": "torchao", "bnb": "bitsandbytes", "quanto": "optimum.quanto"}[backend.split("-")[0]]
    lines.append(f"ok {package} (backend {backend})" if find_spec(package.split(".")[0]) else
                 f"MISSING {package} (backend {backend}; that step is skipped): carry its wheel in .whl/")
    return lines, ok


# ---------------------------------------------------------------- steps (each in its own process)


def _numbers(figures: dict) -> dict:
    """A section's numbers, those one level down included (diff_vs_baseline's ratios sit under "sdpa")."""
    out = {}
    for k, v in figures.items():
        if isinstance(v, (int, float)):
            out[k] = v
        elif isinstance(v, dict):
            out.update({f"{k}.{k2}": v2 for k2, v2 in v.items() if isinstance(v2, (int, float))})
    return out


def _tail(text: str, n: int = 1500) -> str:
    """The end of a step's output without progress bars (each line as its last carriage return left it)."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.splitlines())[-n:]


def step_benchmarks(device: str, smoke: bool, out: Path) -> dict:
    """The device sections, then (a second process, so a failure there keeps the first's figures) where the time
    goes: torch.profiler per operator for the statistics and for DIFF against the baseline."""
    cmd = [sys.executable, "-m", "benchmarks.run", "--out", str(out / f"results-{device}.json")]
    cmd += ["--quick"] if smoke else []
    subprocess.run(cmd + ["--only", *(["diff_vs_baseline"] if smoke else ["profiler", "launches", "diff_vs_baseline",
                                                                          "sweep", "memory"])], check=True, cwd=ROOT)
    breakdown = subprocess.run(cmd + ["--only", "profile_ops", "diff_ops"], cwd=ROOT, capture_output=True, text=True)
    results = json.loads((out / f"results-{device}.json").read_text())
    return {"file": f"results-{device}.json",
            "headline": {section: _numbers(figures) for section, figures in results.items() if isinstance(figures, dict)},
            **({} if breakdown.returncode == 0 else {"breakdown_failed": _tail(breakdown.stderr)})}


def _model_and_ids(device: str, smoke: bool):
    import torch

    from diffquant.models.load import load_model

    folder = os.environ.get("GPU_CHECK_MODEL")
    if folder and not smoke:
        model, tokenizer = load_model(folder, device=device)[:2]
        from diffquant.data.windows import corpus_windows

        ids = corpus_windows(str(ROOT / "docs"), tokenizer, "validation", 512, 16 * 512)
        return folder, model, ids
    preset = "micro" if smoke else "tiny"
    model = load_model(f"{preset}:baseline", device=device)[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 64) if smoke else (16, 256), generator=g)
    return f"{preset}:baseline (random weights)", model, ids


def step_bf16_profile(device: str, smoke: bool, out: Path) -> dict:
    """float32 and bfloat16 profiles of the same weights (the bf16 model is the fp32 one cast), compared."""
    import copy

    import torch

    from diffquant.profiler import profile_model

    name, model, ids = _model_and_ids(device, smoke)
    sites = ["*.hidden", "*.attn_in", "*.mlp_in", "*.attn_logits"]
    stats = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
        prof = profile_model(m, ids, sites, batch_size=4, k=10, progress=False, sinks=True)
        stats[str(dtype).split(".")[1]] = {n: s.summary(full=False) for n, s in prof.sites.items()}
    worst: dict = {}
    for site, a in stats["float32"].items():
        b = stats["bfloat16"][site]
        pairs = {"absmax": (a["absmax"], b["absmax"]), "kurtosis": (a["kurtosis"], b["kurtosis"]),
                 **{q: (a["quantiles"][q], b["quantiles"][q]) for q in ("median", "p99")}}
        for key, (x, y) in pairs.items():
            rel = abs(y - x) / max(abs(x), 1e-30)
            if rel >= worst.get(key, {}).get("rel", -1):
                worst[key] = {"rel": rel, "site": site, "fp32": x, "bf16": y}
    nonfinite = sum(s["nonfinite"] for s in stats["bfloat16"].values())
    return {"model": name, "tokens": ids.numel(), "sites": len(stats["float32"]), "bf16_nonfinite": nonfinite,
            "worst_relative_difference": worst, "status": "ok" if nonfinite == 0 else "failed"}


def step_backend(device: str, smoke: bool, out: Path, backend: str) -> dict:
    """A real backend on the device: SQNR of its logits against the float model's, and tokens/s against it."""
    import inspect
    import tempfile

    import torch

    from diffquant.models.presets import PRESETS, build
    from diffquant.quant.checkpoints import backends

    preset = "micro" if smoke else "tiny"
    torch.manual_seed(0)
    ids = torch.randint(0, PRESETS[preset].vocab, (4, 64) if smoke else (8, 256), device=device)
    with tempfile.TemporaryDirectory() as tmp:
        build(PRESETS[preset], "baseline").save_pretrained(tmp)
        from diffquant.pretrained import from_pretrained

        ref = from_pretrained(tmp).to(device).eval()
        kwargs = {"device": device} if "device" in inspect.signature(backends.load_real).parameters else {}
        real = backends.load_real(backend, tmp, **kwargs)
        if not kwargs and not backend.startswith("bnb"):  # bitsandbytes places itself on the GPU
            real = real.to(device)

    def forward(m):
        with torch.no_grad():
            return m(ids, use_cache=False).logits.float()

    def rate(m):
        forward(m)
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            forward(m)
        if device == "cuda":
            torch.cuda.synchronize()
        return 3 * ids.numel() / (time.perf_counter() - t)

    a, b = forward(ref), forward(real)
    sqnr = 10 * torch.log10(a.pow(2).mean() / (a - b).pow(2).mean().clamp_min(1e-30))
    layer = real.model.layers[0].self_attn.q_proj
    weight = layer.weight
    return {"backend": backend, "preset": preset, "sqnr_db": float(sqnr),
            "layer": type(layer).__name__, "weight": type(weight).__name__, "weight_device": str(weight.device),
            "logits_device": str(b.device), "tokens_per_s": rate(real), "float_tokens_per_s": rate(ref),
            "status": "ok" if float(sqnr) > 20 else "failed"}


def step_recipe(device: str, smoke: bool, out: Path, limit: float) -> dict:
    """The GPU recipe for `limit` seconds: its estimate is printed before training; stopped there if still running."""
    folder = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check")) / "recipe"
    cmd = [sys.executable, "-m", "experiments.gpu_recipe", "--out", str(folder)]  # from ROOT (cwd)
    cmd += ["--quick"] if smoke else []
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        code, text = r.returncode, r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:
        code, text = "stopped at the limit", (e.stdout or b"").decode() + (e.stderr or b"").decode()
    estimate = folder / "estimate.json"
    line = next((x for x in text.splitlines() if "gpu_recipe (" in x and "estimated" in x), None)
    read = lambda f: json.loads(f.read_text()) if f.is_file() else None  # noqa: E731
    return {"exit": code, "estimate_line": line, "estimate": read(estimate), "timing": read(folder / "timing.json"),
            "status": "ok" if line and code in (0, "stopped at the limit") else "failed", "log_tail": _tail(text)}


# ---------------------------------------------------------------- orchestration


def run_step(name: str, smoke: bool, out: Path, backend: str) -> dict:
    limit = LIMITS[name][1 if smoke else 0]
    work = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check"))
    work.mkdir(parents=True, exist_ok=True)
    result_file = work / f"{name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--step", name, "--out", str(out), "--backend", backend]
    cmd += ["--cpu-smoke"] if smoke else []
    env = dict(os.environ)
    if smoke and name in KERNEL_STEPS:  # Triton's interpreter runs the kernels on CPU tensors
        env["TRITON_INTERPRET"] = "1"
    t = time.perf_counter()
    try:  # the recipe stops itself at its limit; the others are stopped here
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env,
                           timeout=limit + (30 if name == "recipe" else 0))
        status, tail = ("ok" if r.returncode == 0 else "failed"), _tail(r.stdout + r.stderr)
    except subprocess.TimeoutExpired as e:
        status, tail = "timed out", _tail((e.stdout or b"").decode() + (e.stderr or b"").decode())
    entry = {"status": status, "seconds": round(time.perf_counter() - t, 1), "limit_s": limit}
    if result_file.is_file():
        found = json.loads(result_file.read_text())
        entry["status"] = found.pop("status", entry["status"]) if status == "ok" else status
        entry.update(found)
    if entry["status"] != "ok":
        entry["log_tail"] = tail
    return entry


def write_summary(summary: dict, out: Path, ok: bool, t0: float) -> None:
    summary["seconds"] = round(time.perf_counter() - t0, 1)
    summary["ok"] = ok and all(s["status"] in ("ok", "skipped") for s in summary["steps"].values())
    tmp = out / "gpu_check.json.tmp"  # written whole, then renamed (diffquant itself may be what is missing)
    tmp.write_text(json.dumps(summary, indent=1, default=str))
    os.replace(tmp, out / "gpu_check.json")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="every step on CPU with tiny settings (seconds)")
    p.add_argument("--out", default=os.environ.get("OUT") or "/tmp/gpu_check-out")
    p.add_argument("--backend", default=os.environ.get("GPU_CHECK_BACKEND", "torchao-int8wo"))
    p.add_argument("--steps", nargs="+", default=None, metavar="STEP",
                   help=f"run these steps ({', '.join(LIMITS)}; 'kernels', the default, names the Triton ones; "
                        "'all' every step)")
    p.add_argument("--step", default=None, choices=sorted(LIMITS), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    # default: the Triton kernels' steps (this round's question; their limits sum to 6.5 min, one device session with
    # start-up); "all" adds the earlier steps (benchmarks, bf16 profile, backend, recipe: about 7 more minutes)
    names = a.steps or ["kernels"]
    names = list(LIMITS) if names == ["all"] else names
    chosen = [x for name in names for x in (KERNEL_STEPS if name == "kernels" else [name])]
    unknown = [name for name in chosen if name not in LIMITS]
    if unknown:
        p.error(f"unknown steps {', '.join(unknown)}; choose from {', '.join(LIMITS)}, kernels or all")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.step:  # inside a step's own process
        import torch

        device = "cuda" if torch.cuda.is_available() and not a.cpu_smoke else "cpu"
        smoke = a.cpu_smoke
        steps = {"benchmarks": lambda: step_benchmarks(device, smoke, out),
                 "bf16_profile": lambda: step_bf16_profile(device, smoke, out),
                 "backend": lambda: step_backend(device, smoke, out, a.backend),
                 "recipe": lambda: step_recipe(device, smoke, out, LIMITS["recipe"][1 if smoke else 0])}
        if a.step in KERNEL_STEPS:
            from benchmarks.kernels_check import STEPS

            steps[a.step] = lambda: STEPS[a.step](device, smoke)
        result = steps[a.step]()
        work = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/gpu_check"))
        (work / f"{a.step}.json").write_text(json.dumps(result, default=str))
        return 0
    t0 = time.perf_counter()
    lines, ok = prerequisites(a.cpu_smoke, a.backend)
    print("\n".join(lines), flush=True)
    summary: dict = {"mode": "cpu-smoke" if a.cpu_smoke else "gpu", "prerequisites": lines, "steps": {}}
    if ok:
        import torch

        summary.update({"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
                        and not a.cpu_smoke else "cpu"})
        for name in chosen:
            if name == "backend" and any(x.startswith("MISSING") and "backend" in x for x in lines):
                summary["steps"][name] = {"status": "skipped", "why": "backend package missing"}
                continue
            if name in KERNEL_STEPS and any(x.startswith("MISSING triton") for x in lines):
                summary["steps"][name] = {"status": "skipped", "why": "triton missing"}
                continue
            summary["steps"][name] = run_step(name, a.cpu_smoke, out, a.backend)
            print(f"{name}: {summary['steps'][name]['status']} ({summary['steps'][name].get('seconds')} s)", flush=True)
            write_summary(summary, out, ok, t0)  # after every step: a stop keeps what finished
    write_summary(summary, out, ok, t0)
    verdict = "ok" if summary["ok"] else "FAILED"
    print(f"gpu_check: {verdict} in {summary['seconds']} s; summary in {out / 'gpu_check.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
