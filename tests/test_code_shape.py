"""The size rules of STYLE.md, checked: functions under ~60 lines, modules under ~500.

ruff's complexity rules (pyproject) count branches and statements; these count lines, which
is what a reader pays for. Both allow-lists below hold today's offenders and only shrink: an
entry whose function or module is back under the limit fails the test until it is removed,
so the list never keeps a stale pass for new code.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("datacache", "tiers", "loaders")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500

# "path::Qualified.name": functions over MAX_FUNCTION_LINES today. Only shrinks.
LONG_FUNCTIONS = {
    "datacache/staging/transfer.py::Transfer.copy",
}

# Modules over MAX_MODULE_LINES today. Only shrinks.
LONG_MODULES: set[str] = set()


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualified name, lines from ``def`` to its last line) for every function, nested too."""
    found: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = prefix + node.name
            found.append((name, (node.end_lineno or node.lineno) - node.lineno + 1))
            found += _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            found += _functions(node, prefix + node.name + ".")
        else:
            found += _functions(node, prefix)
    return found


def long_functions() -> dict[str, int]:
    out = {}
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for name, lines in _functions(ast.parse(path.read_text(), filename=rel)):
            if lines > MAX_FUNCTION_LINES:
                out[f"{rel}::{name}"] = lines
    return out


def long_modules() -> dict[str, int]:
    out = {}
    for path in _sources():
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            out[path.relative_to(ROOT).as_posix()] = lines
    return out


def test_no_new_function_over_the_limit() -> None:
    new = {k: v for k, v in long_functions().items() if k not in LONG_FUNCTIONS}
    assert not new, f"functions over {MAX_FUNCTION_LINES} lines (split them): {new}"


def test_the_function_allow_list_only_shrinks() -> None:
    fixed = LONG_FUNCTIONS - long_functions().keys()
    assert not fixed, f"now under {MAX_FUNCTION_LINES} lines or gone, drop from LONG_FUNCTIONS: {sorted(fixed)}"


def test_no_new_module_over_the_limit() -> None:
    new = {k: v for k, v in long_modules().items() if k not in LONG_MODULES}
    assert not new, f"modules over {MAX_MODULE_LINES} lines (split them): {new}"


def test_the_module_allow_list_only_shrinks() -> None:
    fixed = LONG_MODULES - long_modules().keys()
    assert not fixed, f"now under {MAX_MODULE_LINES} lines or gone, drop from LONG_MODULES: {sorted(fixed)}"


def test_the_measure_counts_nested_and_async_functions() -> None:
    source = "class A:\n    async def f(self):\n        def g():\n" + "            x = 1\n" * 3 + "        return g\n"
    assert dict(_functions(ast.parse(source))) == {"A.f": 6, "A.f.g": 4}


def _benchmark_imports(folder: Path) -> dict[str, set[str]]:
    """Which benchmark modules each one imports (at the top or inside a function)."""
    modules = {path.stem: path for path in folder.glob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
                found.add((node.module or "").split(".")[1])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
        edges[name] = (found & modules.keys()) - {name}
    return edges


def import_cycle(edges: dict[str, set[str]]) -> list[str]:
    """One import cycle, as the path around it, or [] if there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return []


def test_benchmarks_have_no_import_cycle() -> None:
    cycle = import_cycle(_benchmark_imports(ROOT / "benchmarks"))
    assert not cycle, f"benchmarks/ imports in a circle: {' -> '.join(cycle)}; move what both need down"


def test_the_cycle_finder_finds_one() -> None:
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": set()}) == []


def test_every_package_of_the_tree_is_one_a_wheel_installs() -> None:
    """A package missing from pyproject's ``packages`` is absent from the wheel and the image, while an
    editable install (the tests' own) still finds it: `datacache.loaders.remote` was missing so."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    in_tree: set[str] = set()
    for name, folder in project["package-dir"].items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            parts = init.parent.relative_to(base).parts
            if "__pycache__" not in parts:
                in_tree.add(".".join((name, *parts)))
    assert in_tree - listed == set(), "add to [tool.setuptools] packages in pyproject.toml"
