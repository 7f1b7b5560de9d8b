"""Evaluation: perplexity and next-token accuracy on held-out token sequences, and multiple-choice accuracy."""

from __future__ import annotations

import math

import torch

from diffquant.errors import DiffquantError
from diffquant.frozen import evaluating


def input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def language_modeling(model, sequences: torch.Tensor, batch_size: int = 8, progress: bool = False,
                      positions: torch.Tensor | None = None) -> dict:
    """Mean next-token cross-entropy (nats), perplexity and top-1 accuracy over all predicted positions,
    with their standard errors over sequences (all sequences have the same length, so the mean over
    sequences is the mean over tokens), perplexity's 95% interval exp(loss ± t(0.975, n−1) SE), the counts, and the
    per-sequence losses (for paired comparisons of two settings on the same sequences).

    `positions` ([n, seq_len − 1] bool, aligned with the targets sequences[:, 1:]) selects predictions to report
    apart as well: `positions_loss` is their mean cross-entropy pooled over all sequences, `positions_tokens`
    their count (e.g. the copies of Bigram-Backcopy, data/synthetic.copy_targets)."""
    from tqdm.auto import tqdm

    from diffquant.stats.intervals import ppl_interval, standard_error

    if sequences.numel() == 0 or sequences.shape[1] < 2:
        raise DiffquantError("evaluation needs sequences of at least 2 tokens")
    device = input_device(model)
    if positions is not None and tuple(positions.shape) != (sequences.shape[0], sequences.shape[1] - 1):
        raise DiffquantError(f"positions must be [{sequences.shape[0]}, {sequences.shape[1] - 1}] (the targets), "
                             f"got {list(positions.shape)}")
    losses, accs, picked = [], [], []
    with evaluating(model):
        for start in tqdm(range(0, len(sequences), batch_size), desc="eval", unit="batch", disable=not progress,
                          leave=False):
            ids = sequences[start:start + batch_size].to(device)
            logits = model(ids, use_cache=False).logits[:, :-1].float()
            target = ids[:, 1:]
            # classes on the last dim: float32 cross-entropy over a strided class dim ([batch, vocab, pos]) came out
            # 1.4e-4 nats low on average on SmolLM2's 49,152-token vocabulary (up to 2.4e-4 per token, against float64)
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(),
                                                    reduction="none").view(target.shape)
            losses += nll.double().mean(dim=1).tolist()
            if positions is not None:
                picked.append(nll.double()[positions[start:start + batch_size].to(nll.device)].cpu())
            accs += (logits.argmax(-1) == target).double().mean(dim=1).tolist()
    loss = math.fsum(losses) / len(losses)
    se = standard_error(losses)
    out = {"loss": loss, "loss_se": se, "ppl": math.exp(min(loss, 700)),
           "ppl_ci95": ppl_interval(loss, se, len(losses)),
           "accuracy": math.fsum(accs) / len(accs), "accuracy_se": standard_error(accs),
           "tokens": len(losses) * (sequences.shape[1] - 1), "sequences": len(losses), "per_sequence_loss": losses}
    if positions is not None:
        chosen = torch.cat(picked)
        out["positions_tokens"] = int(chosen.numel())
        out["positions_loss"] = math.fsum(chosen.tolist()) / chosen.numel() if chosen.numel() else None
    return out


def multiple_choice(model, tokenizer, examples: list[dict], progress: bool = False, batch_tokens: int = 2048) -> dict:
    """Zero-shot multiple choice scored like lm-eval's multiple-choice tasks (HellaSwag):

    - `acc`: the chosen answer is the choice with the largest summed log-likelihood of its tokens given the
      context, log P(" " + choice | input), the choice tokenized on its own after the input's tokens;
    - `acc_norm`: the same log-likelihood divided by the choice's length in characters (as lm-eval does).

    Each example is {"input": str, "target_scores": {choice: score}}; the correct choice is the first with
    the top score. Returns both accuracies with their sample SE and 95% Wilson interval, `chance` (the mean of
    1 / number of choices), the per-example outcomes `correct` / `correct_norm` (0/1, in example order) for
    paired tests between settings, and `predicted`, the index of each example's chosen answer under `acc`.

    Sequences (input + one choice) of equal token length are batched together, never padded: a dynamic
    quantizer scales each sequence from that sequence alone (quant/numerics/granularity.py), so a sequence scores the
    same as it would alone; padding would add its positions to a per-tensor scale.
    """
    from tqdm.auto import tqdm

    from diffquant.stats.intervals import wilson

    if not examples:
        raise DiffquantError("the multiple-choice task has no examples")
    device = input_device(model)
    requests = []  # (example, choice, token ids, number of continuation tokens)
    golds, n_choices = [], []
    for i, ex in enumerate(examples):
        choices = list(ex["target_scores"])
        golds.append(max(range(len(choices)), key=lambda c: ex["target_scores"][choices[c]]))
        n_choices.append(len(choices))
        ctx = tokenizer(ex["input"], add_special_tokens=False)["input_ids"]
        if not ctx:
            raise DiffquantError(f"example {i} has an empty input: its first choice token would have no context")
        for j, choice in enumerate(choices):
            cont = tokenizer(" " + choice.strip(), add_special_tokens=False)["input_ids"]
            if not cont:
                raise DiffquantError(f"example {i}: choice {choice!r} has no tokens")
            requests.append((i, j, (ctx + cont)[-2048:], min(len(cont), 2047)))
    by_length: dict[int, list] = {}
    for r in requests:
        by_length.setdefault(len(r[2]), []).append(r)
    batches = [group[k:k + max(1, batch_tokens // length)] for length, group in sorted(by_length.items())
               for k in range(0, len(group), max(1, batch_tokens // length))]
    loglik = [[0.0] * k for k in n_choices]
    with evaluating(model):
        for batch in tqdm(batches, desc="mc", disable=not progress, leave=False):
            keep = max(r[3] for r in batch) + 1  # the logits that predict the longest continuation
            ids = torch.tensor([r[2] for r in batch], device=device)
            logp = torch.log_softmax(model(ids, use_cache=False, logits_to_keep=keep).logits[:, -keep:].float(), -1)
            for row, (i, j, seq, n) in enumerate(batch):
                target = torch.tensor(seq[-n:], device=device)
                loglik[i][j] = float(logp[row, keep - n - 1:keep - 1].gather(-1, target[:, None]).double().sum())
    correct, correct_norm, predicted = [], [], []
    for ex, gold, ll in zip(examples, golds, loglik):
        lengths = [max(1, len(c.strip())) for c in ex["target_scores"]]  # lm-eval divides by characters
        predicted.append(max(range(len(ll)), key=ll.__getitem__))
        correct.append(int(predicted[-1] == gold))
        norm = [v / n for v, n in zip(ll, lengths)]
        correct_norm.append(int(max(range(len(norm)), key=norm.__getitem__) == gold))
    n = len(examples)
    binomial = lambda p: (p * (1 - p) / (n - 1)) ** 0.5 if n > 1 else None  # noqa: E731 - SE of a mean of 0/1
    acc, acc_norm = sum(correct) / n, sum(correct_norm) / n
    return {"acc": acc, "acc_se": binomial(acc), "acc_ci95": wilson(sum(correct), n), "acc_norm": acc_norm,
            "acc_norm_se": binomial(acc_norm), "acc_norm_ci95": wilson(sum(correct_norm), n), "examples": n,
            "chance": sum(1 / k for k in n_choices) / n, "correct": correct, "correct_norm": correct_norm, "predicted": predicted}
