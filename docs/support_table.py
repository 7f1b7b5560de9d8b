"""Write docs/support.md, the architecture support table, from the architecture matrix.

    python -m docs.support_table            # rewrite docs/support.md
    python -m docs.support_table --check    # exit 1 if docs/support.md is not what this writes

Each family of `diffquant.models.matrix` is built tiny; the table says which site points it has, whether
attention logits can be tapped, which scheme presets apply (`attach_scheme`'s own check) and which real
backends load it and run a forward with finite logits here, and which presets export to compressed-tensors
(`quant/checkpoints/export.py`'s check; the export of each family is loaded bit-identically by transformers in
tests/test_export.py). The numbers behind every ✓ of the first columns are checked against independent
computations by tests/test_architectures.py.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

PAGE = Path(__file__).resolve().parent / "support.md"
BEGIN, END = "<!-- support-table:begin -->", "<!-- support-table:end -->"
INTRO = """# Supported architectures

Sites are defined by what the modules compute, so the same names work on every Hugging Face decoder family:
`attn_out` is the input of Llama's `o_proj`, OPT's `out_proj`, GPT-2's `c_proj` (a `Conv1D`, whose weight taps
see as [out, in] like every other) or GPT-NeoX's `dense`. Mixture-of-experts layers have `experts.down_in` (the
input of the routed experts' down projections, one row per token and routed slot, tapped inside diffquant's
experts function registered with transformers' `ExpertsInterface`) and, with a shared expert,
`shared_expert.down_in`; their fused 3-D expert weights are quantized per expert and output channel, and the
routers stay in float under wildcard weight patterns. Where a site does not exist, diffquant says why and lists
what the model has; a scheme that cannot apply is refused before anything runs (`diffquant sites --model M`).

The table is written by `python -m docs.support_table` from the architecture matrix (tiny random-weight models,
`diffquant/models/matrix.py`); every statistic and scheme in its first columns is checked against an
independent computation in `tests/test_architectures.py`. The real backends convert `nn.Linear` modules only: on
GPT-2 (`Conv1D`) torchao and quanto leave every layer weight in float, bitsandbytes leaves Falcon's
`FalconLinear` in float, and on MoE models no backend converts the fused 3-D experts, so a "real" low-bit MoE is
mostly float; diffquant's simulation quantizes all of them.

"""
BACKENDS = ("bnb-int8", "bnb-nf4", "torchao-int8", "torchao-intx4wo", "quanto-int8", "quanto-w4")


def _converted(float_model, real) -> float:
    """Fraction of the decoder layers' weight elements that the backend holds in low-bit form: a module of
    another class, or a weight that is no longer a plain floating-point tensor."""
    import torch

    from diffquant.taps import site_table

    done = total = 0
    for site in site_table(float_model):
        if not site.is_weight or site.layer is None:
            continue
        module = float_model.get_submodule(site.weight_module)
        n = getattr(module, site.param).numel()
        total += n
        try:
            other = real.get_submodule(site.weight_module)
        except AttributeError:
            continue
        w = getattr(other, site.param, None)
        plain = w is not None and type(w.data) is torch.Tensor and w.dtype.is_floating_point
        done += n if type(other) is not type(module) or not plain else 0
    return done / max(1, total)


def _backends(model, ids) -> str:
    """Backends that load the model and give finite logits, with the share of layer weights they convert."""
    import torch

    from diffquant.quant.checkpoints.backends import load_real

    ok, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for name in BACKENDS:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    q = load_real(name, tmp, ids)
                    with torch.no_grad():
                        finite = bool(torch.isfinite(q(ids).logits).all())
            except Exception:  # noqa: BLE001 - any failure is "does not run here"
                finite = False
            if finite:
                share = _converted(model, q)
                ok.append(name if share > 0.999 else f"{name} ({share:.0%} of layer weights)")
            else:
                failed.append(name)
    return ", ".join(ok) + (f"; fails: {', '.join(failed)}" if failed else "")


EXPORT_PRESETS = ("w8a16", "w4a16", "w4a16-g32", "w8a8", "w8a8-static", "w4a8", "fp8")


def _export(model) -> str:
    """The presets `diffquant quantize --export compressed-tensors` writes for this family, or why none."""
    from diffquant.errors import DiffquantError
    from diffquant.quant.checkpoints.export import check
    from diffquant.quant.numerics.scheme import SCHEME_PRESETS

    ok, why, notes = [], "", set()
    for name in EXPORT_PRESETS:
        try:
            notes.update(check(model, SCHEME_PRESETS[name]).notes)
            ok.append(name)
        except DiffquantError as e:
            why = why or str(e)
    if not ok:
        return "– (Conv1D weights)" if "Conv1D" in why else "– (fused MoE experts)" if "Experts" in why else "–"
    return ", ".join(ok) + (" (loads with dequantize=True)" if notes else "")


def rows(real: bool = True) -> list[list[str]]:
    import torch

    from diffquant.models.matrix import FAMILIES, VOCAB
    from diffquant.quant.numerics.scheme import SCHEME_PRESETS, applies
    from diffquant.taps import site_table

    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    out = []
    for family in FAMILIES.values():
        model = family.build()
        table = site_table(model)
        inside = ("k_cache", "v_cache", "attn_logits", "attn_probs", "attn_map", "lambda")  # where logits ✓
        points = [p for p in table.points() if p not in inside]
        logits = "✓" if "attn_logits" in table.points() else "– (own attention)"
        schemes = {name: applies(model, scheme) is None for name, scheme in SCHEME_PRESETS.items()}
        weight_only = [n for n in ("w8a16", "w4a16", "nf4", "fp4") if schemes[n]]
        row = [f"{family.name}", family.note, ", ".join(points), logits, "✓" if schemes["w8a8"] else "–",
               ", ".join(weight_only) or "–", _export(model)]
        if real:
            row.append(_backends(model, ids))
        out.append(row)
    return out


def table(real: bool = True) -> str:
    from diffquant.report.tables import markdown

    header = ["family", "what is special", "module sites", "logits", "w8a8", "weight-only", "compressed-tensors export"]
    if real:
        header.append("real backends that run here (CPU; share of layer weights converted where not all)")
    return markdown(header, rows(real)).strip()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--no-real", action="store_true", help="skip the real backends column")
    args = p.parse_args(argv)
    from diffquant.report.tables import update_between_markers

    if not PAGE.is_file():
        PAGE.write_text(INTRO + BEGIN + "\n" + END + "\n")
    return update_between_markers(PAGE, BEGIN, END, table(not args.no_real), args.check, "the support table")


if __name__ == "__main__":
    sys.exit(main())
