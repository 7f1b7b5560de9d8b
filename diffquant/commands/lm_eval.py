"""`diffquant lm-eval`: lm-eval's tasks on a model quantized by a recipe (diffquant/lm_eval_adapter.py)."""

from __future__ import annotations

from pathlib import Path

from diffquant.lm_eval_adapter import evaluate


def run_cli(args) -> None:
    from diffquant.commands.common import calib_tokens, command_recipe, load_models
    from diffquant.data.windows import corpus_windows
    from diffquant.paths import atomic_write_json

    recipe = command_recipe(args, "fp")
    ((_, (model, tok)),) = load_models(args).items()
    calibration = (corpus_windows(args.data, tok, "train", args.seq_len, calib_tokens(args), args.cache_dir,
                                  chars=200_000) if recipe.needs_calibration else None)
    results = evaluate(model, tok, [t.strip() for t in args.tasks.split(",")], recipe, args.include_path,
                       args.limit, args.batch_size, calibration)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "lm_eval.json", {"model": args.model, "recipe": recipe.to_dict(),
                                             "scheme": recipe.adjusted_scheme().to_dict(), "device": str(model.device),
                                             "dtype": args.dtype, "results": results})
    for task, metrics in results.items():
        print(task, " ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
