"""Export to compressed-tensors (quant/checkpoints/export.py) and reading such checkpoints (quant/checkpoints/compressed.py).

Parity is checked where a user would check it: each exported folder is loaded by transformers'
`AutoModelForCausalLM.from_pretrained` in a fresh interpreter that never imports diffquant (the designs, whose
model_type is diffquant's, after `import diffquant`), and its weights and logits are compared with the
simulation that wrote it (saved beside it as plain tensors)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import write_micro_diff_checkpoint
from diffquant.cli import main
from diffquant.errors import DiffquantError
from diffquant.models.matrix import FAMILIES, VOCAB
from diffquant.quant.numerics import granularity as G
from diffquant.quant.algorithms import solvers
from diffquant.quant.numerics.config import QuantConfig, int_config
from diffquant.quant.checkpoints.export import check
from diffquant.quant.numerics.formats import Format
from diffquant.quant.algorithms.mitigate import Clip, SmoothQuant, adjust_scheme
from diffquant.quant.recipe import Recipe, quantize_
from diffquant.quant.numerics.scheme import LAYER_WEIGHTS, LINEAR_INPUTS, QuantScheme, attach_scheme, get_scheme

IDS = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
CALIB = torch.randint(3, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))

CHILD = r'''
import json, sys, torch
from transformers import AutoModelForCausalLM, CompressedTensorsConfig
jobs = json.loads(sys.argv[1])
if jobs["import_diffquant"]:
    import diffquant  # noqa: F401 - registers the designs' model types
out = {}
for job in jobs["folders"]:
    ref = torch.load(job["dir"] + "/ref.pt")
    kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if job["dequantize"] else {}
    model = AutoModelForCausalLM.from_pretrained(job["dir"], **kw)
    r = {"dtype": str(model.dtype)}
    with torch.no_grad():
        logits = model(ref["ids"]).logits  # the first forward decompresses the packed weights
        r["weights_identical"] = all(torch.equal(model.get_submodule(k).weight, w) for k, w in ref["weights"].items())
        r["max_weight_diff"] = max(float((model.get_submodule(k).weight - w).abs().max()) for k, w in ref["weights"].items())
        r["max_logit_diff"] = float((logits - ref["logits"]).abs().max())
        if "logits_float" in ref:  # how far the simulation itself moved the logits from the float model
            r["max_logit_change_of_simulation"] = float((ref["logits"] - ref["logits_float"]).abs().max())
        if "logits_ct_rule" in ref:
            r["max_logit_diff_ct_rule"] = float((logits - ref["logits_ct_rule"]).abs().max())
        if "logits_weights_only" in ref:  # the loader's activation quantizers off: weights alone
            for m in model.modules():
                m.quantization_enabled = False
            r["max_logit_diff_weights_only"] = float((model(ref["ids"]).logits - ref["logits_weights_only"]).abs().max())
    out[job["dir"]] = r
out["diffquant_imported"] = "diffquant" in sys.modules
print("RESULT " + json.dumps(out))
'''


def load_fresh(folders: list[tuple], import_diffquant: bool = False) -> dict:
    """{folder: what the child measured} for (folder, dequantize) pairs, in one fresh interpreter."""
    jobs = {"import_diffquant": import_diffquant, "folders": [{"dir": str(d), "dequantize": q} for d, q in folders]}
    run = subprocess.run([sys.executable, "-c", CHILD, json.dumps(jobs)], capture_output=True, text=True)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert run.returncode == 0 and line, run.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    assert result.pop("diffquant_imported") == import_diffquant
    return result


def linear_weights(model) -> dict:
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def export(model, scheme, folder, solver=None, mitigation=None, references=False) -> dict:
    """diffquant's pipeline on `model` (fix → solver → scheme → calibration, `quantize_`), exported to `folder` with
    what the child compares against: the simulated Linear weights and logits on IDS; `references`: also the logits
    of the simulated weights alone, and with the Linear inputs quantized by compressed-tensors' rule (`ct_rule`)
    at the simulation's static scales."""
    recipe = Recipe(scheme, (mitigation,) if mitigation is not None else (), solver)
    with quantize_(model, recipe, CALIB) as q:
        info = q.export(folder)
        with torch.no_grad():
            ref = {"ids": IDS, "logits": model(IDS).logits, "weights": linear_weights(model)}
        attachment = q.attachment
    if references:
        with torch.no_grad():
            ref["logits_float"] = model(IDS).logits
        weights_only = Recipe(QuantScheme("weights", (), scheme.weights), recipe.fixes, solver)
        with quantize_(model, weights_only, CALIB):  # deterministic: the same fix and weights again
            with torch.no_grad():
                ref["logits_weights_only"] = model(IDS).logits
            ref["logits_ct_rule"] = ct_rule(model, IDS, scheme, attachment)
    torch.save(ref, folder / "ref.pt")
    return info


