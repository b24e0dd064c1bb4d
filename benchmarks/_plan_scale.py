"""A plan for 1e6 shards: peak RSS per rank and time to the first planned sample, without writing 1e6 files.

Writing a million files is too slow here, so each point is a fresh process that holds what the
loader would hold for such a dataset and plans epoch 0 the way `datasetplans.indexed_plan` does
for an indexed dataset (the reader's `readplan.IndexedPositions` and the node's future: every
reader's units of this epoch and the next). Included: the interpreter and ``datacache.loaders``'
imports, a `manifest.Manifest` of 1e6 `manifest.Shard` entries with keys, sizes, checksums and
counts (what the catalog would give the loader), the per-shard counts array, the plan, the node
future and the first sample's (shard, offset). Not included: listing, opening or reading any
shard, the catalog's database, the stager and its threads (`CachedIterableDataset` start-up, the
Parquet rows measure those on real files).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

SHARDS = 10**6
PER_SHARD = 1000
"""Samples a shard: 1e9 samples in all, the largest Parquet set's total, in 1e6 shards instead of 100."""
LAYOUTS = ((0, 1), (3, 8))
_CHILD = r"""
import json, resource, sys, time, tracemalloc
started = time.perf_counter()
import numpy as np
from datacache.loaders.epochs.dataset import indexed_plan
from datacache.loaders.plans.positions import auto_window
from datacache.loaders.order.layout import Layout
from datacache.loaders.plans.interface import Dealing
from datacache.manifest import Manifest, Shard, ShardFormat
shards, per_shard, rank, world = map(int, sys.argv[1:5])
mb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
imported = mb()
manifest = Manifest(
    dataset="synthetic", url="s3://bucket/synthetic/", format=ShardFormat.PARQUET,
    shards=tuple(Shard(f"part-{i:07d}.parquet", 4096 + i % 512, None, f"{i:016x}", per_shard) for i in range(shards)),
)
counts = np.fromiter((s.samples for s in manifest.shards), dtype=np.int64, count=shards)
held = mb()
window = auto_window(int(counts.sum()), shards)
def planned():
    plan = indexed_plan(counts, Layout(world, rank, 1, 0, 64), Dealing(seed=3, shuffle=True, drop_last=False),
                        epoch=0, cursors=(), window=window)
    return plan, (int(plan.positions.unit_of[0]), int(plan.positions.local[0]))
t = time.perf_counter()
plan, first = planned()
seconds, peak, process = time.perf_counter() - t, mb(), time.perf_counter() - started
future = plan.future()
units, samples = sum(len(v) for v in future.units.values()) if future else 0, len(plan.positions)
del plan, future
# Traced in a second planning, after the RSS is read: tracemalloc's own bookkeeping of the
# plan's ~1e6 small objects would otherwise add about as much again to the RSS and the time.
tracemalloc.start()
planned()
_, traced = tracemalloc.get_traced_memory()
tracemalloc.stop()
print(json.dumps({
    "plan_s": seconds, "process_s": process, "first": first, "window": window,
    "rank_samples": samples, "future_units": units,
    "imports_rss_mb": imported, "manifest_rss_mb": held, "peak_rss_mb": peak, "plan_traced_mb": traced / 2**20,
}))
"""


def measure(env: dict[str, str], timeout: float = 600.0) -> list[dict[str, Any]]:
    """One fresh process per layout of `LAYOUTS`."""
    points: list[dict[str, Any]] = []
    for rank, world in LAYOUTS:
        args = [str(SHARDS), str(PER_SHARD), str(rank), str(world)]
        point: dict[str, Any] = {"shards": SHARDS, "samples": SHARDS * PER_SHARD, "rank": rank, "world": world}
        try:
            done = subprocess.run(
                [sys.executable, "-c", _CHILD, *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            point["error"] = f"no plan within {timeout:.0f} s"
        else:
            if done.returncode == 0:
                point.update(json.loads(done.stdout.strip().splitlines()[-1]))
            else:
                lines = done.stderr.strip().splitlines()
                point["error"] = lines[-1] if lines else f"exit {done.returncode}"
        points.append(point)
        print(f"scale: a plan of {SHARDS:,} shards, rank {rank} of {world}: {point}", flush=True)
    return points


def render(points: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        f"{SHARDS:,} shards of {PER_SHARD:,} samples ({SHARDS * PER_SHARD:,} in all), planned in a fresh process",
        "from a synthetic manifest (`benchmarks._plan_scale`): writing a million files is too slow here. Included:",
        "the interpreter and imports, a `Manifest` of 1e6 `Shard`s (key, size, checksum, count), the counts,",
        "epoch 0's plan for the reader (`datasetplans.indexed_plan`), the node's future (every reader's shards",
        "this epoch and the next) and the first sample's (shard, offset). Not included: listing or reading",
        "any shard, the catalog's database, the stager's threads. *Plan* is the seconds from the counts to the",
        "first sample's (shard, offset); *traced* is tracemalloc's peak over the same planning done again",
        "once the RSS is read (tracemalloc's own bookkeeping would add about as much to the RSS and the time);",
        "*future* is the shards in the node's future (every rank's, this epoch and the next). Memory in MB.",
        "",
        "| shards | rank | plan (s) | process (s) | RSS, imports | with manifest | peak RSS | traced | future |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        where = f"| {p['shards']:,} | {p['rank']} of {p['world']} |"
        if "error" in p:
            lines.append(f"{where} {p['error']} | | | | | | |")
            continue
        lines.append(
            f"{where} {p['plan_s']:.2f} | {p['process_s']:.2f} | {p['imports_rss_mb']:.0f} "
            f"| {p['manifest_rss_mb']:.0f} | {p['peak_rss_mb']:.0f} | {p['plan_traced_mb']:.0f} "
            f"| {p['future_units']:,} |"
        )
    met = [p for p in points if "error" not in p]
    if met:
        worst = max(met, key=lambda p: p["peak_rss_mb"])
        traced = max(p["plan_traced_mb"] for p in met)
        lines += [
            "",
            f"- Peak RSS per rank at most {worst['peak_rss_mb']:.0f} MB (target under 200 MB: "
            f"{'met' if worst['peak_rss_mb'] < 200 else 'missed'}): of it {worst['imports_rss_mb']:.0f} MB is the "
            f"interpreter and imports, {worst['manifest_rss_mb'] - worst['imports_rss_mb']:.0f} MB the manifest's "
            f"1e6 `Shard`s, {worst['peak_rss_mb'] - worst['manifest_rss_mb']:.0f} MB the planning's high-water mark.",
            f"- The planning alone traced at most {traced:.0f} MB "
            f"(under 200 MB: {'met' if traced < 200 else 'missed'}).",
        ]
    return lines
