"""llm-compressor's own recipe, rerun by diffquant, against the weights llm-compressor solved with it.

    python -m benchmarks.llmcompressor_recipe_check

tests/data/llmcompressor-micro-llama-gptq-w4g32 holds a checkpoint llm-compressor 0.14 wrote (its GPTQ, int4
symmetric in groups of 32, no act-order, every Linear but lm_head, of the matrix's micro Llama on 8 random windows
of 32 tokens; benchmarks/llmcompressor_check.py --fixture) with the recipe.yaml it saved and its own dequantized
weights. Here diffquant reads that recipe (`actorder: null` set on the modifier, as the run had it: the saved file
leaves it to the config group, which llm-compressor resolves to static act-order), quantizes the same float model
on the same windows, and compares every Linear's quantized values: the share equal to llm-compressor's, and the
largest difference in grid steps. Writes docs/weights/llmcompressor_recipe.md and .json.
"""

from __future__ import annotations

from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / "llmcompressor-micro-llama-gptq-w4g32"
OUT = Path(__file__).resolve().parents[1] / "docs" / "weights"


def compare(static_groups: bool = True) -> dict[str, dict]:
    """{Linear: {"equal": share of values equal to llm-compressor's, "steps": largest difference in grid steps}}."""
    import torch
    import yaml
    from safetensors.torch import load_file

    import diffquant as dq
    from diffquant.models.matrix import FAMILIES, VOCAB
    from diffquant.quant import llmcompressor_recipe

    torch.manual_seed(0)  # as write_fixture built the model and drew the windows
    g = torch.Generator().manual_seed(1)
    calib = torch.randint(3, VOCAB, (8, 32), generator=g)
    model = FAMILIES["llama"].build().eval()
    doc = yaml.safe_load((FIXTURE / "recipe.yaml").read_text())
    doc["default_stage"]["default_modifiers"]["GPTQModifier"]["actorder"] = None
    steps = llmcompressor_recipe.read(doc)
    if not static_groups:  # the reference's lazy groups instead: how far that is from llm-compressor
        from dataclasses import replace

        steps = [replace(s, static_groups=False) if getattr(s, "static_groups", False) else s for s in steps]
    theirs = load_file(FIXTURE / "reference.safetensors")
    floats = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = {}
    with dq.quantize_(model, dq.Recipe.of(steps), calib):
        for name, w in theirs.items():
            if not name.endswith("proj.weight"):
                continue
            mine = model.get_submodule(name.removesuffix(".weight")).weight.detach()
            float_w = floats[name]  # each group's step on the compressed-tensors grid: its float absmax / 7.5
            step = (float_w.abs().reshape(w.shape[0], -1, 32).amax(-1) / 7.5).repeat_interleave(32, 1)
            out[name.removesuffix(".weight")] = {"equal": float((mine == w).float().mean()),
                                                 "steps": float(((mine - w).abs() / step).max())}
    return out


def main() -> None:
    from diffquant.paths import atomic_write_json, atomic_write_text

    static, lazy = compare(True), compare(False)
    rows = [f"| {n} | {static[n]['equal']:.2%} | {static[n]['steps']:.2f} | {lazy[n]['equal']:.2%} |" for n in static]
    text = "\n".join([
        "# llm-compressor's recipe rerun by diffquant (`python -m benchmarks.llmcompressor_recipe_check`)", "",
        __doc__.split("\n\n")[1].replace("\n", " "), "",
        "diffquant reads llm-compressor's GPTQModifier as `gptq:static-groups`: llm-compressor 0.14 takes each group's "
        "scale from the float weight before any column moves; the GPTQ reference (and diffquant's `gptq`) takes it "
        "as each group is reached, from the updated weights. The last column is that lazy form against the same "
        "weights. The remaining differences are single grid steps where llm-compressor's float32 solve and "
        "diffquant's float64 one round a value near a midpoint apart, after which the error feedback differs.", "",
        "| Linear | values equal (static groups) | largest difference (grid steps) | values equal (lazy groups) |",
        "|---|---|---|---|", *rows, ""])
    atomic_write_text(OUT / "llmcompressor_recipe.md", text)
    atomic_write_json(OUT / "llmcompressor_recipe.json", {"static_groups": static, "lazy_groups": lazy})
    print(text)


if __name__ == "__main__":
    main()
