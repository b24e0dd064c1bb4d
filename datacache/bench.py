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

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from datacache.config import DatasetConfig, Settings
from datacache.errors import ConfigError
from datacache.manifest import Shard
from datacache.stager import DatasetHandle, Stager
from datacache.tiers import ByteRange, device_free
from datacache.units import format_bytes

__all__ = [
    "BenchReport",
    "Plan",
    "PlanTier",
    "TierMeasurement",
    "TierVerdict",
    "assess",
    "format_bench",
    "format_plan",
    "plan_tiers",
    "run_bench",
]

logger = logging.getLogger(__name__)

TIERS = ("origin", "shared", "local")
_GB = 1e9


def _gbps(value: float | None) -> str:
    return "-" if value is None else f"{value / _GB:.2f} GB/s"


@dataclass(frozen=True)
class TierMeasurement:
    """What reading one tier gave: bytes over seconds, with how many readers."""

    tier: str
    bytes_read: int
    seconds: float
    readers: int
    files: int

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TierVerdict:
    """One tier set against the job: measured, needed in steady state, and on a cold epoch."""

    tier: str
    measured: float | None
    need: float
    cold_need: float
    note: str = ""

    @property
    def meets(self) -> bool | None:
        """Whether the tier delivers what the job needs of it (None: not measured)."""
        if self.need <= 0:
            return True
        return None if self.measured is None else self.measured >= self.need

    @property
    def meets_cold(self) -> bool | None:
        """Whether the tier could feed a cold epoch, nothing staged (None: not asked or not measured)."""
        if self.cold_need <= 0 or self.measured is None:
            return None
        return self.measured >= self.cold_need


@dataclass(frozen=True)
class BenchReport:
    """The answer of `run_bench`."""

    dataset: str
    gpus: int
    per_gpu: float
    dataset_bytes: int
    local_fraction: float
    tiers: tuple[TierVerdict, ...]
    bottleneck: str | None
    verdict: str
    measurements: tuple[TierMeasurement, ...] = field(default=())

    @property
    def need(self) -> float:
        return self.gpus * self.per_gpu

    @property
    def ok(self) -> bool:
        return self.bottleneck is None

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "gpus": self.gpus,
            "per_gpu_bytes_per_s": self.per_gpu,
            "need_bytes_per_s": self.need,
            "dataset_bytes": self.dataset_bytes,
            "local_fraction": round(self.local_fraction, 4),
            "ok": self.ok,
            "bottleneck": self.bottleneck,
            "verdict": self.verdict,
            "tiers": [
                {
                    "tier": v.tier,
                    "measured_bytes_per_s": v.measured,
                    "need_bytes_per_s": v.need,
                    "cold_epoch_need_bytes_per_s": v.cold_need,
                    "meets": v.meets,
                    "meets_cold_epoch": v.meets_cold,
                    "note": v.note,
                }
                for v in self.tiers
            ],
            "measurements": [asdict(m) | {"bytes_per_s": m.bytes_per_s} for m in self.measurements],
        }


def assess(
    measured: dict[str, float | None],
    *,
    gpus: int,
    per_gpu: float,
    dataset_bytes: int,
    local_room: int | None,
    shared_configured: bool,
    dataset: str = "",
) -> BenchReport:
    """Set measured bandwidths (bytes/s per tier; None = not measured) against a job's needs.

    In steady state the local tier serves the share of the dataset it can
    hold; the rest comes from the next tier down (shared if configured, else
    the origin). A cold epoch, with nothing staged, reads at the full rate
    from wherever the data is: that is the case ``datacache warm`` avoids.
    """
    if gpus <= 0 or per_gpu <= 0:
        raise ConfigError("--gpus and --per-gpu must be positive")
    need = gpus * per_gpu
    fraction = (
        1.0 if local_room is None or dataset_bytes <= 0 else min(1.0, local_room / dataset_bytes)
    )
    below = need * (1.0 - fraction)
    verdicts = [
        TierVerdict(
            "origin",
            measured.get("origin"),
            0.0 if shared_configured else below,
            need,
            "first reads of every shard"
            + ("" if shared_configured else "; the rest of each epoch"),
        ),
        TierVerdict(
            "shared",
            measured.get("shared"),
            below if shared_configured else 0.0,
            need if shared_configured else 0.0,
            "what the local tier cannot hold" if shared_configured else "not configured",
        ),
        TierVerdict(
            "local",
            measured.get("local"),
            need * fraction,
            0.0,
            "holds all of the dataset" if fraction >= 1 else f"holds {fraction:.0%} of the dataset",
        ),
    ]
    short = [v for v in verdicts if v.need > 0 and v.measured is not None and v.measured < v.need]
    bottleneck = None
    if short:
        worst = min(short, key=lambda v: (v.measured or 0.0) / v.need)
        bottleneck = worst.tier
        verdict = (
            f"NO: the {worst.tier} tier delivers {_gbps(worst.measured)} "
            f"of the {_gbps(worst.need)} "
            f"{gpus} GPUs need from it; it is the bottleneck"
        )
    else:
        verdict = f"YES: this node can feed {gpus} GPUs at {_gbps(per_gpu)} each ({_gbps(need)})"
        cold_short = [v for v in verdicts if v.meets_cold is False]
        if cold_short:
            first = cold_short[0]  # the origin before the shared tier: where a cold read goes first
            verdict += (
                f", once the dataset is warm; a cold first epoch reads the {first.tier} at "
                f"{_gbps(first.measured)}: run 'datacache warm' before training"
            )
    return BenchReport(
        dataset=dataset,
        gpus=gpus,
        per_gpu=per_gpu,
        dataset_bytes=dataset_bytes,
        local_fraction=fraction,
        tiers=tuple(verdicts),
        bottleneck=bottleneck,
        verdict=verdict,
    )


