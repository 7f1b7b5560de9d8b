"""benchmarks/mutations.py's tables: every core module and test file it names exists, and every argued equivalent
mutant names a core module, the diff it was argued for and a reason (the run itself takes hours: not in CI)."""

import json
from pathlib import Path

from benchmarks import mutations

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
    modules = {m.removesuffix(".py").replace("/", ".") for m in mutations.CORE}
    for name, argued in json.loads(mutations.EQUIVALENTS.read_text()).items():
        assert name.rsplit(".", 1)[0] in modules, name
        assert argued["diff"].strip() and len(argued["reason"]) > 20, name
