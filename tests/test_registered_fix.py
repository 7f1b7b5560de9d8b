"""A fix defined here, outside diffquant, and registered (quant/algorithms/steps.py) is a recipe step like the built-in ones:
the command line's help and `diffquant list` name it, `dq.registries()` lists it, a recipe file round-trips it,
`quantize_` applies and removes it, and an export refuses it with its own reason. No file of diffquant knows of it."""

from dataclasses import dataclass

import pytest
import torch

import diffquant as dq
from diffquant.cli import main
from diffquant.errors import DiffquantError
from diffquant.quant.algorithms.steps import FIXES, Fix


@dataclass(frozen=True)
class Halve(Fix):
    """Halves the final norm's gain and doubles lm_head's weight: the logits stay what they were (powers of two
    scale floats exactly), the weights do not."""

    note: str = "x"
    words = ("halve",)
    docs = {"halve[:NOTE]": "halve the final norm, double lm_head (a test's fix)"}
    export_refusal = "a test's fix has no place in a checkpoint"

    @classmethod
    def from_text(cls, word: str, arg: str) -> "Halve":
        return cls(arg or "x")

    def label(self) -> str:
        return f"halve:{self.note}"

    def apply(self, model, calibration, scheme, applied) -> None:
        if model.lm_head.weight is model.get_input_embeddings().weight:
            raise DiffquantError("halve doubles lm_head, which is the embedding here")
        applied.set(model.model.norm, "weight", model.model.norm.weight / 2)
        applied.set(model.lm_head, "weight", model.lm_head.weight * 2)
        applied.record.update(note=self.note)


@pytest.fixture
def halve():
    FIXES.register(Halve)
    yield Halve
    FIXES.unregister(Halve)


def test_a_registered_fix_is_named_everywhere(halve, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "100000")
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    assert "halve[:NOTE]" in capsys.readouterr().out
    assert main(["list"]) == 0 and "halve the final norm, double lm_head" in capsys.readouterr().out
    assert "halve[:NOTE]" in dq.registries()["fixes"]
    recipe = dq.Recipe.of([Halve("y"), dq.GPTQ(act_order=True), "w4a16"])
    for suffix in (".yaml", ".json"):
        path = recipe.save(tmp_path / f"r{suffix}")
        assert "halve:y" in path.read_text() and dq.Recipe.load(path) == recipe
    with pytest.raises(DiffquantError, match="already names a fix"):
        FIXES.register(Halve)


def test_a_registered_fix_applies_and_is_refused_by_the_export(halve, micro_pair):
    from diffquant.quant.recipe import check_export

    model = micro_pair[0]
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(ids).logits
        with dq.quantize_(model, [FIXES.parse("halve:z"), "fp"]) as q:
            assert torch.equal(model(ids).logits, ref) and not torch.equal(model.lm_head.weight, before["lm_head.weight"])
            assert q.record["fixes"] == [{"mitigation": "halve:z", "note": "z"}]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(DiffquantError) as e:
        check_export(model, [Halve("z"), "w4a16"])
    assert str(e.value) == "export to compressed-tensors: halve:z: a test's fix has no place in a checkpoint"
