"""The reader's own shard first: how long a blocked reader waits behind a prefetch backlog (issue 25).

Run alone::

    python -m benchmarks.reader_first [--rounds 3] [--results benchmarks/RESULTS.md]

A file origin, the stager's bandwidth limit (the shares are then zero-sum, as
on a saturated link), ``concurrency`` workers and a backlog of prefetches. In
each round, alternating: ``alone``, the reader's ``ensure`` of one shard with
nothing else queued; ``behind``, the same with every worker moving a prefetch
and the rest of the dataset queued behind them. The figure is the reader's wait;
``behind / alone`` is 1.0x when the reader's shard takes the whole limit at
once, and about ``concurrency`` x 2 when it waits for a worker and then shares.
The table goes into RESULTS.md between ``<!-- reader-first -->`` marks.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from datacache.config import load_settings
from datacache.staging import Stager, StagingEvent

MARK = "<!-- reader-first -->"
SHARDS = 12
SHARD = 4 << 20
RATE = 40e6
CONCURRENCY = 4


async def _wait(settings_dir: Path, origin: Path, backlog: bool) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATACACHE_")}
    env["HOME"] = str(settings_dir / "home")
    settings = load_settings(env, overrides={"local_dir": str(settings_dir / "local"), "fsync": False})
    settings = replace(settings, part_size=1 << 20, concurrency=CONCURRENCY, bandwidth_limit=RATE)
    async with Stager(settings) as stager:
        handle = await stager.open(str(origin))
        keys = [shard.key for shard in handle.manifest.shards]
        if backlog:
            moving: set[str] = set()
            busy = asyncio.get_running_loop().create_future()

            def listen(event: StagingEvent) -> None:
                if event.kind == "bytes":
                    moving.add(event.key)
                    if len(moving) == CONCURRENCY and not busy.done():
                        busy.set_result(None)

            stager.add_listener(listen)
            await stager.prefetch(handle, keys[:-1])
            await busy
        started = time.perf_counter()
        await stager.ensure(handle, keys[-1])
        return time.perf_counter() - started


def measure(rounds: int) -> dict[str, list[float]]:
    waits: dict[str, list[float]] = {"alone": [], "behind": []}
    with tempfile.TemporaryDirectory(prefix="datacache-reader-first-") as scratch:
        root = Path(scratch)
        origin = root / "origin"
        origin.mkdir()
        for index in range(SHARDS):
            # Files over 1 MiB parts: the origin's parts stream through the limit one by one.
            (origin / f"shard-{index:04d}.tar").write_bytes(os.urandom(SHARD))
        for number in range(rounds):
            for backlog in (False, True) if number % 2 == 0 else (True, False):
                cache = root / f"cache-{number}-{backlog}"
                waits["behind" if backlog else "alone"].append(asyncio.run(_wait(cache, origin, backlog)))
    return waits


def table(waits: dict[str, list[float]]) -> str:
    alone, behind = statistics.median(waits["alone"]), statistics.median(waits["behind"])
    one, five, _ = os.getloadavg()
    return "\n".join(
        [
            f"{SHARDS} shards of {SHARD >> 20} MiB from a file origin, bandwidth limit {RATE / 1e6:.0f} MB/s, "
            f"{CONCURRENCY} workers, 1 MiB parts; the reader's wait for its shard, median of "
            f"{len(waits['alone'])} rounds, seconds; load average {one:.2f} / {five:.2f} (1 / 5 min) on "
            f"{os.cpu_count()} cores",
            "",
            "| reader's shard | wait s | / alone |",
            "|---|---|---|",
            f"| alone (nothing queued) | {alone:.3f} | 1.00x |",
            f"| behind {CONCURRENCY} prefetches in flight and {SHARDS - 1 - CONCURRENCY} queued | {behind:.3f} "
            f"| {behind / alone:.2f}x |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", type=Path, help="put the table into this RESULTS.md, between its marks")
    args = parser.parse_args(argv)
    waits = measure(args.rounds)
    shown = table(waits)
    print(shown)
    if args.results:
        from benchmarks.eviction_sweep import write_table

        heading = "### The reader's own shard first (`benchmarks/reader_first.py`)\n\n"
        write_table(f"{MARK}\n{heading}{shown}\n{MARK}\n", args.results, mark=MARK)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
