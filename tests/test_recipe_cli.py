"""The command line speaks Recipe: the recipe.yaml `quantize` writes reruns the same model bit for bit under
`quantize --recipe`, as a `sweep --recipe` cell and from `dq.Recipe.load`; an llm-compressor recipe runs as one;
fixes chain in order; renamed flags are refused in one line naming the new one; one --seq-len default."""

import json

import pytest

import diffquant as dq
from diffquant.cli import build_parser, main

LLMCOMPRESSOR_RECIPE = "tests/data/llmcompressor-micro-llama-gptq-w4g32/recipe.yaml"
DATA = ["--eval-tokens", "256", "--seq-len", "32", "--calib-tokens", "128"]


@pytest.fixture(scope="module")
def saved(micro_pair, tmp_path_factory):
    from diffquant.data.tokens import byte_tokenizer

    root = tmp_path_factory.mktemp("recipe")
    micro_pair[0].save_pretrained(root / "m")
    byte_tokenizer().save_pretrained(root / "m")
    (root / "c.txt").write_text("\n".join(f"line {i}: and the lord spake unto moses" for i in range(2000)))
    return root


def _quantize(saved, out, *recipe) -> dict:
    assert main(["quantize", "--model", str(saved / "m"), "--data", str(saved / "c.txt"), *DATA, *recipe,
                 "--out", str(out)]) == 0
    return json.loads((out / "quantize.json").read_text())


def test_the_recipe_quantize_writes_reruns_bit_for_bit(saved, tmp_path):
    first = _quantize(saved, tmp_path / "a", "--fix", "smoothquant:0.5", "--fix", "clip:mse", "--solver",
                      "gptq:act-order", "--scheme", "w8a8-static")
    written = tmp_path / "a" / "recipe.yaml"
    recipe = dq.Recipe.load(written)
    assert [f.label() for f in recipe.fixes] == ["smoothquant:0.5", "clip:mse"]  # the chain, in order
    assert recipe.solver == dq.GPTQ(act_order=True) and first["fixes"] == ["smoothquant:0.5", "clip:mse"]
    assert [r["mitigation"] for r in first["fix_records"]] == ["smoothquant:0.5", "clip:mse"]
    again = _quantize(saved, tmp_path / "b", "--recipe", str(written))
    assert again["simulated"] == first["simulated"] and again["recipe"] == first["recipe"]
    for name in ("diffquant_scheme.json", "diffquant_solved_weights.safetensors", "recipe.yaml"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name

    # a sweep cell of the same file on the same windows: the same loss
    assert main(["sweep", "--model", f"m={saved / 'm'}", "--data", str(saved / "c.txt"), *DATA, "--bits", "16",
                 "--recipe", str(written), "--no-plots", "--out", str(tmp_path / "s")]) == 0
    rows = json.loads((tmp_path / "s" / "results.json").read_text())["rows"]
    (cell,) = [r for r in rows if r["kind"] == "recipe"]
    assert cell["loss"] == first["simulated"]["loss"] and cell["weights"] == "gptq:act-order"
    assert cell["mitigate"] == "smoothquant:0.5 → clip:mse"

    # and from Python: the same calibration windows give the same weights and loss
    model, tok = dq.load(str(saved / "m"))
    calib = dq.windows(str(saved / "c.txt"), tok, split="train", seq_len=32, tokens=128)
    held_out = dq.windows(str(saved / "c.txt"), tok, split="validation", seq_len=32, tokens=256)
    with dq.quantize_(model, dq.Recipe.load(written), calib):
        assert dq.perplexity(model, held_out)["loss"] == first["simulated"]["loss"]


def test_an_llmcompressor_recipe_runs_as_a_recipe_file(saved, tmp_path):
    from diffquant.quant.llmcompressor_recipe import read
    import yaml

    result = _quantize(saved, tmp_path / "l", "--recipe", LLMCOMPRESSOR_RECIPE)
    expected = dq.Recipe.of(read(yaml.safe_load(open(LLMCOMPRESSOR_RECIPE)), "recipe"))
    assert dq.Recipe.load(tmp_path / "l" / "recipe.yaml") == expected == dq.Recipe.load(LLMCOMPRESSOR_RECIPE)
    assert result["solver"] == "gptq:act-order:static-groups" and result["simulated"]["loss"] > 0  # absent actorder: static


@pytest.mark.parametrize("argv, new", [
    (["quantize", "--mitigate", "rotate"], "--fix"),
    (["quantize", "--weights", "gptq"], "--solver"),
    (["quantize", "--calib-batches", "2"], "--calib-tokens"),
    (["quantize", "--tokens", "64"], "--eval-tokens"),
    (["sweep", "--model", "m", "--out", "o", "--mitigate", "rotate"], "--fix"),
    (["sweep", "--model", "m", "--out", "o", "--tokens", "64"], "--eval-tokens"),
    (["lm-eval", "--model", "m", "--tasks", "t", "--out", "o", "--tokens", "64"], "--calib-tokens"),
    (["lm-eval", "--model", "m", "--tasks", "t", "--out", "o", "--weights", "awq"], "--solver"),
])
def test_renamed_flags_are_refused_in_one_line_naming_the_new_one(argv, new, capsys, tmp_path):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{argv[-2]} is gone from {argv[0]}: use {new}" in err


def test_a_recipe_file_goes_alone_and_every_command_has_one_seq_len_default(saved, tmp_path, capsys):
    assert main(["quantize", "--model", str(saved / "m"), "--recipe", LLMCOMPRESSOR_RECIPE, "--fix", "rotate",
                 "--out", str(tmp_path / "x")]) == 2
    assert "drop --fix" in capsys.readouterr().err and not (tmp_path / "x").exists()
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    defaults = {cmd: {a.dest: a.default for a in sub[cmd]._actions} for cmd in ("profile", "quantize", "sweep", "lm-eval")}
    assert {d["seq_len"] for d in defaults.values()} == {256}
    assert all("calib_tokens" in defaults[c] for c in ("quantize", "sweep", "lm-eval"))
    assert all("eval_tokens" in defaults[c] for c in ("quantize", "sweep"))
    sites = {o for a in build_parser()._subparsers._group_actions[0].choices["sites"]._actions for o in a.option_strings}
    assert {"--device", "--dtype"} <= sites


def test_fix_chains_and_implied_solvers():
    from diffquant.quant.recipe import from_cli

    r = from_cli(["smoothquant:0.5", "quarot"], None, "w4a8")
    assert [f.label() for f in r.fixes] == ["smoothquant:0.5", "rotate"] and r.solver == dq.GPTQ()
    assert dq.Recipe.from_dict({"fixes": ["quarot"], "scheme": "w4a8"}).solver == dq.GPTQ()  # no solver given
    assert dq.Recipe.from_dict({"fixes": ["quarot"], "solver": "rtn", "scheme": "w4a8"}).solver is None  # as given
    r = from_cli(["clip:output"], None, "w4a4-static")
    assert r.solver.label() == "clip:output"


def test_the_example_llmcompressor_recipes_read():
    """docs/recipes' llm-compressor files (the README points at them) read as the recipes they say."""
    assert dq.Recipe.load("docs/recipes/llmcompressor-w4a16-gptq.yaml").label() == \
        "gptq:static-groups → llmcompressor-w4a16-gptq:W4A16"
    assert dq.Recipe.load("docs/recipes/llmcompressor-smoothquant-w8a8.yaml").label() == \
        "smoothquant:0.8 → llmcompressor-smoothquant-w8a8:W8A8"
