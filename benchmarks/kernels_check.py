"""The Triton kernels on the device (issue 47): gpu_check.py's steps index_add, site_kernel, flash, forward and
kernel_time, each a function of (device, smoke) returning its figures and "status". On CUDA they measure; with
--cpu-smoke they run the same code under Triton's interpreter (TRITON_INTERPRET=1, set by gpu_check.py for these
steps) on tiny shapes, which checks the step runs, not its speed.

Every check of the contract (diffquant/kernels) compares the Triton path with the torch path and float64 references
computed here: integers, maxima and top-k exactly, moments as |ΔM_p| / Σ|x − μ|^p (bound 1e-6), std and kurtosis
relative (bound 1e-6), and two runs bit for bit. Times are medians over rounds of CUDA events around each call (on CPU,
perf_counter), the cases of one ratio alternating within each round.
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch

from benchmarks.run import interleaved

BOUND = 1e-6


def timed(cases: dict, device, rounds: int) -> dict[str, float]:
    """Median seconds of each case (a callable), the cases alternating within each round, after one warm-up round."""
    cuda = torch.device(device).type == "cuda"
    times = {name: [] for name in cases}
    for r in range(rounds + 1):
        for name, fn in cases.items():
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                elapsed = start.elapsed_time(end) / 1e3
            else:
                t = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - t
            if r:
                times[name].append(elapsed)
    return {name: statistics.median(v) for name, v in times.items()}


def spread(times: dict, a: str, b: str) -> float:
    return round(times[a] / times[b], 4)


# ---------------------------------------------------------------- the contract, measured


def reference_moments(values: torch.Tensor) -> dict:
    v = values.double()
    mu = v.mean()
    d = v - mu
    return {"n": v.numel(), **{f"m{p}": float((d**p).sum()) for p in (2, 3, 4)},
            **{f"abs{p}": float((d.abs() ** p).sum()) for p in (2, 3, 4)}}


def contract(torch_stats, triton_stats, values: torch.Tensor) -> dict:
    """The Triton path's SiteStats against the torch path's (same updates) and a float64 reference of the counted
    values: which parts are exact, and each moment's deviation in the contract's units."""
    a, b = torch_stats, triton_stats
    a._fold(), b._fold()
    exact = {
        "histogram": torch.equal(a.hist.counts, b.hist.counts),
        "nonfinite": int(a.nonfinite) == int(b.nonfinite),
        "maxima": all((x is None and y is None) or torch.equal(x, y) for x, y in (
            (a.channel_absmax, b.channel_absmax), (a.position_absmax, b.position_absmax), (a.channel_hits, b.channel_hits))),
        "topk": torch.equal(a.topk._abs, b.topk._abs) and torch.equal(a.topk._values, b.topk._values)
        and torch.equal(a.topk._coords, b.topk._coords),
    }
    ref = reference_moments(values)
    dev = {f"m{p}": abs(float(getattr(b.moments, f"m{p}")) - ref[f"m{p}"]) / max(ref[f"abs{p}"], 1e-300) for p in (2, 3, 4)}
    var = ref["m2"] / ref["n"]
    s = b.moments.summary()
    dev["std"] = abs(s["std"] - var**0.5) / var**0.5
    dev["kurtosis"] = abs(s["kurtosis"] - ref["m4"] / ref["n"] / var**2) / (ref["m4"] / ref["n"] / var**2)
    ok = all(exact.values()) and all(v <= BOUND for v in dev.values()) and float(b.moments.n) == ref["n"]
    return {"exact": exact, "deviation": {k: float(f"{v:.3g}") for k, v in dev.items()}, "ok": ok}


# ---------------------------------------------------------------- index_add: the bin-0 hypothesis


def step_index_add(device: str, smoke: bool) -> dict:
    """One layer of `small`'s logits (16 × 8 × 512 × 512 = 33.5M values, half of them masked): the histogram's
    index_add_ with masked values sent to bin 0 (the torch path before issue 47), kept in their own bins with weight 0
    (its interim fix, stats/histogram.py `counted`), and given the visible values only (selected outside the timing)."""
    from diffquant.stats.histogram import NBINS, abs_magnitude_bins, magnitude_bins

    shape = (2, 2, 64, 64) if smoke else (16, 8, 512, 512)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, device=device, generator=g) * 3
    visible = torch.ones(shape[-2:], dtype=torch.bool, device=device).tril().expand(shape)
    counts = torch.zeros(NBINS, dtype=torch.int64, device=device)
    zeroed = abs_magnitude_bins(torch.where(visible, x, 0.0).abs())
    spread_bins, weights = magnitude_bins(x), visible.reshape(-1).long()
    kept = magnitude_bins(x[visible])
    ones = torch.ones(1, dtype=torch.int64, device=device)
    cases = {"masked_to_bin_0": lambda: counts.index_add_(0, zeroed.reshape(-1), ones.expand(zeroed.numel())),
             "spread_weight_0": lambda: counts.index_add_(0, spread_bins.reshape(-1), weights),
             "visible_only": lambda: counts.index_add_(0, kept, ones.expand(kept.numel()))}
    t = timed(cases, device, 3 if smoke else 10)
    return {"values": x.numel(), "visible": int(visible.sum()), "times_s": t,
            "masked_to_bin_0_vs_spread": spread(t, "masked_to_bin_0", "spread_weight_0"),
            "spread_vs_visible_only": spread(t, "spread_weight_0", "visible_only"), "status": "ok"}


# ---------------------------------------------------------------- the fused site kernel


def step_site_kernel(device: str, smoke: bool) -> dict:
    """The fused site kernel on token-site shapes (8,192 tokens × 512 and × 1,376 channels; fp32 and bf16): its read
    rate (GB/s of the activation, kernel and pooling), the whole update (top-k included) against the torch path's, the
    contract against the torch path and float64, and two runs bit for bit."""
    from diffquant.kernels.site import SiteKernel
    from diffquant.stats.histogram import NBINS
    from diffquant.stats.site_stats import TOKEN_DIMS, SiteStats

    out, ok = {}, True
    tokens = (2, 32) if smoke else (16, 512)
    for width in ((64, 172) if smoke else (512, 1376)):
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator(device=device).manual_seed(width)
            x = (torch.randn(*tokens, width, device=device, generator=g) * 2 + 0.3)
            x[..., 7] *= 50
            x = x.to(dtype)
            label = f"{tokens[0] * tokens[1]}x{width}_{str(dtype).split('.')[1]}"
            kernel = SiteKernel()
            hist = torch.zeros(NBINS, dtype=torch.int64, device=device)
            zero = torch.zeros((), dtype=torch.int64, device=device)
            colmax = torch.zeros(width, dtype=torch.float32, device=device)
            hits = torch.zeros(width, dtype=torch.int64, device=device)
            stats = {p: SiteStats(TOKEN_DIMS, kernels=p) for p in ("torch", "triton")}
            t = timed({"kernel": lambda: kernel(x, None, hist, zero, colmax, hits, zero, 6.0),
                       "update_triton": lambda: stats["triton"].update(x),
                       "update_torch": lambda: stats["torch"].update(x)}, device, 2 if smoke else 10)
            fresh = {p: SiteStats(TOKEN_DIMS, kernels=p) for p in ("torch", "triton")}
            for s in fresh.values():
                s.update(x)
            check = contract(fresh["torch"], fresh["triton"], x.float().flatten())
            again = SiteStats(TOKEN_DIMS, kernels="triton")
            again.update(x)
            again._fold()
            check["deterministic"] = all(torch.equal(getattr(again.moments, k), getattr(fresh["triton"].moments, k))
                                         for k in ("n", "mean", "m2", "m3", "m4"))
            ok = ok and check["ok"] and check["deterministic"]
            out[label] = {"kernel_s": t["kernel"], "GBps": x.numel() * x.element_size() / t["kernel"] / 1e9,
                          "update_triton_s": t["update_triton"], "update_torch_s": t["update_torch"],
                          "update_triton_vs_torch": spread(t, "update_triton", "update_torch"), "contract": check}
    return {**out, "status": "ok" if ok else "failed"}


# ---------------------------------------------------------------- the flash kernel with statistics


def step_flash(device: str, smoke: bool) -> dict:
    """Attention of `small`'s shape (16 × 8 heads × 512 × 64; fp32 and bf16): the flash kernel alone, with the logit
    statistics, with int4 per-tensor quantized logits, against SDPA and eager attention (matmul, softmax, matmul); its
    output against SDPA's, its statistics against the torch path of the logits it wrote out (the contract)."""
    from diffquant.kernels import flash
    from diffquant.stats.site_stats import SiteStats

    batch, heads, seq, d = (1, 2, 72, 16) if smoke else (16, 8, 512, 64)
    out, ok = {}, True
    dims = ("batch", "head", "q_pos", "k_pos")
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device=device).manual_seed(1)
        q, k, v = (torch.randn(batch, heads, seq, d, device=device, generator=g).to(dtype) for _ in range(3))
        causal = flash.Masking(True)
        scale = d**-0.5
        stats = SiteStats(dims)
        quant = flash.Quant(torch.full((batch, heads, seq), 0.05, device=device), 7.0)
        visible = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()

        def eager():
            logits = torch.matmul(q, k.transpose(2, 3)) * scale
            probs = torch.softmax(logits.float().masked_fill(~visible, float("-inf")), -1).to(dtype)
            return torch.matmul(probs, v)

        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        cases = {"sdpa": sdpa, "eager": eager,
                 "flash": lambda: flash.attention(q, k, v, causal, scale, v_div=1, v_mod=heads),
                 "flash_stats": lambda: flash.attention(q, k, v, causal, scale, v_div=1, v_mod=heads,
                                                        hist=stats.hist.counts, nonfinite=stats.nonfinite),
                 "flash_int4": lambda: flash.attention(q, k, v, causal, scale, v_div=1, v_mod=heads, quant=quant)}
        t = timed(cases, device, 2 if smoke else 10)
        mine = SiteStats(dims, k=20)
        r = flash.attention(q, k, v, causal, scale, v_div=1, v_mod=heads, hist=mine.hist.counts,
                            nonfinite=mine.nonfinite, write_logits=True)
        mine.update_from_kernel(r.entry, r.rowmax, r.logits.shape,
                                lambda rows: flash.logit_rows(q, k, causal, scale, rows))
        ref = SiteStats(dims, k=20, kernels="torch")
        ref.update(r.logits, visible)
        check = contract(ref, mine, r.logits[visible.expand_as(r.logits)])
        error = float((r.out.transpose(1, 2).float() - sdpa().float()).abs().max())
        check["output_max_abs_error_vs_sdpa"] = error
        ok = ok and check["ok"] and error < (1e-4 if dtype == torch.float32 else 3e-2)
        out[str(dtype).split(".")[1]] = {
            "times_s": t, "flash_vs_sdpa": spread(t, "flash", "sdpa"), "flash_stats_vs_sdpa": spread(t, "flash_stats", "sdpa"),
            "flash_stats_vs_eager": spread(t, "flash_stats", "eager"), "flash_int4_vs_flash": spread(t, "flash_int4", "flash"),
            "contract": check}
    return {"shape": [batch, heads, seq, d], **out, "status": "ok" if ok else "failed"}


