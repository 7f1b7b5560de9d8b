"""benchmarks/mutations.py's tables: every core module and test file it names exists, and every argued equivalent
mutant names a core module, the diff it was argued for and a reason (the run itself takes hours: not in CI)."""

import json
from pathlib import Path

from benchmarks import kernel_mutations, mutations

ROOT = Path(__file__).resolve().parent.parent


def test_the_module_table_names_files_that_exist():
    for module, tests in mutations.CORE.items():
        assert (ROOT / module).is_file(), module
        assert tests, module
        for test in tests:
            path, _, name = test.partition("::")
            assert (ROOT / path).is_file() and (not name or f"def {name}(" in (ROOT / path).read_text()), test
    assert set(mutations.FUNCTIONS) <= set(mutations.CORE)
    for test in mutations.SLOW:
        path, _, name = test.partition("::")
        assert f"def {name}(" in (ROOT / path).read_text(), test


def test_every_argued_equivalent_names_its_module_diff_and_reason():
    modules = {m.removesuffix(".py").replace("/", ".") for m in [*mutations.CORE, *kernel_mutations.KERNELS]}
    notes = json.loads(mutations.NOTES.read_text()) if mutations.NOTES.exists() else {}
    for name, argued in [*json.loads(mutations.EQUIVALENTS.read_text()).items(), *notes.items()]:
        assert name.rsplit(".", 1)[0] in modules, name
        assert argued["diff"].strip() and len(argued["reason"]) > 20, name


def test_a_kept_verdict_counts_only_while_its_function_is_unchanged():
    codes = {"diffquant.m.x_f__mutmut_1": 1, "diffquant.m.x_f__mutmut_2": 0,
             "diffquant.m.xǁCǁg__mutmut_1": 1, "diffquant.m.x_gone__mutmut_1": 1}
    then = {"x_f": "aa", "xǁCǁg": "bb", "x_gone": "cc"}
    now = {"x_f": "aa", "xǁCǁg": "b2"}  # g changed, gone was deleted
    assert mutations.fresh(codes, then, now) == {"diffquant.m.x_f__mutmut_1": 1, "diffquant.m.x_f__mutmut_2": 0}
    assert mutations.fresh(codes, {}, now) == {}  # verdicts without hashes say nothing


def test_kept_verdicts_name_core_mutants_and_carry_each_survivors_diff():
    for path in sorted(p for p in mutations.VERDICTS.glob("*.json") if not p.name.startswith("kernels_")):
        module = next(m for m in mutations.CORE if mutations._kept_path(m) == path)
        kept = json.loads(path.read_text())
        prefix = module.removesuffix(".py").replace("/", ".") + "."
        assert all(n.startswith(prefix) for n in kept["exit_code_by_key"]), path
        alive = {n for n, c in kept["exit_code_by_key"].items() if mutations.STATUS.get(c) in ("survived", "no tests")}
        assert alive <= set(kept["diffs"]), path


def test_kills_forgotten_by_mutmut_come_back_only_for_a_wider_selection_and_an_unchanged_function(tmp_path,
                                                                                                 monkeypatch):
    module = "diffquant/m.py"
    before = {"tests": ["tests/a.py"], "hash_by_function_name": {"x_f": "h1", "x_g": "old"},
              "exit_code_by_key": {"diffquant.m.x_f__mutmut_1": 1, "diffquant.m.x_f__mutmut_2": 0,
                                   "diffquant.m.x_g__mutmut_1": 1}}
    meta = tmp_path / "mutants" / (module + ".meta")
    meta.parent.mkdir(parents=True)
    cleared = {"exit_code_by_key": dict.fromkeys(before["exit_code_by_key"]),
               "hash_by_function_name": {"x_f": "h1", "x_g": "new"}}
    for tests, carried in ((("tests/a.py", "tests/b.py"), {"diffquant.m.x_f__mutmut_1": 1}), (("tests/b.py",), {})):
        monkeypatch.setitem(mutations.CORE, module, tests)
        meta.write_text(json.dumps(cleared))
        mutations._carry_killed(tmp_path, module, before)
        codes = json.loads(meta.read_text())["exit_code_by_key"]
        assert {n: c for n, c in codes.items() if c is not None} == carried, tests
    mutations._carry_killed(tmp_path, module, {k: v for k, v in before.items() if k != "tests"})  # unknown selection
    assert all(c is None for c in json.loads(meta.read_text())["exit_code_by_key"].values())


def test_a_run_tries_survivors_timeouts_and_new_mutants_but_not_kills_or_argued_equivalents():
    names = [f"diffquant.m.x_f__mutmut_{i}" for i in range(1, 8)]
    done = {names[0]: 1, names[1]: 0, names[2]: 36, names[3]: -11, names[4]: None, names[6]: 0}
    assert mutations.to_run(names, done, {names[6]: {}}) == [names[1], names[2], names[4], names[5]]


