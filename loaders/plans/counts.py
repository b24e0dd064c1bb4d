"""The unit plan of a dataset: how many samples each unit holds, known before an epoch starts.

The global order deals sample ids, so counts are needed up front. The
dataset's format finds them (`datacache.formats`: the manifest, Parquet
footers, Zarr metadata, one per file, the tar shards' indexes). The plan is
built once per node and dataset snapshot, under a node lock, and persisted for
every rank and worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from typing import Any

from datacache.loaders.shardfiles import UnitPlan
from datacache.tiers import ByteRange
from datacache.tiers.files import Place, atomic_write

from datacache.access import ShardAccess
from datacache.config import Settings
from datacache.counting.cluster import node_plan_path
from datacache.formats import get_format
from datacache.formats._base import PlanContext
from datacache.locks import NodeLock
from datacache.staging import DatasetHandle

__all__ = ["complete", "load_or_build_plan", "plan_context", "save_plan"]

logger = logging.getLogger(__name__)


def plan_context(access: ShardAccess, handle: DatasetHandle, settings: Settings) -> PlanContext:
    """What the dataset's format counts its samples with: reads go through ``access`` (the cache)."""

    async def read(key: str, byte_range: ByteRange | None) -> bytes:
        return await access.read(handle, key, byte_range)

    return PlanContext(handle.manifest, handle.origin, settings, read)


async def _build(access: ShardAccess, handle: DatasetHandle, settings: Settings, *, wait: bool) -> UnitPlan:
    fmt = get_format(handle.manifest.format.value)
    return await fmt.plan(plan_context(access, handle, settings), wait=wait)


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
