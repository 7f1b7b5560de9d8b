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
