"""Evaluation: perplexity and next-token accuracy on held-out token sequences."""

from __future__ import annotations

import math

import torch

from diffquant.errors import DiffquantError
from diffquant.frozen import frozen_weights


def input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def language_modeling(model, sequences: torch.Tensor, batch_size: int = 8, progress: bool = False) -> dict:
    """Mean next-token cross-entropy (nats), perplexity and top-1 accuracy over all predicted positions,
    with their standard errors over sequences (all sequences have the same length, so the mean over
    sequences is the mean over tokens), perplexity's 95% interval exp(loss ± t(0.975, n−1) SE), the counts, and the
    per-sequence losses (for paired comparisons of two settings on the same sequences)."""
    from tqdm.auto import tqdm

    from diffquant.stats.intervals import ppl_interval, standard_error

    if sequences.numel() == 0 or sequences.shape[1] < 2:
        raise DiffquantError("evaluation needs sequences of at least 2 tokens")
    device = input_device(model)
    losses, accs = [], []
    with torch.inference_mode(), frozen_weights():
        for start in tqdm(range(0, len(sequences), batch_size), desc="eval", unit="batch", disable=not progress,
                          leave=False):
            ids = sequences[start:start + batch_size].to(device)
            logits = model(ids, use_cache=False).logits[:, :-1].float()
            target = ids[:, 1:]
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
            losses += nll.double().mean(dim=1).tolist()
            accs += (logits.argmax(-1) == target).double().mean(dim=1).tolist()
    loss = math.fsum(losses) / len(losses)
    se = standard_error(losses)
    out = {"loss": loss, "loss_se": se, "ppl": math.exp(min(loss, 700)),
           "ppl_ci95": ppl_interval(loss, se, len(losses)),
           "accuracy": math.fsum(accs) / len(accs), "accuracy_se": standard_error(accs),
           "tokens": len(losses) * (sequences.shape[1] - 1), "sequences": len(losses), "per_sequence_loss": losses}
    return out


def multiple_choice(model, tokenizer, examples: list[dict], progress: bool = False) -> dict:
    """Zero-shot multiple choice scored like lm-eval's HellaSwag: each choice's summed log-likelihood
    given the context (`acc`), and the same divided by the choice's length in characters (`acc_norm`, as
    lm-eval computes it).

    Each example is {"input": str, "target_scores": {choice: score}}; the correct choice has the top score.
    """
    from tqdm.auto import tqdm

    if not examples:
        raise DiffquantError("the multiple-choice task has no examples")
    device = input_device(model)
    correct = correct_norm = 0
    with torch.inference_mode(), frozen_weights():
        for ex in tqdm(examples, desc="mc", disable=not progress, leave=False):
            choices = list(ex["target_scores"])
            gold = max(range(len(choices)), key=lambda i: ex["target_scores"][choices[i]])
            ctx = tokenizer(ex["input"], add_special_tokens=False)["input_ids"]
            scores, norms = [], []
            for choice in choices:
                cont = tokenizer(" " + choice.strip(), add_special_tokens=False)["input_ids"]
                ids = torch.tensor([(ctx + cont)[-2048:]], device=device)
                logits = model(ids, use_cache=False).logits[0, -len(cont) - 1:-1].float()
                ll = float(torch.log_softmax(logits, -1).gather(-1, torch.tensor(cont, device=device)[:, None]).sum())
                scores.append(ll)
                norms.append(ll / max(1, len(choice.strip())))  # lm-eval divides by the choice's length
            correct += max(range(len(scores)), key=scores.__getitem__) == gold
            correct_norm += max(range(len(norms)), key=norms.__getitem__) == gold
    n = len(examples)
    binomial = lambda p: (p * (1 - p) / (n - 1)) ** 0.5 if n > 1 else None  # noqa: E731 - SE of a mean of 0/1
    return {"acc": correct / n, "acc_se": binomial(correct / n), "acc_norm": correct_norm / n,
            "acc_norm_se": binomial(correct_norm / n), "examples": n}
