import subprocess
import sys

import pytest

from diffquant.cli import build_parser, main

COMMANDS = ["env", "models", "sites", "profile", "quantize", "train", "sweep", "lm-eval", "plot", "data", "demo",
            "list"]


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
    """The installed command starts through diffquant_cli: its help (every sub-command's too, registries
    included) imports neither torch nor transformers."""
    for argv in (["--help"], ["profile", "--help"], ["quantize", "--help"], ["list"]):
        run = subprocess.run([sys.executable, "-X", "importtime", "-m", "diffquant_cli", *argv], capture_output=True,
                             text=True)
        assert run.returncode == 0, run.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in run.stderr.splitlines() if "|" in line}
        assert not imported & {"torch", "transformers"}, argv


def _help(capsys, monkeypatch, command: str) -> str:
    monkeypatch.setenv("COLUMNS", "100000")  # one line per help text: argparse would wrap inside hyphenated names
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


REGISTRY_FLAGS = {  # command: the registries its help must list in full
    "profile": ["corpora", "metric sets", "zoo"], "quantize": ["schemes", "fixes", "solvers", "backends", "corpora"],
    "sweep": ["schemes", "fixes", "solvers", "granularities", "corpora"], "train": ["designs", "model presets"],
    "lm-eval": ["schemes", "fixes", "solvers"]}


@pytest.mark.parametrize("command", list(REGISTRY_FLAGS))
def test_help_lists_every_registry_entry(capsys, monkeypatch, command):
    from diffquant.catalog import names

    text = _help(capsys, monkeypatch, command)
    for registry in REGISTRY_FLAGS[command]:
        missing = [n for n in names()[registry] if n not in text and n != "fake"]
        assert not missing, (command, registry, missing)
    if command in ("profile", "sweep"):
        from diffquant.taps.sites import POINTS

        assert all(p in text for p in POINTS)  # the site points