# ---------------------------------------------------------------- the whole profiled forward


def _model(device: str, smoke: bool, dtype=torch.float32):
    from diffquant.models.presets import PRESETS, build

    preset, shape = ("micro", (1, 40)) if smoke else ("small", (16, 512))
    torch.manual_seed(0)
    model = build(PRESETS[preset], "baseline").to(device=device, dtype=dtype).eval()
    ids = torch.randint(0, PRESETS[preset].vocab, shape, device=device)
    return preset, model, ids


TOKEN_SITES = ["*.hidden", "*.attn_in", "*.attn_out", "*.mlp_in", "*.down_in", "final_norm"]


def _taps(model, sites: list[str], kernels: str):
    from diffquant.kernels import chosen
    from diffquant.profiler import StatsObserver
    from diffquant.taps import tapped

    @contextlib.contextmanager
    def context():
        with chosen(kernels), tapped(model, {p: StatsObserver(kernels=kernels) for p in sites}):
            yield
    return context


def _graphed(forward):
    """A CUDA graph of `forward` (captured after a warm-up on a side stream) and its replay, or (None, why)."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        return graph.replay, None
    except Exception as e:  # noqa: BLE001 - reported, not raised: the step's other figures stand
        return None, f"{type(e).__name__}: {e}"[:300]


def step_forward(device: str, smoke: bool) -> dict:
    """The profiled forward of `small` (16 × 512 tokens; fp32 and bf16) against the plain SDPA forward, 5 interleaved
    rounds: hidden states and Linear inputs, and attention logits, on the torch path and the Triton path; on CUDA also
    CUDA-graphed (timing only: SiteStats' state is rebound in Python after each update, so a replay times the kernels
    and launches of an update without keeping its statistics; graph-safe state is what remains to do)."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        preset, model, ids = _model(device, smoke, dtype)
        forward = lambda: model(ids, use_cache=False)  # noqa: E731
        contexts = {"plain": contextlib.nullcontext}
        for kernels in ("torch", "triton"):
            contexts[f"tokens_{kernels}"] = _taps(model, TOKEN_SITES, kernels)
            contexts[f"logits_{kernels}"] = _taps(model, ["*.attn_logits"], kernels)
        with torch.inference_mode():  # each round attaches fresh observers, outside the timed call (as run.py times)
            t, _ = interleaved({name: (context, forward) for name, context in contexts.items()}, torch.device(device),
                               1 if smoke else 5)
        label = str(dtype).split(".")[1]
        r = {"times_s": dict(t), **{f"{name}_vs_plain": spread(t, name, "plain") for name in contexts if name != "plain"},
             **{f"{name}_vs_plain_spread": t.spread(name, "plain") for name in contexts if name != "plain"}}
        if torch.device(device).type == "cuda":
            graphed, why = {}, {}
            for name in ("plain", "tokens_triton", "logits_triton"):
                with contexts[name](), torch.inference_mode():
                    replay, why[name] = _graphed(forward)
                    if replay is not None:
                        graphed[name] = timed({name: replay}, device, 5)[name]
            r["graphed_times_s"] = graphed
            r["graphed_failures"] = {k: v for k, v in why.items() if v}
            for name in ("tokens_triton", "logits_triton"):
                if name in graphed and "plain" in graphed:
                    r[f"graphed_{name}_vs_plain"] = round(graphed[name] / graphed["plain"], 4)
        out[label] = r
    return {"preset": preset, "tokens": ids.numel(), **out, "targets": {"tokens_vs_plain": 1.1, "logits_vs_plain": 1.2},
            "status": "ok"}


