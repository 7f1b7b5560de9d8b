"""The Llama layout the function-preserving fixes and the output-error searches rely on: which models have it,
their decoder layers, and the Linears that read each Linear-input site.

A pre-RMSNorm decoder with a SwiGLU MLP: the attention input (the input norm's output) is read by q/k/v (and
the gated designs' gate), the MLP input by gate/up, the down-projection input by down_proj, o_proj's input by
o_proj. Its own module so that the quantizers (`quant/numerics/scheme.py`) and the fixes (`quant/algorithms/mitigate.py`) share it
without importing each other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffquant.errors import DiffquantError

if TYPE_CHECKING:
    import torch

SUPPORTED = ("llama", "diffllama", "qwen2", "qwen3", "mistral", "smollm3", "diffquant_gated", "diffquant_clipsoftmax",
             "diffquant_headnorm", "diffquant_diff_gain", "diffquant_diff_nonorm", "diffquant_diff_frozen",
             "diffquant_sink")
ATTN_READERS = ("q_proj", "k_proj", "v_proj", "gate")  # Linears that read the attention input


def layers(model):
    """The decoder layers of a supported model, or a clear refusal."""
    from diffquant.taps.sites import _decoder_layers

    if getattr(model.config, "model_type", None) not in SUPPORTED:
        raise DiffquantError(f"smoothquant and rotate need a pre-RMSNorm SwiGLU decoder ({', '.join(SUPPORTED)}); "
                             f"{type(model).__name__} ({model.config.model_type}) is not one")
    return _decoder_layers(model)[1]


def readers(layer) -> tuple[list, list]:
    """(the Linears that read the attention input, those that read the MLP input) of one decoder layer."""
    import torch

    attn = [getattr(layer.self_attn, n) for n in ATTN_READERS if isinstance(getattr(layer.self_attn, n, None),
                                                                             torch.nn.Linear)]
    return attn, [layer.mlp.gate_proj, layer.mlp.up_proj]


def reader_gram(model, site: str) -> torch.Tensor:
    """G = Σ WᵀW over the float weights of the Linears that read a Linear-input site (attn_in: q/k/v and the
    gate; mlp_in: gate/up; down_in: down_proj; attn_out: o_proj), so ‖E·Wᵀ‖² summed over them is e·G·eᵀ."""
    from diffquant.taps import site_table

    info = site_table(model).sites.get(site)
    point = None if info is None or info.point is None else info.point.name
    if point not in ("attn_in", "mlp_in", "down_in", "attn_out"):
        raise DiffquantError(f"{site}: output-error ranges are for Linear inputs (attn_in, attn_out, mlp_in, down_in)")
    layer = layers(model)[info.layer]
    attn, mlp = readers(layer)
    read = {"attn_in": attn, "mlp_in": mlp, "down_in": [layer.mlp.down_proj], "attn_out": [layer.self_attn.o_proj]}
    gram = 0
    for r in read[point]:
        w = r.parametrizations["weight"].original if "weight" in getattr(r, "parametrizations", {}) else r.weight
        gram = gram + w.detach().double().T @ w.detach().double()
    return gram.float()