READERS = {"attn_in": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn_out": ("self_attn.o_proj",),
           "mlp_in": ("mlp.gate_proj", "mlp.up_proj"), "down_in": ("mlp.down_proj",)}  # the Llama layout's


def ct_rule(model, ids, scheme, attachment) -> torch.Tensor:
    """Logits of `model` (its weights as they are) with each Linear input quantized as compressed-tensors' int8
    quantizer does, written out here: grid −128..127, round half to even; dynamic per token with scale
    max|x| / 127.5, static with the simulation's calibrated scale (diffquant: grid ±127, dynamic scale
    max|x| / 127)."""
    def hook(scale):
        def apply(module, args):
            x = args[0]
            s = x.abs().amax(dim=-1, keepdim=True) / 127.5 if scale is None else scale.reshape(1)
            s = torch.where(s == 0, torch.finfo(s.dtype).eps, s)
            return (torch.clamp(x / s, -128, 127).round() * s,)
        return apply

    handles = []
    for site, config in scheme.activations:
        point = site.removeprefix("*.")
        for i, layer in enumerate(model.model.layers):
            q = attachment.quantizers[f"layers.{i}.{point}"]
            for path in READERS[point]:
                handles.append(layer.get_submodule(path).register_forward_pre_hook(
                    hook(None if config.dynamic else q.scale)))
    try:
        with torch.no_grad():
            return model(ids).logits
    finally:
        for h in handles:
            h.remove()


def weight_scheme(config: QuantConfig) -> QuantScheme:
    return QuantScheme("custom", (), ((LAYER_WEIGHTS, config),))


WEIGHT_SCHEMES = {  # name: (scheme, solver); on the micro Llama (inputs 64 and 128 wide)
    "rtn-g32": (get_scheme("w4a16-g32"), None),
    "rtn-g128-wider-than-inputs": (get_scheme("w4a16"), None),  # groups of 128 over 64 inputs: one ragged group
    "rtn-int8-channel": (get_scheme("w8a16"), None),
    "rtn-int4-tensor": (weight_scheme(int_config(4, G.PerTensor())), None),
    "rtn-int2-g16": (weight_scheme(int_config(2, G.PerGroup(16))), None),
    "rtn-fp8-channel": (weight_scheme(QuantConfig(Format("fp8_e4m3"), G.PerChannel(0))), None),
    "gptq-g32": (get_scheme("w4a16-g32"), "gptq"),
    "gptq-act-order-g32": (get_scheme("w4a16-g32"), "gptq:act-order"),
    "awq-g32": (get_scheme("w4a16-g32"), "awq"),
    "awq+gptq-g32": (get_scheme("w4a16-g32"), "awq+gptq"),
    "clip-output-int8": (get_scheme("w8a16"), "clip:output"),
    "clip-mse-g32": (adjust_scheme(get_scheme("w4a16-g32"), Clip("mse")), None),  # static MSE-clipped weight scales
    "asym-int4-g48-ragged": (weight_scheme(QuantConfig(Format("int", 4, False), G.PerGroup(48))), None),
    "asym-int8-channel-gptq": (weight_scheme(QuantConfig(Format("int", 8, False), G.PerChannel(0))), "gptq"),
}
FAMILY_CASES = ("llama", "diffllama", "diffllama-gqa", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "opt",
                "olmo2", "gpt_neox", "falcon", "stablelm", "granite", "smollm3", "bloom")
