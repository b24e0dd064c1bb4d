"""A queued job's first batch with and without prestage, on a dataset bigger than the local tier (issue 36).

Run alone::

    python -m benchmarks.prestage [--rounds 3] [--results benchmarks/RESULTS.md]

A file origin of tar shards read through the stager's bandwidth limit (a shared link
to object storage); a job of ``WORLD`` ranks, ``PER_NODE`` on this node (node rank 1).
Before the job starts, the node's cache is, alternating in each round:

- ``none``: empty (what a job finds without a prolog);
- ``warm``: filled by ``datacache warm DATASET`` (the whole dataset in manifest order,
  as much as the local tier keeps; what a prolog that preloads does today);
- ``prestage``: filled by ``datacache warm DATASET --order-for seed=..,world_size=..,
  node_rank=..,ranks_per_node=..``: the shards this node's ranks read first in epoch 0
  first, then the rest while room is left.

Then the node's ranks start together, each a fresh process (RANK, WORLD_SIZE) that
creates ``CachedIterableDataset`` and takes one batch, its consumer touching every
byte. The figure is the slower rank's seconds from creating the dataset to holding
its first batch (the job's first step waits for both). The table goes into RESULTS.md
between ``<!-- prestage -->`` marks.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

MARK = "<!-- prestage -->"
REPO = Path(__file__).resolve().parent.parent
SHARDS = 16
SAMPLES = 32
SAMPLE = 256 << 10  # 8 MiB shards
CAPACITY = "48MB"  # the dataset is 128 MiB: under half of it fits
RATE = "10MB/s"  # a node's share of a busy link to object storage
WORLD, PER_NODE, NODE_RANK, SEED = 8, 2, 1, 17
BATCH = 16


def _shard(index: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(SAMPLES):
            for ext, data in ((".bin", os.urandom(SAMPLE)), (".cls", b"%d" % (i % 10))):
                member = tarfile.TarInfo(f"{index:04d}_{i:04d}{ext}")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    return out.getvalue()


def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATACACHE_", "AWS_"))}
    env.update(
        HOME=str(cache / "home"),
        DATACACHE_LOCAL_DIR=str(cache / "local"),
        DATACACHE_LOCAL_CAPACITY=CAPACITY,
        DATACACHE_BANDWIDTH_LIMIT=RATE,
        DATACACHE_SOCKET=str(cache / "no-daemon.sock"),
        WORLD_SIZE=str(WORLD),
    )
    return env


def _prepare(mode: str, origin: Path, cache: Path) -> float:
    """Fill the cache as ``mode`` says; return the seconds it took (0 for none)."""
    if mode == "none":
        return 0.0
    argv = [sys.executable, "-m", "datacache.cli", "warm", str(origin), "--quiet", "--no-daemon"]
    if mode == "prestage":
        argv += ["--order-for", f"seed={SEED},world_size={WORLD},node_rank={NODE_RANK},ranks_per_node={PER_NODE}"]
    started = time.perf_counter()
    # A warm of more than the tier holds exits 1 (not all resident): expected for "warm".
    done = subprocess.run(argv, env=_env(cache), capture_output=True, text=True, timeout=900, check=False)
    if done.returncode not in (0, 1) or "Traceback" in done.stderr:
        raise RuntimeError(f"{mode}: {done.stderr[-2000:]}")
    return time.perf_counter() - started


def job(origin: str) -> dict[str, Any]:
    """One rank, in a fresh process: create the dataset, take one batch, touch every byte."""
    from datacache.loaders import CachedIterableDataset

    started = time.perf_counter()
    dataset = CachedIterableDataset(origin, seed=SEED, batch_size=BATCH)
    batch = next(iter(dataset))
    touched = sum(int(v.data.numpy().sum(dtype="uint64") % 251) for k, v in batch.items() if k != "__key__")
    return {"first_batch_s": time.perf_counter() - started, "samples": len(batch["__key__"]), "touched": touched}


def _start_job(origin: Path, cache: Path) -> float:
    """The node's ranks started together; the slower one's time to its first batch."""
    ranks = range(NODE_RANK * PER_NODE, (NODE_RANK + 1) * PER_NODE)
    started = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.prestage", "--job", str(origin)],
            env={**_env(cache), "RANK": str(rank)}, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True,
        )
        for rank in ranks
    ]
    seconds = []
    for process in started:
        out, err = process.communicate(timeout=900)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if process.returncode != 0 or not lines:
            raise RuntimeError(err[-2000:])
        seconds.append(json.loads(lines[-1])["first_batch_s"])
    return max(seconds)


MODES = ("none", "warm", "prestage")


def measure(rounds: int) -> dict[str, dict[str, list[float]]]:
    found: dict[str, dict[str, list[float]]] = {mode: {"first_batch_s": [], "prepare_s": []} for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="datacache-prestage-") as scratch:
        root = Path(scratch)
        origin = root / "origin"
        origin.mkdir()
        for index in range(SHARDS):
            (origin / f"shard-{index:04d}.tar").write_bytes(_shard(index))
        for number in range(rounds):
            order = MODES if number % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                cache = root / f"cache-{number}-{mode}"
                found[mode]["prepare_s"].append(_prepare(mode, origin, cache))
                found[mode]["first_batch_s"].append(_start_job(origin, cache))
                print(f"round {number} {mode}: {found[mode]['first_batch_s'][-1]:.3f}s", file=sys.stderr)
    return found


def table(found: dict[str, dict[str, list[float]]]) -> str:
    none = statistics.median(found["none"]["first_batch_s"])
    one, five, _ = os.getloadavg()
    words = {
        "none": "none (empty cache)",
        "warm": "`datacache warm` (manifest order, as much as fits)",
        "prestage": "`datacache warm --order-for` (this node's epoch-0 order)",
    }
    rows = [
        f"{SHARDS} tar shards of {SAMPLES * SAMPLE >> 20} MiB from a file origin, bandwidth limit {RATE}, local tier "
        f"{CAPACITY} (the dataset is {SHARDS * SAMPLES * SAMPLE >> 20} MiB); a job of {WORLD} ranks, ranks "
        f"{NODE_RANK * PER_NODE}-{(NODE_RANK + 1) * PER_NODE - 1} on this node, seed {SEED}, batches of {BATCH}; "
        f"the slower rank's time to its first batch, median of {len(found['none']['first_batch_s'])} rounds, one run; "
        f"load average {one:.2f} / {five:.2f} (1 / 5 min) on {os.cpu_count()} cores",
        "",
        "| before the job starts | first batch s | / none | prestage s (before the job) |",
        "|---|---|---|---|",
    ]
    for mode in MODES:
        first = statistics.median(found[mode]["first_batch_s"])
        prepare = statistics.median(found[mode]["prepare_s"])
        rows.append(f"| {words[mode]} | {first:.3f} | {first / none:.2f}x | {prepare:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--results", type=Path, help="put the table into this RESULTS.md, between its marks")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        print(json.dumps(job(args.job)))
        return 0
    shown = table(measure(args.rounds))
    print(shown)
    if args.results:
        from benchmarks.eviction_sweep import write_table

        heading = "### A queued job's first batch, prestaged or not (`benchmarks/prestage.py`, issue 36)\n\n"
        write_table(f"{MARK}\n{heading}{shown}\n{MARK}\n", args.results, mark=MARK)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
