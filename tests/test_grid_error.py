"""quant/grid_error.py: each Linear input's static per-tensor grid figures against a computation written here from
plain forward hooks on the Linears (absmax over the calibration draw, round half to even, clamp, the readers'
weights), on a Llama and a DiffLlama."""

import math

import pytest
import torch

from diffquant.models.presets import PRESETS, build
from diffquant.quant.grid_error import static_grid_errors

READERS = {"attn_in": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "attn_out": ("self_attn.o_proj",),
           "mlp_in": ("mlp.gate_proj", "mlp.up_proj"), "down_in": ("mlp.down_proj",)}


def _inputs(model, ids):
    """{(layer, kind): the input of the kind's first reader, [tokens, channels]} from plain pre-hooks."""
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        for kind, names in READERS.items():
            module = layer.get_submodule(names[0])
            hooks.append(module.register_forward_pre_hook(
                lambda m, a, key=(i, kind): seen.setdefault(key, []).append(a[0].detach().reshape(-1, a[0].shape[-1]))))
    with torch.no_grad():
        for batch in ids.split(3):
            model(batch)
    for h in hooks:
        h.remove()
    return {k: torch.cat(v) for k, v in seen.items()}


@pytest.mark.parametrize("arch", ["baseline", "diff"])
def test_static_grid_figures_equal_a_plain_computation(arch):
    model = build(PRESETS["micro"], arch)
    g = torch.Generator().manual_seed(7)
    calib, held = torch.randint(0, 512, (5, 24), generator=g), torch.randint(0, 512, (7, 24), generator=g)
    got = static_grid_errors(model, held, calib, bits=(8, 4), batch_size=3)
    cal_x, held_x = _inputs(model, calib), _inputs(model, held)
    for (layer, kind), x in held_x.items():
        site = got["sites"][f"layers.{layer}.{kind}"]
        readers = [model.model.layers[layer].get_submodule(n).weight.detach().double() for n in READERS[kind]]
        for bits in (8, 4):
            qmax = 2 ** (bits - 1) - 1
            scale = cal_x[(layer, kind)].abs().max() / qmax  # absmax over the calibration draw
            q = torch.clamp(torch.round(x / scale), -qmax, qmax)  # torch.round: half to even
            e = (x - q * scale).double()
            xd = x.double()
            want = {"zero_share": float((q == 0).double().mean()),
                    "snr_db": 10 * math.log10(float((xd ** 2).sum() / (e ** 2).sum())),
                    "output_error": float(sum(((e @ w.T) ** 2).sum() for w in readers)
                                          / sum(((xd @ w.T) ** 2).sum() for w in readers))}
            figures = site[f"a{bits}"]
            assert figures["values"] == x.numel()
            assert figures["scale"] == pytest.approx(float(scale), rel=1e-6)
            for key, value in want.items():
                assert figures[key] == pytest.approx(value, rel=1e-6), (layer, kind, bits, key)
    # pooled figures: the sums over layers, recomputed from the per-layer figures' definitions
    for bits in (8, 4):
        xs = [x for (layer, kind), x in held_x.items() if kind == "down_in"]
        scales = [cal_x[(layer, "down_in")].abs().max() / (2 ** (bits - 1) - 1) for layer in range(len(xs))]
        zeros = sum(int((torch.round(x / s) == 0).sum()) for x, s in zip(xs, scales))
        assert got["kinds"]["down_in"][f"a{bits}"]["pooled"]["zero_share"] == pytest.approx(
            zeros / sum(x.numel() for x in xs), rel=1e-9)
        worst = max(range(len(xs)), key=lambda i: got["sites"][f"layers.{i}.down_in"][f"a{bits}"]["output_error"])
        assert got["kinds"]["down_in"][f"a{bits}"]["worst_layer"]["layer"] == worst
