"""The README is true: its Python block runs verbatim (the public API it shows), its generated parts and
docs/RESULTS.md are what docs/readme_results.py writes from the committed files, and it stays short with the
main job on its first screen."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_is_short_and_opens_with_install_and_a_profile_command():
    lines = README.splitlines()
    assert len(lines) <= 300
    first = "\n".join(lines[:40])
    assert "pip install" in first and "diffquant profile --model" in first
    head = "\n".join(lines[:60])
    assert "diffquant profile --model path/to/your/model" in head


def test_every_python_block_uses_only_the_public_api():
    blocks = python_blocks(README)
    assert blocks
    for block in blocks:
        imports = re.findall(r"^(?:from|import) [\w.]+.*$", block, re.M)
        assert imports == ["import diffquant as dq"], imports


@pytest.mark.slow
def test_the_python_block_runs_verbatim(tmp_path):
    """In a fresh interpreter, in an empty folder, exactly as a reader would paste it."""
    code = "\n".join(python_blocks(README))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread, as every test worker (see test_notebook_runs)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900,
                         env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "smoothquant:0.5 → gptq → w8a8-static" in run.stdout and "attention logits" in run.stdout
    assert (tmp_path / "runs/python/profile/table5.md").is_file()
    assert (tmp_path / "runs/python/sweep/metric_vs_bits.png").is_file()


def test_generated_parts_and_the_results_page_are_current():
    from conftest import load_script_module

    rr = load_script_module("docs/readme_results.py", "readme_results_current")
    assert rr.main(["--check"]) == 0, "run: python -m docs.readme_results"
