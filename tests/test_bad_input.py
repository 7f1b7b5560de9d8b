"""Bad input gets one line that names the file and what was expected, exit 2 (issue 51): broken model files of each
kind a loader reads, and a command that fails before writing results leaves no --out folder it created."""

import pytest

from diffquant.cli import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from diffquant.models.presets import PRESETS, build

    folder = tmp_path_factory.mktemp("saved")
    build(PRESETS["micro"], "baseline").save_pretrained(folder)
    return folder


def _broken(tmp_path, saved, kind):
    import shutil

    if kind.endswith(".gguf"):
        path = tmp_path / kind
        path.write_bytes(b"" if kind == "empty.gguf" else b"hello, not a model\n")
        return path, path.name, "GGUF"
    folder = tmp_path / kind
    shutil.copytree(saved, folder)
    if kind == "config":
        (folder / "config.json").write_text('{"model_type": "llama", oops}')
        return folder, "config.json", "not valid JSON"
    if kind == "tokenizer":
        (folder / "tokenizer.json").write_text("{oops")
        return folder, "tokenizer.json", "not valid JSON"
    if kind == "weights":
        with open(folder / "model.safetensors", "r+b") as f:
            f.truncate(100)
        return folder, "model.safetensors", "safetensors"
    if kind == "scheme":
        (folder / "diffquant_scheme.json").write_text("[1, 2]")
        return folder, "diffquant_scheme.json", "not an object"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["empty.gguf", "text.gguf", "config", "tokenizer", "weights", "scheme"])
def test_a_broken_model_file_is_named_in_one_line_with_exit_2(tmp_path, saved, kind, capsys):
    source, name, expected = _broken(tmp_path, saved, kind)
    out = tmp_path / "runs" / "profile"
    text = tmp_path / "t.txt"
    text.write_text("In the beginning was the word.\n" * 50)
    code = main(["profile", "--model", str(source), "--data", str(text), "--tokens", "64", "--seq-len", "32",
                 "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and name in err[0] and expected in err[0], err
    assert not (tmp_path / "runs").exists()  # the failed command took back the folders it created


@pytest.mark.parametrize("args", [
    ["profile", "--model", "no/such/model"],
    ["profile", "--model", "micro:diff", "--device", "cuda"],
    ["profile", "--model", "micro:diff", "--sites", "*.nonsense"],
    ["profile", "--model", "micro:diff", "--data", "EMPTY"],
    ["quantize", "--model", "micro:diff", "--scheme", "kv4", "--export", "compressed-tensors"],
])
def test_a_command_that_fails_before_its_results_leaves_no_out_folder(tmp_path, args, capsys):
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    empty, text = tmp_path / "empty.txt", tmp_path / "t.txt"
    empty.write_text("")
    text.write_text("In the beginning was the word.\n" * 50)
    args = [str(empty) if a == "EMPTY" else a for a in args]
    if "--data" not in args and args[0] == "profile":
        args += ["--data", str(text)]
    out = tmp_path / "runs" / "x"
    tokens = "--tokens" if args[0] == "profile" else "--eval-tokens"  # profiled, or evaluated, tokens
    assert main([*args, tokens, "64", "--seq-len", "32", "--out", str(out)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


def test_a_failed_command_keeps_a_folder_that_existed_and_results_it_wrote(tmp_path):
    from diffquant.paths import removed_if_failed

    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(RuntimeError), removed_if_failed(mine):
        (mine / "sweep_config.json").write_text("{}")
        raise RuntimeError
    assert mine.is_dir()  # the user's own folder stays
    new = tmp_path / "new" / "sweep"
    with pytest.raises(RuntimeError), removed_if_failed(new):
        new.mkdir(parents=True)
        (new / "sweep_config.json").write_text("{}")
        (new / "cells.jsonl").write_text("{}\n")  # a finished cell: --resume continues from it
        raise RuntimeError
    assert (new / "cells.jsonl").is_file()
