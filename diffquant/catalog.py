"""Every registry a user names things from, read in one place: `diffquant list`, `dq.registries()` and the
command line's help texts (so a help text cannot drift from what the code accepts). No torch: the help
answers at once."""

from __future__ import annotations


def entries() -> dict[str, list[tuple[str, str]]]:
    """{registry: [(name as typed, one-line description)]}."""
    from diffquant.data.corpora import CORPORA
    from diffquant.designs import DESIGNS
    from diffquant.models.presets import PRESETS as MODEL_PRESETS
    from diffquant.models.zoo import ZOO
    from diffquant.quant.checkpoints.backends import BACKENDS
    from diffquant.quant.numerics.scheme import SCHEME_PRESETS as SCHEMES
    from diffquant.quant.algorithms.steps import FIXES, SOLVERS
    from diffquant.stats.metric_sets import REGISTRY as METRIC_SETS
    from diffquant.taps.sites import MODEL_SITES, POINTS

    return {
        "schemes": [(s.name, s.description) for s in SCHEMES.values()],
        "fixes": FIXES.docs(),
        "solvers": SOLVERS.docs(),
        "backends": [("fake", "diffquant's exact simulation of any scheme")]
                    + [(b.name, f"{b.description}; simulated by {b.simulated_by}") for b in BACKENDS.values()],
        "sites": [(f"*.{p.name}", p.doc) for p in POINTS.values()] + [(p.name, p.doc) for p in MODEL_SITES.values()],
        "designs": [(d.key, f"{d.display}: {d.doc}") for d in DESIGNS.values()],
        "metric sets": [(m.name, m.citation) for m in METRIC_SETS.values()],
        "corpora": [(c.name, c.about) for c in CORPORA.values()]
                   + [("debian-mix", "kjv, gcide, wordnet, pydoc and linuxdoc together"),
                      ("FILE or FOLDER", "local text"), ("hf:NAME[:CONFIG]", "a Hugging Face dataset (online)"),
                      ("synth:bb[:...] | synth:markov[:...]", "generated Bigram-Backcopy / Markov tokens")],
        "granularities": [("tensor", "one scale"), ("channel[:AXIS]", "per channel"), ("token", "per token (row)"),
                          ("head", "per attention head"), ("group:SIZE", "per group of SIZE channels"),
                          ("kv-channel[:POSITIONS]", "KV cache: per channel over runs of positions (KIVI)")],
        "model presets": [(f"{p.name}:DESIGN", f"width {p.hidden}, {p.layers} layers, random weights")
                          for p in MODEL_PRESETS.values()],
        "zoo": [(z.name, z.display) for z in ZOO.values()],
    }


def names() -> dict[str, list[str]]:
    return {registry: [name for name, _ in rows] for registry, rows in entries().items()}


def choices(registry: str) -> str:
    """"a, b, c": the names of one registry, for a help text."""
    return ", ".join(names()[registry])


def text() -> str:
    """Every registry with its entries, for `diffquant list`."""
    out = []
    for registry, rows in entries().items():
        out.append(f"{registry}:")
        width = max(len(n) for n, _ in rows)
        out += [f"  {n:<{width}}  {doc}" for n, doc in rows]
    return "\n".join(out)