# -- measuring ----------------------------------------------------------------------------


def _read_files_parallel(
    paths: Sequence[Path], readers: int, seconds: float, max_bytes: int, chunk: int = 8 << 20
) -> tuple[int, float]:
    """Read ``paths`` with ``readers`` threads into reused buffers; return (bytes, seconds)."""
    if not paths:
        return 0, 0.0
    deadline = time.monotonic() + seconds
    budget = max(chunk, max_bytes // readers)
    totals = [0] * readers
    barrier = threading.Barrier(readers + 1)

    def reader(index: int) -> None:
        buffer = bytearray(chunk)
        mine = list(paths[index::readers]) or [paths[index % len(paths)]]
        barrier.wait()
        position = 0
        while totals[index] < budget and time.monotonic() < deadline:
            path = mine[position % len(mine)]
            position += 1
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                with contextlib.suppress(OSError, AttributeError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                with os.fdopen(fd, "rb", buffering=0, closefd=False) as handle:
                    while totals[index] < budget:
                        count = handle.readinto(buffer)
                        if not count:
                            break
                        totals[index] += count
            finally:
                os.close(fd)

    with concurrent.futures.ThreadPoolExecutor(
        readers, thread_name_prefix="datacache-bench"
    ) as pool:
        futures = [pool.submit(reader, i) for i in range(readers)]
        barrier.wait()
        started = time.monotonic()
        for future in futures:
            future.result()
        elapsed = time.monotonic() - started
    return sum(totals), elapsed


async def _read_origin(
    handle: DatasetHandle,
    shards: Sequence[Shard],
    *,
    readers: int,
    seconds: float,
    max_bytes: int,
    part: int,
) -> tuple[int, float]:
    """Read shards from the origin in ``part``-sized ranged GETs, ``readers`` at a time."""
    spans = [
        (s.key, ByteRange(o, min(o + part, s.size)), s.version)
        for s in shards
        for o in range(0, s.size, part)
    ]
    if not spans:
        return 0, 0.0
    deadline = time.monotonic() + seconds
    total = 0
    position = 0

    async def reader() -> None:
        nonlocal total, position
        while total < max_bytes and time.monotonic() < deadline:
            key, span, version = spans[position % len(spans)]
            position += 1
            total += len(await handle.origin.get(key, span, version=version))

    started = time.monotonic()
    await asyncio.gather(*(reader() for _ in range(readers)))
    return total, time.monotonic() - started


def _sample(shards: Sequence[Shard], budget: int, at_least: int) -> list[Shard]:
    """The largest shards first, up to ``budget`` bytes but at least ``at_least`` of them."""
    chosen: list[Shard] = []
    used = 0
    for shard in sorted(shards, key=lambda s: (-s.size, s.key)):
        if used >= budget and len(chosen) >= at_least:
            break
        chosen.append(shard)
        used += shard.size
    return chosen


async def run_bench(
    settings: Settings,
    dataset: DatasetConfig | str | None,
    *,
    gpus: int,
    per_gpu: float,
    readers: int | None = None,
    seconds: float = 10.0,
    sample_bytes: int = 2 * 10**9,
    stage: bool = True,
    tiers: Sequence[str] = TIERS,
) -> BenchReport:
    """Measure this node's read bandwidth from each tier and set it against ``gpus x per_gpu``.

    Parameters
    ----------
    dataset
        What to read. Without one, the disk tiers are measured on temporary
        files written for the purpose (and removed), and the origin is not.
    readers
        Parallel readers per tier (default: ``max(4, gpus)``, one or more per GPU).
    seconds, sample_bytes
        Each tier is read for at most this long, and at most this many bytes.
    stage
        Stage the sample onto the shared and local tiers first when it is not
        resident (it stays cached); without it, only resident shards are read.
    """
    unknown = set(tiers) - set(TIERS)
    if unknown:
        raise ConfigError(f"unknown tier {sorted(unknown)[0]!r} (choose from {', '.join(TIERS)})")
    if gpus <= 0 or per_gpu <= 0:
        raise ConfigError("--gpus and --per-gpu must be positive")
    readers = readers or max(4, gpus)
    if dataset is None:
        return await _bench_synthetic(
            settings,
            gpus=gpus,
            per_gpu=per_gpu,
            readers=readers,
            seconds=seconds,
            sample_bytes=sample_bytes,
            tiers=tiers,
        )
    measurements: list[TierMeasurement] = []
    async with Stager(settings) as stager:
        handle = await stager.open(dataset)
        sample = _sample(handle.manifest.shards, sample_bytes, readers)
        if "origin" in tiers and sample:
            logger.info(
                "bench: reading %d shards from the origin with %d readers", len(sample), readers
            )
            read, elapsed = await _read_origin(
                handle,
                sample,
                readers=readers,
                seconds=seconds,
                max_bytes=sample_bytes,
                part=settings.part_size,
            )
            measurements.append(TierMeasurement("origin", read, elapsed, readers, len(sample)))
        for tier_name in ("shared", "local"):
            if tier_name not in tiers:
                continue
            paths = await _resident_paths(stager, handle, sample, tier_name, stage=stage)
            if not paths:
                logger.info(
                    "bench: nothing of %s is on the %s tier; not measured", handle.id, tier_name
                )
                continue
            logger.info(
                "bench: reading %d files from the %s tier, %d readers",
                len(paths),
                tier_name,
                readers,
            )
            read, elapsed = await asyncio.to_thread(
                _read_files_parallel, paths, readers, seconds, sample_bytes
            )
            measurements.append(TierMeasurement(tier_name, read, elapsed, readers, len(paths)))
        local_room = settings.local_capacity
        if local_room is None:
            used, _ = await stager.catalog.usage()
            free = await asyncio.to_thread(device_free, settings.local_dir)
            local_room = None if free is None else free + used
        shared_configured = stager.shared is not None
    report = assess(
        {m.tier: m.bytes_per_s for m in measurements},
        gpus=gpus,
        per_gpu=per_gpu,
        dataset_bytes=handle.manifest.total_bytes,
        local_room=local_room,
        shared_configured=shared_configured,
        dataset=handle.id,
    )
    return replace(report, measurements=tuple(measurements))


async def _bench_synthetic(
    settings: Settings,
    *,
    gpus: int,
    per_gpu: float,
    readers: int,
    seconds: float,
    sample_bytes: int,
    tiers: Sequence[str],
) -> BenchReport:
    """Measure the disk tiers on temporary files: ``readers`` files sharing ``sample_bytes``."""
    measurements: list[TierMeasurement] = []
    size = max(1 << 20, sample_bytes // readers)
    for tier_name, root in (("shared", settings.shared_dir), ("local", settings.local_dir)):
        if tier_name not in tiers or root is None:
            continue
        directory = root / f".bench-{os.getpid()}"
        try:
            paths = await asyncio.to_thread(_write_files, directory, readers, size)
            read, elapsed = await asyncio.to_thread(
                _read_files_parallel, paths, readers, seconds, sample_bytes
            )
        finally:
            await asyncio.to_thread(shutil.rmtree, directory, True)
        measurements.append(TierMeasurement(tier_name, read, elapsed, readers, readers))
    report = assess(
        {m.tier: m.bytes_per_s for m in measurements},
        gpus=gpus,
        per_gpu=per_gpu,
        dataset_bytes=0,
        local_room=None,
        shared_configured=settings.shared_dir is not None,
        dataset="(temporary files)",
    )
    return replace(report, measurements=tuple(measurements))


def _write_files(directory: Path, count: int, size: int) -> list[Path]:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    block = os.urandom(min(size, 8 << 20))
    paths = []
    for index in range(count):
        path = directory / f"bench-{index:04d}.bin"
        with path.open("wb") as handle:
            written = 0
            while written < size:
                written += handle.write(block[: size - written])
            handle.flush()
            os.fsync(handle.fileno())
        paths.append(path)
    return paths


async def _resident_paths(
    stager: Stager, handle: DatasetHandle, sample: Sequence[Shard], tier_name: str, *, stage: bool
) -> list[Path]:
    """Files of ``sample`` on a disk tier, staging the missing ones there first if ``stage``."""
    tier = stager.local if tier_name == "local" else stager.shared
    if tier is None:
        return []
    paths: list[Path] = []
    for shard in sample:
        if tier_name == "local":
            resident = (await stager.locate(handle, shard.key)).tier == "local"
        else:
            resident = await tier.stat(handle.tier_key(shard.key)) is not None
        if not resident and stage:
            resident = (await stager.ensure(handle, shard.key, tier=tier_name)).tier == tier_name
        if resident:
            paths.append(tier.path(handle.tier_key(shard.key)))
    return paths


def format_bench(report: BenchReport) -> str:
    """The report as a table, one line per tier, then the verdict."""
    lines = [
        f"bench {report.dataset}: {report.gpus} GPUs x {_gbps(report.per_gpu)} = "
        f"{_gbps(report.need)} needed"
        + (
            f" (dataset {format_bytes(report.dataset_bytes)}, "
            f"local tier holds {report.local_fraction:.0%})"
            if report.dataset_bytes
            else ""
        ),
        f"{'TIER':<8} {'MEASURED':>12} {'NEED':>12} {'OK':<4} {'COLD EPOCH':>12} {'OK':<4} NOTE",
    ]
    by_tier = {m.tier: m for m in report.measurements}
    for verdict in report.tiers:
        measurement = by_tier.get(verdict.tier)
        note = verdict.note
        if measurement is not None:
            m = measurement
            note += f" ({m.readers} readers, {m.files} shards, {m.seconds:.1f}s)"
        elif verdict.tier != "shared" or verdict.note != "not configured":
            note += " (not measured)"
        # Each need beside its own answer: a tier idle once warm can still starve a cold epoch.
        lines.append(
            f"{verdict.tier:<8} {_gbps(verdict.measured):>12} {_gbps(verdict.need):>12} "
            f"{_yes_no(verdict.meets):<4} {_gbps(verdict.cold_need) if verdict.cold_need else '-':>12} "
            f"{_yes_no(verdict.meets_cold):<4} {note}"
        )
    lines.append(f"bottleneck: {report.bottleneck or 'none'}")
    lines.append(report.verdict)
    return "\n".join(lines) + "\n"


def _yes_no(meets: bool | None) -> str:
    return "-" if meets is None else "yes" if meets else "NO"


# -- planning -----------------------------------------------------------------------------

_HEADROOM = 1.10  # staging in flight, eviction lag, filesystem overhead


@dataclass(frozen=True)
class PlanTier:
    """What one tier needs for a job."""

    tier: str
    capacity: int
    capacity_scope: str  # "per node", "cluster", "read once"
    bandwidth: float
    bandwidth_scope: str
    note: str


@dataclass(frozen=True)
class Plan:
    """The answer of `plan_tiers`."""

    gpus: int
    per_gpu: float
    dataset_bytes: int
    epochs: int
    nodes: int
    node_need: float
    cluster_need: float
    epoch_seconds: float
    local_fraction: float
    tiers: tuple[PlanTier, ...]
    warm_seconds: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus_per_node": self.gpus,
            "gpus": self.gpus * self.nodes,
            "per_gpu_bytes_per_s": self.per_gpu,
            "dataset_bytes": self.dataset_bytes,
            "epochs": self.epochs,
            "nodes": self.nodes,
            "node_need_bytes_per_s": self.node_need,
            "cluster_need_bytes_per_s": self.cluster_need,
            "epoch_seconds": self.epoch_seconds,
            "local_fraction": self.local_fraction,
            "warm_seconds": self.warm_seconds,
            "tiers": [asdict(t) for t in self.tiers],
        }


def plan_tiers(
    *,
    gpus: int,
    per_gpu: float,
    dataset_bytes: int,
    epochs: int = 1,
    nodes: int = 1,
    local_capacity: int | None = None,
    origin_bandwidth: float | None = None,
) -> Plan:
    """Size each tier for ``nodes`` x ``gpus`` reading ``dataset_bytes`` at ``per_gpu`` each.

    Every node reads a different part of each epoch and, over the epochs,
    all of the dataset (the order is reshuffled across ranks each epoch), so a
    node's local tier needs the whole dataset to serve every epoch after the
    first from NVMe. Given a smaller ``local_capacity``, the no-thrash policy
    keeps that share resident and the rest of each epoch comes from the
    shared tier. The shared tier holds one copy for the cluster, filled from
    the origin once.
    """
    if gpus <= 0 or per_gpu <= 0 or dataset_bytes <= 0 or epochs <= 0 or nodes <= 0:
        raise ConfigError("--gpus, --per-gpu, --dataset, --epochs and --nodes must be positive")
    node_need = gpus * per_gpu
    cluster_need = node_need * nodes
    epoch_seconds = dataset_bytes / cluster_need
    wanted_local = int(dataset_bytes * _HEADROOM)
    fraction = 1.0 if local_capacity is None else min(1.0, local_capacity / wanted_local)
    local = PlanTier(
        "local",
        wanted_local if local_capacity is None else local_capacity,
        "per node",
        node_need * fraction if fraction < 1 else node_need,
        "per node, sustained reads",
        (
            "the whole dataset plus 10% headroom: every epoch after the first reads NVMe only"
            if fraction >= 1
            else f"holds {fraction:.0%} of the dataset (no-thrash policy); the rest of each epoch "
            "comes from the shared tier"
        ),
    )
    warm_epochs_from_shared = cluster_need * (1.0 - fraction)
    shared = PlanTier(
        "shared",
        int(dataset_bytes * 1.05),
        "cluster",
        max(cluster_need if fraction >= 1 else warm_epochs_from_shared, 0.0),
        "cluster, aggregate reads",
        (
            f"one copy for all {nodes} nodes; {_gbps(cluster_need)} while the first epoch "
            "fills the local tiers (or warm them before training), "
            + (
                "nothing afterwards"
                if fraction >= 1
                else f"{_gbps(warm_epochs_from_shared)} every epoch after"
            )
        ),
    )
    warm_seconds = dataset_bytes / origin_bandwidth if origin_bandwidth else None
    origin = PlanTier(
        "origin",
        dataset_bytes,
        "read once",
        cluster_need,
        "to feed a cold first epoch directly",
        (
            "each shard is read once for the whole cluster (through the shared tier); "
            + (
                f"at {_gbps(origin_bandwidth)} warming takes {_duration(warm_seconds)}"
                if warm_seconds is not None
                else "give --origin-bandwidth to see how long warming takes"
            )
        ),
    )
    return Plan(
        gpus=gpus,
        per_gpu=per_gpu,
        dataset_bytes=dataset_bytes,
        epochs=epochs,
        nodes=nodes,
        node_need=node_need,
        cluster_need=cluster_need,
        epoch_seconds=epoch_seconds,
        local_fraction=fraction,
        tiers=(origin, shared, local),
        warm_seconds=warm_seconds,
    )


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def format_plan(plan: Plan) -> str:
    """The plan as a short table."""
    lines = [
        f"job: {plan.nodes} node{'s' if plan.nodes != 1 else ''} x {plan.gpus} GPUs per node = "
        f"{plan.gpus * plan.nodes} GPUs x {_gbps(plan.per_gpu)} = "
        f"{_gbps(plan.node_need)} per node, {_gbps(plan.cluster_need)} for the cluster",
        f"dataset {format_bytes(plan.dataset_bytes)}: one epoch takes "
        f"{_duration(plan.epoch_seconds)} at that rate; {plan.epochs} epoch(s) read "
        f"{format_bytes(plan.dataset_bytes * plan.epochs)} in all",
        f"{'TIER':<8} {'CAPACITY':>12} {'':<10} {'BANDWIDTH':>12}  NOTE",
    ]
    for tier in plan.tiers:
        lines.append(
            f"{tier.tier:<8} {format_bytes(tier.capacity):>12} {tier.capacity_scope:<10} "
            f"{_gbps(tier.bandwidth):>12}  {tier.note}"
        )
    return "\n".join(lines) + "\n"
