"""Text corpora: offline Debian packages, local files and folders, and `hf:NAME[:CONFIG]` datasets.

Debian packages are fetched with `apt-get download` (no install) and unpacked with `dpkg -x` into a
temporary folder; only the cleaned text is kept in the cache, with its SHA-256 in `meta.json` so a
partial or corrupt cache is detected and fetched again.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diffquant.errors import DiffquantError
from diffquant.paths import atomic_write_json, atomic_write_text, cache_dir

VAL_EVERY, BLOCK = 20, 50  # every 20th block of 50 lines is validation


def _kjv(root: Path) -> str:
    bible = root / "usr/bin/bible"
    out = subprocess.run([str(bible), "-p", str(root / "usr/lib"), "-f", "Gen1:1-Rev22:21"],
                         capture_output=True, text=True, check=True).stdout
    return "\n".join(re.sub(r"^\S+\d+:\d+\s+", "", line) for line in out.splitlines() if line.strip())


def _gcide(root: Path) -> str:
    raw = gzip.open(root / "usr/share/dictd/gcide.dict.dz").read().decode("utf-8", "replace")
    raw = raw[raw.find("Begin file 1 of 26"):]
    text = re.sub(r"<[^>]*>", "", raw)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", text)
    lines = (re.sub(r"\s+", " ", line).strip() for line in text.splitlines())
    return "\n".join(line for line in lines if len(line) > 20)


def _wordnet(root: Path) -> str:
    glosses = []
    for part in ("noun", "verb", "adj", "adv"):
        for line in (root / f"usr/share/wordnet/data.{part}").read_text("utf-8", "replace").splitlines():
            if " | " in line and not line.startswith("  "):
                glosses.append(line.split(" | ", 1)[1].strip())
    return "\n".join(glosses)


def _pydoc(root: Path) -> str:
    files = sorted((root / "usr/share/doc/python3.11/html/_sources").rglob("*.rst.txt"))
    return "\n".join(f.read_text("utf-8", "replace") for f in files)


def _linuxdoc(root: Path) -> str:
    files = sorted(root.rglob("Documentation/**/*.rst.gz"))
    return "\n".join(gzip.open(f).read().decode("utf-8", "replace") for f in files)


@dataclass(frozen=True)
class Corpus:
    name: str
    packages: tuple[str, ...]
    extract: Callable[[Path], str]
    about: str


CORPORA: dict[str, Corpus] = {
    c.name: c
    for c in (
        Corpus("kjv", ("bible-kjv-text", "bible-kjv"), _kjv, "King James Bible, 31,102 verses, public domain"),
        Corpus("gcide", ("dict-gcide",), _gcide, "Collaborative International Dictionary of English"),
        Corpus("wordnet", ("wordnet-base",), _wordnet, "WordNet 3.0 glosses"),
        Corpus("pydoc", ("python3.11-doc",), _pydoc, "Python 3.11 documentation sources (reST)"),
        Corpus("linuxdoc", ("linux-doc-6.1",), _linuxdoc, "Linux 6.1 kernel documentation (reST)"),
    )
}
MIX = ("kjv", "gcide", "wordnet", "pydoc", "linuxdoc")
NAMES = (*CORPORA, "debian-mix")


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def download_debian(packages: tuple[str, ...], where: Path) -> Path:
    """apt-get download + dpkg -x into `where/root`; clear errors when apt or its lists are missing."""
    if not shutil.which("apt-get") or not shutil.which("dpkg"):
        raise DiffquantError("fetching Debian corpora needs apt-get and dpkg; pass a local text file or folder instead")
    result = subprocess.run(["apt-get", "download", *packages], cwd=where, capture_output=True, text=True)
    if result.returncode != 0:
        hint = "run 'apt-get update' first" if "Unable to locate" in result.stderr else "check the package registry"
        raise DiffquantError(f"apt-get download {' '.join(packages)} failed ({result.stderr.strip()[-200:]}); "
                             f"{hint}, or pass a local text file instead")
    root = where / "root"
    for deb in where.glob("*.deb"):
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True, capture_output=True)
    return root


def fetch(name: str, cache: str | None = None) -> Path:
    """Path of the cleaned text of a named corpus, fetched once into the cache."""
    if name == "debian-mix":
        parts = [fetch(n, cache).read_text("utf-8") for n in MIX]
        return _store(cache, name, "\n".join(parts))
    if name not in CORPORA:
        raise DiffquantError(f"unknown corpus {name!r}; choose one of: {', '.join(NAMES)}, a local file or folder, "
                             "or hf:NAME[:CONFIG]")
    cached = _cached(cache, name)
    if cached is not None:
        return cached
    corpus = CORPORA[name]
    import sys
    import time

    print(f"fetching corpus {name} from Debian ({', '.join(corpus.packages)}; once, cached in "
          f"{cache_dir(cache) / 'corpora' / name})", file=sys.stderr, flush=True)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"diffquant-{name}-") as tmp:
        text = corpus.extract(download_debian(corpus.packages, Path(tmp)))
    path = _store(cache, name, text)
    print(f"corpus {name}: {len(text) / 1e6:.1f} MB of text in {time.perf_counter() - t:.0f} s", file=sys.stderr,
          flush=True)
    return path


def _cached(cache: str | None, name: str) -> Path | None:
    folder = cache_dir(cache) / "corpora" / name
    text, meta = folder / "text.txt", folder / "meta.json"
    if not (text.is_file() and meta.is_file()):
        return None
    try:
        expected = json.loads(meta.read_text())["sha256"]
    except (ValueError, KeyError):
        return None
    return text if sha256(text.read_text("utf-8", "replace")) == expected else None


def _store(cache: str | None, name: str, text: str) -> Path:
    if not text.strip():
        raise DiffquantError(f"corpus {name} came out empty after cleaning")
    folder = cache_dir(cache) / "corpora" / name
    atomic_write_text(folder / "text.txt", text)
    atomic_write_json(folder / "meta.json", {"name": name, "sha256": sha256(text), "chars": len(text),
                                             "lines": text.count("\n") + 1})
    return folder / "text.txt"


def _read_local(path: Path) -> str:
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".md", ".rst")) \
        if path.is_dir() else [path]
    if not files:
        raise DiffquantError(f"folder {path} holds no .txt/.md/.rst files")
    parts = []
    for f in files:
        try:
            parts.append(f.read_text("utf-8"))
        except UnicodeDecodeError as e:
            raise DiffquantError(f"{f} is not UTF-8 text (byte {e.start}); convert it, e.g. iconv -f latin1 -t utf-8") from None
    return "\n".join(parts)


def _read_hf(spec: str) -> str:
    try:
        import datasets
    except ImportError:
        raise DiffquantError("hf: corpora need the datasets package: pip install 'diffquant[eval]'") from None
    name, _, config = spec.partition(":")
    ds = datasets.load_dataset(name, config or None, split="train")
    column = "text" if "text" in ds.column_names else ds.column_names[0]
    return "\n".join(str(t) for t in ds[column])


def load_text(source: str, cache: str | None = None) -> tuple[str, str]:
    """(text, description) of a corpus name, local path or hf: spec."""
    if source.startswith("synth:"):
        raise DiffquantError(f"{source} is a synthetic corpus of token ids, not text: profile, sweep, quantize and "
                             "train read it as --data/--corpus, `data` commands describe text corpora")
    if source.startswith("hf:"):
        text = _read_hf(source[3:])
    elif source in NAMES:
        text = fetch(source, cache).read_text("utf-8")
    else:
        path = Path(source)
        if not path.exists():
            raise DiffquantError(f"unknown corpus {source!r}: not one of {', '.join(NAMES)}, and no such file or folder")
        text = _read_local(path)
    if not text.strip():
        raise DiffquantError(f"corpus {source} is empty")
    return text, source


def split(text: str) -> tuple[str, str]:
    """Deterministic train/validation split by blocks of lines; the two never share a line position."""
    lines = text.splitlines()
    if len(lines) < 2:
        cut = max(1, int(len(text) * 0.95))
        return text[:cut], text[cut:]
    train, val = [], []
    for i in range(0, len(lines), BLOCK):
        (val if (i // BLOCK) % VAL_EVERY == VAL_EVERY - 1 else train).extend(lines[i:i + BLOCK])
    if not val:  # short corpora: last 5% of lines
        cut = max(1, int(len(lines) * 0.95))
        train, val = lines[:cut], lines[cut:]
    return "\n".join(train), "\n".join(val)


def info(source: str, cache: str | None = None) -> dict:
    text, _ = load_text(source, cache)
    train, val = split(text)
    return {"name": source, "chars": len(text), "lines": text.count("\n") + 1, "sha256": sha256(text),
            "train_chars": len(train), "val_chars": len(val)}
