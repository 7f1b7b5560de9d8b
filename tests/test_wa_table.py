"""experiments/weight_solvers.py --wa --quick (the W×A table): every cell present, quarot solved by GPTQ on the
rotated model, and the table's paired intervals recomputed here from the committed per-sequence losses with scipy."""

import json

import numpy as np
from scipy import stats


def test_quick_table(tmp_path, load_script):
    ws = load_script("experiments/weight_solvers.py", "weight_solvers_wa_under_test")
    ws.main(["--wa", "--quick", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "results.json").read_text())
    cells = {(c["fix"], c["weights"]): c for c in r["cells"]}
    assert set(cells) == {(f, w) for f in ws.WA_FIXES for w in ws.WA_SOLVERS}
    quarot = cells[("rotate", "gptq")]
    assert quarot["weights_record"]["weights"] == "gptq" and quarot["mitigation_record"]["matrices"]["v_o"]
    assert cells[("smoothquant:search", "rtn")]["mitigation_record"]["alpha"] in (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    a = np.array(cells[("rotate", "rtn")]["per_sequence_loss"])
    b = np.array(quarot["per_sequence_loss"])
    d = b - a
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d))
    got = ws.wa_comparisons(r)[("rotate", "gptq")]["solver"]
    assert np.isclose(got["mean"], d.mean()) and np.allclose(got["ci95"], [d.mean() - half, d.mean() + half])
    assert "| quarot |" in (tmp_path / "results.md").read_text()
    ws.main(["--wa", "--quick", "--out", str(tmp_path)])  # resumes: nothing recomputed, the same cells
    assert json.loads((tmp_path / "results.json").read_text())["cells"] == r["cells"]
