"""The wheel carries every package: a folder with an ``__init__.py`` missing from pyproject's list is left out of it.

Editable installs find every subpackage anyway, so nothing else in the suite notices; the
container image installs a built wheel, where a missing `datacache.daemon` means no daemon.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_in_the_wheel() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    folders = {name: Path(path) for name, path in config["package-dir"].items()}
    found: set[str] = set()
    for name, folder in folders.items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder)
            parts = [name, *relative.parts] if relative.parts else [name]
            package = ".".join(parts)
            # A subfolder mapped elsewhere (datacache/tiers is tiers/) is that mapping's.
            if not any(package != n and package.startswith(n + ".") and n != name for n in folders):
                found.add(package)
    assert found - listed == set(), f"packages missing from pyproject.toml's list: {sorted(found - listed)}"
