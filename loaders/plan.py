"""The unit plan of a dataset: how many samples each unit holds, known before an epoch starts.

The global order deals sample ids, so counts are needed up front. They come
from the cheapest place that has them: the manifest (``datacache shard``
output), Parquet footers (a ranged read each), Zarr metadata, one per file,
or, for tar shards, `datacache.indexing.ClusterIndex`: the cluster's index on
the shared tier, the sidecar indexes beside the shards (wids, open_clip,
img2dataset, DALI), and for shards nobody indexed a streaming scan of their
headers that the nodes divide among themselves. The plan is built once per
node and dataset snapshot, under a node lock, and persisted for every rank
and worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from collections.abc import Mapping
from typing import Any

from datacache.loaders.readers import COUNT_SOURCES, Unit, UnitPlan, zarr_plan
from datacache.tiers import ByteRange
from datacache.tiers._dirfd import Place
from datacache.tiers._files import atomic_write

from datacache.access import ShardAccess
from datacache.config import Settings
from datacache.errors import ShardReadError
from datacache.indexing import ClusterIndex, node_plan_path
from datacache.locks import NodeLock
from datacache.manifest import ShardFormat, max_samples
from datacache.sidecars import KnownCount
from datacache.stager import DatasetHandle

__all__ = ["complete", "load_or_build_plan", "save_plan"]

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


async def _build(access: ShardAccess, handle: DatasetHandle, settings: Settings, *, wait: bool) -> UnitPlan:
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
    if fmt is ShardFormat.TAR:
        index = ClusterIndex(handle.origin, manifest, settings)
        if not wait:
            found = await index.known()
            if len(found) < len(manifest.shards):
                # A cold epoch starts now; the counts are completed in the background (`coldplan`).
                units = tuple(
                    Unit((s.key,), found[s.key].samples if s.key in found else -1, s.key) for s in manifest.shards
                )
                return UnitPlan(units, _sources(found))
        found, report = await index.build()
        if report.scanned:
            logger.info(
                "dataset %s: scanned %d tar shards (%d bytes) in %.1fs for their sample counts; "
                "other nodes shared the work (`datacache index` does it ahead of time)",
                handle.id,
                report.scanned,
                report.scanned_bytes,
                report.seconds,
            )
        uncounted = "its samples could not be counted"
        uncountable = {
            s.key: report.unreadable.get(s.key, f"dataset {handle.id}: shard {s.key!r}: {uncounted}")
            for s in manifest.shards
            if s.key not in found
        }
        units = tuple(Unit((s.key,), found[s.key].samples if s.key in found else 0, s.key) for s in manifest.shards)
        return UnitPlan(units, _sources(found), uncountable)
    known = {s.key: s.samples for s in manifest.shards if s.samples is not None}
    missing = [s for s in manifest.shards if s.samples is None]
    unreadable: dict[str, str] = {}
    gate = asyncio.Semaphore(settings.concurrency)

    async def count(key: str, size: int) -> tuple[str, int | ShardReadError]:
        async with gate:
            try:
                return key, await _parquet_rows(access, handle, key, size)
            except ShardReadError as exc:
                return key, exc

    for key, counted in await asyncio.gather(*(count(s.key, s.size) for s in missing)):
        if isinstance(counted, ShardReadError):
            # Recorded, not raised: whether to skip it is each reader's on_error.
            unreadable[key] = str(counted)
            known[key] = 0
        else:
            known[key] = counted
    return UnitPlan(tuple(Unit((s.key,), known[s.key], s.key) for s in manifest.shards), {}, unreadable)


def _sources(found: Mapping[str, KnownCount]) -> dict[str, Any]:
    sources = sorted({count.source for count in found.values() if count.source != "scanned"})
    return {COUNT_SOURCES: sources} if sources else {}


def complete(plan: UnitPlan) -> bool:
    """Whether every unit's sample count is known (a cold epoch starts without some)."""
    return all(unit.count >= 0 for unit in plan.units)


async def save_plan(settings: Settings, handle: DatasetHandle, plan: UnitPlan) -> None:
    """Keep a complete plan for every later reader on this node."""
    encoded = json.dumps(plan.to_json(), separators=(",", ":")).encode()

    async def body() -> Any:
        yield encoded

    # The node's own cache: 0700 directories and 0600 files, whatever the umask.
    place = Place.of(node_plan_path(settings.local_dir, handle.manifest), dir_mode=0o700)
    await atomic_write(place, body(), durable=False, file_mode=0o600)


async def load_or_build_plan(
    access: ShardAccess, handle: DatasetHandle, settings: Settings, *, wait: bool = True
) -> UnitPlan:
    """The dataset's unit plan: read from disk, or built once per node and saved.

    With ``wait=False`` a tar dataset whose counts are not all known yet gets a
    plan at once, its unknown counts -1 (a cold epoch completes them).
    """
    path = node_plan_path(settings.local_dir, handle.manifest)

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
            plan = await _build(access, handle, settings, wait=wait)
            if complete(plan):
                await save_plan(settings, handle, plan)
    return plan
