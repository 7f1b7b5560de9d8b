"""Markdown and CSV tables, and how many values a result row's metric averages."""

from __future__ import annotations

import csv
import io


def fmt(v, digits: int = 5) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e5 else f"{v:.1f}"
    return str(v)


def markdown(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def to_csv(header: list[str], rows: list[list]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def between_markers(text: str, begin: str, end: str, block: str) -> str | None:
    """`text` with what stands between the `begin` and `end` marker lines replaced by `block` (None when the
    markers are missing): how scripts keep generated tables in the README."""
    if begin not in text or end not in text:
        return None
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{block}\n{end}{rest.split(end, 1)[1]}"


def update_between_markers(path, begin: str, end: str, block: str, check: bool, what: str) -> int:
    """The command behind the README scripts: rewrite `path` between its markers (exit code 0), or with `check`
    only compare (1 when it differs); 2 with a one-line message when the markers are missing."""
    import sys
    from pathlib import Path

    path = Path(path)
    text = path.read_text()
    new = between_markers(text, begin, end, block)
    if new is None:
        print(f"{path.name} has no {begin} ... {end} markers", file=sys.stderr)
        return 2
    if check:
        return 0 if new == text else 1
    path.write_text(new)
    print(f"wrote {what} into {path}")
    return 0


def sample_size(r: dict, metric: str) -> int | None:
    """How many values a row's metric averages: sequences for perplexity and next-token accuracy, examples for a
    multiple-choice task (`{task}_acc` and `{task}_acc_norm` over `{task}_examples`)."""
    if metric in ("ppl", "loss", "next_token_acc"):
        return r.get("sequences")
    task = metric.removesuffix("_norm").removesuffix("_acc")
    return r.get(f"{task}_examples")
