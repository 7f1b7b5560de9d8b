"""Where GPTQ's time goes, layer by layer and stage by stage, on the calibration benchmarks/llmcompressor_check.py
uses: SmolLM2-135M-Instruct (the zoo's Q4_1 GGUF dequantized to fp32), 128 KJV windows of 256 tokens from the
training split, int4 symmetric weights in groups of 64 on every Linear of the decoder layers, no act-order.

    python -m benchmarks.gptq_breakdown [--layers 2] [--before REV]   # stages of the first layers
    python -m benchmarks.gptq_breakdown --whole [--label NAME]           # the whole model's GPTQ by quantize_

One thread; CPU seconds (the process's own, which a busy machine inflates less than wall seconds; the load average
is recorded beside them). Each layer, as `solvers._layer_by_layer` runs it:

    statistics   one pass of the layer over the calibration inputs with the Hessian hooks (`_input_stats`);
                 beside it the layer's whole forward without hooks and the products XᵀX alone (timed on the
                 first chunk's four input tensors, times the number of chunks), which together make most of it
    solve        `gptq.solve` of the seven Linears; beside it their Cholesky factors alone (U of each H)
    propagate    the layer's forward with the solved weights: the next layer's inputs

`--before REV` also times `_input_stats` and `gptq.solve` as they were at git revision REV (read with `git
show`), alternating with the current ones so both see the same load, and checks that both give bit-identical
Hessians and weights. Results go into benchmarks/gptq_breakdown.json ("layers", and "whole" by label) and
gptq_breakdown.md. A whole-model run of an older revision (this file run from a checkout of REV, which it
imports diffquant and experiments from): cd CHECKOUT && PYTHONPATH=. python THIS_FILE --whole --label "REV
(before)" --out THIS_JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
import types
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
OUT = HERE / "gptq_breakdown.json"


def cpu_seconds(f):
    """(CPU seconds of f(), its result)."""
    t = time.process_time()
    r = f()
    return time.process_time() - t, r


def at_revision(rev: str, module: str) -> types.ModuleType:
    """`module` (a dotted name in this repository) as its source stood at git revision `rev`."""
    root = HERE.parent
    path = module.replace(".", "/") + ".py"
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=root, check=True, capture_output=True,
                            text=True).stdout
    mod = sys.modules[f"{module}@{rev}"] = types.ModuleType(f"{module}@{rev}")  # dataclasses look it up
    exec(compile(source, f"{rev}:{path}", "exec"), mod.__dict__)
    return mod


def setting(quick: bool):
    """(model, calibration windows, scheme, what they are): llmcompressor_check's; `quick`: the micro model."""
    from experiments.weight_solvers import CALIBRATION_WINDOWS, _data

    from diffquant.quant.numerics import granularity as G
    from diffquant.quant.numerics.config import int_config
    from diffquant.quant.numerics.scheme import LAYER_WEIGHTS, QuantScheme

    model, _, _, calib, label = _data(quick, CALIBRATION_WINDOWS)
    group = 32 if quick else 64
    scheme = QuantScheme(f"w4a16-g{group}", (), ((LAYER_WEIGHTS, int_config(4, G.PerGroup(group))),))
    return model.eval(), calib, scheme, {"model": label, "windows": len(calib), "tokens": int(calib.numel()),
                                         "corpus": "kjv (training split)", "scheme": scheme.name}


def layers(model, calib, scheme, count: int, before: str | None) -> list[dict]:
    """Stage seconds of the first `count` layers (see the module's doc)."""
    from diffquant.quant.algorithms import gptq as G
    from diffquant.quant.algorithms import solvers as S
    from diffquant.quant.algorithms.gptq_config import GPTQ
    from diffquant.quant.numerics.scheme import plan
    from diffquant.taps import site_table
    from diffquant.taps.tap import canonical_weight, stored_weight

    old_solvers, old_gptq = (at_revision(before, "diffquant.quant.algorithms.solvers"),
                             at_revision(before, "diffquant.quant.algorithms.gptq")) if before else (None, None)
    table = site_table(model)
    configs = {n: c for n, c in plan(model, scheme).items() if table.sites[n].is_weight}
    rows = []
    with torch.no_grad():
        inputs = S._first_layer_inputs(model, table.layers[0], calib)
        for i in range(count):
            layer, row = table.layers[i], {"layer": i}
            wanted = {n: table.modules[n] for n in configs if table.sites[n].layer == i}
            row["forward (no hooks)"], _ = cpu_seconds(lambda: [layer(*a, **k) for a, k in inputs])
            row["XᵀX alone"] = len(inputs) * products(layer, inputs[0], wanted)
            row["statistics"], stats = cpu_seconds(lambda: S._input_stats(layer, inputs, wanted, mean_abs=False))
            if before:
                row["statistics before"], old = cpu_seconds(lambda: old_solvers._input_stats(layer, inputs, wanted))
                assert all(torch.equal(old[n][0], stats[n][0]) for n in wanted), "Hessians differ"
            row["solve"] = row["Cholesky alone"] = row["solve before"] = 0.0
            solved = {}
            for name, (h, _) in stats.items():
                site, module = table.sites[name], table.modules[name]
                w = canonical_weight(getattr(module, site.param).detach(), site.layout)
                seconds, solved[name] = cpu_seconds(lambda: G.solve(w, h, configs[name], GPTQ()))
                row["solve"] += seconds
                row["Cholesky alone"] += cpu_seconds(lambda: cholesky(h))[0]
                if before:
                    seconds, old = cpu_seconds(lambda: old_gptq.solve(w, h, configs[name], GPTQ()))
                    row["solve before"] += seconds
                    assert all(torch.equal(a, b) for a, b in zip(old, solved[name])), f"{name}: weights differ"
            for name, (wq, _, _) in solved.items():
                site, module = table.sites[name], table.modules[name]
                getattr(module, site.param).copy_(stored_weight(wq, site.layout, getattr(module, site.param).shape))
            row["propagate"], outputs = cpu_seconds(lambda: [S._hidden(layer(*a, **k)) for a, k in inputs])
            inputs = [S._with_hidden(a, k, h) for (a, k), h in zip(inputs, outputs)]
            row["per layer"] = row["statistics"] + row["solve"] + row["propagate"]
            if before:
                row["per layer before"] = row["statistics before"] + row["solve before"] + row["propagate"]
            if not before:
                del row["solve before"]
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()},
                             ensure_ascii=False), flush=True)
            rows.append(row)
    return rows