DESIGNS = ("gated", "clipsoftmax", "sink", "baseline-headnorm", "diff-gain", "gated-nobias", "diff-nonorm")


@pytest.mark.slow
def test_weight_only_exports_load_bit_identical_without_diffquant(tmp_path):
    """Every weight-only grid (symmetric/asymmetric, per tensor/channel/group, ragged groups, int2/4/8 and fp8),
    from RTN, GPTQ (with act-order), AWQ, AWQ+GPTQ and the output-error clip, and every family that transformers'
    compressed-tensors integration loads: every dequantized weight and every logit bit-identical."""
    folders = []
    for name, (scheme, solver) in WEIGHT_SCHEMES.items():
        info = export(FAMILIES["llama"].build(), scheme, tmp_path / name, solvers.parse(solver or "rtn"))
        folders.append((tmp_path / name, bool(info["notes"])))
        assert info["max_abs_weight_difference"] == 0 and info["safetensors_bytes"] > 0
    for family in FAMILY_CASES:
        info = export(FAMILIES[family].build(), get_scheme("w4a16-g32"), tmp_path / family)
        folders.append((tmp_path / family, bool(info["notes"])))
    results = load_fresh(folders)
    bad = {d: r for d, r in results.items() if not (r["weights_identical"] and r["max_logit_diff"] == 0)}
    assert not bad
    asym = json.loads((tmp_path / "asym-int4-g48-ragged" / "config.json").read_text())["quantization_config"]
    weights = asym["config_groups"]["group_0"]["weights"]
    assert (weights["symmetric"], weights["group_size"], asym["format"]) == (False, 16, "pack-quantized")  # gcd(48, 64)
    act = json.loads((tmp_path / "gptq-act-order-g32" / "config.json").read_text())["quantization_config"]
    assert act["config_groups"]["group_0"]["weights"]["actorder"] == "weight"
    assert act["ignore"] == ["lm_head"]


@pytest.mark.slow
def test_designs_export_and_load_after_import_diffquant(tmp_path):
    folders = []
    for design in DESIGNS:
        export(FAMILIES[design].build(), get_scheme("w4a16-g32"), tmp_path / design)
        folders.append((tmp_path / design, False))
        assert json.loads((tmp_path / design / "config.json").read_text())["model_type"].startswith("diffquant_")
    results = load_fresh(folders, import_diffquant=True)
    assert all(r["weights_identical"] and r["max_logit_diff"] == 0 for r in results.values()), results


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "diffllama"])
def test_w8a8_exports_with_smoothquant(tmp_path, family):
    """SmoothQuant's scales folded, GPTQ weights, W8A8 in four forms. fp8 (static and dynamic): compressed-tensors'
    fp8 arithmetic is diffquant's, logits bit-identical. int8: the loader's grid is −128..127 (a dynamic scale
    max|x|/127.5, a static one clamping at −128) where diffquant's is ±127 (max|x|/127): its logits equal the
    simulated weights with that rule (written in the test) bit for bit, and with its activation quantizers off
    the weight-only simulation; from the simulation they differ by the two grids only."""
    fp8_static = QuantScheme("fp8-static", tuple((p, QuantConfig(Format("fp8_e4m3"), G.PerTensor(), dynamic=False))
                                                 for p in LINEAR_INPUTS), get_scheme("fp8").weights)
    cases = {"w8a8-static": get_scheme("w8a8-static"), "w8a8": get_scheme("w8a8"), "fp8": get_scheme("fp8"),
             "fp8-static": fp8_static}
    folders = []
    for name, scheme in cases.items():
        info = export(FAMILIES[family].build(), scheme, tmp_path / name, solvers.parse("gptq"), SmoothQuant(0.5),
                      references=name.startswith("w8a8"))
        folders.append((tmp_path / name, False))
        assert info["quantization_config"]["format"] == ("int-quantized" if "w8a8" in name else "float-quantized")
    results = load_fresh(folders)
    for name in cases:
        r = results[str(tmp_path / name)]
        assert r["weights_identical"], (name, r)
        if name.startswith("fp8"):
            assert r["max_logit_diff"] == 0, (name, r)
        else:
            assert r["max_logit_diff_ct_rule"] == 0 and r["max_logit_diff_weights_only"] == 0, (name, r)
            # two int8 grids, two draws of rounding noise of one size: the loader's logits sit within the
            # simulation's own distance from float of it (a wrong scale or weight would be far outside)
            assert 0 < r["max_logit_diff"] < 2 * r["max_logit_change_of_simulation"], (name, r)


