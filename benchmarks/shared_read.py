"""The shared tier as a second source: a shard another node staged, read from there, against a plain read.

Run alone::

    python -m benchmarks.shared_read [--shards 8] [--size 64MB] [--rounds 3] [--results benchmarks/RESULTS.md]

The shards are staged onto a shared tier once (as another node of the cluster
would), the local tier stays empty, and then, alternating in each round over
the same files with the page cache hot for all of them:

- ``plain``: ``open(path, "rb").read()`` of each shared copy: the baseline;
- ``stager.read``: `Stager.read`, which finds the shard on the shared tier (a
  trusted writer, its version) and returns its bytes checked against its checksum;
- ``loader``: what the loader does with a shared location (`Stager.locate`, map
  the file, hash it before a sample is served): the reader's path, and the one
  the target (>= 0.8x the plain read) is for.

Both datacache reads verify every byte; the plain read verifies nothing. The
figures are MB/s (10^6 bytes) over all shards of a round, median of the rounds.
The table goes into RESULTS.md between ``<!-- shared-read -->`` marks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from datacache.loaders.reading.units import map_file

from datacache.checksum import copy_problem
from datacache.config import load_settings
from datacache.sizes import parse_size
from datacache.staging import DatasetHandle, Stager

MARK = "<!-- shared-read -->"


def _make_origin(directory: Path, shards: int, size: int) -> None:
    directory.mkdir(parents=True)
    block = os.urandom(1 << 20)
    for index in range(shards):
        with (directory / f"shard-{index:04d}.tar").open("wb") as handle:
            for _ in range(size // len(block)):
                handle.write(block)
            handle.write(block[: size % len(block)])


def _plain(paths: list[Path]) -> int:
    total = 0
    for path in paths:
        with open(path, "rb") as handle:
            total += len(handle.read())
    return total


async def _stager_read(stager: Stager, handle: DatasetHandle, keys: list[str]) -> int:
    return sum([len(await stager.read(handle, key)) for key in keys])


async def _loader_read(stager: Stager, handle: DatasetHandle, keys: list[str]) -> int:
    total = 0
    for key in keys:
        location = await stager.locate(handle, key)
        if location.tier != "shared" or location.path is None or location.checksum is None:
            raise RuntimeError(f"shard {key!r} is not read from the shared tier here ({location.tier})")
        buffer = await asyncio.to_thread(map_file, location.path)
        problem = await asyncio.to_thread(copy_problem, buffer, location.shard.size, location.checksum)
        if problem:
            raise RuntimeError(f"shard {key!r}: the shared copy {problem}")
        total += len(buffer)
        if hasattr(buffer, "close"):
            buffer.close()
    return total


def _timed(run: Callable[[], int]) -> float:
    started = time.perf_counter()
    moved = run()
    return moved / (time.perf_counter() - started) / 1e6


def measure(shards: int, size: int, rounds: int) -> dict[str, list[float]]:
    """MB/s of each way, per round."""
    with tempfile.TemporaryDirectory(prefix="datacache-shared-read-") as scratch:
        root = Path(scratch)
        _make_origin(root / "origin", shards, size)
        env = {k: v for k, v in os.environ.items() if not k.startswith("DATACACHE_")}
        env["HOME"] = str(root / "home")
        settings = load_settings(
            env, overrides={"local_dir": str(root / "local"), "shared_dir": str(root / "shared"), "fsync": False}
        )
        figures: dict[str, list[float]] = {"plain": [], "stager.read": [], "loader": []}

        async def main() -> None:
            async with Stager(settings) as stager:
                handle = await stager.open(str(root / "origin"))
                keys = [shard.key for shard in handle.manifest.shards]
                await stager.warm(handle, tier="shared")
                assert stager.shared is not None
                paths = [stager.shared.path(handle.tier_key(key)) for key in keys]
                _plain(paths)  # the page cache holds every copy before any figure is taken
                for _ in range(rounds):
                    figures["plain"].append(await asyncio.to_thread(_timed, lambda: _plain(paths)))
                    started = time.perf_counter()
                    moved = await _stager_read(stager, handle, keys)
                    figures["stager.read"].append(moved / (time.perf_counter() - started) / 1e6)
                    started = time.perf_counter()
                    moved = await _loader_read(stager, handle, keys)
                    figures["loader"].append(moved / (time.perf_counter() - started) / 1e6)
                if stager.stats().bytes_from_origin != sum(s.size for s in handle.manifest.shards):
                    raise RuntimeError("the reads went to the origin, not the shared tier")

        asyncio.run(main())
        return figures


def table(figures: dict[str, list[float]], shards: int, size: int) -> str:
    plain = statistics.median(figures["plain"])
    lines = [
        f"{shards} shards of {size / 1e6:,.0f} MB on the shared tier, none local, page cache hot; "
        f"median of {len(figures['plain'])} rounds, MB/s (range); load: {_load()}",
        "",
        "| read | MB/s | / plain read | verified |",
        "|---|---|---|---|",
    ]
    for name, verified in (("plain", "no"), ("stager.read", "yes"), ("loader", "yes")):
        values = figures[name]
        median = statistics.median(values)
        lines.append(
            f"| {name} | {median:,.0f} ({min(values):,.0f}-{max(values):,.0f}) | {median / plain:.2f}x | {verified} |"
        )
    return "\n".join(lines)


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--size", default="64MB", help="bytes per shard (default 64MB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", type=Path, help="put the table into this RESULTS.md, between its marks")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    figures = measure(args.shards, size, args.rounds)
    shown = table(figures, args.shards, size)
    print(shown)
    if args.results:
        from benchmarks.eviction_sweep import write_table

        heading = "### The shared tier as a second source (`benchmarks/shared_read.py`)\n\n"
        write_table(f"{MARK}\n{heading}{shown}\n{MARK}\n", args.results, mark=MARK)
    # The target (issue 25, >= 0.8x) is the reader's path; `Stager.read` returns a fresh copy, shown beside it.
    return 0 if statistics.median(figures["loader"]) >= 0.8 * statistics.median(figures["plain"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
