"""Mutation testing of the numeric core: does the suite fail when a formula is changed? (issue 50)

    python -m benchmarks.mutations --module diffquant/stats/topk.py     # one module (resumes where it stopped)
    python -m benchmarks.mutations --module stats --jobs 2              # every module whose path contains "stats"
    python -m benchmarks.mutations                                      # the whole core (hours on two cores)
    python -m benchmarks.mutations --report                             # only rewrite docs/mutations.md and .json

mutmut 3 (https://github.com/boxed/mutmut) makes the mutants: an operator, comparison, number, string, keyword
or call argument changed, one at a time, inside a function (module-level constants and decorated functions other
than static and class methods are not mutated: the constants a statistic reads, such as the quantile names, have
their own tests). mutmut rather than cosmic-ray because it forks each mutant's test run from a process that has
imported torch and transformers and collected the tests (about 5 s a process here, which cosmic-ray pays per
mutant), runs only the tests that reach the mutated function, and names each mutant by its function and number
(`diffquant.stats.topk.xǁTopKǁ_merge_raw__mutmut_3`), invalidating a verdict when that function's text changes.

Each module runs in its own folder under .mutations/ (a copy of the tree that tests need, and mutmut's
`mutants/` with its verdicts), against its own fast test files (`CORE`, the one table to change when a module
moves). The verdicts are also kept in the repository (benchmarks/mutation_verdicts/, written as mutmut records
them), so a fresh checkout resumes where the last run stopped: a rerun keeps the verdicts of killed mutants whose
function is unchanged (mutmut's hash of the function) and runs the rest again (survivors too, so new tests are
tried on them, and timeouts, which a loaded machine can give a survivor); the report counts a verdict whose function has changed since as not run. Survivors that no test
can kill, because they compute the same
numbers, are argued in benchmarks/mutations_equivalent.json (`--equivalent NAME REASON`), keyed by mutant name
with the diff they were argued for (a changed diff marks the argument stale); they are not rerun. The report:
killed, survived, equivalent and the score (killed / (mutants − equivalent − not run)) per module, each
survivor's diff, each equivalent's reason. Not run in CI: it takes hours.

The Triton kernels (diffquant/kernels/site.py, flash.py) are in the same command and report, by
benchmarks/kernel_mutations.py: mutmut leaves `@triton.jit` functions alone, so their bodies get a small mutator of
their own, run against the kernel tests in Triton's interpreter (`--module kernels` for both).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / ".mutations"
EQUIVALENTS = ROOT / "benchmarks" / "mutations_equivalent.json"
NOTES = ROOT / "benchmarks" / "mutation_survivor_notes.json"  # why a survivor cannot be killed here (still a survivor)
REPORT = ROOT / "docs" / "mutations"  # .md and .json
VERDICTS = ROOT / "benchmarks" / "mutation_verdicts"  # per module: exit codes, function hashes, survivors' diffs
COPIED = ("diffquant", "tests", "experiments", "benchmarks", "docs", "diffquant_cli.py", "README.md")

# module -> its fast test files (or single tests). Of these, the tests that reach the mutated function run.
CORE = {
    "diffquant/stats/moments.py": ("tests/test_stats.py", "tests/test_hot_path.py", "tests/test_placement.py",
                                   "tests/test_site_stats.py"),
    "diffquant/stats/histogram.py": ("tests/test_stats.py", "tests/test_hot_path.py", "tests/test_placement.py",
                                     "tests/test_site_stats.py"),
    "diffquant/stats/topk.py": ("tests/test_stats.py", "tests/test_hot_path.py", "tests/test_placement.py",
                                "tests/test_site_stats.py"),
    "diffquant/stats/site_stats.py": ("tests/test_site_stats.py", "tests/test_stats.py", "tests/test_hot_path.py",
                                      "tests/test_kernels.py", "tests/test_placement.py",
                                      "tests/test_profile.py::test_the_profiler_counts_llm_int8_outliers_at_six"),
    "diffquant/stats/sinks.py": ("tests/test_sinks.py", "tests/test_sink_bookkeeping.py", "tests/test_diff_sinks.py",
                                 "tests/test_hot_path.py", "tests/test_site_stats.py"),
    "diffquant/stats/distributed.py": ("tests/test_stats.py", "tests/test_stats.py::test_merge_across_two_gloo_ranks"),
    "diffquant/stats/outlier_regime.py": ("tests/test_regime.py", "tests/test_fair_rivals.py"),
    "diffquant/stats/intervals.py": ("tests/test_interval_edges.py", "tests/test_stats.py", "tests/test_binomial_stats.py",
                                     "tests/test_reporting.py",
                                     "tests/test_fair_rivals.py", "tests/test_wa_table.py"),
    "diffquant/stats/metric_sets.py": ("tests/test_metric_sets.py", "tests/test_metric_set_parts.py",
                                       "tests/test_placement.py"),
    "diffquant/quant/numerics/math.py": ("tests/test_quant.py", "tests/test_kv_cache.py", "tests/test_placement.py"),
    "diffquant/quant/numerics/fake.py": ("tests/test_fake_quant.py", "tests/test_quant.py", "tests/test_kv_cache.py",
                                         "tests/test_placement.py"),
    "diffquant/quant/numerics/formats.py": ("tests/test_formats.py", "tests/test_quant.py", "tests/test_full_grid.py"),
    "diffquant/quant/numerics/granularity.py": ("tests/test_granularity.py", "tests/test_quant.py",
                                                "tests/test_kv_cache.py"),
    "diffquant/quant/algorithms/gptq.py": ("tests/test_gptq.py",),
    "diffquant/quant/algorithms/awq.py": ("tests/test_awq.py",),
    "diffquant/quant/algorithms/mitigate.py": ("tests/test_mitigate.py", "tests/test_mitigate_parts.py",
                                               "tests/test_placement.py",
                                               "tests/test_mitigate.py::test_smoothquant_search_applies_the_alpha_of_"
                                               "least_calibration_loss"),
    "diffquant/taps/attention.py": ("tests/test_visible.py", "tests/test_attention_parts.py", "tests/test_placement.py",
                                    "tests/test_hot_path.py", "tests/test_taps.py", "tests/test_sinks.py"),
}
# taps/attention.py: only the functions that shape what the statistics see (masks, blocks, first-key masses)
FUNCTIONS = {"diffquant/taps/attention.py": ("xǁVisibleǁrows", "xǁVisibleǁdense", "xǁVisibleǁkey_end",
                                             "xǁVisibleǁkeys", "x_first_key_only", "x_first_key_masses",
                                             "x_first_key_taps", "x__block_of", "x__widen", "x_masked_scores",
                                             "x__differential_map")}
# Tests too slow to run once per mutant (seconds measured on two cores); the fast ones beside them cover the same code.
# A module whose CORE names one of them explicitly runs it (the two-rank test is the only one to reach the process
# group calls of stats/distributed.py).
SLOW = ("tests/test_hot_path.py::test_blocks_cut_at_their_last_key_equal_uncut_blocks",  # 64 s
        "tests/test_quant.py::test_dynamic_scales_do_not_depend_on_batch_size",  # 57 s
        "tests/test_gptq.py::test_quantize_cli_with_gptq_round_trip",  # 25 s
        "tests/test_stats.py::test_merge_across_two_gloo_ranks",  # 20 s, and spawns processes
        "tests/test_gptq.py::test_gptq_layer_zero_solves_its_own_inputs",  # 17 s
        "tests/test_awq.py::test_awq_scales_fold_exactly",  # 12 s
        "tests/test_quant.py::test_quantization_aware_training_lowers_loss",  # 11 s
        "tests/test_mitigate.py::test_smoothquant_search_applies_the_alpha_of_least_calibration_loss")  # 11 s
# Tests that reach a module's code only in processes they start (mutmut learns which tests reach a function from the
# calls it sees in its own process, so it never picks these): run for every survivor of the module, after mutmut, with
# the mutant switched on in every process (mutmut's MUTANT_UNDER_TEST, which started processes inherit)
IN_CHILD_PROCESSES = {"diffquant/stats/distributed.py": ("tests/test_stats.py::test_merge_across_two_gloo_ranks",)}
# Error messages are not numbers: lines raising them are not mutated (their wording has tests of its own)
NOT_MUTATED = (r"raise (DiffquantError|ValueError)\(",)
# exit codes of mutmut's forked test runs; a signal (abort, segfault) means the mutant crashed the tests: caught
STATUS = {1: "killed", 3: "killed", -6: "killed", -11: "killed",
          36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          0: "survived", 5: "no tests", 33: "no tests", None: "not run"}


def _toml_list(items) -> str:
    return "[" + ", ".join(json.dumps(str(i)) for i in items) + "]"


def workspace(module: str, refresh: bool = True) -> Path:
    """The module's folder: the files tests need, copied when changed (mtimes kept, which mutmut reads), and a
    pyproject.toml that tells mutmut what to mutate and which tests to choose from. `refresh=False` (the report)
    leaves mutmut's own copies under mutants/ alone: a run may be using them."""
    ws = WORK / module.replace("/", "_").removesuffix(".py")
    ws.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--", *COPIED],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout  # ignored files stay out
    for rel in filter(None, listed.split("\0")):
        f = ROOT / rel
        if f.is_file():
            dest = ws / rel
            if not dest.exists() or dest.read_bytes() != f.read_bytes():
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dest)
    stale = ws / "mutants" / "diffquant"  # mutmut copies the unmutated sources once: refresh them every run
    if refresh and stale.exists():
        for f in stale.rglob("*.py"):
            if f.relative_to(ws / "mutants").as_posix() != module:
                f.unlink()
    meta = ws / "mutants" / (module + ".meta")
    kept = _kept(module)
    if kept and not meta.exists():  # a fresh checkout: mutmut merges these, dropping changed functions' verdicts
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"exit_code_by_key": kept["exit_code_by_key"],
                                    "hash_by_function_name": kept["hash_by_function_name"],
                                    "durations_by_key": {}, "estimated_durations_by_key": {}}))
    pytest_ini = _pytest_options()
    (ws / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        'source_paths = ["diffquant"]\n'
        f"only_mutate = {_toml_list([module])}\n"
        f"also_copy = {_toml_list(name for name in COPIED[2:])}\n"
        f"do_not_mutate_patterns = {_toml_list(NOT_MUTATED)}\n"
        f"pytest_add_cli_args_test_selection = {_toml_list(CORE[module])}\n"
        "pytest_add_cli_args = " + _toml_list(["-p", "no:cacheprovider", "-p", "no:xdist", "-m",
                                               "not slow and not cuda and not network", "-W", "ignore"]
                                              + [a for t in SLOW if t not in CORE[module] for a in ("--deselect", t)]
                                              ) + "\n"
        'process_isolation = "forkserver"\n'
        "use_git_change_detection = false\n"
        "\n[tool.pytest.ini_options]\n"
        f"pythonpath = {_toml_list(pytest_ini['pythonpath'])}\n"
        f"markers = {_toml_list(pytest_ini['markers'])}\n")
    return ws