def micro(family="llama"):
    return FAMILIES[family].build()


REFUSALS = [  # (family, scheme, mitigation, words of the one-line refusal)
    ("llama", get_scheme("w4a16"), "rotate", "online Hadamard"),
    ("llama", get_scheme("w4a16"), "quarot", "online Hadamard"),
    ("llama", get_scheme("logits-int8"), None, "attn_logits"),
    ("llama", QuantScheme("p", (("*.attn_probs", int_config(8)),)), None, "attn_probs"),
    ("llama", QuantScheme("h", (("*.attn_logits", int_config(8, G.PerHead())),)), None, "per-head logit scales"),
    ("llama", get_scheme("kv4"), None, "KV cache"),
    ("llama", get_scheme("kivi2"), None, "KV cache"),
    ("llama", QuantScheme("k", (("*.k_cache", QuantConfig(Format("fp8_e4m3"), G.PerTensor(), dynamic=False)),)), None,
     "does not apply one on load"),
    ("llama", get_scheme("nf4"), None, "no nf4 weights"),
    ("llama", get_scheme("fp4"), None, "no fp4_e2m1 weights"),
    ("llama", weight_scheme(QuantConfig(Format("fp8_e5m2"), G.PerChannel(0))), None, "no fp8_e5m2"),
    ("llama", weight_scheme(int_config(6, G.PerChannel(0))), None, "int6 weights"),
    ("llama", get_scheme("w6a6"), None, "Linear inputs"),  # int6 activations
    ("llama", get_scheme("w4a4"), None, "Linear inputs"),  # int4 activations
    ("llama", weight_scheme(QuantConfig(Format("int", 4, False, minmax=True), G.PerGroup(32))), None, "float offset"),
    ("llama", weight_scheme(int_config(8, G.PerChannel(1))), None, "per tensor, per output channel or per group"),
    ("llama", weight_scheme(QuantConfig(Format("fp8_e4m3"), G.PerGroup(32))), None, "per group of integer"),
    ("llama", QuantScheme("d", tuple((p, int_config(8, G.PerTensor())) for p in LINEAR_INPUTS),
                          get_scheme("w8a8").weights), None, "dynamic per token or static per tensor"),
    ("llama", QuantScheme("a", (("*.down_in", QuantConfig(Format("int", 8, False), G.PerToken())),),
                          get_scheme("w8a8").weights), None, "symmetric int8 or fp8"),
    ("llama", QuantScheme("s", (("*.down_in", int_config(8, G.PerToken(), keep_first=1)),),
                          get_scheme("w8a8").weights), None, "full precision"),
    ("llama", QuantScheme("o", (("*.down_in", int_config(8, G.PerToken())),)), None, "weight is not"),
    ("llama", QuantScheme("m", (("*.down_in", int_config(8, G.PerToken())),), get_scheme("w8a8").weights), None,
     "mixes int-quantized and pack-quantized"),
    ("gpt2", get_scheme("w4a16"), None, "Conv1D"),
    ("mixtral", get_scheme("w4a16"), None, "experts"),
    ("opt", get_scheme("w8a8"), None, "Llama layout"),
]


@pytest.mark.parametrize("family, scheme, mitigation, words", REFUSALS,
                         ids=[f"{f}-{s.name}-{m}-{i}" for i, (f, s, m, _) in enumerate(REFUSALS)])
def test_what_the_format_cannot_hold_is_refused_in_one_line(family, scheme, mitigation, words):
    with pytest.raises(DiffquantError) as e:
        check(micro(family), scheme, mitigation)
    message = str(e.value)
    assert words in message and "\n" not in message and message.startswith("export to compressed-tensors")


