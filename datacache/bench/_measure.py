"""Measuring each tier's read bandwidth: parallel readers of whole shards, the way training reads them."""

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
from dataclasses import replace
from pathlib import Path

from datacache.bench._verdict import TIERS, BenchReport, TierMeasurement, assess
from datacache.config import DatasetConfig, Settings
from datacache.errors import ConfigError
from datacache.manifest import Shard
from datacache.staging import DatasetHandle, Stager
from datacache.tiers import ByteRange, device_free

logger = logging.getLogger(__name__)


def _read_files_parallel(
    paths: Sequence[Path], readers: int, seconds: float, max_bytes: int, chunk: int = 8 << 20
) -> tuple[int, float]:
    """Read ``paths`` with ``readers`` threads into reused buffers; return (bytes, seconds)."""
    if not paths:
        return 0, 0.0
    budget = max(chunk, max_bytes // readers)
    totals = [0] * readers
    barrier = threading.Barrier(readers + 1)

    def reader(index: int) -> None:
        buffer = bytearray(chunk)
        mine = list(paths[index::readers]) or [paths[index % len(paths)]]
        barrier.wait()
        # The time starts once every reader is ready: on a loaded machine, starting the
        # threads can take longer than a short --seconds, which then measured nothing.
        deadline = time.monotonic() + seconds
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
    return await _bench_dataset(
        settings,
        dataset,
        gpus=gpus,
        per_gpu=per_gpu,
        readers=readers,
        seconds=seconds,
        sample_bytes=sample_bytes,
        stage=stage,
        tiers=tiers,
    )


async def _bench_dataset(
    settings: Settings,
    dataset: DatasetConfig | str,
    *,
    gpus: int,
    per_gpu: float,
    readers: int,
    seconds: float,
    sample_bytes: int,
    stage: bool,
    tiers: Sequence[str],
) -> BenchReport:
    """Measure the tiers on a sample of the dataset's largest shards."""
    measurements: list[TierMeasurement] = []
    async with Stager(settings) as stager:
        handle = await stager.open(dataset)
        sample = _sample(handle.manifest.shards, sample_bytes, readers)
        if "origin" in tiers and sample:
            logger.info("bench: reading %d shards from the origin with %d readers", len(sample), readers)
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
                logger.info("bench: nothing of %s is on the %s tier; not measured", handle.id, tier_name)
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
        local_room = await _local_room(stager, settings)
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


async def _local_room(stager: Stager, settings: Settings) -> int | None:
    """What the local tier may hold: its capacity, else what it holds plus the device's free space."""
    if settings.local_capacity is not None:
        return settings.local_capacity
    used, _ = await stager.catalog.usage()
    free = await asyncio.to_thread(device_free, settings.local_dir)
    return None if free is None else free + used


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
