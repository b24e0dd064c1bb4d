"""No import circle in the code, measured from its own imports (grimp, as import-linter reads them).

Two kinds of circle are looked for: modules that import one another (a run-time circle), and the
parts of one package that do (``config`` -> ``formats`` -> ``manifest`` -> ``config``, each a file
or a subpackage of ``datacache``), which make layers impossible to state. An import under
``TYPE_CHECKING`` names a type and loads nothing, so it is not an edge (as in pyproject's
import-linter contracts). grimp walks folders, so the tree is laid out as installed (tiers/ and
loaders/ under datacache/), as `make lint` does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

_FIND_CIRCLES = textwrap.dedent(
    """
    import json, sys
    import grimp

    graph = grimp.build_graph(sys.argv[1], exclude_type_checking_imports=True)
    modules = sorted(graph.modules)
    imports = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}

    def strongly_connected(nodes, edges):
        # Tarjan's algorithm, without recursion (a chain of imports can be long).
        index, low, stack, on_stack, found = {}, {}, [], set(), []
        for start in nodes:
            if start in index:
                continue
            work = [(start, iter(edges.get(start, ())))]
            index[start] = low[start] = len(index)
            stack.append(start)
            on_stack.add(start)
            while work:
                node, following = work[-1]
                for other in following:
                    if other not in index:
                        index[other] = low[other] = len(index)
                        stack.append(other)
                        on_stack.add(other)
                        work.append((other, iter(edges.get(other, ()))))
                        break
                    if other in on_stack:
                        low[node] = min(low[node], index[other])
                else:
                    work.pop()
                    if work:
                        low[work[-1][0]] = min(low[work[-1][0]], low[node])
                    if low[node] == index[node]:
                        part = []
                        while True:
                            other = stack.pop()
                            on_stack.discard(other)
                            part.append(other)
                            if other == node:
                                break
                        if len(part) > 1:
                            found.append(sorted(part))
        return found

    circles = []
    for part in strongly_connected(modules, imports):
        edges = [f"{m} -> {w}" for m in part for w in imports[m] if w in part]
        circles.append({"within": "modules", "members": part, "imports": edges})

    packages = [m for m in modules if any(other.startswith(m + ".") for other in modules)]
    for package in packages:
        depth = package.count(".") + 2

        def child(module, package=package, depth=depth):
            if not module.startswith(package + "."):
                return None
            return ".".join(module.split(".")[:depth])

        edges, example = {}, {}
        for module in modules:
            importer = child(module)
            if importer is None:
                continue
            for imported_module in imports[module]:
                imported = child(imported_module)
                if imported is not None and imported != importer:
                    edges.setdefault(importer, set()).add(imported)
                    example.setdefault((importer, imported), f"{module} -> {imported_module}")
        nodes = sorted({child(m) for m in modules if child(m) is not None})
        for part in strongly_connected(nodes, {k: sorted(v) for k, v in edges.items()}):
            shown = [example[(a, b)] for a in part for b in sorted(edges.get(a, ())) if b in part]
            circles.append({"within": package, "members": part, "imports": shown})
    print(json.dumps(circles))
    """
)


def _lay_out(target: Path) -> Path:
    """The tree as installed (tiers/ and loaders/ inside datacache/), as links, in ``target``."""
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "datacache", target / "datacache", copy_function=os.symlink, ignore=skip)
    for part in ("tiers", "loaders"):
        shutil.copytree(ROOT / part, target / "datacache" / part, copy_function=os.symlink, ignore=skip)
    return target


def import_circles(tree: Path, package: str) -> list[dict[str, Any]]:
    """Every circle of imports in ``package`` (found on ``tree``): modules, or parts of one package."""
    done = subprocess.run(
        [sys.executable, "-c", _FIND_CIRCLES, package],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    circles: list[dict[str, Any]] = json.loads(done.stdout)
    return circles


def _write(tree: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = tree / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_datacache_tiers_and_loaders_import_in_no_circle(tmp_path: Path) -> None:
    circles = import_circles(_lay_out(tmp_path), "datacache")
    assert not circles, "import circles (break each, e.g. with a leaf module both import):\n" + "\n".join(
        f"  in {c['within']}: {', '.join(c['imports'])}" for c in circles
    )


def test_a_circle_of_modules_or_of_a_packages_parts_is_found_and_a_type_checking_import_is_not(
    tmp_path: Path,
) -> None:
    _write(
        tmp_path,
        {
            "shape/__init__.py": "",
            # Two modules of one package import each other: a run-time circle.
            "shape/left.py": "import shape.right\n",
            "shape/right.py": "import shape.left\n",
            # Two subpackages whose files import each other's, no module in a circle of its own.
            "shape/upper/__init__.py": "",
            "shape/upper/one.py": "import shape.lower.two\n",
            "shape/upper/three.py": "",
            "shape/lower/__init__.py": "",
            "shape/lower/two.py": "",
            "shape/lower/four.py": "import shape.upper.three\n",
            # A type named back, under TYPE_CHECKING only: no circle.
            "shape/typed/__init__.py": "",
            "shape/typed/a.py": "import shape.typed.b\n",
            "shape/typed/b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import shape.typed.a\n"),
        },
    )
    circles = import_circles(tmp_path, "shape")
    found = {(c["within"], tuple(c["members"])) for c in circles}
    assert ("modules", ("shape.left", "shape.right")) in found
    assert ("shape", ("shape.left", "shape.right")) in found
    assert ("shape", ("shape.lower", "shape.upper")) in found
    assert not any("typed" in str(c["members"]) for c in circles), circles
    assert len(found) == 3, circles
