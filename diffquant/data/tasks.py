"""Multiple-choice tasks: local JSONL, tasks built offline from Debian's packages, and BIG-bench `task.json` files.

Every task is a list of examples {"input": str, "target_scores": {choice: score}} (the correct choice has the top
score); a local task is a .jsonl file of one such object per line (or a BIG-bench-style .json with "examples").

- `wordnet:nouns` (built here from Debian's wordnet-base, fetched as the corpora are: no network beyond the Debian
  archive): a WordNet 3.0 noun definition, and which of four single-word nouns it defines; the three others are
  drawn, seeded, from the other nouns. WordNet 3.0 is © Princeton University under its own permissive licence.
- a BIG-bench task name (`hyperbaton`, `cs_algorithms/valid_parentheses`): from the PyPI sdist bigbench==1.0.0
  (358 MB, Apache 2.0; never installed), looked up on the package indexes pip is configured with (a mirror or a
  proxy included) and then on PyPI's file host, checked by its sha256; every task.json is extracted once into the
  cache. pip itself cannot fetch it: the sdist's metadata declares a direct-URL dependency, which pip refuses.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from diffquant.errors import DiffquantError
from diffquant.paths import atomic_write_text, cache_dir

BIGBENCH = "bigbench==1.0.0"
SDIST = "bigbench-1.0.0.tar.gz"
SDIST_URL = ("https://files.pythonhosted.org/packages/95/f8/c019b3579df548a04cac12342cfcb878e50ddf6cfcd7fddba8cfc721"
             "c157/bigbench-1.0.0.tar.gz")
SDIST_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
FORMAT = ('a .jsonl file, one example a line: {"input": "Q: ...", "target_scores": {"right answer": 1, '
          '"wrong answer": 0}}')


# ---------------------------------------------------------------- tasks built offline

def _wordnet_nouns(root: Path) -> list[dict]:
    """Every WordNet noun synset with a single-word lemma (the first, lower-case letters, 3+ of them): its definition
    (the gloss before its quoted examples) and that lemma among three other such lemmas, drawn with seed 0."""
    entries = []
    for line in (root / "usr/share/wordnet/data.noun").read_text("utf-8", "replace").splitlines():
        if line.startswith("  ") or " | " not in line:
            continue  # the licence header
        fields, gloss = line.split(" | ", 1)
        word = fields.split()[4]
        definition = gloss.split('; "')[0].strip().rstrip(";").strip()
        if re.fullmatch(r"[a-z]{3,}", word) and len(definition) >= 10:
            entries.append((word, definition))
    words = sorted({w for w, _ in entries})
    rng = random.Random(0)
    examples = []
    for word, definition in entries:
        others = set()
        while len(others) < 3:
            pick = words[rng.randrange(len(words))]
            if pick != word:
                others.add(pick)
        choices = [word, *sorted(others)]
        rng.shuffle(choices)
        examples.append({"input": f"Definition: {definition}\nWord:",
                         "target_scores": {c: int(c == word) for c in choices}})
    return examples


GENERATED = {  # name: (Debian packages, builder, what it is)
    "wordnet:nouns": (("wordnet-base",), _wordnet_nouns,
                      "a WordNet 3.0 noun definition: which of four nouns it defines (built from Debian's wordnet-base)"),
}


def _generated(name: str, cache: str | None) -> Path:
    """The task's JSONL in the cache, built once from its Debian package."""
    from diffquant.data.corpora import download_debian

    path = cache_dir(cache) / "tasks" / (name.replace(":", "-") + ".jsonl")
    if path.is_file():
        return path
    packages, build, _ = GENERATED[name]
    print(f"building task {name} from Debian's {', '.join(packages)} (once; cached in {path.parent})",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="diffquant-task-") as tmp:
        examples = build(download_debian(packages, Path(tmp)))
    write_jsonl(path, examples)
    return path


# ---------------------------------------------------------------- BIG-bench

def pip_indexes() -> list[str]:
    """The package indexes pip is configured with (its config files and PIP_* variables, as `pip config list`
    reports them), the index-url first; PyPI's when pip names none."""
    try:
        listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                                timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        listed = ""
    found: dict[str, list[str]] = {"index-url": [], "extra-index-url": []}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name = key.rsplit(".", 1)[-1]
        if name in found:
            found[name] += value.strip().strip("'\"").split()
    urls = found["index-url"] or ["https://pypi.org/simple"]
    return list(dict.fromkeys(urls + found["extra-index-url"]))


