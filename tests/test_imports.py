"""The package's layers import downward only: no import cycle (module-level or inside functions), and no library
module builds an argparse parser (command-line glue lives in diffquant/cli.py and diffquant/commands/)."""

import ast
import importlib
from pathlib import Path

import pytest

PKG = Path(__file__).parent.parent / "diffquant"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its text (`from a.b import c` counts a.b.c when c is a
    module, else a.b)."""
    modules = _modules()

    def resolve(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {m: set() for m in modules}
    for m, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("diffquant"):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("diffquant")]
            graph[m].update(t for t in map(resolve, names) if t and t != m)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_hand_made_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_argparse_outside_the_command_line_modules():
    allowed = {"diffquant.cli"} | {m for m in _modules() if m.startswith("diffquant.commands")}
    offenders = [m for m, path in _modules().items() if m not in allowed and "argparse" in path.read_text()]
    assert offenders == []


@pytest.mark.parametrize("module", sorted(_modules()))
def test_every_module_imports(module):
    importlib.import_module(module)


EXPERIMENTS = PKG.parent / "experiments"


def internal_imports(folder: Path) -> list[str]:
    """`file:line module` for each import in folder/*.py (module-level or inside functions) that reaches into
    diffquant past its two faces: `diffquant` (the API; `from diffquant import NAME` of its __all__) and
    `diffquant.lab` (the experiments' sub-API)."""
    import diffquant

    faces = {"diffquant", "diffquant.lab"}
    found = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "diffquant":
                names = [f"diffquant.{a.name}" for a in node.names if a.name not in diffquant.__all__]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.name}:{node.lineno} {n}" for n in names
                      if (n == "diffquant" or n.startswith("diffquant.")) and n not in faces]
    return found


def test_the_import_finder_finds_internal_imports_anywhere(tmp_path):
    (tmp_path / "x.py").write_text("import diffquant as dq\nfrom diffquant import lab, load\nfrom diffquant.lab import "
                                   "markdown\n\n\ndef f():\n    from diffquant.quant.numerics.scheme import get_scheme\n"
                                   "    import diffquant.sweeps\n    from diffquant import api\n")
    assert internal_imports(tmp_path) == ["x.py:7 diffquant.quant.numerics.scheme", "x.py:8 diffquant.sweeps",
                                          "x.py:9 diffquant.api"]


def test_experiments_import_only_the_api_and_lab():
    """An internal module can move without breaking an experiment: experiments/ reaches diffquant through `dq` and
    diffquant/lab.py only, and lab.py is the one file that says where each internal name lives."""
    assert internal_imports(EXPERIMENTS) == []


def test_every_lab_name_resolves_and_is_public():
    from diffquant import lab

    public = sorted(n for n in vars(lab) if not n.startswith("_") and n != "annotations")
    assert sorted(lab.__all__) == public  # every re-export is listed, and nothing listed is missing
    assert len(set(lab.__all__)) == len(lab.__all__)
    for name in lab.__all__:
        assert getattr(lab, name) is not None, name
        assert (getattr(getattr(lab, name), "__module__", None) or "diffquant").startswith("diffquant"), name
