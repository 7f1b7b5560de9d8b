"""The generated results (docs/RESULTS.md) state no comparison verdict its result files do not support: every 'higher' or
'lower' in an "Against DIFF" table is recomputed here from the per-seed values (Welch's t-test by scipy,
Holm's correction by hand over the table's tests), and every 'no difference detected' must be one."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from scipy.stats import ttest_ind

ROOT = Path(__file__).resolve().parent.parent
LABELS = {"hidden top-1/median": "hidden_ratio", "logit top-1/median": "logit_ratio", "max‖h‖/median": "massive_ratio",
          "hidden kurtosis": "hidden_kurtosis", "sink rate": "sink_rate", "int4-logit cost": "logits_int4_cost",
          "W8A8 cost": "w8a8_cost", "loss": "loss", "logit top-1": "logit_top1"}
SOURCES = {"## ": ("emergence.py", "docs/emergence/results.json"),
           "In the demo setting": (None, "docs/rivals/demo/results.json"),
           "In the setting the emergence search chose": (None, "docs/rivals/regime/results.json")}


def _results_block() -> list[str]:
    return (ROOT / "docs/RESULTS.md").read_text().splitlines()


def _tables() -> list[tuple[str, list[str], list[list[str]]]]:
    """(results file, header, rows) of every Against-DIFF table, the file told by the section it stands in."""
    source, tables, lines = None, [], _results_block()
    for i, line in enumerate(lines):
        for start, (needs, path) in SOURCES.items():
            if line.startswith(start) and (needs is None or needs in line):
                source = path
        if line.startswith("Against DIFF"):
            rows = []
            for r in lines[i + 2:]:  # the table: the lines that start with "|" after the sentence's blank line
                if not r.startswith("|"):
                    break
                rows.append(r)
            header = [c.strip() for c in rows[0].split("|")[1:-1]]
            body = [[c.strip() for c in r.split("|")[1:-1]] for r in rows[2:]]
            tables.append((source, header, body))
    return tables


def _p(a: list[float], b: list[float]) -> float:
    if len(set(a)) == 1 and len(set(b)) == 1:  # two constants: no variance to test, the difference is exact
        return 0.0 if a[0] != b[0] else 1.0
    return float(ttest_ind(a, b, equal_var=False).pvalue)


def test_the_readme_words_comparisons_as_tests_not_as_equalities():
    block = "\n".join(_results_block())
    assert "≈" not in block and "chosen for the baseline" not in block
    search = json.loads((ROOT / "docs/emergence/search.json").read_text())
    crit = search["criterion"]
    if not any(m["hidden_ratio"] >= crit["hidden_ratio"] or m["sink_rate"] >= crit["sink_rate"]
               for m in search["results"].values()):  # nothing reached the regime: no heading may say it appeared
        assert "When outliers appear" not in block and "no setting reached it" in block
    assert "a real pretrained Llama" not in block


def test_every_verdict_in_the_readme_survives_holm():
    tables = _tables()
    if not tables:
        pytest.skip("the README holds no Against-DIFF table")
    for source, header, body in tables:
        assert source is not None and (ROOT / source).is_file(), f"no results file for a table in {source}"
        doc = json.loads((ROOT / source).read_text())
        per = doc["per_seed"]
        keys = [LABELS[h] for h in header[1:]]
        raw = {(row[0], k): _p([m[k] for m in per[row[0]]], [m[k] for m in per["DIFF"]]) for row in body for k in keys}
        order, adjusted, running = sorted(raw, key=raw.get), {}, 0.0
        for i, key in enumerate(order):  # Holm by hand
            running = max(running, min(1.0, (len(raw) - i) * raw[key]))
            adjusted[key] = running
        assert f"over the table's {len(raw)} tests" in "\n".join(_results_block())
        for row in body:
            for k, cell in zip(keys, row[1:]):
                p = adjusted[(row[0], k)]
                diff = sum(m[k] for m in per[row[0]]) - sum(m[k] for m in per["DIFF"])
                assert "same" not in cell and "equal" not in cell
                word = re.match(r"(higher|lower|no difference detected)", cell)
                assert word, f"{source}: {row[0]} / {k}: unreadable verdict {cell!r}"
                if p < 0.05:
                    assert word.group(1) == ("higher" if diff > 0 else "lower"), f"{source}: {row[0]} / {k}: {cell}"
                else:
                    assert word.group(1) == "no difference detected", f"{source}: {row[0]} / {k}: {cell} (p {p:.3g})"
                    assert f"n = {len(per['DIFF'])}" in cell
                assert f"p {p:.2g})" in cell, f"{source}: {row[0]} / {k}: {cell} vs adjusted p {p:.2g}"