def test_presets_that_export():
    """The export's reach over the presets, stated: every weight-only and W8A8 preset a serving runtime runs."""
    model = micro()
    ok = []
    for name in ("w8a8", "w8a8-static", "w4a16", "w4a16-g32", "w8a16", "w4a8", "fp8", "w6a6", "w4a4", "nf4", "fp4",
                 "w4a4-static", "kv8", "logits-int8"):
        try:
            check(model, get_scheme(name))
            ok.append(name)
        except DiffquantError:
            pass
    assert ok == ["w8a8", "w8a8-static", "w4a16", "w4a16-g32", "w8a16", "w4a8", "fp8"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A micro DIFF model with a trained tokenizer and a small corpus (as tests/test_quantize_cli.py's)."""
    return write_micro_diff_checkpoint(tmp_path_factory.mktemp("ct"))


LOSS_CHILD = r'''
import json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.load(sys.argv[2])
with torch.no_grad():
    logits = model(ids).logits[:, :-1].float()
loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
print("RESULT " + json.dumps({"loss": float(loss), "diffquant_imported": "diffquant" in sys.modules}))
'''


@pytest.mark.slow
def test_cli_export_loads_without_diffquant_and_profiles_as_model(ckpt, tmp_path, capsys):
    """`diffquant quantize --solver gptq --export compressed-tensors` on a DIFF model: the folder loads in a fresh
    interpreter without diffquant, with the held-out loss diffquant printed; `diffquant profile --model DIR`
    reads it back, and its report records what the checkpoint held."""
    out = tmp_path / "ct"
    args = ["quantize", "--model", str(ckpt / "m"), "--scheme", "w4a16", "--solver", "gptq", "--data",
            str(ckpt / "c.txt"), "--eval-tokens", "256", "--seq-len", "32", "--calib-tokens", "64", "--export",
            "compressed-tensors", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "exported    compressed-tensors (pack-quantized)" in printed and "from_pretrained" in printed
    result = json.loads((out / "quantize.json").read_text())
    assert result["export"]["safetensors_bytes"] < result["fp_bytes"]
    assert not (out / "diffquant_scheme.json").exists()
    card = (out / "README.md").read_text()  # the folder says what it is, how it was made, what it measured
    assert f"`{ckpt / 'm'}`" in card and "w4a16" in card and f"{result['simulated']['ppl']:.4g}" in card
    assert "Caveat" not in card  # a float model: nothing to warn about
    from diffquant.data.corpora import split
    from diffquant.data.tokens import encode, sequences
    from diffquant.models.load import load_model

    model, tok = load_model(str(out))
    assert model._diffquant_source_quantization["groups"][0]["weights"] == "int4, symmetric, group 128, static"
    ids = sequences(encode(tok, split((ckpt / "c.txt").read_text())[1]), 32, 256)
    torch.save(ids, tmp_path / "ids.pt")
    run = subprocess.run([sys.executable, "-c", LOSS_CHILD, str(out), str(tmp_path / "ids.pt")], capture_output=True,
                         text=True)
    line = next((ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, run.stderr[-2000:]
    fresh = json.loads(line[len("RESULT "):])
    assert not fresh["diffquant_imported"]
    # transformers' two-call DIFF forward there, diffquant's one-softmax forward here: equal to float rounding
    assert fresh["loss"] == pytest.approx(result["simulated"]["loss"], rel=1e-5)
    prof = tmp_path / "prof"
    assert main(["profile", "--model", str(out), "--data", str(ckpt / "c.txt"), "--tokens", "256", "--seq-len", "32",
                 "--out", str(prof)]) == 0
    text = " ".join(p.read_text() for p in prof.rglob("*.json"))
    assert "compressed-tensors" in text and "int4, symmetric, group 128" in text
    again = tmp_path / "again"  # and quantize takes it as --model, recording what it held
    assert main(["quantize", "--model", str(out), "--scheme", "w8a16", "--data", str(ckpt / "c.txt"), "--eval-tokens", "64",
                 "--seq-len", "32", "--calib-tokens", "32", "--out", str(again)]) == 0
    held = json.loads((again / "quantize.json").read_text())["source_quantization"]
    assert held["compression"] == "pack-quantized" and held["ignore"] == ["lm_head"]


def test_cli_refuses_a_recipe_the_format_cannot_hold_before_any_work(ckpt, tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["quantize", "--model", str(ckpt / "m"), "--scheme", "w4a16", "--fix", "rotate", "--data",
                 str(ckpt / "c.txt"), "--export", "compressed-tensors", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "online Hadamard" in err and not (out / "quantize.json").exists()
    assert main(["quantize", "--model", str(ckpt / "m"), "--backend", "torchao-int8", "--export", "compressed-tensors",
                 "--out", str(out)]) == 2
    assert "--backend fake" in capsys.readouterr().err


LLMCOMPRESSOR = Path(__file__).parent / "data" / "llmcompressor-micro-llama-gptq-w4g32"


def test_a_checkpoint_llmcompressor_wrote_loads_profiles_and_sweeps(tmp_path, capsys):
    """A checkpoint llm-compressor 0.14 itself wrote (tests/data, `python -m benchmarks.llmcompressor_check
    --fixture`: its GPTQ w4 g32 of a micro Llama, saved compressed): `--model DIR` loads it dequantized, every
    weight equal to llm-compressor's own `fake_quantize` of it, each evaluation window's loss equal to the loss
    llm-compressor's model computed in its own process; profile, sweep and quantize take it, recording what it held."""
    from safetensors.torch import load_file

    from diffquant.models.load import load_model

    fixture = json.loads((LLMCOMPRESSOR / "fixture.json").read_text())
    model, tok = load_model(str(LLMCOMPRESSOR))
    assert model._diffquant_source_quantization["groups"][0]["weights"] == "int4, symmetric, group 32, static"
    reference = load_file(LLMCOMPRESSOR / "reference.safetensors")
    assert sum(n.endswith("proj.weight") for n in reference) == 14  # 2 layers x 7 Linears
    for name, w in reference.items():
        assert torch.equal(model.get_parameter(name).detach(), w), name
    with torch.no_grad():
        for row, theirs in zip(fixture["eval_ids"], fixture["per_sequence_loss"]):
            ids = torch.tensor([row])
            logits = model(ids).logits[0, :-1]
            mine = -logits.log_softmax(-1).gather(1, ids[0, 1:, None]).mean()
            assert float(mine) == pytest.approx(theirs, rel=1e-5)
    text = tmp_path / "c.txt"
    text.write_text("\n".join(f"and {w} went unto the {v}." for w in ("he", "she", "they") * 40
                              for v in ("house", "city", "field")))
    common = ["--model", str(LLMCOMPRESSOR), "--data", str(text), "--seq-len", "16"]
    assert main(["profile", *common, "--tokens", "128", "--out", str(tmp_path / "p")]) == 0
    assert "int4, symmetric, group 32" in " ".join(f.read_text() for f in (tmp_path / "p").rglob("*.json"))
    # named in every table as a GGUF model is: what the checkpoint held, and what it runs in
    assert "llmcompressor-micro-llama-gptq-w4g32 (compressed-tensors int4 group 32 → fp32)" in \
        (tmp_path / "p" / "table5.md").read_text()
    # its weights were int4 before diffquant saw them: the caveat stands in the profile's report (issue 51)
    caveat = "compressed-tensors checkpoint (compressed-tensors int4 group 32 → fp32), dequantized on load"
    assert caveat in (tmp_path / "p" / "table5.md").read_text()
    capsys.readouterr()
    assert main(["sweep", *common, "--eval-tokens", "128", "--bits", "16,4", "--scheme", "w4a16", "--no-plots", "--out",
                 str(tmp_path / "s")]) == 0
    held = json.loads((tmp_path / "s" / "source_quantization.json").read_text())  # dq.sweep writes it too
    assert [h["groups"][0]["weights"] for h in held.values()] == ["int4, symmetric, group 32, static"]
    assert caveat in json.dumps(json.loads((tmp_path / "s" / "source_caveats.json").read_text()), ensure_ascii=False)
    printed = capsys.readouterr().out
    assert "Whole-model schemes" in printed and "| w4a16 |" in printed and f"caveat: {LLMCOMPRESSOR}: " in printed
    assert main(["quantize", *common, "--eval-tokens", "128", "--scheme", "w8a16", "--calib-tokens", "16", "--out",
                 str(tmp_path / "q")]) == 0
    result = json.loads((tmp_path / "q" / "quantize.json").read_text())
    held = result["source_quantization"]
    assert held["compression"] == "pack-quantized" and held["ignore"] == ["lm_head"]
    assert caveat in result["source_caveat"] and "caveat      " + result["source_caveat"] in capsys.readouterr().out

@pytest.mark.slow
def test_llmcompressor_check_compares_shipped_checkpoints(tmp_path, load_script):
    """benchmarks/llmcompressor_check.py's export section on hand-made inputs: a diffquant export of a micro Llama
    read back as --model DIR (size, loss, weight errors against an independent computation), and the side-by-side
    rows (shares of the float size, paired loss change against scipy's t interval, median and worst errors)."""
    from scipy import stats

    from diffquant.evaluate import language_modeling

    check_script = load_script("benchmarks/llmcompressor_check.py", "llmcompressor_check_under_test")
    model = FAMILIES["llama"].build()
    float_weights = {f"{n}.weight": w for n, w in linear_weights(model).items() if n != "lm_head"}
    export(model, get_scheme("w4a16-g32"), tmp_path / "ours")
    simulated = torch.load(tmp_path / "ours" / "ref.pt")["weights"]
    side = check_script.checkpoint_side(tmp_path / "ours", float_weights, CALIB)
    assert side["bytes"] == (tmp_path / "ours" / "model.safetensors").stat().st_size
    assert side["holds"]["groups"][0]["weights"] == "int4, symmetric, group 32, static"
    for name, w in float_weights.items():
        q = simulated[name.removesuffix(".weight")].double()
        assert side["weight_error"][name] == pytest.approx(float(((q - w.double()) ** 2).sum() / (w.double() ** 2).sum()))
    model_sim = FAMILIES["llama"].build()
    attachment = attach_scheme(model_sim, get_scheme("w4a16-g32"))
    assert side["loss"] == pytest.approx(language_modeling(model_sim, CALIB)["loss"], rel=1e-6)
    attachment.remove()

    ones = {"a.weight": torch.ones(2, 2), "b.weight": torch.ones(2, 2)}
    errors = check_script.weight_errors(ones, {"a.weight": torch.full((2, 2), 1.1), "b.weight": torch.full((2, 2), 0.8)})
    assert errors == pytest.approx({"a.weight": 0.01, "b.weight": 0.04})
    first = {"bytes": 50, "holds": None, "loss": 2.0, "ppl": 7.389, "ppl_ci95": [7.0, 7.8],
             "per_sequence_loss": [1.0, 2.0, 3.0, 2.0], "weight_error": errors}
    losses = [1.1, 2.3, 3.2, 2.0]
    second = {**first, "bytes": 60, "per_sequence_loss": losses, "weight_error": {"a.weight": 0.02, "b.weight": 0.1}}
    sec = check_script.compare_sides({"ours": first, "theirs": second}, float_bytes=200)
    ours, theirs = sec["rows"]
    assert (ours["share_of_float"], theirs["share_of_float"]) == (0.25, 0.3)
    assert (ours["weight_error_median"], theirs["weight_error_worst"]) == (pytest.approx(0.025), 0.1)
    d = [b - a for a, b in zip(first["per_sequence_loss"], losses)]
    lo, hi = stats.t.interval(0.95, len(d) - 1, loc=sum(d) / len(d), scale=stats.sem(d))
    assert theirs["delta_vs_first"] == pytest.approx(sum(d) / len(d))
    assert theirs["delta_vs_first_ci95"] == pytest.approx([lo, hi])
    table = check_script.export_table(sec, {"ppl": 7.0})
    assert "| theirs | 0.0 MB (30%) |" in table and "1.00e-01" in table
