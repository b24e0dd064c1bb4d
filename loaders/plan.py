"""The unit plan of a dataset: how many samples each unit holds, known before an epoch starts.

The global order deals sample ids, so counts are needed up front. They come
from the cheapest place that has them: the manifest (``datacache shard``
output), Parquet footers (a ranged read each), Zarr metadata, one per file,
or, for tar shards nobody indexed, one pass that stages every shard and scans
its headers (it also warms the cache). The plan is built once per node and
dataset snapshot, under a node lock, and persisted for every rank and worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import time
from typing import Any

from datacache.loaders.readers import Unit, UnitPlan, map_file, zarr_plan
from datacache.tiers import ByteRange
from datacache.tiers._files import atomic_write

from datacache.access import ShardAccess
from datacache.config import Settings
from datacache.errors import DatasetTooLargeError, ShardReadError
from datacache.locks import NodeLock
from datacache.manifest import ShardFormat, max_samples
from datacache.stager import DatasetHandle
from datacache.tarindex import group_samples, scan_tar
from datacache.units import format_bytes

__all__ = ["load_or_build_plan"]

logger = logging.getLogger(__name__)


async def _parquet_rows(access: ShardAccess, handle: DatasetHandle, key: str, size: int) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = f"dataset {handle.id}: shard {key!r}"
    if size < 12:
        raise ShardReadError(f"{where}: too small to be a Parquet file ({size} bytes)")
    tail = await access.read(handle, key, ByteRange(max(0, size - 65536), size))
    if tail[-4:] != b"PAR1":
        raise ShardReadError(f"{where}: not a Parquet file (no PAR1 footer magic)")
    footer = int.from_bytes(tail[-8:-4], "little")
    if footer + 8 > size:
        raise ShardReadError(f"{where}: corrupt Parquet footer length")
    if footer + 8 > len(tail):
        tail = await access.read(handle, key, ByteRange(size - footer - 8, size))
    try:
        metadata = pq.read_metadata(pa.BufferReader(b"PAR1" + tail[-(footer + 8) :]))
    except (pa.ArrowException, OSError) as exc:
        raise ShardReadError(f"{where}: corrupt Parquet footer ({exc})") from None
    rows = int(metadata.num_rows)
    bound = max_samples(ShardFormat.PARQUET, size)
    if bound is not None and rows > bound:
        raise ShardReadError(f"{where}: its footer claims {rows} rows in {size} bytes (at most {bound})")
    return rows


async def _tar_samples(access: ShardAccess, handle: DatasetHandle, key: str) -> int:
    where = f"dataset {handle.id}: shard {key!r}"
    location = await access.ensure(handle, key)
    if location.path is not None:
        buffer = await asyncio.to_thread(map_file, location.path)
        view = memoryview(buffer)
        try:
            return len(group_samples(await asyncio.to_thread(scan_tar, view, where=where)))
        finally:
            view.release()
            if hasattr(buffer, "close"):
                buffer.close()
    data = await access.read(handle, key)
    return len(group_samples(scan_tar(data, where=where)))


async def _build(access: ShardAccess, handle: DatasetHandle, *, concurrency: int) -> UnitPlan:
    manifest = handle.manifest
    fmt = manifest.format
    if fmt is ShardFormat.ZARR:
        metadata: dict[str, bytes] = {}
        for shard in manifest.shards:
            if shard.key.rsplit("/", 1)[-1] in ("zarr.json", ".zarray"):
                metadata[shard.key] = await access.read(handle, shard.key)
        return zarr_plan(manifest, metadata.__getitem__)
    if fmt is ShardFormat.FILES:
        return UnitPlan(tuple(Unit((s.key,), 1, s.key) for s in manifest.shards), {})
    known = {s.key: s.samples for s in manifest.shards if s.samples is not None}
    missing = [s for s in manifest.shards if s.samples is None]
    if missing:
        started = time.monotonic()
        if fmt is ShardFormat.TAR:
            logger.warning(
                "dataset %s: %d tar shards have no sample index; staging and scanning them once "
                "(write shards with `datacache shard` to skip this)",
                handle.id,
                len(missing),
            )
        gate = asyncio.Semaphore(concurrency)

        async def count(key: str, size: int) -> tuple[str, int]:
            async with gate:
                if fmt is ShardFormat.PARQUET:
                    return key, await _parquet_rows(access, handle, key, size)
                return key, await _tar_samples(access, handle, key)

        for key, samples in await asyncio.gather(*(count(s.key, s.size) for s in missing)):
            known[key] = samples
        logger.info(
            "dataset %s: counted samples of %d shards in %.1fs", handle.id, len(missing), time.monotonic() - started
        )
    return UnitPlan(tuple(Unit((s.key,), known[s.key], s.key) for s in manifest.shards), {})


PLAN_BYTES_PER_SAMPLE = 48
"""What an epoch plan holds per sample (order, unit and offset arrays, and their temporaries)."""


def _check_fits(plan: UnitPlan, handle: DatasetHandle) -> None:
    """Refuse, before any epoch allocates for it, a sample count this machine's memory cannot plan."""
    total = sum(unit.count for unit in plan.units)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if total * PLAN_BYTES_PER_SAMPLE > memory // 2:
        raise DatasetTooLargeError(
            f"dataset {handle.id}: {total} samples declared; planning an epoch needs "
            f"{format_bytes(total * PLAN_BYTES_PER_SAMPLE)}, over half this machine's memory ({format_bytes(memory)})"
        )


async def load_or_build_plan(access: ShardAccess, handle: DatasetHandle, settings: Settings) -> UnitPlan:
    """The dataset's unit plan: read from disk, or built once per node and saved."""
    path = settings.local_dir / "indexes" / f"{handle.id}-{handle.manifest.snapshot}.json"

    def load() -> UnitPlan | None:
        try:
            return UnitPlan.from_json(json.loads(path.read_bytes()))
        except FileNotFoundError:
            return None
        except (ValueError, TypeError):
            logger.warning("ignoring an unreadable unit plan at %s", path)
            return None

    plan = await asyncio.to_thread(load)
    if plan is not None:
        return plan
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="datacache-plan-lock") as waiters:
        async with NodeLock(path.with_suffix(".lock"), waiters).hold():
            plan = await asyncio.to_thread(load)
            if plan is not None:
                return plan
            plan = await _build(access, handle, concurrency=settings.concurrency)
            _check_fits(plan, handle)
            encoded = json.dumps(plan.to_json(), separators=(",", ":")).encode()

            async def body() -> Any:
                yield encoded

            await atomic_write(path, body(), durable=False)
    return plan
