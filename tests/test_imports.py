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
