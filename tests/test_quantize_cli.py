import importlib.util
import json

import pytest
import torch

from diffquant.cli import main
from diffquant.models.load import load_model
from diffquant.quant.backends import BACKENDS, load_real, serialized_bytes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from diffquant.data.tokens import train_tokenizer
    from diffquant.models.presets import ModelSpec, build_pair

    root = tmp_path_factory.mktemp("q")
    text = "\n".join(f"and {w} went unto the {v} of {u}." for w, v, u in
                     zip(["he", "she", "they"] * 300, ["house", "city", "field", "land"] * 225, ["god", "men"] * 450))
    (root / "c.txt").write_text(text)
    spec = ModelSpec("q", hidden=128, layers=2, heads=4, ffn=256, vocab=512, seq_len=64)
    _, diff = build_pair(spec)
    diff.save_pretrained(root / "m")
    train_tokenizer(text, 400).save_pretrained(root / "m")
    return root


@pytest.mark.parametrize("weights", [False, True])
def test_fake_quantize_saves_and_reloads_with_scheme(ckpt, tmp_path, weights, capsys):
    out = tmp_path / "fake"
    assert main(["quantize", "--model", str(ckpt / "m"), "--scheme", "w8a8-static", "--data", str(ckpt / "c.txt"),
                 "--tokens", "256", "--seq-len", "32", "--calib-batches", "2", "--out", str(out)]
                + (["--save-weights"] if weights else [])) == 0
    printed = capsys.readouterr().out
    assert f"use it as --model {out}" in printed and "diffquant_scheme.json (" in printed
    assert (out / "model.safetensors").is_file() == weights  # by default: the scheme and a reference only
    saved = json.loads((out / "diffquant_scheme.json").read_text())
    assert ("source" in saved) != weights
    from diffquant.paths import user_mode

    assert all((f.stat().st_mode & 0o777) == user_mode() for f in out.iterdir())  # the user's umask, not 0600
    result = json.loads((out / "quantize.json").read_text())
    assert result["fp"]["tokens"] == 8 * 31 and result["simulated"]["paired_loss_change"]["n"] == 8
    model, _ = load_model(str(out))
    assert model._diffquant_quant.quantizers  # the scheme is applied on load
    assert all(q.scale is not None for q in model._diffquant_quant.quantizers.values() if not q.config.dynamic)
    from diffquant.data.corpora import split
    from diffquant.data.tokens import encode, sequences
    from diffquant.evaluate import language_modeling

    _, tok = load_model(str(out))
    evalset = sequences(encode(tok, split((ckpt / "c.txt").read_text())[1]), 32, 256)
    assert language_modeling(model, evalset)["loss"] == pytest.approx(result["simulated"]["loss"], rel=1e-6)


def _snr_db(ref, out):
    return float(10 * torch.log10(ref.pow(2).mean() / (out - ref).pow(2).mean()))


@pytest.mark.parametrize("name", list(BACKENDS))
def test_real_backend_against_float_and_simulation(ckpt, name, request):
    backend = BACKENDS[name]
    if backend.package.startswith("optimum.quanto"):
        request.getfixturevalue("quanto_kernels")
    if importlib.util.find_spec(backend.package.split(".")[0]) is None:
        pytest.skip(f"{backend.package} not installed")
    ids = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    ref, _ = load_model(str(ckpt / "m"))
    with torch.no_grad():
        fp = ref(ids).logits
        model = load_real(name, ckpt / "m", calibration=ids)
        out = model(ids).logits
    threshold = 25 if "8" in name else 10  # signal-to-quantization-noise of the logits, dB
    assert _snr_db(fp, out) > threshold, name
    assert serialized_bytes(model) < serialized_bytes(ref)


def test_real_backend_cli_round_trip(ckpt, tmp_path):
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao not installed")
    out = tmp_path / "ao"
    assert main(["quantize", "--model", str(ckpt / "m"), "--backend", "torchao-int8", "--data", str(ckpt / "c.txt"),
                 "--tokens", "256", "--seq-len", "32", "--out", str(out)]) == 0
    r = json.loads((out / "quantize.json").read_text())
    assert r["real_bytes"] < r["fp_bytes"] and abs(r["gap_loss_real_minus_simulated"]) < 0.05
    model, tok = load_model(str(out))
    assert tok is not None and model(torch.randint(0, 512, (1, 8))).logits.shape[-1] == 512


def test_quantize_list_and_errors(capsys, tmp_path):
    assert main(["quantize", "--list"]) == 0
    text = capsys.readouterr().out
    assert "logits-int4" in text and "bnb-int8" in text
    assert main(["quantize", "--model", "x", "--backend", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown backend" in capsys.readouterr().err


@pytest.mark.slow
def test_quanto_backends_through_the_evaluation_paths(ckpt, quanto_kernels):
    """Every quanto backend through `language_modeling` and `profile_model` (the paths `quantize` and `profile`
    take), with quanto's real kernels. quanto-w4 crashed there ("Cannot set version_counter for inference
    tensor"): they ran under inference mode. The loss equals an independent cross-entropy of the same real
    model's logits, and stays near the float model's."""
    from diffquant.evaluate import language_modeling
    from diffquant.profile import profile_model

    ids = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(0))
    ref, _ = load_model(str(ckpt / "m"))
    fp = language_modeling(ref, ids)["loss"]
    for name in ("quanto-w4", "quanto-w8", "quanto-int8"):
        model = load_real(name, ckpt / "m", calibration=ids[:2])
        loss = language_modeling(model, ids)["loss"]
        with torch.no_grad():
            logits = model(ids).logits[:, :-1].double()
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item()
        assert loss == pytest.approx(expected, rel=1e-6), name
        assert abs(loss - fp) < 0.05, name
        prof = profile_model(model, ids, ["*.hidden"], progress=False)
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states[1]
        assert prof.sites["layers.0.hidden"].topk.rank(1) == pytest.approx(float(hidden.abs().max()), rel=1e-6)
    assert quanto_kernels._lib is not None  # quanto's C++ unpack was loaded and ran