def test_a_survivor_that_only_moves_a_tensor_is_told_from_one_that_changes_a_number():
    moved = ["-    b = b.to(a.device)\n+    b = b.to(None)",
             "-        nonfinite = torch.zeros((), dtype=torch.int64, device=x.device)\n"
             "+        nonfinite = torch.zeros((), dtype=torch.int64, )",
             "-        best[1].to(best[0].device) if float(best[1][0]) > float(best[0][0]) else best[0])\n"
             "+        best[1].to(best[1].device) if float(best[1][0]) > float(best[0][0]) else best[0])"]
    changed = ["-    x = torch.zeros(3, device=d)\n+    x = torch.zeros(4, device=d)",
               "-        best[1].to(best[0].device) if float(best[1][0]) > float(best[0][0]) else best[0])\n"
               "+        best[1].to(best[0].device) if float(best[1][0]) >= float(best[0][0]) else best[0])",
               "-    return a + b\n+    return a - b", ""]
    assert all(mutations.placement_only(d) for d in moved)
    assert not any(mutations.placement_only(d) for d in changed)


def test_child_process_tests_kill_the_survivors_whose_mutant_fails_them_in_a_started_process(tmp_path, monkeypatch):
    """A test that starts a process which fails when mutant _1 is on: _1 (a survivor) is killed, _2 survives, a kill
    stays a kill; with a test that fails without any mutant, nothing is decided."""
    import os

    module = "diffquant/m.py"
    meta = tmp_path / "mutants" / (module + ".meta")
    meta.parent.mkdir(parents=True)
    (tmp_path / "mutants" / "tests").mkdir()
    child = ("import os, subprocess, sys\n\n\ndef test_child():\n"
             "    code = \"import os, sys; sys.exit(1 if os.environ['MUTANT_UNDER_TEST'].endswith('_1') else 0)\"\n"
             "    assert subprocess.run([sys.executable, '-c', code]).returncode == 0\n")
    (tmp_path / "mutants" / "tests" / "test_child.py").write_text(child)
    (tmp_path / "mutants" / "tests" / "test_broken.py").write_text("def test_broken():\n    assert False\n")
    codes = {"diffquant.m.x_f__mutmut_1": 0, "diffquant.m.x_f__mutmut_2": 0, "diffquant.m.x_f__mutmut_3": 1}
    env = {**os.environ, "PYTHONPATH": ""}
    for test, want in (("tests/test_broken.py", codes), ("tests/test_child.py", {**codes, "diffquant.m.x_f__mutmut_1": 1})):
        meta.write_text(json.dumps({"exit_code_by_key": codes}))
        monkeypatch.setitem(mutations.IN_CHILD_PROCESSES, module, (test,))
        mutations.run_in_child_processes(tmp_path, module, env, timeout=120)
        assert json.loads(meta.read_text())["exit_code_by_key"] == want, test


KERNEL = '''import triton
import triton.language as tl


@triton.jit
def k(a, b):
    """A docstring is not mutated."""
    c = tl.maximum(a + b, 1.0)
    return tl.where(c > 0, c, -c)


def plain(a):
    return a + 1
'''


def test_kernel_mutants_change_one_thing_in_a_jit_function_only():
    got = kernel_mutations.mutants("diffquant/kernels/x.py", KERNEL)
    assert all(m["function"] == "k" and m["name"].startswith("diffquant.kernels.x.k__kmut_") for m in got)
    assert {(m["line"], m["new"].strip()) for m in got} == {
        (8, "c = tl.minimum(a + b, 1.0)"), (8, "c = tl.maximum((a - b), 1.0)"), (8, "c = tl.maximum(a + b, 2.0)"),
        (9, "return tl.where(c > 0, -c, c)"), (9, "return tl.where((c >= 0), c, -c)"),
        (9, "return tl.where(c > 1, c, -c)"), (9, "return tl.where(c > 0, c, c)")}
    assert len({m["name"] for m in got}) == len(got) == 7
    for m in got:  # each is the source with one line changed, and still parses
        lines = KERNEL.splitlines(keepends=True)
        assert lines[m["line"] - 1] == m["old"]
        lines[m["line"] - 1] = m["new"]
        compile("".join(lines), "x.py", "exec")


def test_kernel_verdicts_count_while_their_function_and_diff_are_unchanged(tmp_path, monkeypatch):
    module = "diffquant/kernels/x.py"
    (tmp_path / "diffquant" / "kernels").mkdir(parents=True)
    (tmp_path / module).write_text(KERNEL)
    monkeypatch.setattr(kernel_mutations, "ROOT", tmp_path)
    monkeypatch.setattr(kernel_mutations, "VERDICTS", tmp_path / "verdicts")
    monkeypatch.setattr(kernel_mutations, "KERNELS", {module: ("tests/test_x.py",)})
    ms = kernel_mutations.mutants(module)
    statuses = ["killed", "survived", "timeout", "killed", "killed", "survived", "killed"]
    verdicts = {m["name"]: {"status": st, "diff": kernel_mutations.diff(m)} for m, st in zip(ms, statuses)}
    kernel_mutations._save(module, verdicts, kernel_mutations.function_hashes(module))
    equivalent = ms[5]["name"]
    row, survivors = kernel_mutations.counts(module, {equivalent: {"diff": kernel_mutations.diff(ms[5]),
                                                                   "reason": "r"}}, {})
    assert (row["killed"], row["timeout"], row["survived"], row["equivalent"], row["score"]) == (4, 1, 1, 1, round(5 / 6, 4))
    assert list(survivors) == [ms[1]["name"]] and survivors[ms[1]["name"]]["diff"].startswith("-")
    (tmp_path / module).write_text(KERNEL.replace("1.0)", "1.5)"))  # k changed: its verdicts say nothing now
    row, _ = kernel_mutations.counts(module, {}, {})
    assert row["run"] is False and row["not run"] == row["mutants"]
