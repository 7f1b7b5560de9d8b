import importlib.util
import json

import pytest
import torch

from conftest import write_micro_diff_checkpoint
from diffquant.cli import main
from diffquant.models.load import load_model
from diffquant.quant.checkpoints.backends import BACKENDS, load_real, serialized_bytes


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_micro_diff_checkpoint(tmp_path_factory.mktemp("q"))


@pytest.mark.parametrize("weights", [False, True])
def test_fake_quantize_saves_and_reloads_with_scheme(ckpt, tmp_path, weights, capsys):
    out = tmp_path / "fake"
    assert main(["quantize", "--model", str(ckpt / "m"), "--scheme", "w8a8-static", "--data", str(ckpt / "c.txt"),
                 "--eval-tokens", "256", "--seq-len", "32", "--calib-tokens", "64", "--out", str(out)]
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
    # every stage's wall seconds in order, printed as it finished; non-negative, and within the total
    stages = result["seconds"]
    total = stages.pop("total")
    assert list(stages) == ["load model", "data", *(["save float weights"] if weights else []), "evaluate float",
                            "attach", "static scales", "evaluate simulated", "save"]
    assert all(v >= 0 for v in stages.values()) and sum(stages.values()) <= total
    assert all(f"\n{stage}: " in "\n" + printed for stage in stages)
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
                 "--eval-tokens", "256", "--seq-len", "32", "--out", str(out)]) == 0
    r = json.loads((out / "quantize.json").read_text())
    assert r["real_bytes"] < r["fp_bytes"] and abs(r["gap_loss_real_minus_simulated"]) < 0.05
    # float, simulated and real on one device and dtype, and what the real kernels compute in
    assert (r["real_kernels"]["device"], r["real_kernels"]["dtype"]) == (r["device"], r["dtype"]) == ("cpu", "float32")
    assert r["real_kernels"]["computes"].startswith("int8 x int8")
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
    from diffquant.profiler import profile_model

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


