"""experiments/kv_cache.py: a rerun keeps the committed conditions measured with the same settings and measures
only the new ones; --fresh recomputes them."""

import json


def test_rerun_keeps_measured_conditions(tmp_path, load_script):
    kv = load_script("experiments/kv_cache.py", "kv_cache_under_test")
    kv.OUT = tmp_path
    kv.NEEDLE_SCHEMES = ("kv4", "kv4-had")
    kv.main(["--quick", "--needle"])
    path = tmp_path / "needle-quick.json"
    doc = json.loads(path.read_text())
    assert [r["scheme"] for r in doc["models"][0]["rows"]] == ["fp", "kv4", "kv4-had"]
    doc["models"][0]["rows"][1]["choice"] = 0.123  # a sentinel: kept by a rerun, gone after --fresh
    path.write_text(json.dumps(doc))
    kv.NEEDLE_SCHEMES = ("kv4", "kv4-had", "k4v2")
    kv.main(["--quick", "--needle"])
    rows = {r["scheme"]: r for r in json.loads(path.read_text())["models"][0]["rows"]}
    assert rows["kv4"]["choice"] == 0.123 and set(rows) == {"fp", "kv4", "kv4-had", "k4v2"}
    kv.main(["--quick", "--needle", "--fresh"])
    rows = {r["scheme"]: r for r in json.loads(path.read_text())["models"][0]["rows"]}
    assert rows["kv4"]["choice"] != 0.123


def test_needle_table_tests_each_hadamard_cache_against_its_unrotated_scheme(load_script):
    """Hand-made outcomes: kv4 right on questions 0-3, kv4-had on 0-9 (6 gained, 0 lost); the table's exact
    McNemar p equals scipy's two-sided binomial test on the discordant pairs, Holm over the two metrics."""
    from scipy.stats import binomtest

    kv = load_script("experiments/kv_cache.py", "kv_cache_table_under_test")
    n = 20
    row = lambda name, right: {"scheme": name, "choice": len(right) / n, "exact": len(right) / n,  # noqa: E731
                               "queries": n, "chance": 1 / 6, "per_query": [[i in right] * 2 for i in range(n)]}
    doc = {"models": [{"label": "m", "examples": 10, "context_chars": 1000, "prompt_tokens": [300, 320],
                       "rows": [row("fp", range(12)), row("kv4", range(4)), row("kv4-had", range(10))]}]}
    text = kv.needle_table(doc)
    p = binomtest(6, 6, 0.5).pvalue
    line = next(ln for ln in text.splitlines() if ln.startswith("| `kv4-had` − `kv4`"))
    assert f"+30.0 (6/0, p {p:.2g}, Holm {min(1, 2 * p):.2g})" in line
