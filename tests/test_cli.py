import subprocess
import sys

import pytest

from diffquant.cli import build_parser, main

COMMANDS = ["env", "models", "sites", "profile", "quantize", "train", "sweep", "plot", "data", "demo"]


def test_help_for_every_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    for cmd in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0, cmd
    out = capsys.readouterr().out
    assert all(c in out for c in COMMANDS)


def test_help_is_fast_and_light():
    code = "import sys; from diffquant.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"  # heavy imports are lazy


def test_models_lists_matched_counts(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "5,261,568" in out and "5,262,080" in out and "smollm2-135m" in out


def test_env(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "transformers" in out and "diffquant" in out


def test_sites(capsys):
    assert main(["sites"]) == 0
    assert "attn_logits" in capsys.readouterr().out
    assert main(["sites", "--model", "micro:diff", "--select", "layers.1.*"]) == 0
    assert "layers.1.attn_map" in capsys.readouterr().out


def test_errors_are_one_line(capsys, tmp_path):
    assert main(["sites", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diffquant: error:") and "\n" not in err and "Traceback" not in err
    assert main(["train", "--preset", "huge", "--out", str(tmp_path / "t")]) == 2
    assert "choose one of" in capsys.readouterr().err
    assert main(["data", "info", "no-such-corpus"]) == 2
    assert main(["plot", str(tmp_path)]) == 2
    build_parser()


def test_sites_says_which_presets_apply(capsys, tmp_path):
    from diffquant.models.matrix import FAMILIES

    FAMILIES["bloom"].build().save_pretrained(tmp_path / "bloom")  # ALiBi attention in its own module
    assert main(["sites", "--model", str(tmp_path / "bloom")]) == 0
    out = capsys.readouterr().out
    applies = out.split("apply to BloomForCausalLM: ")[1].splitlines()[0].split(", ")
    assert "w8a8" in applies and "nf4" in applies and "logits-int4" not in applies
    assert "not logits-int4: scheme 'logits-int4' cannot apply to BloomForCausalLM" in out


def test_argument_errors_load_no_heavy_module():
    """Bad arguments are refused before torch loads (that is what makes them answer at once)."""
    for argv in (["train", "--preset", "huge", "--out", "x"], ["profile", "--model", "m", "--tokens", "-1", "--out", "x"],
                 ["sweep", "--model", "m", "--bits", "99", "--out", "x"], ["train", "--arch", "nope", "--out", "x"],
                 ["quantize", "--model", "m", "--scheme", "nope", "--out", "x"], ["models"], ["sites"]):
        code = ("import sys; from diffquant.cli import main; rc = main(%r); "
                "print(rc, 'torch' in sys.modules)" % (argv,))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        rc, torch_loaded = out.stdout.split()[-2:]  # `models` and `sites` print their tables first
        assert torch_loaded == "False", argv
        assert (rc == "0") == (argv in (["models"], ["sites"])), (argv, out.stderr)
        assert rc == "0" or out.stderr.count("\n") == 1  # one line


def test_commands_are_quiet_and_pipes_end_quietly(tmp_path):
    (tmp_path / "t.txt").write_text("In the beginning was the word.\n" * 400)
    out = subprocess.run([sys.executable, "-m", "diffquant.cli", "profile", "--model", "micro:diff", "--data",
                          str(tmp_path / "t.txt"), "--tokens", "512", "--seq-len", "64", "--out", str(tmp_path / "p"),
                          "--no-plots"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    noise = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("profile ")]
    assert noise == [], noise  # only diffquant's own progress bar
    assert "fewer tokens" not in out.stdout
    head = subprocess.run(f"{sys.executable} -m diffquant.cli models | head -1", shell=True, capture_output=True,
                          text=True)
    assert head.stderr == "" and head.stdout.startswith("preset")


def test_profile_says_when_it_got_fewer_tokens(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("In the beginning was the word.\n" * 400)
    assert main(["profile", "--model", "micro:baseline", "--data", str(tmp_path / "t.txt"), "--tokens", "100000",
                 "--seq-len", "64", "--out", str(tmp_path / "p"), "--no-plots"]) == 0
    assert "fewer tokens than asked" in capsys.readouterr().out