# ---------------------------------------------------------------- kernel time against wall time


def step_kernel_time(device: str, smoke: bool) -> dict:
    """torch.profiler's device time (the kernels' own) against wall time per forward, for the plain forward, the token
    statistics and the logit statistics on the Triton path: where the device is busy less than the wall clock runs,
    the host (launches, Python) sets the pace, and graphs are the remedy."""
    from torch.profiler import ProfilerActivity, profile

    preset, model, ids = _model(device, smoke)
    cuda = torch.device(device).type == "cuda"
    out = {}
    for name, context in (("plain", contextlib.nullcontext), ("tokens_triton", _taps(model, TOKEN_SITES, "triton")),
                          ("logits_triton", _taps(model, ["*.attn_logits"], "triton"))):
        with context(), torch.inference_mode():
            model(ids, use_cache=False)
            if cuda:
                torch.cuda.synchronize()
            rounds = 1 if smoke else 3
            t = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
                for _ in range(rounds):
                    model(ids, use_cache=False)
                if cuda:
                    torch.cuda.synchronize()
            wall = (time.perf_counter() - t) / rounds
        events = prof.key_averages()
        device_s = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6 / rounds if cuda else None
        launches = sum(e.count for e in events if "launch" in e.key.lower()) / rounds
        out[name] = {"wall_ms": 1e3 * wall, "device_ms": None if device_s is None else 1e3 * device_s,
                     "device_busy": None if device_s is None else round(device_s / wall, 3),
                     "launch_calls": launches}
    return {"preset": preset, "tokens": ids.numel(), **out, "status": "ok"}