def _sdist_links(index: str) -> list[str]:
    """Links to bigbench-1.0.0.tar.gz on a PEP 503 simple index, absolute: an http(s) page, or a file:// folder
    (its index.html, else the files in it, as pip reads a local index)."""
    page = index.rstrip("/") + "/bigbench/"
    if page.startswith("file:"):
        folder = Path(urllib.request.url2pathname(urllib.parse.urlparse(page).path))
        if not (folder / "index.html").is_file():
            return [(folder / SDIST).as_uri()] if (folder / SDIST).is_file() else []
        page = (folder / "index.html").as_uri()
    with urllib.request.urlopen(page, timeout=30) as r:
        html = r.read().decode("utf-8", "replace")
    return [urllib.parse.urljoin(page, href) for href in re.findall(r'href="([^"]+)"', html) if SDIST in href]


def _download(url: str, dest: Path) -> None:
    """`url` into `dest` with a progress bar, checked against the pinned sha256."""
    from tqdm.auto import tqdm

    digest = hashlib.sha256()
    part = dest.with_name(dest.name + ".part")
    with urllib.request.urlopen(url, timeout=60) as r, open(part, "wb") as f:
        total = int(r.headers.get("content-length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"fetch {SDIST}", file=sys.stderr) as bar:
            for block in iter(lambda: r.read(1 << 20), b""):
                f.write(block)
                digest.update(block)
                bar.update(len(block))
    if digest.hexdigest() != SDIST_SHA256:
        part.unlink()
        raise OSError(f"its sha256 is not PyPI's ({digest.hexdigest()[:12]}…)")
    part.replace(dest)


def _fetch_sdist(dest: Path) -> None:
    tried = []
    for index in pip_indexes():
        try:
            links = _sdist_links(index)
        except OSError as e:
            tried.append(f"{index} ({e})")
            continue
        for url in links or []:
            try:
                return _download(url, dest)
            except OSError as e:
                tried.append(f"{url.split('#')[0]} ({e})")
        if not links:
            tried.append(f"{index} (no {SDIST})")
    try:
        return _download(SDIST_URL, dest)
    except OSError as e:
        tried.append(f"{SDIST_URL} ({e})")
    raise DiffquantError(f"could not fetch {BIGBENCH}: tried {'; '.join(tried)}. Pass your own task as {FORMAT}, "
                         f"or use a task built offline: {', '.join(GENERATED)}")


def _bigbench_dir(cache: str | None) -> Path:
    """Extract every BIG-bench task.json from the sdist once; the 358 MB archive is deleted afterwards."""
    folder = cache_dir(cache) / "bigbench"
    done = folder / ".complete"
    if done.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    sdist = folder / SDIST
    if not sdist.exists():
        _fetch_sdist(sdist)
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


# ---------------------------------------------------------------- loading


def load_task(spec: str, limit: int | None = None, seed: int = 0, cache: str | None = None) -> list[dict]:
    """Examples of `spec`: a local .jsonl/.json file, a task built offline (`wordnet:nouns`), or a BIG-bench task
    name such as `hyperbaton`. Keeps only multiple-choice examples; `limit` samples a fixed subset."""
    path = Path(spec)
    if spec in GENERATED:
        path = _generated(spec, cache)
    if path.suffix in (".jsonl", ".json") and path.is_file():
        examples = _read_local(path)
    elif path.suffix in (".jsonl", ".json"):
        raise DiffquantError(f"task file {spec} does not exist ({FORMAT})")
    else:
        task = _bigbench_dir(cache) / "tasks" / spec / "task.json"
        if not task.is_file():
            names = sorted(p.parent.relative_to(_bigbench_dir(cache) / "tasks").as_posix()
                           for p in (_bigbench_dir(cache) / "tasks").rglob("task.json"))
            raise DiffquantError(f"unknown BIG-bench task {spec!r}; some that exist: {', '.join(names[:15])} ...")
        examples = json.loads(task.read_text("utf-8")).get("examples", [])
    mc = [e for e in examples if isinstance(e, dict) and isinstance(e.get("target_scores"), dict)
          and len(e["target_scores"]) >= 2 and "input" in e]
    if not mc:
        raise DiffquantError(f"{spec} has no multiple-choice examples ({FORMAT})")
    if limit is not None and limit < len(mc):
        mc = random.Random(seed).sample(mc, limit)
    return mc


def _read_local(path: Path) -> list:
    text = path.read_text("utf-8")
    if path.suffix == ".json":
        try:
            return json.loads(text).get("examples", [])
        except (json.JSONDecodeError, AttributeError):
            raise DiffquantError(f"{path} is not a JSON object with \"examples\" ({FORMAT})") from None
    examples = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                examples.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DiffquantError(f"{path} line {i} is not JSON ({e.msg}): expected {FORMAT}") from None
    return examples


def write_jsonl(path: Path, examples: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(e) + "\n" for e in examples))
