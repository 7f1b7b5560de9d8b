import pytest
import torch
from transformers import AutoModelForCausalLM

from diffquant import DiffquantError
from diffquant.models.load import load_model
from diffquant.models.presets import PRESETS, ModelSpec, build_pair, count_parameters, get_preset


def expected_params(spec: ModelSpec, diff: bool) -> int:
    """Parameter count by hand: embeddings, untied head, per layer 4 attention and 3 MLP matrices, 2 norms."""
    h, f = spec.hidden, spec.ffn
    per_layer = 4 * h * h + 3 * h * f + 2 * h + (4 * (h // spec.heads) if diff else 0)
    head = 0 if spec.tie_embeddings else spec.vocab * h
    return spec.vocab * h + head + spec.layers * per_layer + h


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_matched(name):
    spec = PRESETS[name]
    with torch.device("meta"):
        baseline, diff = build_pair(spec)
    nb, nd = count_parameters(baseline), count_parameters(diff)
    assert nb == expected_params(spec, diff=False)
    assert nd == expected_params(spec, diff=True)
    assert abs(nd - nb) / nb < 1e-3
    # softmax maps match; with Guo et al.'s one head, heads of full width match (one differential head of 2 maps)
    assert diff.config.num_attention_heads == baseline.config.num_attention_heads * (2 if spec.one_head else 1)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "rope_parameters"):
        assert getattr(diff.config, key) == getattr(baseline.config, key)


# The fields a design may set apart from the baseline's config: its attention's own (the rest of a pair is shared).
ATTENTION_FIELDS = {
    "diff": {"lambda_std_dev"}, "diff-gain": {"lambda_std_dev"}, "diff-nonorm": {"lambda_std_dev", "head_norm"},
    "gated": {"gate", "gate_bias"}, "gated-nobias": {"gate", "gate_bias"}, "clipsoftmax": {"clip_zeta", "clip_gamma"},
    "sink": set(), "baseline-headnorm": {"head_norm", "head_norm_group", "head_norm_gain"}, "diff-frozen": {"lambda_std_dev", "freeze_lambda"},
    "baseline-diffnorm": {"head_norm", "head_norm_group", "head_norm_gain"},
}
# Llama fields DiffLlama's config class does not have (DiffLlama's MLP has no bias and no tensor-parallel split).
NOT_IN_DIFFLLAMA = {"mlp_bias", "pretraining_tp"}


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_design_differs_from_the_baseline_only_in_attention_fields(name):
    """A matched pair differs only where its design does: eps, RoPE, widths, vocabulary and the rest are equal
    (transformers' defaults differ, e.g. rms_norm_eps 1e-6 for Llama and 1e-5 for DiffLlama, so presets set them)."""
    from diffquant.designs import DESIGNS, get

    spec = PRESETS[name]
    base = spec.config("baseline").to_dict()
    assert base["rms_norm_eps"] == spec.rms_norm_eps == 1e-5
    for design in set(DESIGNS) - {"baseline"}:
        cfg = spec.config(design).to_dict()
        differ = {k for k in set(base) | set(cfg) if base.get(k) != cfg.get(k)} - {"model_type", "architectures"}
        allowed = ATTENTION_FIELDS[design] | (NOT_IN_DIFFLLAMA if get(design).maps_per_head == 2 else set())
        if get(design).narrow_mlp:
            allowed |= {"intermediate_size"}  # gives back the parameters the design adds (parameter-matched)
        if spec.one_head:
            allowed |= {"num_attention_heads", "num_key_value_heads", "head_dim"}  # one head of full width per design
        assert differ <= allowed, (design, {k: (base.get(k), cfg.get(k)) for k in differ - allowed})
        assert cfg["rms_norm_eps"] == base["rms_norm_eps"], design
        for key in NOT_IN_DIFFLLAMA & differ:
            assert key not in cfg or cfg[key] is None, (design, key)


def test_preset_sizes_in_range():
    with torch.device("meta"):
        sizes = {n: count_parameters(build_pair(PRESETS[n])[0]) for n in ("tiny", "small", "base")}
    assert 4e6 <= sizes["tiny"] <= 8e6
    assert 25e6 <= sizes["small"] <= 40e6
    assert 110e6 <= sizes["base"] <= 140e6


def test_unknown_preset():
    with pytest.raises(DiffquantError, match="choose one of"):
        get_preset("huge")


def test_checkpoint_loads_with_plain_transformers(tmp_path, micro_pair):
    ids = torch.randint(0, 512, (1, 12))
    for model in micro_pair:
        model.save_pretrained(tmp_path / model.config.model_type)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / model.config.model_type)
        assert type(reloaded) is type(model)
        assert (tmp_path / model.config.model_type / "model.safetensors").exists()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
        mine, _ = load_model(str(tmp_path / model.config.model_type))
        assert type(mine) is type(model)


