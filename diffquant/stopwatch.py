"""Where a long command's time goes: wall seconds per stage, each stage timed from the end of the one before.

    clock = Stopwatch(say=True)
    windows = load()
    clock.lap("data")                # prints "data: 1.2 s" and records it
    q = quantize_(model, recipe, windows)
    clock.add(q.seconds)             # stages timed inside quantize_, recorded as they are
    clock.seconds                    # {"data": 1.2, "solver gptq": 310.4, ...}; clock.total(): since the start

Laps, not nested timers, so a command marks its stages by adding one line after each, without reindenting
the code it times; the stages never overlap, so their sum is at most the total.
"""

from __future__ import annotations

import time


class Stopwatch:
    def __init__(self, say: bool = False):
        self.say = say
        self.seconds: dict[str, float] = {}
        self._start = self._last = time.perf_counter()

    def lap(self, stage: str) -> float:
        """Record (and print, if `say`) the seconds since the last lap as `stage`; a stage run twice adds up."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
        if self.say:
            print(f"{stage}: {_human(seconds)}", flush=True)
        return seconds

    def add(self, stages: dict[str, float]) -> None:
        """Take stages timed elsewhere (inside the span since the last lap) and start the next lap now; what
        else that span held (checks, copies) is left out, so the sum stays within the total."""
        for stage, seconds in stages.items():
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
        self._last = time.perf_counter()

    def total(self) -> float:
        return time.perf_counter() - self._start


def _human(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