def step_diff_attention(device: str, smoke: bool) -> dict:
    """DIFF's attention in bf16 at `small`'s shape (8 maps of d = 64 on 512 tokens, paired values of 2d for 4
    differential heads), against the baseline's SDPA: DIFF as diffquant runs it on SDPA (Q and K zero-padded to 2d,
    one call; models/fused.py), and in one Triton kernel with the 2d-wide paired values (kernels/flash.py, no
    statistics), each followed by A1·V − λ·A2·V."""
    from diffquant.kernels import flash
    from diffquant.models.fused import _sdpa_padded

    batch, heads, seq, d = (1, 4, 72, 16) if smoke else (16, 8, 512, 64)
    g = torch.Generator(device=device).manual_seed(2)
    q, k, v = (torch.randn(batch, heads, seq, d, device=device, generator=g).bfloat16() for _ in range(3))
    vpair = torch.cat([v[:, : heads // 2], v[:, heads // 2:]], dim=-1)  # [V1 | V2] per differential head
    lam = torch.tensor(0.3, device=device, dtype=torch.bfloat16)
    half = heads // 2

    def diff_sdpa():
        out = _sdpa_padded(q, k, v, d**-0.5)
        return out[:, :, :half] - lam * out[:, :, half:]

    def diff_triton():
        out = flash.attention(q, k, vpair, flash.Masking(True), d**-0.5, v_div=1, v_mod=half, out_dtype=torch.float32)
        return (out.out[:, :, :half] - lam.float() * out.out[:, :, half:]).bfloat16()

    baseline = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    t = timed({"baseline_sdpa": baseline, "diff_sdpa_padded": diff_sdpa, "diff_triton": diff_triton}, device,
              2 if smoke else 20)
    error = float((diff_sdpa().float() - diff_triton().float()).abs().max())
    return {"shape": [batch, heads, seq, d], "times_s": t,
            "baseline_vs_diff_sdpa_padded": spread(t, "baseline_sdpa", "diff_sdpa_padded"),
            "baseline_vs_diff_triton": spread(t, "baseline_sdpa", "diff_triton"),
            "max_abs_difference": error, "status": "ok" if error < 5e-2 else "failed"}


STEPS = {"index_add": step_index_add, "site_kernel": step_site_kernel, "flash": step_flash, "forward": step_forward,
         "kernel_time": step_kernel_time, "diff_attention": step_diff_attention}
