"""Where a unit's shards are, and their bytes, verified before a sample is served from them.

The I/O a `UnitReaders` does to open one unit, as functions of plain values: locate each
shard, stage those only the origin has, and map or take each copy, checked against the
manifest (a bad copy raises `ChecksumMismatchError`, so that the next try reads the next tier).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from datacache.loaders.runtime import Runtime
from datacache.loaders.shardfiles import map_file
from datacache.tiers.files import UnsafeFileError

from datacache.access import ShardAccess
from datacache.checksum import copy_problem
from datacache.errors import ChecksumMismatchError
from datacache.staging import DatasetHandle, Location, Stager

__all__ = ["close_buffers", "load_verified", "locate_keys", "stage_missing"]


def load_verified(runtime: Runtime, location: Location, where: str) -> Any:
    """The bytes of ``location``: the stager's buffer, a read, or a mapped copy checked against the manifest."""
    if location.buffer is not None:
        return location.buffer  # verified by this process's stager as it arrived
    if location.path is None:
        return runtime.loop.run(runtime.access.read(runtime.handle, location.shard.key))
    try:
        buffer = map_file(location.path)
    except UnsafeFileError as exc:
        # As a bad copy: the next try reads the next tier (a link or FIFO is never the shard's bytes).
        raise ChecksumMismatchError(f"{where}: {exc}") from None
    # Others can write the shared tier's directories: a copy there is checked whatever the setting.
    hashed = runtime.settings.verify_on_read or location.tier == "shared"
    problem = copy_problem(buffer, location.shard.size, location.checksum, hashed=hashed)
    if problem:
        if hasattr(buffer, "close"):
            buffer.close()
        raise ChecksumMismatchError(f"{where}: the copy on the {location.tier} tier {problem}")
    return buffer


def close_buffers(buffers: dict[str, Any]) -> None:
    """Unmap the buffers of a unit that failed to open, now, not when the traceback is dropped."""
    for buffer in buffers.values():
        if hasattr(buffer, "close"):
            with contextlib.suppress(BufferError):
                buffer.close()
    buffers.clear()


async def locate_keys(access: ShardAccess, handle: DatasetHandle, keys: tuple[str, ...]) -> list[Location]:
    """Where each of ``keys`` is now (without staging any)."""
    return list(await asyncio.gather(*(access.locate(handle, key) for key in keys)))


async def stage_missing(
    access: ShardAccess, handle: DatasetHandle, located: list[Location]
) -> tuple[list[Location], str]:
    """Where each located shard can be read: local, else shared (its local copy goes on), else staged now.

    Also returns the slowest tier the unit was found on when asked for:
    ``"origin"`` means the reader had to wait for a transfer.
    """

    async def one(location: Location) -> Location:
        if location.tier in ("local", "shared"):
            return location
        if isinstance(access, Stager):
            # In-process: take the bytes as soon as they are verified, not after the fsync.
            return await access.ensure(handle, location.shard.key, early=True)
        return await access.ensure(handle, location.shard.key)

    locations = list(await asyncio.gather(*(one(location) for location in located)))
    found = {location.tier for location in located}
    tier = "origin" if "origin" in found else "shared" if "shared" in found else "local"
    return locations, tier
