"""The modules and classes one sample's path crosses, from `CachedIterableDataset.__iter__` to a shard's bytes.

Not a timing: a count, for `loaders/README.md` (issue 37). It writes a small WebDataset (3 shards of 20
samples) into a temporary directory, reads two epochs with ``num_workers=0`` through local and shared
tiers (the first is cold: counts arrive while it is read; the second is indexed and reads local copies),
and records with ``sys.setprofile`` (every thread) each datacache function that runs while a sample is
asked for. "Crossed" is a module or class with at least one function that ran in that time; a class is
named by the qualified name of its methods. Run: ``.venv/bin/python -m benchmarks.sample_path``.
With ``DATACACHE_BENCH_BASELINE_PYTHON`` (another checkout's ``.venv/bin/python``) that checkout's
own count runs first, in the same run, and both are printed.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections import defaultdict
from pathlib import Path
from types import FrameType
from typing import Any

BASELINE = "DATACACHE_BENCH_BASELINE_PYTHON"


def _module_of(filename: str, root: Path) -> str | None:
    try:
        relative = Path(filename).resolve().relative_to(root)
    except ValueError:
        return None
    parts = list(relative.with_suffix("").parts)
    if not parts or parts[0] not in {"datacache", "tiers", "loaders"}:
        return None
    if parts[0] != "datacache":
        parts = ["datacache", *parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _write_shards(directory: Path, shards: int = 3, per_shard: int = 20) -> None:
    directory.mkdir(parents=True)
    for s in range(shards):
        with tarfile.open(directory / f"train-{s:04d}.tar", "w") as tar:
            for i in range(per_shard):
                key = f"s{s:02d}{i:04d}"
                for field, data in (("bin", bytes(100 + i)), ("cls", str(i % 10).encode())):
                    info = tarfile.TarInfo(f"{key}.{field}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


class _Recorder:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.on = False
        self.functions: dict[str, set[str]] = defaultdict(set)
        self.consumer: dict[str, set[str]] = defaultdict(set)
        self.main = threading.main_thread()
        self.stacks: dict[str, set[str]] = defaultdict(set)
        """On the consumer thread, the functions on the stack when a local copy is mapped (`map_file`)."""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not self.on:
            return
        module = _module_of(frame.f_code.co_filename, self.root)
        if module is not None:
            self.functions[module].add(frame.f_code.co_qualname)
            if threading.current_thread() is self.main:
                self.consumer[module].add(frame.f_code.co_qualname)
                if frame.f_code.co_name == "map_file":
                    self._stack(frame)

    def _stack(self, frame: FrameType | None) -> None:
        while frame is not None:
            module = _module_of(frame.f_code.co_filename, self.root)
            if module is not None:
                self.stacks[module].add(frame.f_code.co_qualname)
            frame = frame.f_back


def _classes(functions: dict[str, set[str]]) -> set[str]:
    found = set()
    for module, names in functions.items():
        for name in names:
            head = name.split(".<locals>.")[-1].rsplit(".", 1)
            if len(head) == 2 and head[0][:1].isupper():
                found.add(f"{module}.{head[0]}")
    return found


def measure() -> dict[str, Any]:
    from datacache.loaders import CachedIterableDataset

    from datacache.config import load_settings

    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        origin = Path(tmp) / "origin"
        _write_shards(origin)
        settings = load_settings(
            {"HOME": tmp, "XDG_CACHE_HOME": f"{tmp}/.cache", "XDG_CONFIG_HOME": f"{tmp}/.config"},
            overrides={"local_dir": str(Path(tmp) / "local"), "shared_dir": str(Path(tmp) / "shared")},
        )
        dataset = CachedIterableDataset(str(origin), config=settings, seed=1, shuffle_buffer=8)
        recorder = _Recorder(root)
        by_epoch = {}
        sys.setprofile(recorder)
        threading.setprofile(recorder)
        try:
            for epoch, name in enumerate(("cold epoch", "indexed epoch")):
                dataset.set_epoch(epoch)
                recorder.functions, recorder.consumer = defaultdict(set), defaultdict(set)
                recorder.stacks = defaultdict(set)
                recorder.on = True
                count = sum(1 for _ in dataset)
                recorder.on = False
                by_epoch[name] = {"samples": count, "functions": recorder.functions}
                by_epoch[f"{name}, consumer thread"] = {"samples": count, "functions": recorder.consumer}
                by_epoch[f"{name}, stack to map_file"] = {"samples": count, "functions": recorder.stacks}
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
        dataset.close()
    report: dict[str, Any] = {}
    for name, seen in by_epoch.items():
        functions = seen["functions"]
        report[name] = {
            "samples": seen["samples"],
            "modules": sorted(functions),
            "functions": {module: sorted(names) for module, names in sorted(functions.items())},
            "loaders_modules": sorted(m for m in functions if m.startswith("datacache.loaders")),
            "classes": sorted(_classes(functions)),
        }
    return report


def _baseline(python: str) -> dict[str, Any]:
    """The same count by another checkout (its own benchmark, in its own tree: ``<root>/.venv/bin/python``)."""
    root = Path(python).absolute().parents[2]
    env = {**os.environ, BASELINE: ""}
    command = [python, "-m", "benchmarks.sample_path", "--json"]
    ran = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=True)
    report: dict[str, Any] = json.loads(ran.stdout[ran.stdout.index("{") :])
    return report


def main() -> None:
    reports: dict[str, dict[str, Any]] = {}
    if os.environ.get(BASELINE):
        reports["baseline"] = _baseline(os.environ[BASELINE])
    reports["branch" if reports else ""] = measure()
    for label, report in reports.items():
        for name, seen in report.items():
            print(
                f"{label + ': ' if label else ''}{name} ({seen['samples']} samples): {len(seen['modules'])} modules "
                f"({len(seen['loaders_modules'])} in loaders), {len(seen['classes'])} classes"
            )
    if "--json" in sys.argv:
        print(json.dumps(reports.get("", reports), indent=1))


if __name__ == "__main__":
    main()