def products(layer, first, wanted: dict) -> float:
    """CPU seconds of (XᵀX).double() for each distinct input tensor the `wanted` modules read in one chunk."""
    seen = {}
    handles = [m.register_forward_pre_hook(lambda m, a: seen.setdefault(id(a[0]), a[0])) for m in wanted.values()]
    try:
        layer(*first[0], **first[1])
    finally:
        for h in handles:
            h.remove()
    xs = [x.reshape(-1, x.shape[-1]).float() for x in seen.values()]
    return cpu_seconds(lambda: [(x.T @ x).double() for x in xs])[0]


def cholesky(h: torch.Tensor) -> torch.Tensor:
    """GPTQ's U for the Hessian h, as `gptq.solve` takes it (dampened 1%, no act-order)."""
    H = h.double().clone()
    H.diagonal().add_(0.01 * H.diagonal().mean())
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)


def whole(model, calib, scheme) -> dict:
    """The whole model's GPTQ through quantize_, as llmcompressor_check times it."""
    from diffquant.quant.algorithms.gptq_config import GPTQ
    from diffquant.quant.recipe import Recipe, quantize_

    wall, cpu = time.perf_counter(), time.process_time()
    with quantize_(model, Recipe(scheme, solver=GPTQ()), calib):
        out = {"wall_seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu}
        digest = hashlib.sha256()  # of every solved weight: two revisions' runs compare by it
        for name, p in model.named_parameters():
            digest.update(name.encode() + p.detach().contiguous().numpy().tobytes())
        out["weights_sha256"] = digest.hexdigest()
    print(json.dumps(out), flush=True)
    return out


def machine() -> dict:
    """The CPU, threads, versions, and the git revision of the diffquant that ran (PYTHONPATH may name another)."""
    import diffquant

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads":
            torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
            "diffquant": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=Path(diffquant.__file__).parent).stdout.strip()}


STAGES = ("forward (no hooks)", "XᵀX alone", "statistics", "statistics before", "Cholesky alone", "solve",
          "solve before", "propagate", "per layer", "per layer before")


