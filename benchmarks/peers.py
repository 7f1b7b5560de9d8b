"""diffquant's streaming profile beside the tools researchers already use: TransformerLens and nnsight.

    python -m benchmarks.peers                           # everything: parity, then every cost case
    python -m benchmarks.peers --sizes 8192 --attn 2048  # only these cost cases (others recorded as not run)
    python -m benchmarks.peers --model tiny --sizes 8192 65536 262144 --attn  # the cost cases on the tiny preset
    python -m benchmarks.peers --render                  # print the README tables from benchmarks/peers.json

Each peer runs in its own virtual environment, benchmarks/.peers/<peer>-venv (created on first use, pinned
below; the project's own dependencies do not change), and every workflow — diffquant's included — runs as
a fresh subprocess that loads the same SmolLM2-135M-Instruct folder (the zoo's Q4_1 GGUF dequantized to
fp32 by transformers, saved once with `save_pretrained` so the peers can load it offline), reads the same
KJV validation windows (tokenized by the model's tokenizer), and reports its statistics, its seconds
after loading, and its peak resident memory (VmHWM at the end of the process). Every child runs with one
thread (OMP_NUM_THREADS=1): with two threads on a shared two-core machine, OpenMP's waiting threads spin, and
in a diagnostic run by hand the CPU time of a 1,024-token profile grew from 3.2 to 24-30 CPU-s (the bare forward
from 2.6 to 11), most for diffquant, whose statistics run many short kernels per batch.

- Parity: the values each peer returns for every decoder layer's output (`hidden`), the inputs of its
  Linear layers (`attn_in`, `attn_out`, `mlp_in`, `down_in`) and its pre-softmax attention scores on
  causal positions (`attn_logits`), reduced by benchmarks/peer_stats.py's `exact_stats`, against the
  same statistics of diffquant's `profile_model`.
- Cost: each peer's cache-then-compute workflow as its docs show it (a names filter / `.save()` on the
  sites, activations kept per batch, the statistics computed at the end, as an exact median needs every
  value) against diffquant's streaming profile of the same statistics, and the model's bare forward over
  the same batches (no hooks, no statistics) as the floor every workflow pays. `--model tiny` runs the cost
  cases on the `tiny` preset with random weights (4 layers, width 256, about 5M parameters; KJV as bytes),
  whose forward is cheap enough for 256K tokens on two cores: the cost of keeping and reducing activations
  depends on their number, not on the weights.

A case whose cached activations would need more than half of the memory available is not started; it is
recorded as refused with the estimate. Results: benchmarks/peers.json, written atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRATCH = HERE / ".peers"
MODEL_DIR = SCRATCH / "smollm2-135m"
RESULTS = HERE / "peers.json"
MODEL_LABEL = "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)"
MODELS = {"smollm2-135m": MODEL_LABEL,
          "tiny": "diffquant's tiny preset, random weights (4 layers, width 256, 5M parameters; KJV as bytes)"}

# diffquant's torch and transformers in every venv, so that the peers run the same Hugging Face modules and any
# difference is theirs (the version diffquant runs on: re-measured with every workflow on 5.25, issue 41)
SHARED_PINS = ("torch==2.13.0", "transformers==5.25.0", "numpy")
PEERS = {
    "transformer_lens": (*SHARED_PINS, "transformer-lens==4.3.0"),
    "nnsight": (*SHARED_PINS, "nnsight==0.8.1"),
}
PEER_LABELS = {"forward": "bare forward (no statistics; the floor)", "diffquant": "diffquant profile (streaming)",
               "transformer_lens": "TransformerLens 4.3 TransformerBridge", "nnsight": "nnsight 0.8 LanguageModel"}
LINEAR_POINTS = ("attn_in", "attn_out", "mlp_in", "down_in")
TOKEN_POINTS = ("hidden", *LINEAR_POINTS)
PARITY = {"seq_len": 256, "tokens": 1024, "batch_size": 4}
COST = {"seq_len": 256, "batch_size": 8}
SIZES = (8192, 65536, 262144)
ATTN_CONTEXTS = (2048, 8192)
NOT_RUN = "not run in this session"
THREADS = 1  # torch / OpenMP threads in every child (see the docstring)

# The child every workflow runs: load, capture the sites batch by batch, reduce, report. `capture(model,
# ids, sites)` returns {site: float32 numpy array of its valid values} for one batch; each peer's snippet
# defines `load` and `capture` and is pasted above this.
CHILD_MAIN = r'''
import json, sys, time
import numpy as np
from benchmarks.peer_stats import exact_stats

def _peak_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])

ids = np.load(ARGS["ids"])
model = load(ARGS["model_dir"], ARGS["attention"])
t, cpu = time.perf_counter(), time.process_time()
kept = {s: [] for s in ARGS["sites"]}
for start in range(0, len(ids), ARGS["batch_size"]):
    for site, v in capture(model, ids[start:start + ARGS["batch_size"]], ARGS["sites"]).items():
        kept[site].append(v)
stats = {}
for site in ARGS["sites"]:
    stats[site] = exact_stats(np.concatenate(kept.pop(site)))
seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
print("RESULT " + json.dumps({"seconds": seconds, "cpu_seconds": cpu, "peak_kib": _peak_kib(), "stats": stats,
                              "versions": VERSIONS()}))
'''

TRANSFORMER_LENS = r'''
import torch, transformers, transformer_lens
from importlib.metadata import version
from transformer_lens.model_bridge import TransformerBridge
torch.set_grad_enabled(False)

def VERSIONS():
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "transformer_lens": version("transformer-lens")}

HOOKS = {"hidden": "blocks.{i}.hook_out", "attn_in": "blocks.{i}.ln1.hook_out", "attn_out": "blocks.{i}.attn.o.hook_in",
         "mlp_in": "blocks.{i}.ln2.hook_out", "down_in": "blocks.{i}.mlp.out.hook_in",
         "attn_logits": "blocks.{i}.attn.hook_attn_scores"}

def load(model_dir, attention):
    # the bridge wraps the Hugging Face modules themselves; no weight processing is applied unless asked
    return TransformerBridge.boot_transformers(model_dir, device="cpu", dtype=torch.float32)

def _hook(site):
    _, i, point = site.split(".")
    return HOOKS[point].format(i=i)

def capture(model, ids, sites):
    names = {_hook(s): s for s in sites}
    _, cache = model.run_with_cache(torch.from_numpy(ids), names_filter=lambda n: n in names)
    out = {}
    for name, site in names.items():
        x = cache[name]
        if site.endswith("attn_logits"):  # [batch, head, q, k]: the causal positions only
            q = x.shape[-1]
            x = x[..., torch.ones(q, q, dtype=torch.bool).tril()]
        out[site] = x.float().numpy().reshape(-1).copy()
    return out
'''

NNSIGHT = r'''
import torch, transformers, nnsight
from importlib.metadata import version
from nnsight import LanguageModel
torch.set_grad_enabled(False)

def VERSIONS():
    return {"torch": torch.__version__, "transformers": transformers.__version__, "nnsight": version("nnsight")}

def load(model_dir, attention):
    # eager attention where the scores are asked for: sdpa never forms them
    extra = {"attn_implementation": "eager"} if attention else {}
    return LanguageModel(model_dir, dtype=torch.float32, dispatch=True, **extra)

def _proxy(model, site):
    _, i, point = site.split(".")
    layer = model.model.layers[int(i)]
    if point == "hidden":
        return layer.output
    if point == "attn_in":
        return layer.input_layernorm.output
    if point == "attn_out":
        return layer.self_attn.o_proj.input
    if point == "mlp_in":
        return layer.post_attention_layernorm.output
    if point == "down_in":
        return layer.mlp.down_proj.input
    # attn_logits: `attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling` inside transformers'
    # eager attention function (called by the attention module's second `attention_interface` line), before the mask
    return layer.self_attn.source.attention_interface_1.source.attn_weights_0.output

ORDER = ("attn_in", "attn_logits", "attn_out", "mlp_in", "down_in", "hidden")

def _in_execution_order(site):  # nnsight 0.5+ requires the proxies to be asked for in the order they run
    _, i, point = site.split(".")
    return int(i), ORDER.index(point)

def capture(model, ids, sites):
    saved = {}
    with model.trace(torch.from_numpy(ids)):
        for site in sorted(sites, key=_in_execution_order):
            saved[site] = _proxy(model, site).save()
    out = {}
    for site, v in saved.items():
        x = v[0] if isinstance(v, tuple) else v
        if site.endswith("attn_logits"):
            q = x.shape[-1]
            x = x[..., torch.ones(q, q, dtype=torch.bool).tril()]
        out[site] = x.float().numpy().reshape(-1).copy()
    return out
'''

# What diffquant's two workflows share: load the windows and the model, start the clocks; `RUN` (the workflow)
# sets `stats`, then `REPORT` prints the RESULT line.
LOCAL_HEAD = r'''
import json, sys, time
import numpy as np
import torch, transformers
from diffquant.models.load import load_model

def _peak_kib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])

ids = torch.from_numpy(np.load(ARGS["ids"]))
model, _ = load_model(ARGS["model_dir"])
t, cpu = time.perf_counter(), time.process_time()
'''
LOCAL_REPORT = r'''
seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
print("RESULT " + json.dumps({"seconds": seconds, "cpu_seconds": cpu, "peak_kib": _peak_kib(), "stats": stats,
                              "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}))
'''

# diffquant's own workflow: the streaming profile, nothing per token kept.
DIFFQUANT = LOCAL_HEAD + r'''
from diffquant.profiler import profile_model

prof = profile_model(model, ids, ARGS["sites"], batch_size=ARGS["batch_size"], k=100, progress=False)
stats = {}
for site in ARGS["sites"]:
    s = prof.sites[site].summary(full=False)
    stats[site] = {"count": s["count"], **{r: s["top"].get(r) for r in ("top1", "top10", "top100")},
                   "median": s["quantiles"]["median"], "kurtosis": s["kurtosis"]}
''' + LOCAL_REPORT

# The floor: the same forward passes with nothing attached.
FORWARD = LOCAL_HEAD + r'''
with torch.inference_mode():
    for start in range(0, len(ids), ARGS["batch_size"]):
        model(ids[start:start + ARGS["batch_size"]], use_cache=False, logits_to_keep=1)
stats = {}
''' + LOCAL_REPORT


def venv_python(peer: str) -> Path:
    """The peer's venv interpreter, created and installed with its pins on first use."""
    venv = SCRATCH / f"{peer}-venv"
    python = venv / "bin" / "python"
    stamp = venv / "diffquant-pins.txt"
    pins = "\n".join(PEERS[peer])
    if python.is_file() and stamp.is_file() and stamp.read_text() == pins:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", *PEERS[peer]], check=True)
    stamp.write_text(pins)
    return python


