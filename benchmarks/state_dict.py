"""Issue 34 item 7: ``state_dict()`` in the training process while torch's worker processes read.

Run alone (not part of ``make bench``)::

    python -m benchmarks.state_dict [--rounds 3] [--shards 64] [--results benchmarks/RESULTS.md]

A WebDataset dataset (``--shards`` tar shards of 100 samples of 2 KB) in moto's S3 server on
127.0.0.1. Each job is a fresh training process with an empty cache: ``CachedIterableDataset``
through torch's ``DataLoader(num_workers=2, persistent_workers=True)``, one whole epoch (which
counts the shards), then 5 batches of the next, then 21 calls of
``state_dict(samples_consumed=..., batch_size=...)``, each timed. Three rows, in turn each round:

- **now**: the state is made from what the workers published when they planned the epoch
  (`loaders/statehead.py`);
- **before**: the same process with the published fields wiped first, so the training process
  opens its own runtime to name the dataset (lists the origin), as every state did before: the
  code path of the previous commit, in the same run;
- **one import**: ``datacache.loaders.DataLoader`` (it reads in the training process, whose own
  runtime answers).

The table (medians over the rounds: the first call, and the median of the 20 after it) goes into
RESULTS.md between ``<!-- state-dict -->`` marks.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._common import REPO, boto_client, clean_env, s3_env

MARK = "<!-- state-dict -->"
BUCKET = "state-dict"
ROWS = {
    "now": "torch's DataLoader, 2 workers: the workers' published fields",
    "before": "torch's DataLoader, 2 workers: the training process opens its own runtime (before)",
    "one-import": "datacache.loaders.DataLoader, 2 workers (one import)",
}
_JOB = r"""
import json, os, sys, time
spec = json.loads(sys.argv[1])
import torch
from torch.utils.data import DataLoader as TorchLoader
from datacache.config import load_settings
from datacache.loaders import CachedIterableDataset, DataLoader as OneImport
torch.set_num_threads(1)
settings = load_settings(dict(os.environ), overrides={"local_dir": spec["local"]})
dataset = CachedIterableDataset(spec["url"], config=settings, seed=1)
loader_class = OneImport if spec["row"] == "one-import" else TorchLoader
loader = loader_class(dataset, batch_size=16, num_workers=2, persistent_workers=True)
for _ in loader:
    pass
dataset.set_epoch(1)
iterator = iter(loader)
for _ in range(5):
    next(iterator)
if spec["row"] == "before":
    dataset._table.heads.slots.zero_()
times = []
for _ in range(21):
    started = time.perf_counter()
    dataset.state_dict(samples_consumed=80, batch_size=16)
    times.append((time.perf_counter() - started) * 1000)
print(json.dumps({"first_ms": times[0], "rest_ms": sorted(times[1:])[10]}))
os._exit(0)
"""


def upload(endpoint: str, shards: int) -> str:
    """``shards`` tar shards of 100 samples; return the dataset's URL."""
    import webdataset as wds

    client = boto_client(endpoint)
    client.create_bucket(Bucket=BUCKET)
    for shard in range(shards):
        out = io.BytesIO()
        with wds.TarWriter(out) as writer:
            for i in range(100):
                writer.write({"__key__": f"s{shard:04d}-{i:03d}", "bin": os.urandom(2000)})
        client.put_object(Bucket=BUCKET, Key=f"wds/shard-{shard:04d}.tar", Body=out.getvalue())
    return f"s3://{BUCKET}/wds/"


def _job(endpoint: str, url: str, row: str, work: Path) -> dict[str, float]:
    shutil.rmtree(work, ignore_errors=True)
    spec = {"url": url, "row": row, "local": str(work / "local")}
    done = subprocess.run(
        [sys.executable, "-c", _JOB, json.dumps(spec)],
        env=clean_env(s3_env(endpoint)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{row}: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(rounds: int, shards: int) -> dict[str, Any]:
    from benchmarks.warm_vs_awscli import start_s3_server

    server, endpoint = start_s3_server()
    runs: dict[str, list[dict[str, float]]] = {row: [] for row in ROWS}
    loads = [os.getloadavg()]
    try:
        url = upload(endpoint, shards)
        with tempfile.TemporaryDirectory(prefix="datacache-state-dict-") as work:
            for number in range(rounds):
                order = list(ROWS) if number % 2 == 0 else list(reversed(ROWS))
                for row in order:
                    runs[row].append(_job(endpoint, url, row, Path(work) / row))
                    print(f"state_dict: round {number} {row}: {runs[row][-1]}", file=sys.stderr)
                loads.append(os.getloadavg())
    finally:
        server.terminate()
        server.wait(timeout=10)
    return {"runs": runs, "loads": loads, "shards": shards}


def table(measured: dict[str, Any]) -> str:
    runs, loads = measured["runs"], measured["loads"]
    first = {row: statistics.median(run["first_ms"] for run in runs[row]) for row in ROWS}
    rest = {row: statistics.median(run["rest_ms"] for run in runs[row]) for row in ROWS}
    lines = [
        f"{measured['shards']} tar shards of 100 samples in moto's S3 server; a fresh training process per job, "
        "torch's DataLoader or the one-import one with 2 persistent workers, one whole epoch, then 5 batches of "
        "the next and 21 calls of `state_dict(samples_consumed=80, batch_size=16)`; medians of "
        f"{len(runs['now'])} round(s), rows alternating; load average (1 min) {loads[0][0]:.1f} at the start, "
        f"{loads[-1][0]:.1f} at the end, on {os.cpu_count()} cores.",
        "",
        "| row | first call, ms | the 20 after it (median), ms | first call / now's | rounds (first call, ms) |",
        "|---|---|---|---|---|",
    ]
    for row, label in ROWS.items():
        rounds = ", ".join(f"{run['first_ms']:.2f}" for run in runs[row])
        lines.append(
            f"| {label} | {first[row]:.2f} | {rest[row]:.2f} | {first[row] / first['now']:.0f}x | {rounds} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.state_dict", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--results", type=Path, help="put the table into this RESULTS.md, between its marks")
    args = parser.parse_args(argv)
    shown = table(measure(args.rounds, args.shards))
    print(shown)
    if args.results:
        from benchmarks.eviction_sweep import write_table

        heading = "### `state_dict()` with torch's worker processes (`benchmarks/state_dict.py`, issue 34 item 7)\n\n"
        write_table(f"{MARK}\n{heading}{shown}\n{MARK}\n", args.results, mark=MARK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
