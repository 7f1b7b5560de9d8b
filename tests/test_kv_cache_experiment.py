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


def test_trained_pairs_are_compared_over_seeds(load_script):
    """Hand-made rows for a pair saved as <runs>/demo/s<seed>/<design> (3 seeds each, two conditions): each cell is
    the mean ± t of log(1 + Δppl) over seeds, DIFF − Transformer is scipy's Welch test, Holm over the conditions;
    a model outside the layout keeps its own table and the pair's models get none."""
    import math
    import re

    from scipy.stats import t as student
    from scipy.stats import ttest_ind

    from conftest import assert_detectable

    kv = load_script("experiments/kv_cache.py", "kv_cache_pairs_under_test")
    pcts = {"baseline": [[10.0, 1.0], [12.0, 2.0], [14.0, 0.5]], "diff": [[4.0, 1.5], [5.0, 0.5], [4.5, 1.0]]}

    def model(source, dppl):
        rows = [{"bits": b, "keys": "token", "sink": 0, "ppl": 20 * (1 + p / 100), "dppl_pct": p, "dppl_pct_ci95": None}
                for b, p in zip((4, 8), dppl)]
        return {"source": source, "label": source, "kv_heads": 2, "head_dim": 16, "rows": rows,
                "fp": {"loss": 3.0, "ppl": 20.0, "tokens": 100}}

    doc = {"settings": {"corpus": "kjv", "sequences": 8, "seq_len": 256},
           "models": [model("smollm2-135m", [13.0, 0.1])]
           + [model(f"runs/rivals/demo/s{s}/{d}", pcts[d][s]) for d in pcts for s in range(3)]}
    groups = kv.seed_groups(doc)
    assert list(groups) == ["demo"] and {d: sorted(g) for d, g in groups["demo"].items()} == {
        "baseline": [0, 1, 2], "diff": [0, 1, 2]}
    text = kv.table(doc)
    assert text.count("full precision ppl") == 1  # SmolLM2 alone gets a per-model table
    lines = [ln for ln in text.splitlines() if ln.startswith("| int")]
    pair_lines = [ln for ln in lines if ln.count("|") > 8]
    ps = []
    for i, line in enumerate(pair_lines):
        cells = [c.strip() for c in line.strip("|").split("|")]
        base = [math.log1p(v[i] / 100) for v in pcts["baseline"]]
        diff = [math.log1p(v[i] / 100) for v in pcts["diff"]]
        for vals, cell in ((base, cells[3]), (diff, cells[4])):
            mean = sum(vals) / 3
            sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / 2)
            half = student.ppf(0.975, 2) * sd / math.sqrt(3)
            got_mean, got_half = (float(x) for x in cell.split(" ± "))
            assert abs(got_mean - mean) < 1e-3 * max(abs(mean), 1e-3) + 5e-4 and abs(got_half - half) < 1e-3 + 1e-3 * half
        p = ttest_ind(diff, base, equal_var=False).pvalue
        assert float(cells[5]) == round(sum(diff) / 3 - sum(base) / 3, 4)
        assert abs(float(cells[6]) - p) < 5e-3 * p + 1e-12  # shown to 3 significant digits
        ps.append((p, cells))
    (p1, c1), (p2, c2) = ps
    small, large = sorted((p1, p2))
    want = {p1: None, p2: None}
    want[small] = min(1, 2 * small)
    want[large] = max(want[small], large)
    for p, cells in ps:
        assert abs(float(cells[7]) - want[p]) < 5e-3 * want[p] + 1e-12
    for i, (p, cells) in enumerate(ps):
        if want[p] < 0.05:
            assert cells[8] == "DIFF costs less"
            continue
        m = re.fullmatch(r"no difference detected \(n = 3; detectable ([\d.]+) SD = ([\d.e-]+) nats\)", cells[8])
        assert m, cells[8]
        assert_detectable(m.group(1), m.group(2), [math.log1p(v[i] / 100) for v in pcts["diff"]],
                          [math.log1p(v[i] / 100) for v in pcts["baseline"]], tests=2)
    assert "every design caches 2 KV heads of 16 channels, so the per-token scales are at matched granularity" in text
    doc["models"][-1]["kv_heads"], doc["models"][-1]["head_dim"] = 1, 32  # one DIFF seed cached differently
    assert "are not at matched granularity" in kv.table(doc)


def test_parity_reads_a_trained_checkpoint_on_kjv(tmp_path, load_script):
    """`kv_cache_parity.py --model FOLDER`: the folder's own model and tokenizer, on the first 96 KJV held-out
    tokens (48 prompt + 48 decoded), as the table's other trained rows; a folder without config.json is refused."""
    import pytest
    import torch

    from diffquant.data.corpora import load_text, split
    from diffquant.data.tokens import byte_tokenizer
    from diffquant.models.presets import PRESETS, build

    parity = load_script("experiments/kv_cache_parity.py", "kv_cache_parity_under_test")
    folder = tmp_path / "ckpt"
    build(PRESETS["micro"], "diff").save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    label, model, ids, prompt = parity.models(True, [str(folder)])[-1]
    assert type(model).__name__ == "DiffLlamaForCausalLM" and str(folder) in label and prompt == 48
    expected = list(split(load_text("kjv")[0])[1].encode("utf-8")[:96])  # the byte tokenizer: one token a byte
    assert ids.shape == (1, 96) and ids.dtype == torch.int64
    assert byte_tokenizer().decode(ids[0].tolist()) == bytes(expected).decode("utf-8", "ignore")
    with pytest.raises(SystemExit, match="not a checkpoint folder"):
        parity.main(["--quick", "--model", str(tmp_path / "nothing")])
