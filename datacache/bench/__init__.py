"""Will this node feed its GPUs? Measure each tier's read bandwidth, and size tiers on paper.

`run_bench` reads a dataset from each tier (origin, shared, local) with N
parallel readers of whole shards, the way training reads them, and sets the
measured bandwidth against what ``gpus x per_gpu`` needs from that tier.
Reads from disk tiers go through reused buffers with the page cache dropped
first (best effort, ``posix_fadvise``), so the number is the device's, not
memory's.

`plan_tiers` answers the same question before any hardware exists: for a job
of K nodes x N GPUs at a bandwidth per GPU over a dataset of a given size, the
capacity and bandwidth each tier needs.
"""

from __future__ import annotations

from datacache.bench._measure import run_bench
from datacache.bench._sizing import TierNeed, TierSizing, format_plan, plan_tiers
from datacache.bench._verdict import TIERS, BenchReport, TierMeasurement, TierVerdict, assess, format_bench

__all__ = [
    "TIERS",
    "BenchReport",
    "TierMeasurement",
    "TierNeed",
    "TierSizing",
    "TierVerdict",
    "assess",
    "format_bench",
    "format_plan",
    "plan_tiers",
    "run_bench",
]
