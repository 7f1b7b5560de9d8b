"""Mutation testing of the Triton kernels (issue 50: "the Triton kernels join the same check once they exist").

mutmut leaves decorated functions alone, and a `@triton.jit` body is where a kernel's arithmetic is, so the kernels
get their own small mutator, reported beside mutmut's modules by `python -m benchmarks.mutations`. Inside each jit
function of a module, one change at a time, on expressions that fit on one line:

- an arithmetic or bitwise operator swapped (+ −, * /, // *, % //, & |, << >>), a comparison moved by one (< <=,
  > >=, == !=), `and`/`or` swapped, a unary minus or `~`/`not` dropped;
- a number moved by one (n → n + 1);
- tl.maximum ↔ tl.minimum, tl.max ↔ tl.min, tl.atomic_max ↔ tl.atomic_min, and tl.where's two branches swapped.

Each mutant's file is written into a copy of the tree (one per job under .mutations/) and the module's kernel tests
run in Triton's interpreter (TRITON_INTERPRET=1), stopping at the first failure: a failing or crashing run kills
the mutant, one past three times the unmutated run's time is a timeout (killed), a passing one survives. Verdicts
are kept in benchmarks/mutation_verdicts/kernels_<module>.json with each function's source hash: a rerun keeps the
kills of unchanged functions and tries the rest again. Equivalent survivors are argued in the same file as mutmut's
(`--equivalent NAME REASON`).
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutations"
VERDICTS = ROOT / "benchmarks" / "mutation_verdicts"
COPIED = ("diffquant", "tests", "pyproject.toml", "diffquant_cli.py")

# module -> the pytest arguments of its kernel tests (Triton's interpreter: about a minute for all of them)
KERNELS = {
    "diffquant/kernels/site.py": ("tests/test_kernels.py", "-k", "site_kernel or contract"),
    "diffquant/kernels/flash.py": ("tests/test_kernels.py", "-k", "flash or logit"),
}

OPERATORS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
             ast.Mod: ast.FloorDiv, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.LShift: ast.RShift,
             ast.RShift: ast.LShift}
COMPARISONS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
               ast.NotEq: ast.Eq}
CALLS = {"maximum": "minimum", "minimum": "maximum", "max": "min", "min": "max", "atomic_max": "atomic_min",
         "atomic_min": "atomic_max"}


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any(ast.unparse(d).endswith("jit") for d in fn.decorator_list)


def _variants(node: ast.AST) -> list[ast.AST]:
    """The one-change variants of a node itself (its children are mutated as nodes of their own)."""
    out = []
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        out.append(ast.BinOp(node.left, OPERATORS[type(node.op)](), node.right))
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in COMPARISONS:
        out.append(ast.Compare(node.left, [COMPARISONS[type(node.ops[0])]()], node.comparators))
    elif isinstance(node, ast.BoolOp):
        out.append(ast.BoolOp(ast.Or() if isinstance(node.op, ast.And) else ast.And(), node.values))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Invert, ast.Not)):
        out.append(node.operand)
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        out.append(ast.Constant(node.value + 1))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == "tl":
        if node.func.attr in CALLS:
            swapped = copy.deepcopy(node)
            swapped.func.attr = CALLS[node.func.attr]
            out.append(swapped)
        if node.func.attr == "where" and len(node.args) == 3:
            out.append(ast.Call(node.func, [node.args[0], node.args[2], node.args[1]], node.keywords))
    return out


def mutants(module: str, source: str | None = None) -> list[dict]:
    """Every mutant of the module's jit functions: {"name", "function", "line", "old", "new"} (one source line)."""
    source = (ROOT / module).read_text() if source is None else source
    lines = source.splitlines(keepends=True)
    prefix = module.removesuffix(".py").replace("/", ".")
    out = []
    for fn in ast.parse(source).body:
        if not (isinstance(fn, ast.FunctionDef) and _is_jit(fn)):
            continue
        body = fn.body[1:] if ast.get_docstring(fn) else fn.body
        count = 0
        for stmt in body:
            for node in ast.walk(stmt):
                if getattr(node, "lineno", None) is None or node.lineno != node.end_lineno:
                    continue
                line = lines[node.lineno - 1]
                for variant in _variants(node):
                    new = line[:node.col_offset] + _text(variant) + line[node.end_col_offset:]
                    if new == line:
                        continue
                    count += 1
                    out.append({"name": f"{prefix}.{fn.name}__kmut_{count}", "function": fn.name,
                                "line": node.lineno, "old": line, "new": new})
    return out


def _text(node: ast.AST) -> str:
    text = ast.unparse(node)
    return f"({text})" if isinstance(node, (ast.BinOp, ast.BoolOp, ast.Compare, ast.UnaryOp)) else text


def function_hashes(module: str, source: str | None = None) -> dict[str, str]:
    source = (ROOT / module).read_text() if source is None else source
    return {fn.name: hashlib.sha256(ast.get_source_segment(source, fn).encode()).hexdigest()[:16]
            for fn in ast.parse(source).body if isinstance(fn, ast.FunctionDef) and _is_jit(fn)}


def diff(m: dict) -> str:
    return f"-{m['old'].rstrip()}\n+{m['new'].rstrip()}"


def verdict_path(module: str) -> Path:
    return VERDICTS / ("kernels_" + module.replace("/", "_").removesuffix(".py") + ".json")


def kept(module: str) -> dict:
    path = verdict_path(module)
    return json.loads(path.read_text()) if path.exists() else {}


