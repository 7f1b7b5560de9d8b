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


def evaluate(model, tokenizer, tasks: list[str], scheme=None, include_path: str | Path | None = None,
             limit: int | None = None, batch_size: int = 1) -> dict:
    """lm-eval results {task: {metric: value}} for `model` with `scheme` (a QuantScheme) applied."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise DiffquantError("lm-eval is not installed: pip install 'diffquant[eval]'") from None
    from diffquant.quant.scheme import quantize_

    handle = quantize_(model, scheme) if scheme is not None and not scheme.is_identity else None
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        manager = TaskManager(include_path=str(include_path)) if include_path else TaskManager()
        out = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, bootstrap_iters=0,
                              log_samples=False)
    finally:
        if handle is not None:
            handle.remove()
    return {task: {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, (int, float))}
            for task, metrics in out["results"].items()}


def run_cli(args) -> None:
    from diffquant.models.load import load_model
    from diffquant.paths import atomic_write_json
    from diffquant.quant.scheme import get_scheme

    model, tok = load_model(args.model, hub=args.hub, cache=args.cache_dir)
    if tok is None:
        raise DiffquantError(f"{args.model} has no tokenizer")
    scheme = get_scheme(args.scheme)
    results = evaluate(model, tok, [t.strip() for t in args.tasks.split(",")], scheme, args.include_path, args.limit,
                       args.batch_size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "lm_eval.json", {"model": args.model, "scheme": scheme.to_dict(), "results": results})
    for task, metrics in results.items():
        print(task, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