def _pytest_options() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def _meta(ws: Path, module: str) -> dict:
    path = ws / "mutants" / (module + ".meta")
    return json.loads(path.read_text()) if path.exists() else {}


def _kept_path(module: str) -> Path:
    return VERDICTS / (module.replace("/", "_").removesuffix(".py") + ".json")


def _kept(module: str) -> dict:
    path = _kept_path(module)
    return json.loads(path.read_text()) if path.exists() else {}


def _carry_killed(ws: Path, module: str, before: dict) -> None:
    """Put back the kills mutmut forgot. It clears every verdict when the tests it chooses from change, but a
    mutant some of the earlier tests killed is killed by any selection that still holds them: where the module's
    test files now include every earlier one and the mutant's function is unchanged, its earlier kill stands."""
    if "tests" not in before or not set(before["tests"]) <= set(CORE[module]):
        return
    path = ws / "mutants" / (module + ".meta")
    meta = json.loads(path.read_text())
    codes, hashes = meta["exit_code_by_key"], meta.get("hash_by_function_name", {})
    kept = fresh(before["exit_code_by_key"], before.get("hash_by_function_name", {}), hashes)
    carried = {n: c for n, c in kept.items() if codes.get(n) is None and STATUS.get(c) == "killed"}
    if carried:
        codes.update(carried)
        path.write_text(json.dumps(meta))