def model_dir(model: str) -> Path:
    return MODEL_DIR if model == "smollm2-135m" else SCRATCH / model


def export_model(model: str = "smollm2-135m") -> tuple[Path, object]:
    """The model saved once as a plain fp32 transformers folder (SmolLM2-135M-Instruct, or `tiny`: the preset
    with random weights from seed 0 and its byte tokenizer); returns (folder, tokenizer)."""
    from diffquant.models.load import load_model

    folder = model_dir(model)
    if not (folder / "config.json").is_file():
        if model == "tiny":
            import torch

            torch.manual_seed(0)
        model, tokenizer = load_model("smollm2-135m" if model == "smollm2-135m" else "tiny:baseline")
        part = folder.with_name(folder.name + ".part")
        model.save_pretrained(part)
        tokenizer.save_pretrained(part)
        part.rename(folder)
    from transformers import AutoTokenizer

    return folder, AutoTokenizer.from_pretrained(folder)


def windows(tokenizer, seq_len: int, tokens: int, part: str = "validation", model: str = "smollm2-135m") -> Path:
    """The first `tokens` tokens of KJV's validation split (`part="all"`: of the whole text, validation
    split first, which the cost cases need: the split holds 51,712 tokens of SmolLM2's tokenizer) in
    windows of `seq_len`, saved for the children."""
    import numpy as np

    from diffquant.data.corpora import load_text, split
    from diffquant.data.tokens import encode, sequences

    path = SCRATCH / f"kjv-{part}-{seq_len}x{tokens}{'' if model == 'smollm2-135m' else '-' + model}.npy"
    if not path.is_file():
        train, val = split(load_text("kjv")[0])
        text = val if part == "validation" else val + "\n" + train
        ids = sequences(encode(tokenizer, text), seq_len, tokens).numpy()
        if ids.size < tokens:
            raise SystemExit(f"KJV ({part}) holds {ids.size:,} tokens in windows of {seq_len}, fewer than {tokens:,}")
        np.save(path, ids)
    return path


