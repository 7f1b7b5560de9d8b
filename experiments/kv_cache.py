"""KV-cache quantization, sink-aware or not: perplexity against K/V bits on KJV held-out tokens.

Every condition quantizes the keys after RoPE (`k_cache`) and the values (`v_cache`) of every layer, min-max
with a float offset (KIVI's and quanto's quantizer), in one forward over each sequence (prefill semantics:
every query sees every key and value quantized). With per-token keys this is what decoding through a
write-once quantized cache computes (tests/test_kv_cache.py), up to float rounding: on SmolLM2 a 1e-5
difference between one-query and whole-sequence attention can move a value across a rounding boundary,
and from then on the two are different draws of the same quantization noise (`--decode` shows both). Per-channel keys use KIVI's runs of 32 positions, and
in one forward a query also sees the keys of its own run quantized with a scale that includes the run's
later positions, where a decoding cache would still hold them in full precision (KIVI's convention). Grid:
K/V bits 8/4/3/2 × key granularity (per token and KV head, per channel and KV head in runs of 32, or per token
in each head's Hadamard basis, values too; values are per token and KV head in all three) × sink-aware off/on (the first token kept in full precision). Perplexity change against the same model in full precision is paired over sequences (95% t
interval of the per-sequence loss difference, carried through exp).

    python -m experiments.kv_cache --quick                      # seconds: the micro pair, random init
    python -m experiments.kv_cache                              # SmolLM2-135M-Instruct
    python -m experiments.kv_cache --model runs/pair/baseline --model runs/pair/diff   # trained checkpoints
    python -m experiments.kv_cache --decode [--quick]          # prefill vs decoding through a quantized cache
    python -m experiments.kv_cache --needle [--quick]          # needle retrieval decoded through a quantized cache

Results: docs/kv_cache/results.json, results.md, kv_cache.png/.svg (perplexity vs KV bits, one line per model
and key granularity, sink-aware dashed).
"""

from __future__ import annotations

import argparse
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

OUT = ROOT / "docs" / "kv_cache"
KEY_GRANULARITY = {"token": "per token and KV head", "channel": "per channel and KV head, runs of 32 positions",
                   "hadamard": "per token and KV head, Hadamard basis (values too; QuaRot)"}
RUN = 32  # KIVI's group size: key scales per channel over runs of 32 consecutive positions


@dataclass
class Settings:
    models: list[str] = field(default_factory=lambda: ["smollm2-135m"])
    corpus: str = "kjv"
    seq_len: int = 256
    sequences: int = 8
    bits: list[int] = field(default_factory=lambda: [8, 4, 3, 2])
    key_granularity: list[str] = field(default_factory=lambda: list(KEY_GRANULARITY))
    sinks: list[int] = field(default_factory=lambda: [0, 1])
    quick: bool = False


def scheme(bits: int, keys: str, sink: int):
    from diffquant.lab import KVChannel, PerToken, kv_config, kv_scheme

    kg = KVChannel(RUN) if keys == "channel" else PerToken()
    had = keys == "hadamard"  # keys and values in each head's Hadamard basis (kv_config's `hadamard`)
    return kv_scheme(f"k{bits}v{bits}-{keys}-sink{sink}", kv_config(bits, kg, sink=sink, hadamard=had),
                     kv_config(bits, sink=sink, hadamard=had),
                     f"int{bits} keys {KEY_GRANULARITY[keys]}, values per token; first {sink} token(s) kept")


def held_out(tokenizer, s: Settings) -> torch.Tensor:
    from diffquant.lab import encode, load_text, sequences, split_corpus

    _, val = split_corpus(load_text(s.corpus)[0])
    return sequences(encode(tokenizer, val), s.seq_len, s.seq_len * s.sequences)


def label_of(source: str, model) -> str:
    if source == "smollm2-135m":
        return "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to fp32)"
    if source.startswith("micro:"):
        return f"micro {source.split(':')[1]} (random init)"
    return f"{Path(source).name} ({type(model).__name__})"


