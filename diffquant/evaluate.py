"""Evaluation: perplexity and next-token accuracy on held-out token sequences."""

from __future__ import annotations

import math

import torch

from diffquant import DiffquantError


def input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def language_modeling(model, sequences: torch.Tensor, batch_size: int = 8, progress: bool = False) -> dict:
    """Mean next-token cross-entropy (nats), perplexity and top-1 accuracy over all predicted positions."""
    from tqdm.auto import tqdm

    if sequences.numel() == 0 or sequences.shape[1] < 2:
        raise DiffquantError("evaluation needs sequences of at least 2 tokens")
    device = input_device(model)
    total_nll, total_correct, total = 0.0, 0, 0
    with torch.inference_mode():
        for start in tqdm(range(0, len(sequences), batch_size), desc="eval", disable=not progress, leave=False):
            ids = sequences[start:start + batch_size].to(device)
            logits = model(ids, use_cache=False).logits[:, :-1].float()
            target = ids[:, 1:]
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                    reduction="sum")
            total_nll += float(nll)
            total_correct += int((logits.argmax(-1) == target).sum())
            total += target.numel()
    loss = total_nll / total
    return {"loss": loss, "ppl": math.exp(min(loss, 700)), "accuracy": total_correct / total, "tokens": total}