def _keep(ws: Path, module: str) -> None:
    """Copy the module's verdicts (and the diffs of its survivors, which need mutmut's generated file) into
    the repository."""
    meta = _meta(ws, module)
    if not meta:
        return
    codes = meta["exit_code_by_key"]
    alive = _alive(codes, _equivalents())
    diffs = _diffs(ws, module, alive) if (ws / "mutants" / module).exists() else _kept(module).get("diffs", {})
    kept = {"tests": list(CORE[module]), "exit_code_by_key": dict(sorted(codes.items())),
            "hash_by_function_name": dict(sorted(meta.get("hash_by_function_name", {}).items())), "diffs": diffs}
    _write(_kept_path(module), json.dumps(kept, indent=0, ensure_ascii=False) + "\n")


def _equivalents() -> dict:
    return json.loads(EQUIVALENTS.read_text()) if EQUIVALENTS.exists() else {}


def _alive(codes: dict[str, int | None], equivalents: dict) -> list[str]:
    """The mutants whose diff the report shows or checks: survivors, and argued equivalents (never rerun, so
    without a verdict of their own) that no test has killed."""
    return [n for n, c in codes.items() if STATUS.get(c) in ("survived", "no tests")
            or (n in equivalents and STATUS.get(c) not in ("killed", "timeout"))]


