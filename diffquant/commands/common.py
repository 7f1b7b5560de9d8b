"""Argument handling the sub-commands share: model labels and output folders."""

from __future__ import annotations

from pathlib import Path

from diffquant.errors import DiffquantError


def parse_model_args(values: list[str]) -> list[tuple[str, str]]:
    out = []
    for v in values:
        label, sep, source = v.partition("=")
        out.append((label, source) if sep and source else (Path(v).name or v, v))
    labels = [label for label, _ in out]
    if len(set(labels)) != len(labels):
        raise DiffquantError(f"model labels must differ, got {labels}; name them LABEL=SOURCE")
    return out


def prepare_out(out: str | Path, force: bool, marker: str) -> Path:
    """Create the output folder; refuse one that already holds results unless --force."""
    path = Path(out)
    if (path / marker).exists() and not force:
        raise DiffquantError(f"{path} already holds results ({marker}); pass --force to overwrite or choose another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".diffquant-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise DiffquantError(f"cannot write to {path}: {e.strerror}") from None
    return path


