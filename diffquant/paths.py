"""Cache locations and atomic writes."""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """diffquant's cache: `override`, $DIFFQUANT_CACHE, or $XDG_CACHE_HOME/diffquant."""
    if override is not None:
        path = Path(override)
    elif os.environ.get("DIFFQUANT_CACHE"):
        path = Path(os.environ["DIFFQUANT_CACHE"])
    else:
        path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "diffquant"
    path.mkdir(parents=True, exist_ok=True)
    return path


def folder_lock(folder: str | os.PathLike):
    """An inter-process lock on a cache folder (`with folder_lock(f): ...`), held in `<folder>.lock` beside it so
    the folder holds only what it caches: two processes that fill the same cache entry at once (test workers, a
    user's two shells) must not unpack, convert or train into the same place."""
    from filelock import FileLock

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(folder.parent / f"{folder.name}.lock"))


def user_mode() -> int:
    """The mode a plain `open()` gives a new file: 0o666 less the umask (mkstemp would give 0o600)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write via a temporary file in the same folder and rename, so readers never see half a file; the file
    gets the user's usual permissions."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, user_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def fix_modes(folder: str | os.PathLike) -> None:
    """Give the files of a folder written by a library that creates them with mkstemp (0o600, e.g.
    transformers' model.safetensors) the user's usual permissions."""
    mode = user_mode()
    for f in Path(folder).iterdir():
        if f.is_file() and (f.stat().st_mode & 0o777) == 0o600 and mode != 0o600:
            f.chmod(mode)


# Files a command writes before its work starts: they describe a run, they are not results of one.
RUN_DESCRIPTIONS = frozenset({"sweep_config.json", "train_config.json", "settings.json", "environment.json",
                              "recipe.yaml", "recipe.json"})


@contextmanager
def removed_if_failed(out: str | os.PathLike | None):
    """Run a command that writes into `out`; if it fails and `out` did not exist before, remove what it left there
    when that holds no result (only run descriptions, RUN_DESCRIPTIONS): a failed command leaves no empty or
    config-only folder behind, while one that failed after writing results (a resumable sweep's cells, a
    training checkpoint) keeps them for --resume."""
    import shutil

    top = Path(out).absolute() if out else None  # the outermost folder the command will create (runs/ of runs/q)
    while top is not None and not top.parent.exists():
        top = top.parent
    existed = top is None or top.exists()
    try:
        yield
    except BaseException:
        if not existed and top.is_dir():
            kept = [p for p in top.rglob("*") if p.is_file() and p.name not in RUN_DESCRIPTIONS]
            if not kept:
                shutil.rmtree(top, ignore_errors=True)
        raise
