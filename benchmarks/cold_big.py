"""A cold epoch of a dataset larger than the local tier: embedded against through the daemon (issue 25).

Run alone (not part of ``make bench``)::

    python -m benchmarks.cold_big [--gb 4] [--capacity 1GB] [--repeats 1] [--results benchmarks/RESULTS.md]

The dataset of ``benchmarks.run`` (WebDataset tar shards of 50-150 KB samples,
~64 MB shards) scaled to ``--gb`` GB in the local S3 server, and a local tier of
``--capacity`` (smaller than the dataset: eviction and bypass are on the cold
path). Each repeat runs one cold epoch embedded (the reader's own stager) and
one through a ``datacache serve`` started on an empty cache for it, in turn
(the order alternates between repeats), each in a fresh process with 2
DataLoader workers in batch mode; the consumer copies every payload byte.
The table goes into RESULTS.md between ``<!-- cold-big -->`` marks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import _data
from benchmarks._common import BUCKET, NUM_WORKERS, REPO, WORK, Sizes, clean_env, parse_result, s3_env
from benchmarks.daemon_mode import start_daemon, stop_daemon
from datacache.sizes import format_bytes, parse_size

MARK = "<!-- cold-big -->"
MODES = ("embedded", "daemon")


def _log(message: str) -> None:
    print(f"[cold-big] {message}", file=sys.stderr, flush=True)


def _spy(output: Path, *target: str) -> list[str]:
    """py-spy's command that records ``target`` (a ``--pid`` or a command) as collapsed stacks."""
    spy = Path(sys.executable).with_name("py-spy")
    return [str(spy), "record", "--format", "raw", "--rate", "50", "--nonblocking", "-o", str(output), *target]


def _one(
    work: Path, endpoint: str, mode: str, samples: int, capacity: int, profile: Path | None = None
) -> dict[str, Any]:
    cache = work / mode
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    env = clean_env(s3_env(endpoint))
    env["DATACACHE_LOCAL_CAPACITY"] = f"{capacity}B"
    daemon = start_daemon(cache, env) if mode == "daemon" else None
    env["DATACACHE_SOCKET"] = str(cache / ("daemon.sock" if daemon else "no-daemon.sock"))
    spec = {"cache_dir": str(cache), "form": "batch", "workers": NUM_WORKERS, "expected": samples,
            "dataset": f"s3://{BUCKET}/wds/", "warm_epochs": 0}  # fmt: skip
    command = [sys.executable, "-m", "benchmarks.daemon_mode", "--job", json.dumps(spec)]
    spies: list[subprocess.Popen[bytes]] = []
    if profile is not None:
        # py-spy (pip install py-spy): the reader with its workers, and the daemon.
        command = _spy(profile / f"{mode}-reader.txt", "--subprocesses", "--", *command)
        if daemon is not None:
            spies.append(subprocess.Popen(_spy(profile / "daemon.txt", "--pid", str(daemon.pid))))
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    finally:
        if daemon is not None:
            stop_daemon(daemon)
        for spy in spies:
            spy.wait(timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{done.stderr[-3000:]}")
    result = parse_result(done.stdout)
    if result["mode"] != mode:
        raise RuntimeError(f"asked for {mode}, the loader ran {result['mode']}")
    (epoch,) = result["epochs"]
    if not epoch["ok"]:
        raise RuntimeError(f"{mode}: {epoch['samples']} samples, not {samples}")
    _log(f"{mode}: cold {epoch['mb_per_s']:.0f} MB/s ({time.perf_counter() - started:.0f} s with start-up)")
    return dict(epoch)


def measure(
    work: Path, endpoint: str, samples: int, capacity: int, repeats: int, profile: Path | None = None
) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {mode: [] for mode in MODES}
    for repeat in range(repeats):
        for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
            runs[mode].append(float(_one(work, endpoint, mode, samples, capacity, profile)["mb_per_s"]))
    return runs


def table(runs: dict[str, list[float]], dataset_bytes: int, capacity: int) -> str:
    embedded, daemon = statistics.median(runs["embedded"]), statistics.median(runs["daemon"])
    paired = statistics.median(d / e for d, e in zip(runs["daemon"], runs["embedded"], strict=True))
    one, five, _ = os.getloadavg()
    return "\n".join(
        [
            f"{format_bytes(dataset_bytes)} of tar shards in moto's S3 on 127.0.0.1, local tier "
            f"{format_bytes(capacity)}, no shared tier; DataLoader, batch mode, {NUM_WORKERS} workers, the consumer "
            f"copying every payload byte; one cold epoch per fresh process and empty cache; medians of "
            f"{len(runs['daemon'])} round(s), MB/s; load average {one:.2f} / {five:.2f} (1 / 5 min) on "
            f"{os.cpu_count()} cores at the end",
            "",
            "| | embedded | through the daemon | daemon / embedded | median of the rounds' ratios |",
            "|---|---|---|---|---|",
            f"| cold epoch | {embedded:,.0f} | {daemon:,.0f} | {daemon / embedded:.2f}x | {paired:.2f}x |",
            "",
            "Each round, MB/s (embedded / daemon): "
            + ", ".join(f"{e:.0f} / {d:.0f}" for e, d in zip(runs["embedded"], runs["daemon"], strict=True)),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cold_big", description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=4.0, help="dataset size in GB (default 4)")
    parser.add_argument("--capacity", default="1GB", help="the local tier's capacity (default 1GB)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--results", type=Path, help="put the table into this RESULTS.md, between its marks")
    parser.add_argument("--profile", type=Path, help="record py-spy profiles (collapsed stacks) into this folder")
    args = parser.parse_args(argv)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    from benchmarks.eviction_sweep import write_table
    from benchmarks.warm_vs_awscli import start_s3_server

    capacity = parse_size(args.capacity)
    # 50-150 KB samples: 100 KB on average.
    sizes = replace(Sizes.full(), samples=int(args.gb * 1e9 / 100_000), raw_samples=0)
    work = WORK / "cold-big"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root = _data.prepare_local(sizes, with_anchors=False)
    dataset_bytes = sum(path.stat().st_size for path in _data.wds_shards(root))
    server, endpoint = start_s3_server()
    try:
        _data.upload_all(endpoint, sizes, root, with_anchors=False)
        runs = measure(work, endpoint, sizes.samples, capacity, args.repeats, args.profile)
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
    shown = table(runs, dataset_bytes, capacity)
    print(shown)
    if args.results:
        heading = f"### A cold epoch bigger than the local tier (`benchmarks/cold_big.py --gb {args.gb:g}`)\n\n"
        write_table(f"{MARK}\n{heading}{shown}\n{MARK}\n", args.results, mark=MARK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
