"""What landing a shard in the page cache costs: a reused buffer and write(2), against a shared map of the file.

Run alone (not part of ``make bench``)::

    python -m benchmarks.landing [--dir DIR] [--shards 16] [--rounds 2]

Each of 8 threads lands 64 MB shards in new files under DIR (default: a folder in
``benchmarks/work``, on the disk the local tier would use): either copied into a
reused anonymous buffer (what a GET thread's ``readinto`` does) and then written in
4 MiB ``write`` calls, or copied straight into a shared map of the new file (its
blocks allocated first); then fsync and rename. The CPU figure is user + system
seconds of this process per GB landed. The two paths alternate in one process, and
the first pass of a process is the dearest for both (fresh pages), so compare pairs.
"""

from __future__ import annotations

import argparse
import mmap
import os
import resource
import shutil
import threading
import time
from pathlib import Path

from benchmarks._common import WORK

SHARD = 64 << 20
REGION = 4 << 20
THREADS = 8


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _through_write(path: Path, buffer: mmap.mmap, source: memoryview) -> None:
    fd = os.open(f"{path}.partial", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    view = memoryview(buffer)
    for offset in range(0, SHARD, REGION):
        view[offset : offset + REGION] = source  # the socket's copy into the buffer
    for offset in range(0, SHARD, REGION):
        os.write(fd, view[offset : offset + REGION])
    view.release()
    os.fsync(fd)
    os.close(fd)
    os.replace(f"{path}.partial", path)


def _through_map(path: Path, buffer: mmap.mmap, source: memoryview) -> None:
    fd = os.open(f"{path}.partial", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.posix_fallocate(fd, 0, SHARD)
    mapped = mmap.mmap(fd, SHARD, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    view = memoryview(mapped)
    for offset in range(0, SHARD, REGION):
        view[offset : offset + REGION] = source  # the socket's copy, into the file's pages
    view.release()
    mapped.close()
    os.fsync(fd)
    os.close(fd)
    os.replace(f"{path}.partial", path)


def land(directory: Path, shards: int, how: str) -> tuple[float, float]:
    """Land ``shards`` shards ``how`` ("write" or "map"); MB/s and CPU s per GB."""
    source = memoryview(bytearray(os.urandom(REGION)))
    buffers = [mmap.mmap(-1, SHARD, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) for _ in range(THREADS)]
    for buffer in buffers:  # reused buffers, as the transfer pool's are after its first shards
        for offset in range(0, SHARD, mmap.PAGESIZE):
            buffer[offset] = 1
    one = _through_write if how == "write" else _through_map
    jobs = list(range(shards))
    lock = threading.Lock()

    def worker(buffer: mmap.mmap) -> None:
        while True:
            with lock:
                if not jobs:
                    return
                index = jobs.pop()
            one(directory / f"{how}-{index}", buffer, source)

    os.sync()
    cpu, started = _cpu(), time.perf_counter()
    threads = [threading.Thread(target=worker, args=(buffer,)) for buffer in buffers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds, used = time.perf_counter() - started, _cpu() - cpu
    for path in directory.iterdir():
        path.unlink()
    gb = shards * SHARD / 1e9
    return gb * 1000 / seconds, used / gb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.landing", description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=WORK / "landing")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        for round_ in range(args.rounds):
            for how in ("write", "map") if round_ % 2 == 0 else ("map", "write"):
                rate, cpu = land(args.dir, args.shards, how)
                print(f"round {round_ + 1}, {how}: {rate:,.0f} MB/s, {cpu:.2f} CPU s per GB", flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