def fresh(codes: dict[str, int | None], then: dict[str, str], now: dict[str, str]) -> dict[str, int | None]:
    """The verdicts (mutant name: exit code) whose function has the same hash now as when they were given:
    a verdict on code that has changed since says nothing about the code as it is."""
    return {n: c for n, c in codes.items()
            if (f := n.rsplit(".", 1)[1].rsplit("__mutmut_", 1)[0]) in now and then.get(f) == now[f]}


def _names(ws: Path, module: str) -> tuple[list[str], dict[str, str]]:
    """Every mutant of the module (mutmut's own generator), restricted to `FUNCTIONS` where the table says, and
    the hash of each mutated function (mutmut's, to tell which verdicts a change of the code made stale)."""
    code = f"""
import json
from pathlib import Path
from mutmut.mutation.file_mutation import mutate_file_contents
m = mutate_file_contents({module!r}, Path({module!r}).read_text())
print(json.dumps([list(m.mutant_names), dict(m.hash_by_function_name)]))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ws, capture_output=True, text=True, check=True).stdout
    names, hashes = json.loads(out)
    prefix = module.removesuffix(".py").replace("/", ".") + "."
    keep = FUNCTIONS.get(module)
    return [prefix + n for n in names if keep is None or n.rsplit("__mutmut_", 1)[0] in keep], hashes


def to_run(names: list[str], done: dict[str, int | None], argued: dict) -> list[str]:
    """The mutants a run tries: all but the killed and the argued equivalents. Survivors run again (new tests may
    kill them), and timeouts too: on a loaded machine a survivor's tests can outlast mutmut's limit, and a mutant
    that really hangs times out again."""
    return [n for n in names if STATUS.get(done.get(n), "other") != "killed" and n not in argued]


def run_module(module: str, jobs: int) -> None:
    before = _kept(module)  # mutmut forgets every verdict when its test selection changes: see _carry_killed
    ws = workspace(module)
    names, hashes = _names(ws, module)
    meta = _meta(ws, module)  # mutmut drops a changed function's verdicts only once it runs: drop them here first
    done = fresh(meta.get("exit_code_by_key", {}), meta.get("hash_by_function_name", {}), hashes)
    argued = _equivalents()
    pending = to_run(names, done, argued)
    print(f"{module}: {len(names)} mutants, {len(pending)} to run", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": "", "PYTHONDONTWRITEBYTECODE": "1"}
    for i in range(0, len(pending), 400):  # explicitly named mutants always run: the pending ones, in chunks
        subprocess.run(["mutmut", "run", "--max-children", str(jobs), *pending[i:i + 400]], cwd=ws, env=env)
        _carry_killed(ws, module, before)
        _keep(ws, module)
    if not (ws / "mutants" / module).exists():
        return
    if module in IN_CHILD_PROCESSES:
        run_in_child_processes(ws, module, env)
        _keep(ws, module)
    done = _meta(ws, module).get("exit_code_by_key", {})
    claimed = [n for n in names if n in argued and STATUS.get(done.get(n), "other") != "killed"]
    diffs = _diffs(ws, module, claimed)
    stale = [n for n in claimed if diffs[n] != argued[n]["diff"]]  # argued for another diff: run it like any other
    if stale:
        subprocess.run(["mutmut", "run", "--max-children", str(jobs), *stale], cwd=ws, env=env)
        _carry_killed(ws, module, before)
        _keep(ws, module)


def run_in_child_processes(ws: Path, module: str, env: dict, timeout: float = 600) -> None:
    """The module's `IN_CHILD_PROCESSES` tests on each of its survivors, the mutant on in every process; a failing
    test kills it (exit code 1, as mutmut records a kill), a test past `timeout` seconds times it out (36)."""
    path = ws / "mutants" / (module + ".meta")
    meta = json.loads(path.read_text())
    codes = meta["exit_code_by_key"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", "-W", "ignore",
           *IN_CHILD_PROCESSES[module]]

    def run(mutant: str) -> int:
        try:
            return subprocess.run(cmd, cwd=ws / "mutants", env={**env, "MUTANT_UNDER_TEST": mutant},
                                  capture_output=True, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 36

    if (rc := run("none")) != 0:  # no mutant on: the tests must pass, or their failures say nothing
        print(f"{module}: its child-process tests fail without a mutant (exit {rc}): not run", flush=True)
        return
    for name in [n for n, c in codes.items() if STATUS.get(c) in ("survived", "no tests")]:
        rc = run(name)
        if rc in (1, 36):  # a failed test, or one past the limit; any other exit (a usage error) decides nothing
            codes[name] = rc
        print(f"{name}: {'killed' if rc == 1 else 'timeout' if rc == 36 else 'survived' if rc == 0 else f'exit {rc}'}"
              " by the tests in child processes", flush=True)
        path.write_text(json.dumps(meta))


def _diffs(ws: Path, module: str, names: list[str]) -> dict[str, str]:
    """The changed lines of each mutant (mutmut's own diff, in one process), without the file headers."""
    if not names:
        return {}
    code = f"""
import json, sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
print(json.dumps({{n: get_diff_for_mutant(n, path={module!r}) for n in json.loads(sys.stdin.read())}}))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ws, input=json.dumps(names), capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": ""}).stdout
    return {n: "\n".join(line for line in d.splitlines() if line.startswith(("+", "-"))
                         and not line.startswith(("+++", "---"))) for n, d in json.loads(out).items()}


def argue(pairs: list[list[str]], path: Path = EQUIVALENTS) -> None:
    """Add (mutant name, reason) pairs to EQUIVALENTS (or NOTES), each with the diff it is argued for."""
    equivalents = json.loads(path.read_text()) if path.exists() else {}
    from benchmarks import kernel_mutations

    for name, reason in pairs:
        module = next((m for m in CORE if name.startswith(m.removesuffix(".py").replace("/", ".") + ".")), None)
        if module is None and (diff := kernel_mutations.diff_of(name)) is not None:
            equivalents[name] = {"diff": diff, "reason": reason}
            continue
        if module is None:
            raise SystemExit(f"{name} is not a mutant of a core module")
        diff = _diffs(WORK / module.replace("/", "_").removesuffix(".py"), module, [name])[name]
        if not diff:
            raise SystemExit(f"{name}: mutmut shows no diff (run the module first)")
        equivalents[name] = {"diff": diff, "reason": reason}
    _write(path, json.dumps(dict(sorted(equivalents.items())), indent=1, ensure_ascii=False) + "\n")


def report() -> dict:
    """docs/mutations.md and .json from every module's verdicts and the argued equivalents."""
    equivalents = _equivalents()
    notes = json.loads(NOTES.read_text()) if NOTES.exists() else {}
    modules, survivors = {}, {}
    path = REPORT.with_suffix(".json")
    earlier = json.loads(path.read_text()) if path.exists() else {"modules": {}, "survivors": {}}
    for module in CORE:
        ws = WORK / module.replace("/", "_").removesuffix(".py")
        if not (ws / "mutants").exists() and not _kept(module):
            carried = earlier["modules"].get(module, {})
            if carried.get("run"):  # run before verdicts were kept: its counts stand until the next run
                modules[module] = {**carried, "carried": True}
                survivors.update({n: v for n, v in earlier["survivors"].items() if v["module"] == module})
            else:
                modules[module] = {"run": False}
            continue
        ws = workspace(module, refresh=False)  # restores the kept verdicts in a fresh checkout
        generated = (ws / "mutants" / module).exists()  # mutmut's mutated file: the diffs can be read from it
        names, hashes = _names(ws, module)
        meta = _meta(ws, module)
        done = fresh(meta.get("exit_code_by_key", {}), meta.get("hash_by_function_name", {}), hashes)
        if generated:
            _keep(ws, module)
        counts = {"mutants": len(names), "killed": 0, "timeout": 0, "survived": 0, "equivalent": 0, "no tests": 0,
                  "not run": 0, "other": 0}
        alive = _alive({n: done.get(n) for n in names}, equivalents)
        diffs = _diffs(ws, module, alive) if generated else _kept(module).get("diffs", {})
        for n in names:
            status = STATUS.get(done.get(n), "other")
            if n in alive:
                argued = equivalents.get(n)
                if argued and argued["diff"] == diffs.get(n):
                    status = "equivalent"
                elif status in ("survived", "no tests"):
                    note = notes.get(n, {})
                    survivors[n] = {"module": module, "status": status, "diff": diffs[n],
                                    "stale argument": bool(argued),
                                    "why": note.get("reason") if note.get("diff") == diffs[n] else None}
            counts[status] += 1
        tried = counts["mutants"] - counts["equivalent"] - counts["not run"]
        counts["score"] = round((counts["killed"] + counts["timeout"]) / tried, 4) if tried else None
        modules[module] = {"run": True, **counts}
    from benchmarks import kernel_mutations

    for module in kernel_mutations.KERNELS:
        modules[module], found = kernel_mutations.counts(module, equivalents, notes)
        if not modules[module]["run"]:
            modules[module] = {"run": False}
        survivors.update(found)
    doc = {"tool": "mutmut 3.8; the Triton kernels' jit functions: benchmarks/kernel_mutations.py",
           "modules": modules, "survivors": survivors,
           "equivalents": {k: v for k, v in equivalents.items()}}
    _write(REPORT.with_suffix(".json"), json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    _write(REPORT.with_suffix(".md"), _markdown(doc))
    return doc


_PLACEMENT = re.compile(r"device=[^,)]*,?\s*|\.to\([^()]*(\([^()]*\))?[^()]*\)")


def placement_only(diff: str) -> bool:
    """Whether a mutant changes only where a tensor is made or moved (a `device=` argument or a `.to(...)`): on a
    machine with one device it computes the same numbers, and only a second device (a GPU) can tell it apart."""
    old = [line[1:] for line in diff.splitlines() if line.startswith("-")]
    new = [line[1:] for line in diff.splitlines() if line.startswith("+")]
    strip = lambda lines: [re.sub(r"\s+", "", _PLACEMENT.sub("", line)) for line in lines]  # noqa: E731
    return bool(old) and len(old) == len(new) and strip(old) == strip(new)


def _markdown(doc: dict) -> str:
    lines = ["# Mutation testing of the numeric core", "",
             "Written by `python -m benchmarks.mutations` (see its docstring): each mutant is one small change of a "
             "function, run against the module's fast tests. Killed includes timeouts (a mutant that made a test "
             "hang) and crashes (one that aborted the test process); the score is killed / (mutants − equivalent − "
             "not run).", "",
             "| module | mutants | killed | survived | no tests | equivalent | not run | score |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for module, m in doc["modules"].items():
        if not m["run"]:
            lines.append(f"| {module} | | | | | | not run | |")
            continue
        score = "" if m["score"] is None else f"{100 * m['score']:.1f}%"
        mark = " †" if m.get("carried") else ""
        lines.append(f"| {module}{mark} | {m['mutants']} | {m['killed'] + m['timeout']} | {m['survived']} | "
                     f"{m['no tests']} | {m['equivalent']} | {m['not run']} | {score} |")
    if any(m.get("carried") for m in doc["modules"].values()):
        lines += ["", "† From an earlier run whose per-mutant verdicts were not kept (before "
                  "benchmarks/mutation_verdicts/): its counts stand until the module is run again."]
    lines += ["", "## Survivors", ""]
    if not doc["survivors"]:
        lines.append("None.")
    for name, s in doc["survivors"].items():
        stale = " (its equivalence argument no longer matches the diff)" if s["stale argument"] else ""
        where = (f" — {s['why']}" if s.get("why") else
                 " — changes only where a tensor is placed: the same numbers on one device, told apart only on a "
                 "machine with a second (a GPU)" if placement_only(s["diff"]) else "")
        lines += [f"- `{name}`: {s['status']}{stale}{where}", "", "  ```diff",
                  *("  " + d for d in s["diff"].splitlines()), "  ```"]
    lines += ["", "## Equivalent mutants", "", "Argued in benchmarks/mutations_equivalent.json: they compute the "
              "same numbers as the code, so no test can tell them apart.", ""]
    for name, e in doc["equivalents"].items():
        lines += [f"- `{name}`: {e['reason']}", "", "  ```diff", *("  " + d for d in e["diff"].splitlines()), "  ```"]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    from diffquant.paths import atomic_write_text

    atomic_write_text(path, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--module", action="append", help="a module path, or part of one (repeatable); default: all")
    p.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    p.add_argument("--report", action="store_true", help="only rewrite the report from the verdicts so far")
    p.add_argument("--equivalent", nargs=2, metavar=("MUTANT", "REASON"), action="append",
                   help="record a surviving mutant as equivalent, with its current diff and why (repeatable)")
    p.add_argument("--note", nargs=2, metavar=("MUTANT", "REASON"), action="append",
                   help="say why a survivor cannot be killed on this machine (it stays a survivor; repeatable)")
    args = p.parse_args(argv)
    if args.equivalent or args.note:
        argue(args.equivalent or [])
        argue(args.note or [], NOTES)
        return 0
    from benchmarks import kernel_mutations

    every = [*CORE, *kernel_mutations.KERNELS]
    chosen = [m for m in every if not args.module or any(part in m for part in args.module)]
    if not chosen:
        print(f"no module matches {args.module}; the core: {', '.join(every)}", file=sys.stderr)
        return 2
    if not args.report:
        for module in chosen:
            if module in kernel_mutations.KERNELS:
                kernel_mutations.run(module, args.jobs)
            else:
                run_module(module, args.jobs)
    doc = report()
    for module in chosen:
        m = doc["modules"][module]
        print(module, "not run" if not m["run"] else
              f"killed {m['killed'] + m['timeout']}, survived {m['survived']}, no tests {m['no tests']}, "
              f"equivalent {m['equivalent']}, not run {m['not run']}, score {m['score']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