def report(d: dict, peers: dict | None) -> str:
    """benchmarks/gptq_breakdown.md from the JSON: the stages of the first layers, the whole-model runs beside
    llm-compressor's (docs/weights/llmcompressor.json, `peers`), and what the stages add up to."""
    from diffquant.report.tables import markdown

    c, lay = d["calibration"], d["layers"]
    rows, m = lay["rows"], lay["machine"]
    text = [f"# Where GPTQ's time goes\n\n{c['model']}, {c['scheme']} (every Linear of the decoder layers, no "
            f"act-order), calibration {c['windows']} windows ({c['tokens']:,} tokens) of {c['corpus']}; one thread, "
            f"{m['cores']} cores (AMD EPYC), torch {m['torch']}. Written by `python -m benchmarks.gptq_breakdown` from "
            "benchmarks/gptq_breakdown.json; CPU seconds unless named wall.\n",
            f"## The first layers, stage by stage\n\nRevision {m['diffquant']}; \"before\": `_input_stats` and "
            f"`gptq.solve` of {lay['before']} in the same process, alternating, with bit-identical Hessians and weights "
            f"(checked). 1-minute load average {lay['load_before'][0]:.1f} at the start, {lay['load_after'][0]:.1f} at "
            "the end.\n"]
    stages = [k for k in STAGES if k in rows[0]]
    text.append(markdown(["stage", *[f"layer {r['layer']}" for r in rows]],
                         [[k, *[f"{r[k]:.2f}" for r in rows]] for k in stages]))
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in stages}
    text.append(f"\nPer layer {mean['per layer']:.1f} s: the statistics pass {mean['statistics']:.1f} s (the layer's "
                f"forward up to down_proj's input, and the products XᵀX, {mean['XᵀX alone']:.1f} s alone), the seven "
                f"solves {mean['solve']:.1f} s (their Cholesky factors {mean['Cholesky alone']:.1f} s alone), the "
                f"propagation {mean['propagate']:.1f} s (a whole forward of the solved layer). The two passes over the "
                f"calibration windows, XᵀX included, are {1 - mean['solve'] / mean['per layer']:.0%} of it. They are "
                "matrix products whose every bit the weights depend on (the Hessians, the next layer's inputs): a GPTQ "
                "that keeps today's weights bit for bit must run them as they are, so it can gain only on the solves, "
                "and on what the statistics pass need not compute (down_proj and the residual after its input, now "
                "skipped).\n")
    whole = [[label, f"{w['wall_seconds']:.0f}", f"{w['cpu_seconds']:.0f}",
              f"{w['load_before'][0]:.1f}–{w['load_after'][0]:.1f}", w.get("weights_sha256", "-")[:12]]
             for label, w in d.get("whole", {}).items()]
    for row in (peers or {}).get("gptq", {}).get("rows", []):
        if row["weights"] in ("diffquant gptq", "llm-compressor gptq") and row.get("load"):
            whole.append([f"{row['weights']} (llmcompressor_check)", f"{row['seconds']:.0f}", "-",
                          f"{row['load'][0]:.1f}–{row['load'][1]:.1f}", "-"])
    text.append("## The whole model\n\nWall and CPU seconds of `quantize_` with GPTQ over all 30 layers; the sha256 "
                "of every solved weight shows two revisions solved the same weights. Rows marked (llmcompressor_check) "
                "come from docs/weights/llmcompressor.json (wall seconds only); the llm-compressor row with CPU "
                "seconds is its plain GPTQ run again by `llmcompressor_check.run_peer` (`oneshot` timed in its own "
                "process, one thread, its own venv) and added here by hand.\n")
    text.append(markdown(["run", "wall s", "CPU s", "load (1 min, start–end)", "weights sha256"], whole))
    cpu = {label: w["cpu_seconds"] for label, w in d.get("whole", {}).items() if w.get("cpu_seconds")}
    peer = next((v for k, v in cpu.items() if k.startswith("llm-compressor")), None)
    ours = next((v for k, v in reversed(cpu.items()) if "(after)" in k), None)
    before = next((v for k, v in cpu.items() if "(before)" in k), None)
    if peer and ours:
        passes = ours * (1 - mean["solve"] / mean["per layer"])  # the passes' share of the stage table
        verdict = ("so 2× cannot be reached with today's weights bit for bit on one thread: what would go further "
                   "changes the arithmetic of those products (fewer calibration tokens, XᵀX as a symmetric rank-k "
                   "update, the forward in other kernels) or uses more threads" if passes >= peer / 2 else
                   f"which leaves {peer / 2 - passes:.0f} s for the solves")
        text.append(f"\nIn CPU seconds diffquant's GPTQ is {peer / ours:.2f}× llm-compressor's speed"
                    + (f" ({peer / before:.2f}× before this branch)" if before else "") + f". Twice its speed is "
                    f"{peer / 2:.0f} s, while the two passes over the calibration windows, XᵀX included, take about "
                    f"{passes:.0f} s of diffquant's {ours:.0f} (their share in the stage table), {verdict}.\n")
    return "\n".join(text) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2, help="how many of the first layers to take apart")
    p.add_argument("--before", help="a git revision whose _input_stats and gptq.solve are timed beside today's")
    p.add_argument("--whole", action="store_true", help="time the whole model's GPTQ instead")
    p.add_argument("--label", default="this checkout", help="the whole-model row's name in the JSON")
    p.add_argument("--quick", action="store_true", help="the micro model on random tokens (a smoke test)")
    p.add_argument("--report", action="store_true", help="only rewrite the .md from the JSON")
    p.add_argument("--out", default=str(OUT))
    a = p.parse_args(argv)
    if a.report:
        return write_report(Path(a.out))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    model, calib, scheme, what = setting(a.quick)
    load = os.getloadavg()
    if a.whole:
        result = {"whole": {a.label: {**whole(model, calib, scheme), "load_before": load, "load_after":
                                      os.getloadavg(), "machine": machine()}}}
    else:
        rows = layers(model, calib, scheme, a.layers, a.before)
        result = {"layers": {"rows": rows, "before": a.before, "load_before": load, "load_after": os.getloadavg(),
                             "machine": machine()}}
    if a.quick:
        return
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    old.setdefault("whole", {}).update(result.get("whole", {}))
    if "layers" in result:
        old["layers"] = result["layers"]
    old["calibration"] = what
    out.write_text(json.dumps(old, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out}")
    if "layers" in old:
        write_report(out)


def write_report(out: Path) -> None:
    peers = HERE.parent / "docs" / "weights" / "llmcompressor.json"
    md = out.with_suffix(".md")
    md.write_text(report(json.loads(out.read_text()), json.loads(peers.read_text()) if peers.is_file() else None))
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
