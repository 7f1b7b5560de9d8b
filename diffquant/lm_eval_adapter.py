"""lm-eval with a diffquant scheme applied: `lm_eval.simple_evaluate` on the model as it runs under the
scheme's fake quantizers (for users who are online: HellaSwag, LAMBADA ... come from the hub through
lm-eval; offline, local task folders work too)."""

from __future__ import annotations

import json
from pathlib import Path

from diffquant.errors import DiffquantError


def write_local_task(examples: list[dict], folder: Path, name: str = "diffquant_local") -> Path:
    """Turn {"input", "target_scores"} examples into an lm-eval multiple-choice task folder (YAML + JSONL)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for ex in examples:
        choices = list(ex["target_scores"])
        gold = max(range(len(choices)), key=lambda i: ex["target_scores"][choices[i]])
        rows.append({"input": ex["input"], "choices": [c.strip() for c in choices], "gold": gold})
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{input}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{gold}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return folder


def evaluate(model, tokenizer, tasks: list[str], recipe=None, include_path: str | Path | None = None,
             limit: int | None = None, batch_size: int = 1, calibration=None) -> dict:
    """lm-eval results {task: {metric: value}} for `model` quantized by `recipe` (a Recipe, a scheme or a preset
    name; see quant/recipe.py), `calibration` its training-split windows where the recipe needs them."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise DiffquantError("lm-eval is not installed: pip install 'diffquant[eval]'") from None
    from contextlib import nullcontext

    from diffquant.quant.recipe import Recipe, quantize_

    recipe = Recipe.of(recipe) if recipe is not None else None
    quantized = (nullcontext() if recipe is None or (recipe.scheme.is_identity and not recipe.fixes)
                 else quantize_(model, recipe, calibration))
    with quantized:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        manager = TaskManager(include_path=str(include_path)) if include_path else TaskManager()
        out = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, bootstrap_iters=0,
                              log_samples=False)
    return {task: {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, (int, float))}
            for task, metrics in out["results"].items()}