def test_shared_flags_mean_the_same_on_every_command():
    """--data, --sites, --device, --dtype, --batch-size: present where a command takes them, with one default
    and one spelling; the old spellings stay as aliases."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    takes_model = ("profile", "quantize", "sweep", "lm-eval")
    for cmd in takes_model:
        flags = {o: a for a in sub[cmd]._actions for o in a.option_strings}
        for flag in ("--model", "--hub", "--device", "--dtype", "--batch-size", "--cache-dir", "--data", "--tokens",
                     "--seq-len"):
            assert flag in flags, (cmd, flag)
        assert flags["--batch-size"].default == 8 and flags["--dtype"].default == "fp32"
        assert flags["--data"].dest == "data" and flags["--data"].default == "kjv"
    train = {o: a for a in sub["train"]._actions for o in a.option_strings}
    assert train["--corpus"] is train["--data"] and train["--arch"] is train["--design"]
    sweep = {o: a for a in sub["sweep"]._actions for o in a.option_strings}
    assert sweep["--schemes"] is sweep["--scheme"]
    args = parser.parse_args(["sweep", "--model", "m", "--out", "o", "--sites", "attn_logits,*.attn_probs"])
    from diffquant.taps.sites import site_globs, site_points

    assert site_points(args.sites) == ["attn_logits", "attn_probs"]
    assert site_globs(["*.hidden", "attn_in,layers.2.v"]) == ["*.hidden", "*.attn_in", "layers.2.v"]
    from diffquant.errors import DiffquantError

    with pytest.raises(DiffquantError, match="unknown site 'hiden'"):
        site_globs("hiden")
    with pytest.raises(DiffquantError, match="sweep quantizes a point in every layer"):
        site_points("layers.3.hidden")


@pytest.mark.parametrize("command", ["profile", "quantize", "sweep", "lm-eval"])
def test_a_device_this_machine_lacks_is_one_line_before_any_work(tmp_path, capsys, command):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    extra = {"profile": [], "quantize": [], "sweep": [], "lm-eval": ["--tasks", "x"]}[command]
    code = main([command, "--model", "micro:diff", "--device", "cuda", "--out", str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and "no CUDA device" in err and err.count("\n") == 1
    assert not (tmp_path / "o" / "stats.json").exists()


def test_interrupt_says_resume_only_where_there_is_one(monkeypatch, capsys):
    import diffquant.commands as commands

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "_lazy", lambda module, name: interrupted)
    for argv, says in ((["train", "--out", "x"], True), (["profile", "--model", "m", "--out", "x"], False)):
        assert main(argv) == 130
        assert ("--resume" in capsys.readouterr().err) == says


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
        code = ("import sys, diffquant_cli; rc = diffquant_cli.main(%r); "  # the installed command's entry point
                "print(rc, 'torch' in sys.modules)" % (argv,))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        rc, torch_loaded = out.stdout.split()[-2:]  # `models` and `sites` print their tables first
        assert torch_loaded == "False", argv
        assert (rc == "0") == (argv in (["models"], ["sites"])), (argv, out.stderr)
        assert rc == "0" or out.stderr.count("\n") == 1  # one line


@pytest.mark.slow
def test_commands_are_quiet_and_pipes_end_quietly(tmp_path):
    (tmp_path / "t.txt").write_text("In the beginning was the word.\n" * 400)
    out = subprocess.run([sys.executable, "-m", "diffquant_cli", "profile", "--model", "micro:diff", "--data",
                          str(tmp_path / "t.txt"), "--tokens", "512", "--seq-len", "64", "--out", str(tmp_path / "p"),
                          "--no-plots"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    noise = [line for line in out.stderr.splitlines() if line.strip() and not line.startswith("profile ")]
    assert noise == [], noise  # only diffquant's own progress bar
    assert "fewer tokens" not in out.stdout
    head = subprocess.run(f"{sys.executable} -m diffquant_cli models | head -1", shell=True, capture_output=True,
                          text=True)
    assert head.stderr == "" and head.stdout.startswith("preset")


def test_profile_says_when_it_got_fewer_tokens(tmp_path, capsys):
    (tmp_path / "t.txt").write_text("In the beginning was the word.\n" * 400)
    assert main(["profile", "--model", "micro:baseline", "--data", str(tmp_path / "t.txt"), "--tokens", "100000",
                 "--seq-len", "64", "--out", str(tmp_path / "p"), "--no-plots"]) == 0
    assert "fewer tokens than asked" in capsys.readouterr().out


def test_zoo_models_are_labelled_by_their_exact_name():
    from diffquant.commands.common import parse_model_args

    assert parse_model_args(["smollm2-135m", "runs/pair/diff", "A=runs/x"]) == [
        ("SmolLM2-135M-Instruct (Q4_1 → fp32)", "smollm2-135m"), ("diff", "runs/pair/diff"), ("A", "runs/x")]


def test_help_prints_only_help():
    """`diffquant --help` and a command's --help: the usage text on stdout, nothing on stderr (no optional backend's
    import-time lines, no deprecation notes)."""
    for module, args in (("diffquant_cli", ["--help"]), ("diffquant_cli", ["quantize", "--help"]),
                         ("diffquant", ["--help"])):  # python -m diffquant is the same command line
        run = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True)
        assert run.returncode == 0 and run.stdout.startswith("usage: diffquant") and run.stderr == "", run.stderr


def test_import_diffquant_prints_nothing():
    """`import diffquant` registers the designs with transformers, which imports torchao where it is installed: its
    missing-CUDA-kernel lines and torch's deprecation notes stay quiet for that import, and the loggers keep the
    levels they had (a user's own logging setup is untouched)."""
    code = ("import logging; import diffquant, diffquant.api; "
            "print(logging.getLogger('torchao').level, logging.getLogger('torch.utils._pytree').level)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout.split() == ["0", "0"]
