"""Multiple-choice tasks: BIG-bench `task.json` files (from the PyPI sdist, never installed) and local JSONL."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tarfile
import urllib.request
from pathlib import Path

from diffquant.errors import DiffquantError
from diffquant.paths import atomic_write_text, cache_dir

BIGBENCH = "bigbench==1.0.0"
# pip (>= 25) refuses to download this sdist, even with --no-deps, because its metadata declares a direct-URL
# dependency (bleurt @ file://...); so the pinned file is fetched from PyPI's file host and checked by its hash.
SDIST_URL = ("https://files.pythonhosted.org/packages/95/f8/c019b3579df548a04cac12342cfcb878e50ddf6cfcd7fddba8cfc721"
             "c157/bigbench-1.0.0.tar.gz")
SDIST_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"


def _bigbench_dir(cache: str | None) -> Path:
    """Extract every BIG-bench task.json from the sdist once; the 358 MB archive is deleted afterwards."""
    folder = cache_dir(cache) / "bigbench"
    done = folder / ".complete"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    sdist = folder / "bigbench-1.0.0.tar.gz"
    if not sdist.exists():
        part = sdist.with_suffix(".gz.part")
        try:
            with urllib.request.urlopen(SDIST_URL, timeout=60) as response, open(part, "wb") as f:
                shutil.copyfileobj(response, f)
        except OSError as e:
            raise DiffquantError(f"could not fetch {BIGBENCH} ({e}); pass a local JSONL task") from None
        digest = hashlib.sha256()
        with open(part, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != SDIST_SHA256:
            part.unlink()
            raise DiffquantError(f"{BIGBENCH}: the downloaded file's sha256 does not match PyPI's")
        part.replace(sdist)
    with tarfile.open(sdist) as tar:
        for member in tar:
            if member.isfile() and member.name.endswith("/task.json") and "/benchmark_tasks/" in member.name:
                rel = member.name.split("/benchmark_tasks/", 1)[1]
                target = folder / "tasks" / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    sdist.unlink()
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
