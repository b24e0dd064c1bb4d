"""Issue 35's cold lever in one process: the GET threads' wake-ups, with and without ``SO_RCVLOWAT``.

Run alone (not part of ``make bench``)::

    python -m benchmarks.get_wakeups [--quick] [--rounds 3] [--server-tmp /dev/shm]

The WebDataset shards of ``benchmarks.run`` (~1 GB in 16, or ``--quick`` ~250 MB)
in one moto S3 server on 127.0.0.1. Each round, in turn with the mark on and
off (``datacache.tiers._s3_threads._LOWAT`` set to 0 turns it off: a switch of
this benchmark only, so both sides share one process and one run): every shard
read with `Tier.read_into` (the one-copy GET a cold epoch stages with, 8 at
once, each into a buffer of its size and hashed there), while one Python
thread counts loop turns, standing in for a reader that needs the GIL. Reported:
MB/s, CPU s per GB of this process, ``SocketIO.readinto`` calls per MB, and
the busy thread's turns per second (the GIL left to the readers).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import _data
from benchmarks._common import Sizes, s3_env


def _log(message: str) -> None:
    print(f"[get-wakeups {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


async def _read_all(tier: Any, keys: list[str], sizes: list[int]) -> None:
    from datacache.checksum import new_hasher

    gate = asyncio.Semaphore(8)

    async def one(key: str, size: int) -> None:
        async with gate:
            buffer = memoryview(bytearray(size))
            async for _ in tier.read_into(key, buffer, hasher=new_hasher(), checked=True):
                pass

    await asyncio.gather(*(one(k, s) for k, s in zip(keys, sizes, strict=True)))


def _round(url: str, keys: list[str], sizes: list[int], lowat: int) -> dict[str, float]:
    from datacache.tiers import _s3_threads, open_origin

    _s3_threads._LOWAT = lowat
    reads = [0]
    real = socket.SocketIO.readinto

    def counting(self: socket.SocketIO, buffer: Any) -> int:
        reads[0] += 1
        return real(self, buffer)

    stop = threading.Event()
    turns = [0]

    def busy() -> None:
        while not stop.is_set():
            turns[0] += 1

    async def main() -> None:
        tier = open_origin(url)
        try:
            await _read_all(tier, keys[:1], sizes[:1])  # clients and connections made before the clock
            socket.SocketIO.readinto = counting  # type: ignore[method-assign]
            thread.start()
            await _read_all(tier, keys, sizes)
        finally:
            socket.SocketIO.readinto = real  # type: ignore[method-assign]
            await tier.close()

    thread = threading.Thread(target=busy, daemon=True)
    cpu, started = time.process_time(), time.perf_counter()
    asyncio.run(main())
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    stop.set()
    thread.join()
    megabytes = sum(sizes) / 1e6
    return {"mb_per_s": megabytes / seconds, "cpu_s_per_gb": cpu / (megabytes / 1e3),
            "reads_per_mb": reads[0] / megabytes, "busy_turns_per_s": turns[0] / seconds}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.get_wakeups", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-tmp", type=Path, help="moto's temporary files there (/dev/shm: spare the disk)")
    args = parser.parse_args(argv)
    from benchmarks.cold_path import _server

    sizes = Sizes.quick() if args.quick else Sizes.full()
    root = _data.prepare_local(sizes, with_anchors=False)
    shards = _data.wds_shards(root)
    server, endpoint = _server(args.server_tmp)
    runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    loads = [os.getloadavg()[0]]
    try:
        _data.upload_all(endpoint, sizes, root, with_anchors=False)
        os.environ.update(s3_env(endpoint))
        keys, lengths = [p.name for p in shards], [p.stat().st_size for p in shards]
        from datacache.tiers import _s3_threads

        mark = _s3_threads._LOWAT
        for number in range(args.rounds):
            for name in ("on", "off") if number % 2 == 0 else ("off", "on"):
                result = _round(f"s3://{_data.BUCKET}/wds/", keys, lengths, mark if name == "on" else 0)
                runs[name].append(result)
                _log(f"round {number + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in result.items()))
            loads.append(os.getloadavg()[0])
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(f"{sum(lengths) / 1e9:.2f} GB in {len(keys)} shards, 8 one-copy GETs at once; medians of {args.rounds} "
          f"rounds, alternating; load average (1 min) {loads[0]:.1f} at the start, {max(loads):.1f} at most, "
          f"on {os.cpu_count()} cores\n")  # fmt: skip
    print("| SO_RCVLOWAT | MB/s | CPU s per GB | recv calls per MB | busy thread's turns per s | rounds, MB/s |")
    print("|---|---|---|---|---|---|")
    for name, results in runs.items():
        keys = ("mb_per_s", "cpu_s_per_gb", "reads_per_mb", "busy_turns_per_s")
        cells = [statistics.median(r[k] for r in results) for k in keys]
        rates = ", ".join(f"{r['mb_per_s']:.0f}" for r in results)
        print(f"| {name} | {cells[0]:,.0f} | {cells[1]:.2f} | {cells[2]:.1f} | {cells[3]:,.0f} | {rates} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
