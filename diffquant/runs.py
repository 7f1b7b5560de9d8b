"""Experiment runs: each writes its folder with the resolved settings and the environment, so every
number can be traced to how it was made; helpers to pool seeds."""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from pathlib import Path

from diffquant.paths import atomic_write_json


def start_run(out: str | Path, settings, device: str) -> Path:
    from diffquant.training import environment_record

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "settings.json", asdict(settings) if is_dataclass(settings) else dict(settings))
    atomic_write_json(out / "environment.json", environment_record(device))
    return out


def fmt_ms(values: list[float]) -> str:
    """Mean ± 95% t-interval over seeds (the mean alone for one seed)."""
    from diffquant.stats.intervals import fmt_pm, t_interval

    t = t_interval(values)
    return fmt_pm(t["mean"], t["half"], 4)


def parse_worker(text: str | None) -> tuple[int, int] | None:
    """`--worker K/N` (train only every N-th cell, starting at K: N processes share one experiment's cells) as
    (K, N); None when not given. A malformed value is refused in one line."""
    if not text:
        return None
    k, _, n = text.partition("/")
    if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
        from diffquant.errors import DiffquantError

        raise DiffquantError(f"--worker takes K/N with 0 ≤ K < N, got {text!r}")
    return int(k), int(n)
