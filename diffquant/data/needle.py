"""Multi-needle retrieval (the paper's §3.4): needles "the magic number of CITY is NNNN" hidden at
depths 0/25/50/75/100% of a haystack of corpus text, then R of the N cities are asked for.

Used two ways: mixed into training text at a chosen fraction (so a small model acquires the skill),
and as an evaluation whose accuracy can be measured under quantization.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from diffquant.errors import DiffquantError
from diffquant.frozen import evaluating

CITIES = ("Paris", "London", "Tokyo", "Cairo", "Lima", "Oslo", "Rome", "Delhi", "Sydney", "Toronto", "Madrid", "Berlin",
          "Dublin", "Vienna", "Prague", "Athens", "Lisbon", "Warsaw", "Seoul", "Bangkok", "Nairobi", "Quito", "Havana",
          "Manila", "Jakarta", "Hanoi", "Kyiv", "Riga", "Tunis", "Dakar", "Accra", "Bogota", "Santiago", "Montreal",
          "Boston", "Denver", "Chicago", "Houston", "Phoenix", "Seattle", "Austin", "Miami", "Geneva", "Zurich",
          "Munich", "Milan", "Naples", "Porto", "Seville", "Krakow")
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class NeedleExample:
    context: str  # haystack with needles
    queries: tuple[tuple[str, str], ...]  # (prompt, answer)
    numbers: tuple[str, ...]  # all needle numbers in the context (the choices)


def needle(city: str, number: str) -> str:
    return f" The magic number of {city} is {number}. "


def make_example(haystack: list[str], n_needles: int, n_queries: int, rng: random.Random,
                 context_chars: int = 600) -> NeedleExample:
    if not 1 <= n_queries <= n_needles <= len(CITIES):
        raise DiffquantError(f"need 1 <= queries ({n_queries}) <= needles ({n_needles}) <= {len(CITIES)}")
    start = rng.randrange(max(1, len(haystack) - 50))
    hay = ""
    for line in haystack[start:]:
        if len(hay) >= context_chars:
            break
        hay += line.strip() + " "
    cities = rng.sample(CITIES, n_needles)
    numbers = [str(rng.randrange(1000, 10000)) for _ in cities]
    # each needle goes at one of the paper's depths, cycling through them
    inserts = sorted(((DEPTHS[i % len(DEPTHS)], c, n) for i, (c, n) in enumerate(zip(cities, numbers))),
                     key=lambda t: t[0])
    words = hay.split(" ")
    pieces, last = [], 0
    for depth, city, number in inserts:
        cut = int(depth * len(words))
        pieces.append(" ".join(words[last:cut]))
        pieces.append(needle(city, number).strip())
        last = cut
    pieces.append(" ".join(words[last:]))
    context = " ".join(p for p in pieces if p)
    asked = rng.sample(range(n_needles), n_queries)
    queries = tuple((f" What is the magic number of {cities[i]}? The magic number of {cities[i]} is", f" {numbers[i]}")
                    for i in asked)
    return NeedleExample(context, queries, tuple(numbers))


def mix_needles(text: str, fraction: float, seed: int, n_needles: int = 4) -> str:
    """Append needle documents (context, then every query with its answer) until they make `fraction` of the text."""
    if fraction <= 0:
        return text
    rng = random.Random(seed)
    lines = text.splitlines()
    target = int(len(text) * fraction / (1 - fraction))
    docs, size = [], 0
    while size < target:
        ex = make_example(lines, n_needles, n_needles, rng)
        doc = ex.context + "".join(q + a + "." for q, a in ex.queries)
        docs.append(doc)
        size += len(doc)
    # interleave needle documents with the text in blocks so every part of training sees some
    step = max(1, len(lines) // max(1, len(docs)))
    out = []
    for i, doc in enumerate(docs):
        out.extend(lines[i * step:(i + 1) * step])
        out.append(doc)
    out.extend(lines[len(docs) * step:])
    return "\n".join(out)


def needle_accuracy(model, tokenizer, haystack_text: str, n_needles: int = 6, n_queries: int = 2,
                    examples: int = 20, seed: int = 1234, kv_scheme=None, context_chars: int = 600) -> dict:
    """Accuracy of retrieving the asked number: `choice` = the right number is the likeliest of the
    N needle numbers in the context; `exact` = greedy decoding reproduces it. `per_query` keeps each query's
    (choice, exact) outcome, so two conditions can be compared query by query (McNemar).

    With `kv_scheme` (a scheme quantizing k_cache / v_cache), every score is computed the way a deployed
    low-bit cache is used: the context and question in one forward into a write-once quantized cache (each
    key and value quantized once, when written), then one token per forward through a copy of it."""
    rng = random.Random(seed)
    lines = haystack_text.splitlines()
    device = model.get_input_embeddings().weight.device
    outcomes, lengths = [], []
    with evaluating(model):
        for _ in range(examples):
            ex = make_example(lines, n_needles, n_queries, rng, context_chars)
            for prompt, answer in ex.queries:
                prefix = tokenizer(ex.context + prompt, add_special_tokens=False)["input_ids"]
                lengths.append(len(prefix))
                conts = [tokenizer(f" {n}", add_special_tokens=False)["input_ids"] for n in ex.numbers]
                target = tokenizer(answer, add_special_tokens=False)["input_ids"]
                if kv_scheme is None:
                    scores = [_continuation_logprob(model, prefix, c, device) for c in conts]
                    greedy = _greedy(model, prefix, len(target), device)
                else:
                    scores, greedy = _through_cache(model, prefix, conts, len(target), device, kv_scheme)
                best = ex.numbers[max(range(len(scores)), key=scores.__getitem__)]
                outcomes.append((best == answer.strip(), greedy == target))
    total = len(outcomes)
    return {"choice": sum(c for c, _ in outcomes) / total, "exact": sum(e for _, e in outcomes) / total,
            "queries": total, "chance": 1 / n_needles, "needles": n_needles, "per_query": outcomes,
            "prompt_tokens": [min(lengths), max(lengths)]}


def _continuation_logprob(model, prefix: list[int], cont: list[int], device) -> float:
    ids = torch.tensor([prefix + cont], device=device)
    logp = torch.log_softmax(model(ids, use_cache=False).logits[0, len(prefix) - 1:-1].float(), -1)
    return float(logp.gather(-1, torch.tensor(cont, device=device)[:, None]).sum())


def _greedy(model, prefix: list[int], n: int, device) -> list[int]:
    ids = torch.tensor([prefix], device=device)
    out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prefix):].tolist()


def _through_cache(model, prefix: list[int], conts: list[list[int]], n: int, device, kv_scheme):
    """Each continuation's log-probability and an n-token greedy continuation, decoded through a write-once
    quantized cache of `kv_scheme` filled once with `prefix` (each continuation decodes through its own copy)."""
    import copy

    from diffquant.quant.algorithms.kv_cache import write_once_cache

    cache = write_once_cache(model, kv_scheme)
    first = model(torch.tensor([prefix], device=device), cache=cache, use_cache=True).logits[0, -1]
    step = lambda c, t: model(torch.tensor([[t]], device=device), cache=c, use_cache=True).logits[0, -1]  # noqa: E731
    scores = []
    for cont in conts:
        own, logits, total = copy.deepcopy(cache), first, 0.0
        for i, t in enumerate(cont):
            total += float(torch.log_softmax(logits.float(), -1)[t])
            if i + 1 < len(cont):
                logits = step(own, t)
        scores.append(total)
    own, logits, greedy = copy.deepcopy(cache), first, []
    for i in range(n):
        greedy.append(int(logits.argmax()))
        if i + 1 < n:
            logits = step(own, greedy[-1])
    return scores, greedy
