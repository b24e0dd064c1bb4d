"""Shards at the cost of their metadata: a node's persisted manifest of 1e3 and 1e6 shards, read and planned.

Each point is a fresh process at rank 3 of 8 that does what a reader does between its start and its
first sample's (shard, offset) for an indexed dataset whose manifest this node already saved:
imports, `ManifestStore.load` (what `Stager.open` reads), the per-shard counts, epoch 0's plan
(`indexed_plan`: the reader's positions and the node's future) and the first shard's key. The
manifest is synthetic (written by `ManifestStore.save` in a process of its own before the point):
writing 1e6 files is too slow here. Not included: the unit plan (`loaders.plans.counts`), the
catalog, the stager's threads, reading any shard. With ``DATACACHE_BENCH_BASELINE_PYTHON`` (another
checkout's interpreter) the same points by that checkout run in the same run, turn about.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

SIZES = (10**3, 10**6)
PER_SHARD = 1000
RANK, WORLD = 3, 8
BASELINE = "DATACACHE_BENCH_BASELINE_PYTHON"
_WRITE = r"""
import asyncio, sys
from pathlib import Path
from datacache.manifest import Manifest, ManifestStore, Shard, ShardFormat
shards, per_shard, where = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
manifest = Manifest(
    dataset="synthetic", url="s3://bucket/synthetic/", format=ShardFormat.PARQUET,
    shards=tuple(Shard(f"part-{i:07d}.parquet", 4096 + i % 512, f"v{i}", f"xxh3_64:{i:016x}", per_shard)
                 for i in range(shards)),
)
asyncio.run(ManifestStore(where).save(manifest))
"""
_CHILD = r"""
import asyncio, json, resource, sys, time
started = time.perf_counter()
from pathlib import Path
import numpy as np
from datacache.loaders.epochs.dataset import indexed_plan
from datacache.loaders.order.layout import Layout
from datacache.loaders.plans.interface import Dealing
from datacache.loaders.plans.positions import auto_window
from datacache.manifest import ManifestStore
rank, world, where = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
mb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
imported, t = mb(), time.perf_counter()
manifest = asyncio.run(ManifestStore(where).load("synthetic"))
snapshot = manifest.snapshot
table = getattr(manifest, "table", None)
if table is not None:
    counts = np.asarray(table.samples)
else:
    counts = np.fromiter((s.samples for s in manifest.shards), dtype=np.int64, count=len(manifest.shards))
load_s, held = time.perf_counter() - t, mb()
plan = indexed_plan(counts, Layout(world, rank, 1, 0, 64), Dealing(seed=3, shuffle=True, drop_last=False),
                    epoch=0, cursors=(), window=auto_window(int(counts.sum()), len(counts)))
future = plan.future()
key = manifest.shards[int(plan.positions.unit_of[0])].key
first = time.perf_counter() - started
print(json.dumps({"first_s": first, "load_s": load_s, "imports_rss_mb": imported, "manifest_rss_mb": held,
                  "peak_rss_mb": mb(), "shards": len(manifest.shards), "first_key": key}))
"""


def _run(python: str, script: str, args: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    try:
        done = subprocess.run(
            [python, "-P", "-c", script, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"not done in {timeout:.0f} s"}
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    last = done.stdout.strip().splitlines()
    return json.loads(last[-1]) if last else {}


def _checkout(python: str) -> str:
    """The commit of the checkout ``python`` imports datacache from (for the record)."""
    found = subprocess.run(
        [python, "-P", "-c", "import datacache, pathlib; print(pathlib.Path(datacache.__file__).parents[1])"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    head = subprocess.run(
        ["git", "-C", found, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return f"{found} @ {head.stdout.strip() or '?'}"


def measure(work: Path, env: dict[str, str], timeout: float = 600.0) -> dict[str, Any]:
    """Each size, by this checkout and (if given) the baseline's, turn about; a fresh manifest per checkout."""
    pythons = {"branch": sys.executable}
    if os.environ.get(BASELINE):
        pythons = {"baseline": os.environ[BASELINE], **pythons}
    points: list[dict[str, Any]] = []
    for shards in SIZES:
        for label, python in pythons.items():
            where = work / f"manifest-{label}-{shards}" / "manifests"
            shutil.rmtree(where, ignore_errors=True)
            written = _run(python, _WRITE, [str(shards), str(PER_SHARD), str(where)], env, timeout)
            point = {"checkout": label, "shards": shards, "rank": RANK, "world": WORLD}
            point.update(
                written
                if "error" in written
                else _run(python, _CHILD, [str(RANK), str(WORLD), str(where)], env, timeout)
            )
            point["file_mb"] = sum(p.stat().st_size for p in where.iterdir()) / 2**20 if where.is_dir() else 0.0
            points.append(point)
            print(f"scale: manifest of {shards:,} shards, {label}: {point}", flush=True)
    return {"checkouts": {label: _checkout(python) for label, python in pythons.items()}, "points": points}


def render(result: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"A node's persisted manifest of 1e3 and 1e6 shards of {PER_SHARD:,} samples, at rank {RANK} of {WORLD}, a",
        "fresh process each (`benchmarks._manifest_scale`): imports, `ManifestStore.load`, the counts, epoch 0's",
        "plan and the node's future, the first shard's key. *First* is seconds from the interpreter's start;",
        "*load* the manifest's read; memory in MB; *files* what the store saved for the dataset. Checkouts: "
        + ", ".join(f"{k} {v}" for k, v in result["checkouts"].items())
        + ".",
        "",
        "| checkout | shards | first (s) | load (s) | RSS, imports | with manifest | peak RSS | files (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        where = f"| {p['checkout']} | {p['shards']:,} |"
        if "error" in p:
            lines.append(f"{where} {p['error']} | | | | | |")
            continue
        lines.append(
            f"{where} {p['first_s']:.2f} | {p['load_s']:.2f} | {p['imports_rss_mb']:.0f} | {p['manifest_rss_mb']:.0f} "
            f"| {p['peak_rss_mb']:.0f} | {p['file_mb']:.0f} |"
        )
    return [*lines, *verdicts(result, "first")]


def verdicts(result: dict[str, Any], first: str) -> list[str]:
    """Issue 35's verdict per checkout: 1e6 against 1e3 shards, the ``first`` time and the peak RSS."""
    lines = []
    for label in result["checkouts"]:
        mine = {p["shards"]: p for p in result["points"] if p["checkout"] == label and "error" not in p}
        if len(mine) == len(SIZES):
            small, large = mine[SIZES[0]], mine[SIZES[-1]]
            ratio, extra = large["first_s"] / small["first_s"], large["peak_rss_mb"] - small["peak_rss_mb"]
            met = "met" if ratio <= 2 and extra <= 100 else "missed"
            lines.append(
                f"- {label}: 1e6 against 1e3 shards: {first} {ratio:.2f}x, peak RSS {extra:+.0f} MB "
                f"(target 2x and +100 MB: {met})"
            )
    return lines
