"""Which multiple-choice tasks a model can do at all, decided on the float model before any quantized run.

Accuracy lost to quantization means nothing on a task the model answers at chance: every setting then sits
at chance and "no loss" is guaranteed. So the tasks of an accuracy-versus-bits figure are chosen by a rule
fixed in advance, applied to the float model only, and the record of every candidate is kept.
"""

from __future__ import annotations

from collections import Counter

from diffquant.stats.intervals import wilson

MIN_EXAMPLES = 300
RULE = (f"A candidate task qualifies when the float model's accuracy (summed log-likelihood, lm-eval's acc) on "
        f"at least {MIN_EXAMPLES} examples is above chance with its 95% Wilson interval excluding chance: the "
        "interval's lower bound exceeds chance, the mean over examples of 1 / number of choices. Candidates are "
        "scored in the order listed, on the float model only, before any quantized run.")


def judge(correct: list[int], chance: float, min_examples: int = MIN_EXAMPLES) -> dict:
    """The rule applied to one task's per-example float outcomes (0/1)."""
    n, k = len(correct), sum(correct)
    lo, hi = wilson(k, n)
    if n < min_examples:
        passed, reason = False, f"only {n} examples (< {min_examples})"
    elif lo > chance:
        passed, reason = True, "interval above chance"
    else:
        passed = False
        reason = "interval includes chance" if hi >= chance else "interval below chance"
    return {"examples": n, "correct": k, "acc": k / n, "acc_ci95": [lo, hi], "chance": chance,
            "margin": lo - chance, "passed": passed, "reason": reason}


def majority_rate(examples: list[dict]) -> float:
    """Accuracy of always answering the most common correct choice text (where choice texts repeat across
    examples, e.g. Yes/No): a constant guesser can beat 1 / number of choices on an unbalanced task."""
    golds = [max(e["target_scores"], key=e["target_scores"].get).strip() for e in examples]
    return Counter(golds).most_common(1)[0][1] / len(golds)


def select(model, tokenizer, candidates: list[str], limit: int, seed: int = 0, cache: str | None = None,
           stop_after: int | None = None, progress: bool = False) -> list[dict]:
    """Score each candidate (a BIG-bench name or a .jsonl file) on `limit` examples sampled with `seed`, in
    order, and judge it; stop once `stop_after` candidates have passed (None: score all)."""
    import time

    from diffquant.data.tasks import load_task
    from diffquant.evaluate import multiple_choice

    record = []
    for spec in candidates:
        examples = load_task(spec, limit, seed=seed, cache=cache)
        t0 = time.process_time()
        r = multiple_choice(model, tokenizer, examples, progress=progress)
        record.append({"task": spec, **judge(r["correct"], r["chance"]), "majority": majority_rate(examples),
                       "acc_norm": r["acc_norm"], "acc_norm_ci95": r["acc_norm_ci95"],
                       "cpu_seconds": time.process_time() - t0})
        if stop_after is not None and sum(c["passed"] for c in record) >= stop_after:
            break
    return record
