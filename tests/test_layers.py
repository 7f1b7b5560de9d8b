"""diffquant's import layers (docs/ARCHITECTURE.md draws them): every import, at module level or inside a function, points
to a lower layer, so no two folders import each other and nothing low reaches up. A unit is a top-level module or
folder of diffquant/, and each of quant/'s three subfolders (its root holds the recipe, the face the rest of the
package uses)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "diffquant"

LAYERS = [  # bottom first
    # plain helpers (dev: the tests' and benchmarks' tools)
    ("allocator", "compiled", "dev", "errors", "frozen", "paths", "pretrained", "stopwatch"),
    ("kernels",),  # Triton kernels and the torch/Triton switch
    ("taps",),  # sites, taps and the tapped attention
    ("calibration", "designs", "memory", "stats"),  # streaming statistics; the attention designs
    ("evaluate", "quant.numerics"),  # perplexity; formats, granularities, fake quantizers, schemes
    ("quant.algorithms",),  # GPTQ, AWQ, fixes (SmoothQuant, rotations, clipping), the KV cache, the step registry
    ("data", "quant.checkpoints"),  # corpora and tasks; compressed-tensors, real backends, saved folders
    ("env", "quant", "task_selection"),  # quant/'s face: Recipe, quantize_, recipe files
    ("lm_eval_adapter", "models"),  # loading every kind of model
    ("catalog", "report"),  # the registries users name things from; tables and figures
    ("profiler",),
    ("sweeps", "track"),
    ("training",),
    ("api", "commands", "runs"),  # the public API and the command handlers
    ("__init__",),  # import diffquant as dq
    ("cli",),  # the command line's parser and main
    ("__main__", "lab"),  # python -m diffquant; the experiments' documented sub-API (diffquant/lab.py)
]
SPLIT = ("quant",)


def unit(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    if parts[0] in SPLIT and len(parts) > 1 and (PACKAGE / parts[0] / parts[1]).is_dir():
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def imports(path: Path) -> set[str]:
    """Every diffquant module `path` imports, `from diffquant.x import y` naming module y where y is one."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("diffquant")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("diffquant"):
            base = PACKAGE.parent / node.module.replace(".", "/")
            for a in node.names:
                sub = (base / a.name).is_dir() or (base / f"{a.name}.py").is_file()
                out.add(f"{node.module}.{a.name}" if sub else node.module)
    return out


def test_every_import_points_down_a_layer():
    layer = {u: i for i, units in enumerate(LAYERS) for u in units}
    found, wrong = set(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        src = unit(module)
        found.add(src)
        for target in imports(path):
            dst = unit(target)
            if dst == src:
                continue
            assert src in layer and dst in layer, f"{module}: add {src if src not in layer else dst} to LAYERS"
            if layer[dst] >= layer[src]:
                wrong.append(f"{module} (layer {layer[src]}) imports {target} (layer {layer[dst]})")
    assert not wrong, "\n".join(wrong)
    assert found == set(layer), sorted(found ^ set(layer))  # the list names exactly the package's units


def test_the_check_sees_lazy_imports(tmp_path):
    """An import inside a function counts (most of diffquant's are, to keep `diffquant --help` fast)."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from diffquant.quant.recipe import Recipe\n    import diffquant.stats.moments\n"
                 "    from diffquant import kernels, __version__\n")
    assert imports(f) == {"diffquant.quant.recipe", "diffquant.stats.moments", "diffquant.kernels", "diffquant"}
    assert unit("diffquant.quant.numerics.scheme") == "quant.numerics" and unit("diffquant.quant.recipe") == "quant"


def test_the_architecture_page_draws_these_layers():
    """docs/ARCHITECTURE.md's layer block is this list, so the page cannot drift from the check."""
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    block = text.split("<!-- layers:begin -->")[1].split("<!-- layers:end -->")[0]
    drawn = [line.split(None, 1)[1].split(", ") for line in block.strip().strip("`").strip().splitlines()]
    assert drawn == [list(units) for units in LAYERS]
