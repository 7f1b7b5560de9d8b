"""Multiple-choice tasks: BIG-bench `task.json` files (from the PyPI sdist, never installed) and local JSONL."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tarfile
from pathlib import Path

from diffquant.errors import DiffquantError
from diffquant.paths import atomic_write_text, cache_dir

BIGBENCH = "bigbench==1.0.0"


def _bigbench_dir(cache: str | None) -> Path:
    """Extract every BIG-bench task.json from the sdist once; the 358 MB archive is deleted afterwards."""
    folder = cache_dir(cache) / "bigbench"
    done = folder / ".complete"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    sdists = list(folder.glob("bigbench-*.tar.gz"))
    if not sdists:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", str(folder),
               BIGBENCH]
        result = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(folder.glob("bigbench-*.tar.gz"))
        if result.returncode != 0 or not sdists:
            raise DiffquantError(f"could not fetch {BIGBENCH} ({result.stderr.strip()[-200:]}); pass a local JSONL task")
    with tarfile.open(sdists[0]) as tar:
        for member in tar:
            if member.isfile() and member.name.endswith("/task.json") and "/benchmark_tasks/" in member.name:
                rel = member.name.split("/benchmark_tasks/", 1)[1]
                target = folder / "tasks" / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    sdists[0].unlink()
    done.write_text("ok")
    return folder


def load_task(spec: str, limit: int | None = None, seed: int = 0, cache: str | None = None) -> list[dict]:
    """Examples of `spec`: a local .jsonl/.json file, or a BIG-bench task name such as `hyperbaton` or
    `goal_step_wikihow/goal_inference`. Keeps only multiple-choice examples; `limit` samples a fixed subset."""
    path = Path(spec)
    if path.suffix in (".jsonl", ".json") and path.is_file():
        text = path.read_text("utf-8")
        examples = [json.loads(line) for line in text.splitlines() if line.strip()] if path.suffix == ".jsonl" \
            else json.loads(text).get("examples", [])
    elif path.suffix in (".jsonl", ".json"):
        raise DiffquantError(f"task file {spec} does not exist")
    else:
        task = _bigbench_dir(cache) / "tasks" / spec / "task.json"
        if not task.is_file():
            names = sorted(p.parent.relative_to(_bigbench_dir(cache) / "tasks").as_posix()
                           for p in (_bigbench_dir(cache) / "tasks").rglob("task.json"))
            raise DiffquantError(f"unknown BIG-bench task {spec!r}; some that exist: {', '.join(names[:15])} ...")
        examples = json.loads(task.read_text("utf-8")).get("examples", [])
    mc = [e for e in examples if isinstance(e.get("target_scores"), dict) and len(e["target_scores"]) >= 2
          and "input" in e]
    if not mc:
        raise DiffquantError(f"{spec} has no multiple-choice examples (input + target_scores)")
    if limit is not None and limit < len(mc):
        mc = random.Random(seed).sample(mc, limit)
    return mc


def write_jsonl(path: Path, examples: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(e) + "\n" for e in examples))
