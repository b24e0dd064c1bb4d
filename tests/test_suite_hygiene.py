"""Rules the test suite keeps so that it runs as one: checked on the files themselves."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).parent


def _module_level_conftest_imports(path: Path) -> list[int]:
    """Lines importing from ``conftest`` outside an ``if TYPE_CHECKING:`` block."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in tree.body if isinstance(node, ast.ImportFrom) and node.module == "conftest"]


def test_no_test_module_imports_conftest_at_run_time() -> None:
    # tests/faults/conftest.py is a second module named "conftest": in a whole-suite run,
    # whichever pytest loaded last answers `import conftest`, and a test module importing a
    # name from it fails to collect, stopping the whole run. Types go under TYPE_CHECKING.
    offenders = [
        f"{path.relative_to(TESTS)}:{line}"
        for path in sorted(TESTS.rglob("test_*.py"))
        for line in _module_level_conftest_imports(path)
    ]
    assert not offenders, "import from conftest under `if TYPE_CHECKING:` only: " + ", ".join(offenders)