def site_names(points, layers: int) -> list[str]:
    return [f"layers.{i}.{p}" for i in range(layers) for p in points]


def run_child(workflow: str, args: dict, model: str = "smollm2-135m") -> dict:
    """One workflow in a fresh process with THREADS threads; its RESULT line, or {"error": ...} with the last
    line of its stderr."""
    if workflow in ("diffquant", "forward"):
        python, code = sys.executable, (DIFFQUANT if workflow == "diffquant" else FORWARD)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
    else:
        python, code = str(venv_python(workflow)), (TRANSFORMER_LENS if workflow == "transformer_lens" else NNSIGHT)
        code += CHILD_MAIN
        env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(ROOT)}  # for peer_stats
    env["HF_HUB_OFFLINE"] = env["TRANSFORMERS_OFFLINE"] = "1"
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(THREADS)
    return run_code(python, code, {**args, "model_dir": str(model_dir(model))}, env)


def run_code(python: str, code: str, args: dict, env: dict, cwd=None) -> dict:
    """`code` run by `python` in a fresh process with `ARGS` (a dict) defined before it: the JSON of its last
    "RESULT " line, or {"error": ...} with the last line of its stderr."""
    out = subprocess.run([python, "-c", f"ARGS = {json.dumps(args)!r}\nimport json\nARGS = json.loads(ARGS)\n" + code],
                         capture_output=True, text=True, env=env, cwd=cwd)
    line = next((ln for ln in reversed(out.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if out.returncode or line is None:
        lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
        why = f"killed by signal {-out.returncode}" if out.returncode < 0 else f"exit {out.returncode}"
        return {"error": f"{why}: {lines[-1][:300]}" if lines else why}
    return json.loads(line[len("RESULT "):])


def available_bytes() -> int:
    return int(next(ln for ln in open("/proc/meminfo") if ln.startswith("MemAvailable")).split()[1]) * 1024


def cache_bytes(points, layers: int, hidden: int, intermediate: int, heads: int, tokens: int, seq_len: int) -> int:
    """float32 bytes a cache-then-compute workflow keeps for `points` over `tokens` tokens."""
    width = {"hidden": hidden, "attn_in": hidden, "attn_out": hidden, "mlp_in": hidden, "down_in": intermediate}
    per_layer = sum(tokens * width[p] for p in points if p != "attn_logits")
    if "attn_logits" in points:
        per_layer += (tokens // seq_len) * heads * seq_len * (seq_len + 1) // 2
    return 4 * layers * per_layer


# ---- parity -----------------------------------------------------------------------------------------------

RTOL = 1e-5  # fp32


MEDIAN_RTOL = 2.0**-8  # diffquant/stats/histogram.py's RESOLUTION: its median is within this of the exact one


def compare(ours: dict, theirs: dict) -> dict:
    """Per statistic, the largest relative difference over sites, and the sites outside tolerance: fp32 for
    top-k and kurtosis, none for the count, and for the median the histogram's resolution (diffquant's median
    reads each value as the bf16 number it rounds to, within 2^-8 of it)."""
    out = {}
    for stat in ("top1", "top10", "top100", "median", "kurtosis", "count"):
        worst, where, failing = 0.0, None, []
        for site, mine in ours.items():
            a, b = mine.get(stat), theirs.get(site, {}).get(stat)
            if a is None or b is None:
                continue
            rel = abs(a - b) / max(abs(a), 1e-30)
            outside = rel > {"count": 0.0, "median": MEDIAN_RTOL}.get(stat, RTOL)
            if outside:
                failing.append(site)
            if rel >= worst:
                worst, where = rel, site
        out[stat] = {"max_rel_diff": worst, "at": where, "outside_tolerance": len(failing),
                     "first_outside": failing[:3]}
    return out


def run_parity(tokenizer, layers: int, peers: list[str]) -> dict:
    ids = windows(tokenizer, PARITY["seq_len"], PARITY["tokens"])
    sites = site_names(("hidden", *LINEAR_POINTS, "attn_logits"), layers)
    base = {"ids": str(ids), "sites": sites, "batch_size": PARITY["batch_size"], "attention": True}
    ours = run_child("diffquant", base)
    result = {**PARITY, "sites": len(sites), "diffquant": ours, "peers": {}}
    if "error" in ours:
        return result
    for peer in peers:
        theirs = run_child(peer, base)
        if "error" in theirs:
            result["peers"][peer] = theirs
            continue
        by_point = {}
        for point in ("hidden", *LINEAR_POINTS, "attn_logits"):
            mine = {s: v for s, v in ours["stats"].items() if s.endswith("." + point)}
            by_point[point] = compare(mine, theirs["stats"])
        result["peers"][peer] = {"versions": theirs["versions"], "by_point": by_point,
                                 "stats": theirs["stats"]}
    done = [r["stats"] for r in result["peers"].values() if "stats" in r]
    if len(done) > 1:  # the peers' own values, reduced by the same function, against each other
        result["peers_identical"] = all(d == done[0] for d in done[1:])
    return result


# ---- cost -------------------------------------------------------------------------------------------------

def cost_case(tokenizer, cfg, points, tokens: int, seq_len: int, batch_size: int, peers, run: bool,
              model: str = "smollm2-135m", floor: bool = True) -> dict:
    import numpy as np

    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    need = cache_bytes(points, layers, hidden, cfg.intermediate_size, cfg.num_attention_heads, tokens, seq_len)
    case = {"model": model, "tokens": tokens, "seq_len": seq_len, "batch_size": batch_size, "points": list(points),
            "peer_cache_gib": need / 2**30, "workflows": {}}
    if not run:
        case["not_run"] = NOT_RUN
        return case
    case.update(started=time.strftime("%Y-%m-%d %H:%M"), load_average=os.getloadavg()[0], threads=THREADS)
    ids = windows(tokenizer, seq_len, tokens, part="all", model=model)
    args = {"ids": str(ids), "sites": site_names(points, layers), "batch_size": batch_size,
            "attention": "attn_logits" in points}
    for workflow in ("forward", "diffquant", *peers)[0 if floor else 1:]:
        if workflow in PEERS and need > available_bytes() / 2:
            case["workflows"][workflow] = {"refused": f"its cache would hold {need / 2**30:.1f} GiB; "
                                                      f"{available_bytes() / 2**30:.1f} GiB available"}
            continue
        r = run_child(workflow, args, model)
        if "error" not in r:
            n = int(np.load(ids).size)
            r = {"tokens": n, "tokens_per_s": n / r["seconds"], "tokens_per_cpu_s": n / r["cpu_seconds"],
                 "seconds": r["seconds"], "cpu_seconds": r["cpu_seconds"], "peak_mib": r["peak_kib"] / 1024,
                 "versions": r["versions"]}
        case["workflows"][workflow] = r
    return case


# Not measured, and why (rendered under the tables)
NOT_COVERED = (
    "Every workflow runs with one thread. The first measurement of these cases (2 threads each, at a load average "
    "of 13 on 2 cores) put diffquant at 60 tokens per CPU-second against 78 and 80 for the peers. A diagnostic run by "
    "hand at 1,024 tokens (not recorded in peers.json) gave 11 CPU-s for the bare forward and 24-30 for diffquant's "
    "profile with two threads on a core shared with other work, against 2.6 and 3.2 with one thread: OpenMP's "
    "waiting threads spin, and the statistics' many short kernels per batch pay it most. With one thread per child "
    "(the tables) diffquant is the fastest workflow in every case where a peer ran; the statistics' own speed-up is "
    "the breakdown above.",
    "Where the peers cannot run, diffquant alone: SmolLM2 at 65,536 and 262,144 tokens (the peers' caches would hold "
    "28 and 112 GiB) and SmolLM2's attention window of 8,192 (34 GiB); the memory rule refuses the peers there. Not run: "
    "the bare forward at 65,536 and 262,144 SmolLM2 tokens (its rate at 8,192 stands for it: it does not depend on the "
    "count). The tiny-preset rows (random weights; KJV as bytes) show how cost and memory grow with tokens and "
    "context where every workflow fits.",
    "The demo pair (DIFF and its baseline) is not in these tables: its checkpoints are not on the machine these "
    "figures come from, and TransformerLens 4.3 has no DiffLlama adapter (none among "
    "transformer_lens/model_bridge/supported_architectures), so only nnsight could be compared on it.",
)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="token counts of the cost cases to run")
    p.add_argument("--attn", type=int, nargs="*", default=list(ATTN_CONTEXTS),
                   help="contexts of the attention-score cost cases to run (one window each)")
    p.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    p.add_argument("--model", choices=list(MODELS), default="smollm2-135m",
                   help="the model of the cost cases (parity runs on SmolLM2 only; other models keep it)")
    p.add_argument("--no-parity", action="store_true", help="keep the parity result already in peers.json")
    p.add_argument("--no-floor", action="store_true", help="skip the bare-forward reference in these cases")
    p.add_argument("--render", action="store_true", help="only print the markdown tables from peers.json")
    a = p.parse_args(argv)
    if a.render:
        print("\n".join(markdown_part(json.loads(RESULTS.read_text()))))
        return
    from transformers import AutoConfig

    from diffquant.paths import atomic_write_json

    SCRATCH.mkdir(exist_ok=True)
    folder, tokenizer = export_model(a.model)
    cfg = AutoConfig.from_pretrained(folder)
    parity = a.model == "smollm2-135m" and not a.no_parity
    results = {"model": MODEL_LABEL, "models": MODELS, "threads": THREADS,
               "corpus": "KJV (parity: the validation split; cost: the whole text, validation split first)",
               "started": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg()[0],
               "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "pins": {k: list(v) for k, v in PEERS.items()}}
    results["parity"] = run_parity(tokenizer, cfg.num_hidden_layers, a.peers) if parity else None
    results["cost"] = [cost_case(tokenizer, cfg, TOKEN_POINTS, n, COST["seq_len"], COST["batch_size"], a.peers,
                                 n in a.sizes, a.model, not a.no_floor) for n in SIZES]
    results["attention_cost"] = [cost_case(tokenizer, cfg, ("attn_logits",), c, c, 1, a.peers, c in a.attn, a.model,
                                           not a.no_floor) for c in ATTN_CONTEXTS]
    # read only now, as another invocation (other cases) may have finished meanwhile: its parity result and the
    # cases this one did not run are kept
    disk = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    if not parity:
        results["parity"] = disk.get("parity")
    for key in [k for k in disk if k.startswith("breakdown")]:  # benchmarks/peers_breakdown.py's records
        results[key] = disk[key]
    for key in ("cost", "attention_cost"):
        results[key] = merge_cases(disk.get(key, []), results[key])
    atomic_write_json(RESULTS, results)
    print("\n".join(markdown_part(results)))


def _case_key(c: dict) -> tuple:
    return c.get("model", "smollm2-135m"), c["tokens"], c["seq_len"]


def merge_cases(disk: list[dict], ran: list[dict]) -> list[dict]:
    """This invocation's cases over those on disk: a case not run here keeps its result on disk, and the cases
    of other models stay; ordered by model (as in MODELS), then tokens."""
    done = {_case_key(c): c for c in disk if "not_run" not in c}
    mine = [done.get(_case_key(c), c) if "not_run" in c else c for c in ran]
    keys = {_case_key(c) for c in mine}
    order = list(MODELS)
    return sorted(mine + [c for c in disk if _case_key(c) not in keys],
                  key=lambda c: (order.index(_case_key(c)[0]) if _case_key(c)[0] in order else len(order), c["tokens"]))


# ---- rendering (the README's "diffquant and the tools you know") ----------------------------------------

def _fmt_rel(d: dict) -> str:
    if d["outside_tolerance"]:
        return f"{d['max_rel_diff']:.1e} ({d['outside_tolerance']} sites outside)"
    return "0" if d["max_rel_diff"] == 0 else f"{d['max_rel_diff']:.1e}"


def parity_rows(parity: dict) -> list[list[str]]:
    rows = []
    for peer, r in parity.get("peers", {}).items():
        if "error" in r:
            rows.append([PEER_LABELS[peer], "all", r["error"], "", "", "", "", ""])
            continue
        for point, stats in r["by_point"].items():
            rows.append([PEER_LABELS[peer], point] + [_fmt_rel(stats[s]) for s in
                                                      ("top1", "top10", "top100", "median", "kurtosis", "count")])
    return rows


def _cell(w: dict | None) -> str:
    if w is None:
        return "–"
    if "refused" in w:
        return f"not started ({w['refused']})"
    if "error" in w:
        return w["error"]
    cpu = f" ({w['tokens_per_cpu_s']:,.0f} per CPU-s)" if "tokens_per_cpu_s" in w else ""
    return f"{w['tokens_per_s']:,.0f} tok/s{cpu}, {w['peak_mib']:,.0f} MiB"


COST_COLUMNS = ("diffquant", *PEERS, "forward")  # the floor last


def cost_rows(results: dict) -> list[list[str]]:
    rows = []
    for label, cases in (("hidden + Linear inputs, all layers", results.get("cost", [])),
                         ("attention scores, all layers", results.get("attention_cost", []))):
        for c in cases:
            what = (f"{label}: {c['tokens']:,} tokens" if c["tokens"] != c["seq_len"]
                    else f"{label}: one window of {c['seq_len']:,}")
            if c.get("model", "smollm2-135m") != "smollm2-135m":
                what = f"{c['model']} (random weights), {what}"
            if "load_average" in c:
                what += f" (load {c['load_average']:.0f})"
            if "not_run" in c:
                rows.append([what, c["not_run"], "", "", ""])
                continue
            w = c["workflows"]
            rows.append([what] + [_cell(w.get(k)) for k in COST_COLUMNS])
    return rows


def _case_name(c: dict) -> str:
    model = "SmolLM2" if c.get("model", "smollm2-135m") == "smollm2-135m" else f"{c['model']} (random weights)"
    what = f"{c['tokens']:,} tokens" if c["tokens"] != c["seq_len"] else f"attention scores, one window of {c['seq_len']:,}"
    return f"{model}, {what}"


def verdicts(results: dict) -> list[str]:
    """Per measured case, in words: diffquant's tokens per CPU-second against the fastest peer's (which is faster),
    and, where every workflow runs the same forward (not the attention cases, whose bare forward forms no scores),
    the most any statistics code could give: the fastest peer's CPU time over the bare forward's; then the 3x target
    and how peak memory grows with tokens."""
    out = []
    for c in [*results.get("cost", []), *results.get("attention_cost", [])]:
        w = {k: v for k, v in c.get("workflows", {}).items() if "tokens_per_cpu_s" in v}
        ran = [k for k in PEERS if k in w]
        if "diffquant" not in w or not ran:
            continue
        best = max(ran, key=lambda k: w[k]["tokens_per_cpu_s"])
        ratio = w["diffquant"]["tokens_per_cpu_s"] / w[best]["tokens_per_cpu_s"]
        text = (f"{_case_name(c)}: diffquant {ratio:.2f}× the tokens per CPU-second of the fastest peer "
                f"({PEER_LABELS[best]})" if ratio >= 1 else
                f"{_case_name(c)}: {PEER_LABELS[best]} is faster, diffquant does {ratio:.2f}× its tokens per CPU-second")
        if "forward" in w and c["tokens"] != c["seq_len"]:  # attention cases: the bare forward forms no scores
            floor = w["forward"]["cpu_seconds"] / w["diffquant"]["cpu_seconds"]
            cap = w[best]["cpu_seconds"] / w["forward"]["cpu_seconds"]
            text += (f"; the bare forward is {floor:.0%} of diffquant's CPU time, so even statistics that cost nothing "
                     f"would make it at most {cap:.1f}× that peer")
        out.append(f"- {text}.")
    ratios = {_case_name(c): c["workflows"]["diffquant"]["tokens_per_cpu_s"]
              / max(c["workflows"][k]["tokens_per_cpu_s"] for k in PEERS if "tokens_per_cpu_s" in c["workflows"].get(k, {}))
              for c in [*results.get("cost", []), *results.get("attention_cost", [])]
              if "tokens_per_cpu_s" in c.get("workflows", {}).get("diffquant", {})
              and any("tokens_per_cpu_s" in c["workflows"].get(k, {}) for k in PEERS)}
    if ratios:
        met = [n for n, r in ratios.items() if r >= 3]
        missed = [n for n in ratios if n not in met]
        out.append("- The target of 3× the fastest peer's tokens per CPU-second is met on "
                   + (f"{len(met)} case(s) ({'; '.join(met)})" if met else "no case")
                   + (f" and not on {len(missed)} ({'; '.join(missed)})" if missed else "") + "."
                   + (" The tiny model's ratios do not carry over to SmolLM2: its bare forward is a different share of "
                      "diffquant's time (the floors above); only the growth with tokens does." if met else ""))
    for model in MODELS:
        cases = [c for c in results.get("cost", []) if c.get("model", "smollm2-135m") == model
                 and "peak_mib" in c.get("workflows", {}).get("diffquant", {})]
        if len(cases) < 2:
            continue
        lo, hi = cases[0], cases[-1]
        grow = [f"{PEER_LABELS[k]} {lo['workflows'][k]['peak_mib']:,.0f} → {hi['workflows'][k]['peak_mib']:,.0f} MiB"
                for k in PEERS if "peak_mib" in lo["workflows"].get(k, {}) and "peak_mib" in hi["workflows"].get(k, {})]
        out.append(f"- Peak memory, {_case_name(lo).split(',')[0]}, {lo['tokens']:,} → {hi['tokens']:,} tokens: diffquant "
                   f"{lo['workflows']['diffquant']['peak_mib']:,.0f} → {hi['workflows']['diffquant']['peak_mib']:,.0f} MiB"
                   + (f"; {'; '.join(grow)}" if grow else "; the peers not started at the larger size (memory)") + ".")
    return out


def breakdown_lines(b: dict | None) -> list[str]:
    """The per-statistic CPU time of one batch (benchmarks/peers_breakdown.py), before and after ebaa11f."""
    if not b:
        return []
    e, parts = b["end_to_end_cpu_s"], b["update_parts_cpu_s"]
    fwd, taps, prof = e["bare forward"], e["forward with no-op taps"], e["profile (forward, taps, statistics)"]
    now = [f"{name} {v:.3f}" for name, v in parts.items() if not name.startswith("before")
           and name not in ("SiteStats.update, everything", "full-tensor passes (_passes), all")]
    was = [f"{name[len('before: '):]} {v:.3f} (now {parts[name[len('before: '):]]:.3f})"
           for name, v in parts.items() if name.startswith("before") and name[len("before: "):] in parts]
    return [f"Where diffquant's time goes (benchmarks/peers_breakdown.py; {b['model']}, one batch of {b['tokens']:,} "
            f"tokens at the cost case's {b['sites']} sites, {b['values_per_batch'] / 1e6:.0f}M values; CPU-seconds, "
            f"the least of {b['rounds']} rounds, one thread): the bare forward {fwd:.2f}, with no-op taps on the sites "
            f"{taps:.2f}, the whole profile {prof:.2f}, so the statistics and their hooks add {prof - fwd:.2f} "
            f"({(prof - fwd) / fwd:.0%} of the forward). `SiteStats.update` alone, fed the recorded activations: "
            f"{parts['SiteStats.update, everything']:.3f}, of which the full-tensor passes "
            f"{parts['full-tensor passes (_passes), all']:.3f}; by statistic: " + "; ".join(now) + ". Before commit "
            "ebaa11f (same values, bit for bit): " + "; ".join(was) + ".", ""]


def logit_breakdown_lines(b: dict | None) -> list[str]:
    """Where the attention-logit profile's CPU time goes (benchmarks/peers_breakdown.py --logits): end to end
    against the plain forwards, and the operators that grew most."""
    if not b:
        return []
    e, ops = b["end_to_end_cpu_s"], b["added_by_op"]
    eager = e["plain forward (eager attention)"]
    cases = "; ".join(f"{name} {v:.2f}" + ("" if v == eager else f" ({v / eager:.2f}× eager)") for name, v in e.items())
    grew = ", ".join(f"{name.removeprefix('aten::')} {d['share']:.0%} ({d['calls']:+,} calls)"
                     for name, d in list(ops.items())[:8])
    against = b.get("added_against", "plain forward (eager attention)")
    return [f"Where the attention-logit profile's time goes (benchmarks/peers_breakdown.py --logits at {b['revision']}; "
            f"{b['model']}, one window of {b['tokens']:,} tokens, {b['layers']} layers × {b['heads']} heads; CPU-seconds, "
            f"the least of {b['rounds']} rounds, one thread, load average {b['load_average']:.1f}): {cases}. Per "
            f"operator (torch.profiler self CPU time of the profile with the sink metrics less that of the {against}), "
            "the largest shares of what the profile adds, with the calls it adds per forward: " + grew + ".", ""]


def versions_text(results: dict) -> str:
    """Each side's package versions as the file records them, for the parity run and for the cost cases apart:
    the two were measured in different sessions, and the cost cases' diffquant and peers need not share a
    transformers version (each workflow records its own)."""
    def say(by_side: dict[str, list[dict]]) -> str:
        return "; ".join(f"{PEER_LABELS.get(k, k)}: " + " / ".join(", ".join(f"{n} {v}" for n, v in vs.items())
                                                               for vs in found)
                         for k, found in by_side.items() if found)

    parity = results.get("parity") or {}
    at_parity = {"diffquant": [(parity.get("diffquant") or {}).get("versions")],
                 **{k: [r.get("versions")] for k, r in parity.get("peers", {}).items()}}
    at_cost = {}
    for case in results.get("cost") or []:
        for k, w in case.get("workflows", {}).items():
            if w.get("versions") and w["versions"] not in at_cost.setdefault(k, []):
                at_cost[k].append(w["versions"])
    parts = [f"{what}: {text}." for what, text in (("Versions in the parity run", say({k: [v for v in vs if v] for k, vs
                                                                                       in at_parity.items()})),
                                                   ("In the cost cases", say(at_cost))) if text]
    ours = {v.get("transformers") for v in at_cost.get("diffquant", [])}
    theirs = {v.get("transformers") for k in PEERS for v in at_cost.get(k, [])}
    if ours and theirs and ours != theirs:
        parts.append(f"So the cost cases time diffquant on transformers {', '.join(sorted(ours))} and the peers on "
                     f"{', '.join(sorted(theirs))}: not one version, and not re-measured here.")
    return " ".join(parts)


def markdown_part(results: dict) -> list[str]:
    """The parity and cost tables as markdown lines, from a peers.json dict."""
    from diffquant.report.tables import markdown

    parity = results.get("parity") or {}
    lines = [f"Model: {results['model']}; tokens: {results['corpus']}. {versions_text(results)}", ""]
    if parity:
        lines += [f"Parity on {parity['tokens']:,} tokens (windows of {parity['seq_len']}), {parity['sites']} sites: "
                  "the largest relative difference over the layers between each peer's values reduced exactly "
                  "(benchmarks/peer_stats.py) and diffquant's streaming statistics; tolerance fp32 (1e-5) for top-k "
                  "and kurtosis, exact for the count, and for the median the resolution of diffquant's |x| histogram "
                  "(2^-8: it reads each value as the bf16 number nearest it)"
                  + ("; the peers' own values reduce to identical statistics at every site"
                     if parity.get("peers_identical") else "") + ".", "",
                  markdown(["peer", "site", "top-1", "top-10", "top-100", "median", "kurtosis", "count"],
                           parity_rows(parity))]
    lines += [f"Cost: fresh process per workflow; tokens per second of wall time after loading the model (and per "
              "second of the process's CPU time, steadier on a shared machine), and the peak resident memory "
              f"(VmHWM) of the whole process; {results.get('cores')} cores, in brackets the load average from "
              "other work when the case started. The peers keep each "
              "batch's activations (their cache-then-compute: an exact median needs every value) and reduce them at "
              "the end; diffquant keeps nothing per token, and its median is read off a histogram (the parity table's "
              "tolerance). So the ratios compare diffquant's streaming statistics with our own cache-everything "
              "reduction on each peer (benchmarks/peer_stats.py) as their docs show the caching, not with the fastest "
              "code one could write on a peer's hooks (a streaming reduction there would close part of the gap).", "",
              markdown(["case", *(PEER_LABELS[k] for k in COST_COLUMNS)], cost_rows(results))]
    said = verdicts(results)
    if said:
        lines += ["Per case, from the tokens per CPU-second above:", "", *said, ""]
    lines += breakdown_lines(results.get("breakdown"))
    lines += logit_breakdown_lines(results.get("breakdown_logits"))
    for note in NOT_COVERED:
        lines += [note, ""]
    return lines


if __name__ == "__main__":
    main()