def _save(module: str, verdicts: dict, hashes: dict) -> None:
    from diffquant.paths import atomic_write_text

    doc = {"tests": list(KERNELS[module]), "hash_by_function_name": hashes, "verdicts": dict(sorted(verdicts.items()))}
    atomic_write_text(verdict_path(module), json.dumps(doc, indent=0, ensure_ascii=False) + "\n")


def current(module: str) -> tuple[list[dict], dict[str, dict]]:
    """(The module's mutants now, the kept verdicts still valid for them: same function hash, same diff, same tests.)"""
    ms = mutants(module)
    hashes = function_hashes(module)
    before = kept(module)
    if before.get("tests") != list(KERNELS[module]):
        return ms, {}
    then = before.get("hash_by_function_name", {})
    valid = {}
    for m in ms:
        v = before.get("verdicts", {}).get(m["name"])
        if v and then.get(m["function"]) == hashes[m["function"]] and v["diff"] == diff(m):
            valid[m["name"]] = v
    return ms, valid


def _workspace(module: str, job: int) -> Path:
    ws = WORK / f"kernels_{Path(module).stem}_{job}"
    for name in COPIED:
        src, dest = ROOT / name, ws / name
        if src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
    return ws


def _run_tests(ws: Path, module: str, timeout: float | None) -> tuple[int, float]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ws),
           "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0", "-W", "ignore",
           "-m", "not slow and not cuda and not network", *KERNELS[module]]
    start = time.perf_counter()
    try:
        rc = subprocess.run(cmd, cwd=ws, env=env, capture_output=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = None
    return rc, time.perf_counter() - start


def run(module: str, jobs: int) -> dict[str, dict]:
    """Run the module's mutants that have no valid kill yet; verdicts saved after each one (a stop loses nothing)."""
    from benchmarks.mutations import _equivalents

    ms, valid = current(module)
    hashes = function_hashes(module)
    argued = _equivalents()
    verdicts = dict(valid)
    pending = [m for m in ms if valid.get(m["name"], {}).get("status") not in ("killed", "timeout")
               and argued.get(m["name"], {}).get("diff") != diff(m)]  # an argument for another diff is stale
    print(f"{module}: {len(ms)} kernel mutants, {len(pending)} to run", flush=True)
    spaces = [_workspace(module, j) for j in range(max(1, jobs))]
    probe = subprocess.run([sys.executable, "-c", "import diffquant.kernels as k; print(k.__file__)"], cwd=spaces[0],
                           env={**os.environ, "PYTHONPATH": str(spaces[0])}, capture_output=True, text=True)
    if not probe.stdout.strip().startswith(str(spaces[0])):
        raise SystemExit(f"the workspace's diffquant is not the one imported ({probe.stdout.strip()})")
    rc, seconds = _run_tests(spaces[0], module, None)
    if rc != 0:
        raise SystemExit(f"{module}: its kernel tests fail without a mutant (exit {rc})")
    limit = 3 * seconds + 30
    print(f"{module}: unmutated tests pass in {seconds:.0f} s; limit {limit:.0f} s a mutant", flush=True)
    free, lock = list(spaces), threading.Lock()

    def one(m: dict) -> None:
        ws = free.pop()
        target = ws / module
        original = target.read_text()
        lines = original.splitlines(keepends=True)
        lines[m["line"] - 1] = m["new"]
        target.write_text("".join(lines))
        try:
            rc, took = _run_tests(ws, module, limit)
        finally:
            target.write_text(original)
            free.append(ws)
        status = "timeout" if rc is None else "survived" if rc == 0 else "no tests" if rc == 5 else "killed"
        with lock:
            verdicts[m["name"]] = {"status": status, "diff": diff(m), "seconds": round(took, 1)}
            _save(module, verdicts, hashes)
        print(f"{m['name']}: {status} ({took:.0f} s)", flush=True)

    with ThreadPoolExecutor(max_workers=len(spaces)) as pool:
        list(pool.map(one, pending))
    _save(module, verdicts, hashes)
    return verdicts


def counts(module: str, equivalents: dict, notes: dict) -> tuple[dict, dict]:
    """(The report's row for the module, its survivors {name: entry}) from the kept verdicts, as `mutations.report`
    gives mutmut's modules."""
    ms, valid = current(module)
    row = {"mutants": len(ms), "killed": 0, "timeout": 0, "survived": 0, "equivalent": 0, "no tests": 0,
           "not run": 0, "other": 0}
    survivors = {}
    for m in ms:
        v = valid.get(m["name"])
        argued = equivalents.get(m["name"])
        if argued and argued["diff"] == diff(m) and (v is None or v["status"] not in ("killed", "timeout")):
            row["equivalent"] += 1
            continue
        status = v["status"] if v else "not run"
        row[status] += 1
        if status in ("survived", "no tests"):
            note = notes.get(m["name"], {})
            survivors[m["name"]] = {"module": module, "status": status, "diff": diff(m), "stale argument": bool(argued),
                                    "why": note.get("reason") if note.get("diff") == diff(m) else None}
    tried = row["mutants"] - row["equivalent"] - row["not run"]
    row["score"] = round((row["killed"] + row["timeout"]) / tried, 4) if tried else None
    return {"run": bool(valid), **row}, survivors


def diff_of(name: str) -> str | None:
    """The diff of a kernel mutant by name (for `--equivalent` and `--note`), or None when no kernel module has it."""
    for module in KERNELS:
        for m in mutants(module):
            if m["name"] == name:
                return diff(m)
    return None
