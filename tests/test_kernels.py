"""The kernels switch (diffquant/kernels) and the Triton kernels against the torch path, under the contract written
in diffquant/kernels/__init__.py.

The Triton kernels run here in Triton's interpreter on CPU tensors: TRITON_INTERPRET=1 is set before anything imports
Triton (this module is the only test module that imports it; an xdist worker that runs other modules after this one
keeps the variable, which only Triton reads). References are independent computations written here (float64 sums,
bincount, full sorts) or the torch path, never the kernel compared with itself; tensors are small and tiles large
(about 12 ms per program instance in the interpreter).
"""

from __future__ import annotations

import os
import subprocess
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from diffquant import kernels  # noqa: E402
from diffquant.errors import DiffquantError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_choices_resolve_by_device(monkeypatch):
    pytest.importorskip("triton")
    assert kernels.resolve("auto", "cpu") == "torch"  # auto: Triton on CUDA tensors only, also under the interpreter
    assert kernels.resolve("torch", "cpu") == "torch"
    assert kernels.resolve("triton", "cpu") == "triton"  # the interpreter is on (this module)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(DiffquantError, match="runs on CUDA tensors, not on cpu"):
        kernels.resolve("triton", "cpu")
    with pytest.raises(DiffquantError, match="unknown kernels 'cuda'; choose one of: auto, triton, torch"):
        kernels.resolve("cuda", "cpu")
    with kernels.chosen("triton"):
        assert kernels.current() == "triton"
        with kernels.chosen(None):
            assert kernels.current() == "triton"
    assert kernels.current() == "auto"


def test_diffquant_works_without_triton():
    """Triton hidden (an import of it fails): `import diffquant` and a profile work, "auto" takes torch, and asking
    for "triton" is one clear error."""
    code = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError
import torch
import diffquant as dq
from diffquant.errors import DiffquantError
from diffquant.models.presets import PRESETS, build
model = build(PRESETS["micro"], "baseline", seed=0)
prof = dq.profile(model, torch.randint(0, 512, (2, 40)), kernels="auto")
print(prof.provenance["kernels"], prof.sites["layers.0.hidden"].summary(full=False)["kernels"])
try:
    dq.profile(model, torch.randint(0, 512, (2, 40)), kernels="triton")
except DiffquantError as e:
    print("refused:", e)
print("triton" in sys.modules and sys.modules["triton"] is not None)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "{'asked': 'auto', 'path': 'torch'} torch"
    assert lines[1] == "refused: kernels='triton' needs Triton, which does not import here: pip install 'diffquant[gpu]'"
    assert lines[2] == "False"


def test_every_profiling_command_takes_kernels(tmp_path, capsys):
    from diffquant.cli import build_parser, main

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices
    for command in ("profile", "sweep", "train"):
        flag = next(a for a in sub[command]._actions if "--kernels" in a.option_strings)
        assert flag.default == "auto" and tuple(flag.choices) == kernels.CHOICES, command
    (tmp_path / "t.txt").write_text("In the beginning was the word.\n" * 400)
    argv = ["profile", "--model", "micro:baseline", "--data", str(tmp_path / "t.txt"), "--tokens", "128", "--seq-len",
            "64", "--no-plots", "--no-sinks"]
    assert main([*argv, "--out", str(tmp_path / "p"), "--kernels", "torch"]) == 0
    import json

    model = json.loads((tmp_path / "p" / "stats.json").read_text())["models"][0]
    assert model["provenance"]["kernels"] == {"asked": "torch", "path": "torch"}
    assert {s["kernels"] for s in model["sites"].values()} == {"torch"}
    os.environ.pop("TRITON_INTERPRET")
    try:
        capsys.readouterr()
        assert main([*argv, "--out", str(tmp_path / "q"), "--kernels", "triton"]) == 2
    finally:
        os.environ["TRITON_INTERPRET"] = "1"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kernels='triton'" in err
