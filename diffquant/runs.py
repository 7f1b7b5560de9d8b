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
