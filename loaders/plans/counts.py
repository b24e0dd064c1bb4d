"""The unit plan of a dataset: how many samples each unit holds, known before an epoch starts.

The global order deals sample ids, so counts are needed up front. The
dataset's format finds them (`datacache.formats`: the manifest, Parquet
footers, Zarr metadata, one per file, the tar shards' indexes). The plan is
built once per node and dataset snapshot, under a node lock, and persisted for
every rank and worker: a plan of one unit per shard (`ShardUnits`) as its counts
column with a digest, mapped by each reader (the keys are the snapshot's manifest's),
any other as JSON.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
from datacache.loaders.shardfiles import UnitPlan
from datacache.tiers import ByteRange
from datacache.tiers.files import Place, atomic_write

from datacache.access import ShardAccess
from datacache.config import Settings
from datacache.counting.cluster import node_plan_path
from datacache.formats import get_format
from datacache.formats._base import PlanContext, ShardUnits
from datacache.locks import NodeLock
from datacache.manifest import Manifest
from datacache.staging import DatasetHandle

__all__ = ["complete", "decode_plan", "encode_plan", "load_or_build_plan", "plan_context", "read_plan", "save_plan"]

logger = logging.getLogger(__name__)
_MAGIC = b"DCUNITS1\n"
"""A columnar plan's first line; then a JSON header line, a digest line, and the counts (int64, little-endian)."""


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
    counts = plan.counts
    return not len(counts) or int(counts.min()) >= 0


def _digest(header: bytes, counts: bytes | memoryview) -> bytes:
    digest = hashlib.blake2b(header, digest_size=16)
    digest.update(counts)
    return digest.hexdigest().encode() + b"\n"


def encode_plan(plan: UnitPlan) -> list[bytes]:
    """``plan`` as the bytes `decode_plan` reads: columns with a digest for `ShardUnits`, else JSON."""
    if not isinstance(plan.units, ShardUnits):
        return [json.dumps(plan.to_json(), separators=(",", ":")).encode()]
    fields = {"shards": len(plan.units), "extra": dict(plan.extra), "unreadable": dict(plan.unreadable)}
    header = json.dumps(fields, separators=(",", ":")).encode() + b"\n"
    counts = plan.units.counts.astype("<i8", copy=False).tobytes()
    return [_MAGIC, header, _digest(header, counts), counts]


def decode_plan(data: bytes | mmap.mmap, manifest: Manifest) -> UnitPlan:
    """The plan `encode_plan` wrote for ``manifest``'s snapshot; ValueError if it is not whole or not its."""
    if data[: len(_MAGIC)] != _MAGIC:
        return UnitPlan.from_json(json.loads(bytes(data)))
    header_end = data.find(b"\n", len(_MAGIC)) + 1
    digest_end = data.find(b"\n", header_end) + 1
    if not 0 < header_end < digest_end:
        raise ValueError("a columnar unit plan cut short")
    header = bytes(data[len(_MAGIC) : header_end])
    view = memoryview(data)[digest_end:]
    if _digest(header, view) != bytes(data[header_end:digest_end]):
        raise ValueError("a columnar unit plan whose digest does not match")
    fields = json.loads(header)
    shards = manifest.table
    if not isinstance(fields, dict) or fields.get("shards") != len(shards) or len(view) != 8 * len(shards):
        raise ValueError("a columnar unit plan of another manifest")
    counts = np.frombuffer(data, dtype="<i8", offset=digest_end).astype(np.int64, copy=False)
    unreadable = {str(k): str(v) for k, v in dict(fields.get("unreadable") or {}).items()}
    return UnitPlan(ShardUnits(shards, counts), dict(fields.get("extra") or {}), unreadable)


def read_plan(path: Path, manifest: Manifest) -> UnitPlan | None:
    """The unit plan saved at ``path`` for ``manifest`` (mapped, not copied, when columnar); None if none.

    Raises ValueError (or TypeError) if what is there is not a whole plan of ``manifest``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if not size:
            raise ValueError("an empty unit plan")
        # A saved plan is replaced by a rename, never written in place: the mapping stays whole.
        return decode_plan(mmap.mmap(fd, size, prot=mmap.PROT_READ), manifest)
    finally:
        os.close(fd)


async def save_plan(settings: Settings, handle: DatasetHandle, plan: UnitPlan) -> None:
    """Keep a complete plan for every later reader on this node."""
    encoded = encode_plan(plan)

    async def body() -> Any:
        for part in encoded:
            yield part

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
            return read_plan(path, handle.manifest)
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
