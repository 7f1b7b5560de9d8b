"""The public API, `import diffquant as dq`: its names stay functions and classes whatever else is imported, a
recipe round-trips as data and runs as the same steps done by hand, the handle restores the float model
bit-exactly, and a profile merges exactly."""

import importlib
import pkgutil
import types

import pytest
import torch

import diffquant as dq
from diffquant.errors import DiffquantError


def test_public_names_are_never_shadowed_by_modules():
    for info in pkgutil.walk_packages(dq.__path__, "diffquant."):
        importlib.import_module(info.name)
    for name in dq.__all__:
        obj = getattr(dq, name)
        assert not isinstance(obj, types.ModuleType), name
    assert set(dq.__all__) - {"DiffquantError"} == set(importlib.import_module("diffquant.api").__all__)


def _ids(n=8, t=16, seed=0):
    return torch.randint(3, 512, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def model(micro_pair):
    return micro_pair[1]  # DIFF


def test_recipe_is_data(tmp_path):
    recipe = dq.Recipe.of([dq.SmoothQuant(alpha=0.5), dq.GPTQ(act_order=True), "w8a8-static"])
    assert recipe.label() == "smoothquant:0.5 → gptq:act-order → w8a8-static"
    for suffix in (".json", ".yaml"):
        path = recipe.save(tmp_path / f"r{suffix}")
        assert dq.Recipe.load(path) == recipe
    assert dq.Recipe.from_dict({"scheme": "w4a16", "weights": "awq"}) == dq.Recipe.of([dq.AWQ(), "w4a16"])
    with pytest.raises(DiffquantError, match="comes after the weight solver"):
        dq.Recipe.of([dq.GPTQ(), dq.Rotate(), "w4a8"])
    with pytest.raises(DiffquantError, match="one weight solver"):
        dq.Recipe.of([dq.GPTQ(), dq.AWQ(), "w4a8"])
    with pytest.raises(DiffquantError, match="ends with its scheme"):
        dq.Recipe.of([dq.Rotate()])
    with pytest.raises(DiffquantError, match="unknown scheme"):
        dq.Recipe.of(["w9a9"])


def test_quantize_is_the_steps_done_by_hand_and_leaving_restores_the_model(model):
    """The pipeline against the same steps called one by one (fix, solver, scheme, its static scales), and the
    float model back bit for bit after the `with` block."""
    from diffquant.quant.algorithms.mitigate import mitigate_
    from diffquant.quant.numerics.scheme import attach_scheme, calibrate, get_scheme
    from diffquant.quant.algorithms.solvers import solve_weights_

    calib, ids = _ids(seed=1), _ids(4, 16, seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(ids).logits
    recipe = [dq.SmoothQuant(alpha=0.5), dq.GPTQ(), "w8a8-static"]
    with dq.quantize_(model, recipe, calibration=calib) as q:
        with torch.no_grad():
            got = model(ids).logits
        assert q.scheme.name == "w8a8-static+gptq" and q.record["fixes"][0]["alpha"] == 0.5
        # each step's wall seconds, in the order the steps ran (values not checked: timing)
        assert list(q.seconds) == ["fix smoothquant:0.5", "solver gptq", "attach", "static scales"]
        assert all(v >= 0 for v in q.seconds.values()) and q.record["seconds"] == q.seconds
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref)
    scheme = get_scheme("w8a8-static")
    applied = mitigate_(model, dq.SmoothQuant(alpha=0.5), calib, scheme)
    solved = solve_weights_(model, dq.GPTQ(), scheme, calib, progress=False)
    attachment = attach_scheme(model, solved.scheme(scheme))
    solved.install(attachment)
    calibrate(model, attachment, calib.split(8))
    with torch.no_grad():
        by_hand = model(ids).logits
    attachment.remove(), solved.remove(), applied.remove()
    assert torch.equal(got, by_hand) and not torch.equal(got, ref)


def test_a_recipe_that_needs_calibration_is_refused_without_it_before_anything_changes(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for recipe in (["w8a8-static"], [dq.SmoothQuant(), "w8a8"], [dq.GPTQ(), "w4a16"]):
        with pytest.raises(DiffquantError, match="needs calibration windows"):
            dq.quantize_(model, recipe)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with dq.quantize_(model, "w8a8"):  # dynamic scales, round to nearest: nothing to calibrate
        pass


@pytest.mark.slow
def test_profile_merges_saves_and_loads_exactly(model, tmp_path):
    ids = _ids(6, 16, seed=3)
    whole = dq.profile(model, ids, sites=["*.attn_logits", "*.hidden"], k=5)
    a = dq.profile(model, ids[:2], sites=["*.attn_logits", "*.hidden"], k=5)
    b = dq.profile(model, ids[2:], sites=["*.attn_logits", "*.hidden"], k=5)
    merged = a.merge(b)
    a.save(tmp_path / "a")
    loaded = dq.Profile.load(tmp_path / "a").merge(b)
    for prof in (merged, loaded):
        for name, stats in whole.sites.items():
            s, w = prof.sites[name].summary(full=False), stats.summary(full=False)
            for key in ("count", "absmax", "kurtosis", "quantiles", "top"):
                assert s[key] == pytest.approx(w[key], rel=1e-7), (name, key)  # float sums in another order
        assert prof.provenance["tokens"] == whole.provenance["tokens"]
    assert (tmp_path / "a" / "table5.md").is_file() and "attention logits" in whole.table()
    with pytest.raises(DiffquantError, match="no saved profile"):
        dq.Profile.load(tmp_path)