def test_load_errors(tmp_path):
    with pytest.raises(DiffquantError, match="unknown model"):
        load_model("no/such-model")
    with pytest.raises(DiffquantError, match="without config.json"):
        load_model(str(tmp_path))
    with pytest.raises(DiffquantError, match="does not exist"):
        load_model(str(tmp_path / "x.gguf"))
    with pytest.raises(DiffquantError, match="unknown dtype"):
        load_model("micro:diff", dtype="fp13")


def test_not_a_causal_lm(tmp_path):
    from transformers import ViTConfig, ViTModel

    ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                       image_size=32, patch_size=16)).save_pretrained(tmp_path)
    with pytest.raises(DiffquantError, match="not a causal language model"):
        load_model(str(tmp_path))


def test_every_load_skips_hub_kernels(tmp_path, micro_pair):
    """transformers kernelizes every `from_pretrained` model when `kernels` is installed (a dependency of 5.25): on
    CUDA it swaps RMSNorm/rotary/activation forwards for kernels fetched from the hub, and an offline H100 load
    failed (benchmarks/gpu_check.sh, 2026-12-05). Every diffquant load passes use_kernels=False: checked on the
    loaded models (kernelize runs on CPU too, it finds no CPU kernels) and by reading the sources."""
    import re
    from importlib.util import find_spec
    from pathlib import Path

    from diffquant.quant.checkpoints import backends

    folder = tmp_path / "m"
    micro_pair[0].save_pretrained(folder)
    if find_spec("kernels"):  # what the default does, so the checks below can fail
        assert AutoModelForCausalLM.from_pretrained(folder).use_kernels is True
    assert load_model(str(folder))[0].use_kernels is False
    assert backends.load_real("torchao-int8wo", folder).use_kernels is False
    root = Path(__file__).resolve().parents[1]
    callers = [p.relative_to(root).as_posix() for d in ("diffquant", "experiments", "benchmarks", "docs")
               for p in (root / d).glob("**/*.py") if ".peers" not in p.parts
               and re.search(r"(=|return)\s*AutoModelForCausalLM\.from_pretrained\(", p.read_text())]
    # export_parity and llmcompressor_check load as a user of plain transformers would, in another environment
    assert sorted(callers) == ["benchmarks/export_parity.py", "benchmarks/llmcompressor_check.py",
                               "diffquant/pretrained.py"]


def test_a_zoo_model_carries_its_weight_caveat_into_reports(micro_pair):
    """SmolLM2-135M-Instruct's weights were Q4_1 before dequantization: load_model tags the model with the caveat
    every report states (describe(), quantize.json, a sweep's caveat lines, a profile's table5.md); a float model
    gets none."""
    from diffquant.models.describe import describe
    from diffquant.models.load import source_caveat

    text = source_caveat("smollm2-135m", micro_pair[0])
    assert "SmolLM2-135M-Instruct (Q4_1 → fp32)" in text and "4-bit grid (Q4_1, groups of 32)" in text
    assert source_caveat("micro:baseline", micro_pair[0]) is None
    assert "caveat" not in describe(micro_pair[0])


def test_a_saved_design_checkpoint_loads_as_a_model(tmp_path):
    """A design registered with the Auto classes (diff-gain here) loads through load_model, as --model DIR (it was
    refused as "not a causal language model": the check read transformers' own names only)."""
    from diffquant.data.tokens import byte_tokenizer
    from diffquant.models.presets import build

    build(PRESETS["micro"], "diff-gain").save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    model, tok = load_model(str(tmp_path))
    assert type(model).__name__ == "DiffGainForCausalLM" and tok is not None


def test_the_zoo_fetch_reports_progress_where_stderr_is_no_file(monkeypatch):
    """pip's download bar goes to our stderr; in a notebook or under pytest's capture sys.stderr has no file
    descriptor (`subprocess.run(stdout=sys.stderr)` raised "UnsupportedOperation: fileno" in `demo --quick`), so the
    bar goes to descriptor 2, which a child process can write to."""
    import io
    import subprocess
    import sys

    from diffquant.models.zoo import progress_stream

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    stream = progress_stream()
    assert stream == 2
    assert subprocess.run([sys.executable, "-c", "print('bar')"], stdout=stream).returncode == 0
    monkeypatch.setattr(sys, "stderr", sys.__stderr__)
    assert progress_stream() is sys.__stderr__
