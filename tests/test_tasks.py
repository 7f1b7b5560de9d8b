"""Multiple-choice tasks that work wherever pip and the Debian archive work (issue 51): the WordNet task built offline
against a parse of the package's own data file written here, local JSONL with errors that name the line, the
BIG-bench sdist looked up on the indexes pip is configured with (a file:// index here, no network) and checked by
its sha256."""

import hashlib
import io
import json
import re
import tarfile

import pytest

from diffquant.data import tasks
from diffquant.errors import DiffquantError


def test_wordnet_nouns_is_every_single_word_noun_definition_with_three_other_nouns(tmp_path):
    root = tmp_path / "root"
    (root / "usr/share/wordnet").mkdir(parents=True)
    lines = ["  1 This software and database is being provided to you, the LICENSEE, by", ]
    want = {}
    for i, (word, gloss) in enumerate([("entity", 'that which is perceived to exist; "a natural entity"'),
                                       ("ice_cream", "frozen dessert"), ("Paris", "capital of France"),
                                       ("ox", "an animal"), ("lantern", "light in a transparent protective case"),
                                       ("wiring", "the work of installing wires"), ("argosy", "a large merchant ship"),
                                       ("mascot", "a person or animal adopted by a team")]):
        lines.append(f"{i:08d} 03 n 01 {word} 0 000 | {gloss}")
        if re.fullmatch(r"[a-z]{3,}", word):
            want[word] = gloss.split('; "')[0]
    (root / "usr/share/wordnet/data.noun").write_text("\n".join(lines) + "\n")
    examples = tasks._wordnet_nouns(root)
    assert [e["input"] for e in examples] == [f"Definition: {g}\nWord:" for g in want.values()]
    for e, word in zip(examples, want):
        scores = e["target_scores"]
        assert len(scores) == 4 and scores[word] == 1 and sum(scores.values()) == 1
        assert set(scores) <= set(want)  # distractors are other eligible nouns
    assert tasks._wordnet_nouns(root) == examples  # seeded


def test_local_jsonl_and_its_errors(tmp_path):
    good = tmp_path / "t.jsonl"
    rows = [{"input": f"Q{i}", "target_scores": {"a": 1, "b": 0}} for i in range(30)]
    good.write_text("".join(json.dumps(r) + "\n" for r in rows) + json.dumps({"input": "x", "target": "no"}) + "\n")
    assert len(tasks.load_task(str(good))) == 30  # non-multiple-choice lines left out
    assert tasks.load_task(str(good), limit=5) == tasks.load_task(str(good), limit=5)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{oops\n")
    with pytest.raises(DiffquantError, match=r"bad.jsonl line 2 is not JSON .*target_scores"):
        tasks.load_task(str(bad))
    with pytest.raises(DiffquantError, match="does not exist"):
        tasks.load_task(str(tmp_path / "missing.jsonl"))


def _sdist(tmp_path):
    """A small stand-in archive with the real sdist's layout (its content is what this test checks: the fetch)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = json.dumps({"examples": [{"input": "Is ( ) valid?", "target_scores": {"Valid": 1, "Invalid": 0}}] * 3})
        info = tarfile.TarInfo("bigbench-1.0.0/bigbench/benchmark_tasks/cs_algorithms/valid_parentheses/task.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data.encode()))
    return buf.getvalue()


def test_bigbench_comes_from_the_index_pip_is_configured_with(tmp_path, monkeypatch):
    blob = _sdist(tmp_path)
    index = tmp_path / "index"
    (index / "bigbench").mkdir(parents=True)
    (index / "files").mkdir()
    (index / "files" / tasks.SDIST).write_bytes(blob)
    (index / "bigbench" / "index.html").write_text(f'<a href="../files/{tasks.SDIST}#sha256=x">{tasks.SDIST}</a>')
    monkeypatch.setenv("PIP_INDEX_URL", f"file://{index}")  # as a user's mirror would be configured
    monkeypatch.setattr(tasks, "SDIST_SHA256", hashlib.sha256(blob).hexdigest())  # the stand-in archive's
    assert tasks.pip_indexes()[0] == f"file://{index}"
    got = tasks.load_task("cs_algorithms/valid_parentheses", cache=str(tmp_path / "cache"))
    assert len(got) == 3 and got[0]["target_scores"] == {"Valid": 1, "Invalid": 0}
    assert not (tmp_path / "cache/bigbench" / tasks.SDIST).exists()  # the archive is not kept


def test_a_wrong_download_is_refused_and_the_message_says_what_to_do(tmp_path, monkeypatch):
    (tmp_path / "index" / "bigbench").mkdir(parents=True)
    (tmp_path / "index" / "bigbench" / tasks.SDIST).write_bytes(_sdist(tmp_path))  # a local index: files in folders
    monkeypatch.setenv("PIP_INDEX_URL", f"file://{tmp_path}/index")
    monkeypatch.setattr(tasks, "SDIST_URL", f"file://{tmp_path}/nothing-here.tar.gz")  # PyPI's host: not reached
    with pytest.raises(DiffquantError, match=r"sha256 is not PyPI's.*\.jsonl file.*wordnet:nouns"):
        tasks.load_task("hyperbaton", cache=str(tmp_path / "cache"))