def previous(stem: str, s: Settings, source: str, same: tuple[str, ...], **fields) -> dict:
    """The entry of `source` in the committed OUT/<stem>.json if it was measured with the same settings (`same`)
    and `fields`, its rows keyed by their scheme's JSON under "kept" ({} otherwise, or with `--fresh`): a rerun
    that adds conditions measures only the new ones. Callers reuse a row only where the float loss recomputed
    now equals the stored one bit for bit (perplexity grid) or the preset's definition is unchanged (needle)."""
    import json

    path = OUT / f"{stem}{'-quick' if s.quick else ''}.json"
    if FRESH or not path.is_file():
        return {}
    doc = json.loads(path.read_text())
    if any(doc["settings"].get(k) != getattr(s, k) for k in same):
        return {}
    m = next((m for m in doc["models"] if m["source"] == source and all(m.get(k) == v for k, v in fields.items())),
             None)
    return {} if m is None else {**m, "kept": {json.dumps(r["scheme"], sort_keys=True): r for r in m["rows"]}}


FRESH = False  # --fresh: recompute every condition


def measure(source: str, s: Settings) -> dict:
    import json

    from experiments.measure import quantization_cost

    import diffquant as dq

    model, tok = dq.load(source, device="cpu")[:2]
    seqs = held_out(tok, s)
    t0 = time.perf_counter()
    fp = dq.perplexity(model, seqs)
    before = previous("results", s, source, ("corpus", "seq_len", "sequences"))
    same_float = before.get("fp", {}).get("loss") == fp["loss"]  # the same model and tokens, bit for bit
    kept = before.get("kept", {}) if same_float else {}
    rows, reused = [], 0
    for bits in s.bits:
        for keys in s.key_granularity:
            for sink in s.sinks:
                sch = scheme(bits, keys, sink)
                old = kept.get(json.dumps(sch.to_dict(), sort_keys=True))
                if old is not None:
                    rows.append(old)
                    reused += 1
                    continue
                cost = quantization_cost(model, seqs, fp["per_sequence_loss"], sch)
                ppl = fp["ppl"] * (1 + cost["pct"] / 100)
                rows.append({"bits": bits, "keys": keys, "sink": sink, "scheme": sch.to_dict(), "ppl": ppl,
                             "dppl_pct": cost["pct"], "dppl_pct_ci95": cost["ci95"], "n": cost["n"]})
                print(f"{source} int{bits} keys={keys} sink={sink}: ppl {ppl:.4f} ({cost['pct']:+.3f}%)", flush=True)
    return {"source": source, "label": label_of(source, model), "architecture": type(model).__name__,
            "kv_heads": model.config.num_key_value_heads, "head_dim": model.config.head_dim,
            "fp": {k: fp[k] for k in ("loss", "ppl", "ppl_ci95", "tokens", "sequences")}, "rows": rows,
            "reused_rows": reused, "seconds": round(time.perf_counter() - t0, 1)}  # seconds: this run's rows


def decode_vs_prefill(source: str, s: Settings, prompt: int, new: int) -> dict:
    """Perplexity of tokens prompt..prompt+new of the first held-out sequence, (a) with K/V quantized in one
    forward over the whole sequence and (b) decoded one token at a time through a write-once quantized
    cache (the prompt in one forward), per condition."""
    import diffquant as dq
    from diffquant.lab import attach_scheme, decode_logits

    model, tok = dq.load(source, device="cpu")[:2]
    ids = held_out(tok, Settings(corpus=s.corpus, seq_len=prompt + new, sequences=1))[:1]

    def ppl(logits):
        lp = torch.log_softmax(logits[0, prompt - 1:-1].float(), -1)
        return math.exp(float(-lp.gather(-1, ids[0, prompt:, None]).mean()))

    with torch.inference_mode():
        fp = ppl(model(ids).logits)
    rows = []
    for bits in (4, 2):
        for keys in KEY_GRANULARITY:
            sch = scheme(bits, keys, 1)
            handle = attach_scheme(model, sch)
            try:
                with torch.inference_mode():
                    prefill = ppl(model(ids).logits)
            finally:
                handle.remove()
            decode = ppl(decode_logits(model, ids, sch, prompt))
            rows.append({"bits": bits, "keys": keys, "sink": 1, "ppl_prefill": prefill, "ppl_decode": decode})
            print(f"{source} decode int{bits} keys={keys}: prefill {prefill:.4f} decode {decode:.4f}", flush=True)
    return {"source": source, "label": label_of(source, model), "prompt": prompt, "decoded": new, "ppl_fp": fp,
            "rows": rows}