def test_renamed_backend_is_refused_with_what_it_is(ckpt, tmp_path, capsys):
    """torchao-int4wo was IntxWeightOnlyConfig: int4 values in int8 storage, dequantized before F.linear."""
    from diffquant import DiffquantError
    from diffquant.quant.checkpoints.backends import require

    with pytest.raises(DiffquantError, match="torchao-int4wo is now torchao-intx4wo: .* no int4 kernel"):
        require("torchao-int4wo")
    assert main(["quantize", "--model", str(ckpt / "m"), "--backend", "torchao-int4wo", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torchao-intx4wo" in err[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The `tiny` demo preset's DIFF model (width 256, SwiGLU 688) saved as a folder."""
    from diffquant.models.presets import PRESETS, build_pair

    root = tmp_path_factory.mktemp("tiny")
    build_pair(PRESETS["tiny"], seed=0)[1].save_pretrained(root)
    return root


@pytest.mark.slow
def test_tiny_preset_shapes_are_refused_up_front(tiny_dir, ckpt, tmp_path, capsys):
    """On the tiny preset torchao-intx4wo failed inside transformers' conversion (688 inputs, groups of 32) and
    bnb-nf4 at its first forward on an AVX512-BF16 CPU ('N must be divisible by block_n': 688 outputs); both are
    refused before loading, naming the layer and the rule."""
    from diffquant import DiffquantError
    from diffquant.quant.checkpoints import backends

    with pytest.raises(DiffquantError, match=r"torchao-intx4wo quantizes weights in groups of 32 input columns: "
                                             r"model\.layers\.0\.mlp\.down_proj has 688 inputs"):
        backends.load_real("torchao-intx4wo", tiny_dir)
    if backends._bnb_cpu_repacks():
        for name in ("bnb-nf4", "bnb-fp4"):
            with pytest.raises(DiffquantError, match=rf"{name} on this CPU .* blocks of 32 output rows .* "
                                                     r"model\.layers\.0\.mlp\.gate_proj is 688 x 256"):
                backends.load_real(name, tiny_dir)
    assert main(["quantize", "--model", "tiny:diff", "--backend", "torchao-intx4wo", "--data", str(ckpt / "c.txt"),
                 "--eval-tokens", "256", "--seq-len", "32", "--out", str(tmp_path / "o")]) == 2  # before any evaluation
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "down_proj has 688 inputs, not a multiple of 32" in err[0]
    for name in ("torchao-int8", "quanto-w8"):  # shapes every kernel takes: nothing refused
        model = backends.load_real(name, tiny_dir)
        with torch.no_grad():
            assert torch.isfinite(model(torch.arange(8)[None]).logits).all()


def test_bnb_int8_keeps_inputs_beyond_float16_out_of_float16(ckpt):
    """bnb-int8 casts Linear inputs to float16 before quantizing them, but with the outlier threshold 6.0 every
    column holding an |x| >= 6 (so every value beyond float16's 65,504) is computed in the input's dtype against
    the dequantized int8 weights (bitsandbytes 0.50): inputs of 1e6..2e6 give the fp32 product of the
    dequantized weights, not inf. So nothing is refused; `kernels` says so."""
    from diffquant.quant.checkpoints import backends

    model = backends.load_real("bnb-int8", ckpt / "m")
    q_proj = model.model.layers[0].self_attn.q_proj
    w = q_proj.weight.data.float() * q_proj.weight.SCB[:, None].float() / 127  # int8 rows x their absmax / 127
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 128, generator=g)
    x[..., ::2] = torch.sign(x[..., ::2]) * (1e6 + 1e6 * torch.rand(2, 5, 64, generator=g))
    assert not torch.isfinite(x.half()).all()  # float16 could not hold them
    with torch.no_grad():
        out = q_proj(x)
    expected = x @ w.T
    assert torch.isfinite(out).all() and float((out - expected).abs().max() / expected.abs().max()) < 1e-5
    assert "never pass through float16" in backends.kernels(model, "bnb-int8")["computes"]


@pytest.mark.parametrize("name,computes", [("bnb-int8", "int8 x int8"), ("bnb-nf4", None), ("torchao-int8", "int8"),
                                           ("torchao-intx4wo", "bfloat16"), ("quanto-w8", "bfloat16"),
                                           ("quanto-w4", "bfloat16")])
def test_real_backend_on_the_asked_dtype_records_what_it_computes_in(ckpt, name, computes, quanto_kernels):
    """load_real(dtype=bf16): the real model's float parts are bf16 on the asked device, and `kernels` records
    it, with what the kernels compute in (bnb's fused 4-bit CPU kernel: bfloat16 whatever the model's)."""
    from diffquant.quant.checkpoints import backends

    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model = backends.load_real(name, ckpt / "m", calibration=ids, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.bfloat16}
    with torch.no_grad():
        assert model(ids).logits.dtype == torch.bfloat16
    record = backends.kernels(model, name)
    assert record["device"] == "cpu" and record["dtype"] == "bfloat16"
    assert sum(record["weights"].values()) == 14  # 2 layers x 7 Linears
    if computes is None:  # bitsandbytes 4-bit: bfloat16 on an AVX512-BF16 CPU, the model's dtype elsewhere
        computes = "bfloat16"
    assert record["computes"].startswith(computes), record["computes"]


def test_quanto_compile_is_noted_or_refused(tmp_path):
    """quanto-w4 compiles quanto's kernels at first use: a note of the cost where the tools are there, a one-line
    refusal where they are not, nothing once built for this torch."""
    from types import SimpleNamespace

    from diffquant import DiffquantError
    from diffquant.quant.checkpoints.backends import quanto_compile_note

    ext = SimpleNamespace(build_directory=str(tmp_path))  # where quanto's extension would be built
    cpu = torch.device("cpu")
    assert "about a minute" in quanto_compile_note(cpu, which=lambda tool: f"/usr/bin/{tool}", extension=ext)
    with pytest.raises(DiffquantError, match="needs ninja, c\\+\\+: not found"):
        quanto_compile_note(cpu, which=lambda tool: None, extension=ext)
    (tmp_path / "pytorch_version.txt").write_text(torch.__version__)
    assert quanto_compile_note(cpu, which=lambda tool: None, extension=ext) is None