NEEDLE_SCHEMES = ("kv8", "kv4", "kv4-sink1", "kv4-had", "k4v2", "k4v2-had", "kivi2")  # kvquant4-sink1 quantizes pre-RoPE keys: no cache


def needle_run(source: str, s: Settings, examples: int, context_chars: int) -> dict:
    """Needle retrieval (diffquant.data.needle: 6 needles, 2 questions per example) in full precision and
    decoded through a write-once quantized cache per preset; per-query outcomes kept for McNemar."""
    import json

    import diffquant as dq
    from diffquant.lab import load_text, needle_accuracy, split_corpus

    model, tok = dq.load(source, device="cpu")[:2]
    hay = split_corpus(load_text(s.corpus)[0])[1]  # held-out text as the haystack
    before = previous("needle", s, source, ("corpus",), examples=examples, context_chars=context_chars)
    kept = before.get("kept", {})
    prompt_tokens = before.get("prompt_tokens")
    rows = []
    for name in (None, *NEEDLE_SCHEMES):
        config = dq.scheme(name).to_dict() if name else None
        old = kept.get(json.dumps(name or "fp"))
        if old is not None and old.get("config", "?") == config:  # the same preset definition
            rows.append(old)
            continue
        t0 = time.perf_counter()
        r = needle_accuracy(model, tok, hay, examples=examples, kv_scheme=dq.scheme(name) if name else None,
                            context_chars=context_chars)
        prompt_tokens = r["prompt_tokens"]
        rows.append({"scheme": name or "fp", "config": config, "choice": r["choice"], "exact": r["exact"],
                     "queries": r["queries"],
                     "chance": r["chance"], "per_query": r["per_query"], "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{source} needle {name or 'fp'}: choice {r['choice']:.3f} exact {r['exact']:.3f}", flush=True)
    return {"source": source, "label": label_of(source, model), "examples": examples, "context_chars": context_chars,
            "prompt_tokens": prompt_tokens, "rows": rows}


def needle_table(doc: dict) -> str:
    import diffquant as dq
    from diffquant.lab import holm_adjust, markdown, mcnemar_exact, wilson

    parts = ["Needle retrieval decoded through a quantized KV cache (`diffquant.data.needle`): six needles \"the magic "
             "number of CITY is NNNN\" at depths 0/0/25/50/75/100% of a held-out KJV haystack, two questions per "
             "example; the context and question in one forward into a write-once cache, each entry quantized once, "
             "when final (on write, except KIVI's 128 most recent positions and incomplete 32-position key runs, which "
             "stay in full precision), each answer decoded one token per forward. The fp row is scored without a "
             "cache: one forward over context, question and candidate, greedy by `generate` (the same computation; "
             "tested equal on a random micro model, not on this one). choice: the asked number is the likeliest of the "
             "six; exact: greedy decoding reproduces it. Brackets: 95% Wilson intervals; Δ and McNemar p (exact, "
             "two-sided) are paired with full precision over the same questions."]
    for m in doc["models"]:
        fp = next(r for r in m["rows"] if r["scheme"] == "fp")
        tests = {(r["scheme"], i): mcnemar_exact([q[i] for q in fp["per_query"]], [q[i] for q in r["per_query"]])
                 for r in m["rows"] if r["scheme"] != "fp" for i in (0, 1)}
        holm = dict(zip(tests, holm_adjust([t["p"] for t in tests.values()])))
        body = []
        for r in m["rows"]:
            n = r["queries"]
            cells = [r["scheme"] if r["scheme"] == "fp" else f"`{r['scheme']}`",
                     "full precision" if r["scheme"] == "fp" else dq.scheme(r["scheme"]).description]
            for key, i in (("choice", 0), ("exact", 1)):
                k = round(r[key] * n)
                lo, hi = wilson(k, n)
                cells.append(f"{100 * r[key]:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]")
                if r["scheme"] == "fp":
                    cells.append("-")
                else:
                    t = tests[(r["scheme"], i)]
                    cells.append(f"{100 * t['delta']:+.1f} ({t['gained']}/{t['lost']}, p {t['p']:.2g}, "
                                 f"Holm {holm[(r['scheme'], i)]:.2g})")
            body.append(cells)
        by = {r["scheme"]: r for r in m["rows"]}
        pairs = {(name, i): mcnemar_exact([q[i] for q in by[name.removesuffix("-had")]["per_query"]],
                                          [q[i] for q in r["per_query"]])
                 for name, r in by.items() if name.endswith("-had") and name.removesuffix("-had") in by
                 for i in (0, 1)}
        lo, hi = m["prompt_tokens"]
        if pairs:
            pholm = dict(zip(pairs, holm_adjust([t["p"] for t in pairs.values()])))
            hadamard = markdown(["Hadamard basis against the same scheme unrotated", "Δ choice (gained/lost, McNemar p)",
                                 "Δ exact (gained/lost, McNemar p)"],
                                [[f"`{name}` − `{name[:-4]}`", *[
                                    f"{100 * pairs[(name, i)]['delta']:+.1f} ({pairs[(name, i)]['gained']}/"
                                    f"{pairs[(name, i)]['lost']}, p {pairs[(name, i)]['p']:.2g}, Holm "
                                    f"{pholm[(name, i)]:.2g})" for i in (0, 1)]]
                                 for name in dict.fromkeys(n for n, _ in pairs)])
        parts.append(f"**{m['label']}**: {m['examples']} examples × 2 questions = {fp['queries']} questions; haystack "
                     f"≥ {m['context_chars']:,} characters, {lo:,}–{hi:,} tokens with the question; chance (choice) "
                     f"{100 * fp['chance']:.1f}%; Holm over the table's {len(tests)} tests.\n\n"
                     + markdown(["cache", "scheme", "choice % [95%]", "Δ choice (gained/lost, McNemar p)",
                                 "exact % [95%]", "Δ exact (gained/lost, McNemar p)"], body))
        if pairs:
            parts.append(f"The same questions, each Hadamard-basis cache against its unrotated scheme (paired exact "
                         f"McNemar, Holm over these {len(pairs)} tests; the two questions of an example share its "
                         "haystack, so the questions are not independent):\n\n" + hadamard)
    return "\n\n".join(parts) + "\n"


def decode_table(doc: dict) -> str:
    from diffquant.lab import markdown

    parts = []
    for m in doc["models"]:
        body = [[f"int{r['bits']}", KEY_GRANULARITY[r["keys"]], f"{r['ppl_prefill']:.4f}", f"{r['ppl_decode']:.4f}"]
                for r in m["rows"]]
        parts.append(f"**{m['label']}**: perplexity of tokens {m['prompt']}..{m['prompt'] + m['decoded'] - 1} of one "
                     f"KJV held-out sequence (n = {m['decoded']} tokens, one sequence: no interval), full precision "
                     f"{m['ppl_fp']:.4f}; first token kept in both.\n\n"
                     + markdown(["K/V bits", "keys", "ppl, one forward (prefill)", "ppl, decoded through the cache"],
                                body))
    return ("Prefill against decode-time KV quantization: one forward with every entry quantized, against decoding "
            "one token at a time through a cache whose entries are quantized once, when written (the prompt in "
            "one forward). With per-token scales the two compute the same quantizer on the same inputs up to float "
            "rounding (≤ 1e-5 in the logits of the micro models in tests/test_kv_cache.py). Where the two differ below "
            "with per-token keys (SmolLM2's int4 row), our explanation, not tested here, is that such a rounding "
            "difference moved a value across a quantization boundary, after which the two runs carry different "
            "draws of the same quantization noise. Per-channel runs of 32 are "
            "quantized at decode only once complete (the newest, incomplete run waits in full precision).\n\n"
            + "\n\n".join(parts) + "\n")


def table(doc: dict) -> str:
    from diffquant.lab import markdown

    s = doc["settings"]
    parts = [f"KV-cache quantization on {s['corpus'].upper()} held-out tokens: {s['sequences']} sequences of "
             f"{s['seq_len']} tokens per model ({s['sequences'] * (s['seq_len'] - 1):,} predicted tokens), one "
             "forward each with keys (after RoPE) and values quantized, min-max with a float offset; values per "
             f"token and KV head; per-channel keys in runs of {RUN} positions (KIVI; in one forward a run's scale "
             "includes positions a decoding cache would not have written yet); Hadamard basis: keys and values "
             "quantized per token after a normalised Hadamard over each head's channels and rotated back (QuaRot's "
             "online Q/K rotation and V/O rotation: attention in float is unchanged). Δppl: the change from the same "
             f"model in full precision; [95% interval]: the paired t-interval over the {s['sequences']} sequences of "
             "the per-sequence loss difference, carried through exp. Models run: "
             + "; ".join(f"{m['label']} (`{m['source']}`)" for m in doc["models"]) + "."]
    grouped = {id(m) for g in seed_groups(doc).values() for seeds in g.values() for m in seeds.values()}
    for m in doc["models"]:
        if id(m) in grouped:
            continue  # trained pairs: one table over seeds below (their rows are in the json)
        body = []
        for r in m["rows"]:
            ci = r["dppl_pct_ci95"]
            body.append([f"int{r['bits']}", KEY_GRANULARITY[r["keys"]], "first token kept" if r["sink"] else "-",
                         f"{r['ppl']:.3f}", f"{r['dppl_pct']:+.2f}%",
                         f"[{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else "-"])
        parts.append(f"**{m['label']}**: full precision ppl {m['fp']['ppl']:.3f} ({m['fp']['tokens']:,} tokens, "
                     f"{m['kv_heads']} KV heads of {m['head_dim']})\n\n"
                     + markdown(["K/V bits", "keys", "sink-aware", "ppl", "Δppl", "95% interval"], body))
    parts += [design_table(setting, groups) for setting, groups in seed_groups(doc).items()]
    return "\n\n".join(parts) + "\n"


def seed_groups(doc: dict) -> dict[str, dict[str, dict[int, dict]]]:
    """{setting: {design: {seed: model entry}}} for checkpoints laid out as <runs>/<setting>/s<seed>/<design>
    (train_pair's layout, as `python -m experiments.emergence --only regime --setting NAME` writes it), where a
    setting has two designs or more, each with two seeds or more: those are compared over seeds rather than shown one
    model at a time."""
    groups: dict[str, dict[str, dict[int, dict]]] = {}
    for m in doc["models"]:
        path = Path(m["source"])
        if re.fullmatch(r"s\d+", path.parent.name):
            groups.setdefault(path.parent.parent.name, {}).setdefault(path.name, {})[int(path.parent.name[1:])] = m
    return {setting: g for setting, g in groups.items() if len(g) >= 2 and all(len(v) >= 2 for v in g.values())}


def seed_costs(seeds: dict[int, dict], row: int) -> list[float]:
    """Each seed's mean held-out loss change (nats) of one condition: log(1 + Δppl%/100)."""
    return [math.log1p(m["rows"][row]["dppl_pct"] / 100) for _, m in sorted(seeds.items())]


def design_table(setting: str, groups: dict[str, dict[int, dict]]) -> str:
    """One setting's designs over seeds: each condition's loss cost, mean ± 95% t over seeds, and DIFF against
    the baseline (Welch's t over seeds, Holm over the table's conditions)."""
    from diffquant.lab import detectable, display, fmt_pm, holm_adjust, markdown, t_interval, welch

    designs = sorted(groups, key=lambda d: (d != "baseline", d != "diff", d))
    first = next(iter(groups[designs[0]].values()))
    conditions = [(r["bits"], r["keys"], r["sink"]) for r in first["rows"]]
    for d in designs:
        for seed, m in groups[d].items():
            if [(r["bits"], r["keys"], r["sink"]) for r in m["rows"]] != conditions:
                raise SystemExit(f"kv_cache: {m['source']} was measured on other conditions than {first['source']}")
    test = "diff" in groups and "baseline" in groups
    tests = [welch(seed_costs(groups["diff"], i), seed_costs(groups["baseline"], i)) if test else None
             for i in range(len(conditions))]
    holm = holm_adjust([t["p"] if t else None for t in tests])
    family = sum(t is not None for t in tests)
    body = []
    for i, (bits, keys, sink) in enumerate(conditions):
        cells = [f"int{bits}", KEY_GRANULARITY[keys], "first token kept" if sink else "-"]
        for d in designs:
            ci = t_interval(seed_costs(groups[d], i))
            cells.append(fmt_pm(ci["mean"], ci["half"]))
        if test:
            t, n = tests[i], min(len(groups["diff"]), len(groups["baseline"]))
            size = t and detectable(seed_costs(groups["diff"], i), seed_costs(groups["baseline"], i), family)
            verdict = ("-" if t is None else f"no difference detected (n = {n}; detectable {size['sd']:.1f} SD = "
                       f"{size['units']:.3g} nats)" if holm[i] >= 0.05
                       else "DIFF costs less" if t["diff"] < 0 else "DIFF costs more")
            cells += ["-" if t is None else f"{t['diff']:+.4f}", "-" if t is None else f"{t['p']:.3g}",
                      "-" if holm[i] is None else f"{holm[i]:.3g}", verdict]
        body.append(cells)
    fp = {d: t_interval([m["fp"]["loss"] for m in groups[d].values()]) for d in designs}
    m0 = first
    shapes = {d: {(m["kv_heads"], m["head_dim"]) for m in groups[d].values()} for d in designs}
    matched = len({hw for v in shapes.values() for hw in v}) == 1
    head = (f"**Trained pair `{setting}`** ({', '.join(f'{display(d)}: seeds {sorted(groups[d])}' for d in designs)}; "
            + (f"every design caches {m0['kv_heads']} KV heads of {m0['head_dim']} channels, so the per-token scales "
               "are at matched granularity" if matched else
               "; ".join(f"{display(d)} caches {h} KV heads of {w} channels" for d in designs for h, w in shapes[d])
               + ": per-token-and-KV-head scales are not at matched granularity")
            + "; full-precision held-out loss "
            + ", ".join(f"{display(d)} {fmt_pm(fp[d]['mean'], fp[d]['half'])} nats" for d in designs)
            + "). Cost: the held-out loss change from the same model in full precision, log(1 + Δppl), in nats, mean "
            "± 95% t over seeds (each seed's value is its mean over the held-out sequences)"
            + (f"; DIFF − Transformer: Welch's t over seeds, Holm over the table's {family} tests; 'detectable': the "
               "smallest true difference a test detects with 80% power at Holm's first step, in standard deviations "
               "and, after '=', in nats from the pooled SD (no equivalence margin was stated, so none is claimed)."
               if test else "."))
    columns = ["K/V bits", "keys", "sink-aware", *[f"{display(d)} cost (nats)" for d in designs]]
    if test:
        columns += ["DIFF − Transformer", "p", "p (Holm)", "verdict"]
    return head + "\n\n" + markdown(columns, body)


def curves(doc: dict) -> list[tuple[str, list[tuple[str, list[dict], float]]]]:
    """The figure's panels: [(title, [(label, rows, full-precision ppl)])]: the models run one at a time in the
    first, each trained pair's designs (geometric mean of perplexity over seeds) in one panel per setting."""
    from diffquant.lab import display

    groups = seed_groups(doc)
    grouped = {id(m) for g in groups.values() for seeds in g.values() for m in seeds.values()}
    single = [(m["label"], m["rows"], m["fp"]["ppl"]) for m in doc["models"] if id(m) not in grouped]
    panels = [("", single)] if single else []
    for setting, g in groups.items():
        lines = []
        for design, seeds in g.items():
            ms = list(seeds.values())
            rows = [{**r, "ppl": math.exp(sum(math.log(m["rows"][i]["ppl"]) for m in ms) / len(ms))}
                    for i, r in enumerate(ms[0]["rows"])]
            fp = math.exp(sum(math.log(m["fp"]["ppl"]) for m in ms) / len(ms))
            lines.append((f"{display(design)} ({len(ms)} seeds)", rows, fp))
        panels.append((f"trained pair `{setting}`", lines))
    return panels


def figure(doc: dict, stem: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from diffquant.lab import color

    panels = curves(doc)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.2), layout="constrained", squeeze=False)
    markers = {"token": "o", "channel": "s", "hadamard": "^"}
    for ax, (title, lines) in zip(axes[0], panels):
        for label, rows, fp in lines:
            c = color(label.split(" (")[0])
            for keys in KEY_GRANULARITY:
                for sink in (0, 1):
                    pts = sorted((r["bits"], r["ppl"]) for r in rows if r["keys"] == keys and r["sink"] == sink)
                    if not pts:
                        continue
                    ax.plot(*zip(*pts), color=c, marker=markers[keys], linestyle="--" if sink else "-",
                            label=f"{label}, keys {keys}" + (", sink kept" if sink else ""))
            ax.axhline(fp, color=c, linestyle=":", linewidth=1)
        ax.set_xlabel("K/V bits")
        ax.set_ylabel("perplexity (log scale)")
        ax.set_yscale("log")
        ax.set_xticks(sorted({r["bits"] for _, rows, _ in lines for r in rows}))
        ax.set_title(("KV-cache quantization" + (f", {title}" if title else "")
                      + " (dotted: full precision; dashed: first token kept)"), fontsize=9)
        ax.legend(fontsize=6)
    for ext in ("png", "svg"):
        fig.savefig(stem.with_suffix(f".{ext}.part"), format=ext, dpi=150)
        stem.with_suffix(f".{ext}.part").replace(stem.with_suffix(f".{ext}"))
    plt.close(fig)


def render(quick: bool) -> None:
    """Rewrite results(-quick).md, decode(-quick).md and the figure from the committed json (no model runs)."""
    import json

    from diffquant.lab import atomic_write_text

    suffix = "-quick" if quick else ""
    for stem, write in ((f"results{suffix}", table), (f"decode{suffix}", decode_table), (f"needle{suffix}", needle_table)):
        path = OUT / f"{stem}.json"
        if path.is_file():
            doc = json.loads(path.read_text())
            atomic_write_text(OUT / f"{stem}.md", write(doc))
            if stem.startswith("results"):
                figure(doc, OUT / f"kv_cache{suffix}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the micro pair (random init), 2 short sequences")
    p.add_argument("--model", action="append", help="a model to run (zoo name, preset:design, checkpoint folder); "
                                                    "repeatable; default smollm2-135m")
    p.add_argument("--decode", action="store_true",
                   help="instead: prefill vs decode-time quantization on one sequence (128 + 64 tokens; quick: 32 + 16)")
    p.add_argument("--sequences", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--needle", action="store_true",
                   help="instead: needle retrieval decoded through each preset's quantized cache (quick: 2 examples)")
    p.add_argument("--examples", type=int, default=10, help="needle examples (two questions each)")
    p.add_argument("--chars", type=int, default=1000, help="needle haystack length in characters")
    p.add_argument("--render", action="store_true", help="only rewrite the reports (md, figure) from the committed json")
    p.add_argument("--fresh", action="store_true", help="recompute conditions the committed json already has")
    a = p.parse_args(argv)
    global FRESH
    FRESH = a.fresh
    s = Settings(quick=a.quick)
    if a.quick:
        s.models, s.sequences, s.seq_len = ["micro:baseline", "micro:diff"], 4, 64
    if a.model:
        s.models = a.model
    s.sequences = a.sequences or s.sequences
    s.seq_len = a.seq_len or s.seq_len
    if a.render:
        render(a.quick)
        return
    torch.manual_seed(0)
    if a.needle:
        examples, chars = (2, 300) if s.quick else (a.examples, a.chars)
        write("needle", s, [needle_run(m, s, examples, chars) for m in s.models], needle_table)
    elif a.decode:
        prompt, new = (32, 16) if s.quick else (128, 64)
        write("decode", s, [decode_vs_prefill(m, s, prompt, new) for m in s.models], decode_table)
    else:
        doc = write("results", s, [measure(m, s) for m in s.models], table, torch_threads=torch.get_num_threads())
        figure(doc, OUT / ("kv_cache-quick" if s.quick else "kv_cache"))


def write(stem: str, s: Settings, models: list[dict], render_md, **extra) -> dict:
    """OUT/<stem>(-quick).json and .md, written atomically; the markdown is printed too."""
    from diffquant.lab import atomic_write_json, atomic_write_text

    doc = {"settings": asdict(s), "models": models, **extra}
    stem += "-quick" if s.quick else ""
    atomic_write_json(OUT / f"{stem}.json", doc)
    atomic_write_text(OUT / f"{stem}.md", render_md(doc))
    print(render_md(doc))
    return doc

if __name__ == "__main__":
    main()
