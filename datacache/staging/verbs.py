"""The stager's verbs on one shard: ensure, prefetch, read, locate, and a reader's progress.

`StagerVerbs` adds them to `StagerRuntime`; the `Stager` facade adds the warm on top.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Iterable, Sequence
from typing import Any

from datacache.errors import (
    ChecksumMismatchError,
    ConfigError,
    DatacacheError,
    InvalidKeyError,
)
from datacache.posix_acl import ACL_XATTR
from datacache.staging.batch import Turn
from datacache.staging.queue import first_answer
from datacache.staging.reading import read_verified
from datacache.staging.runtime import StagerRuntime
from datacache.staging.shared import known_checksum, shared_copy_matches
from datacache.staging.types import (
    LOCAL,
    ORIGIN,
    PRIORITY_PREFETCH,
    PRIORITY_URGENT,
    SHARED,
    TIERS,
    DatasetHandle,
    FutureOrder,
    Job,
    Location,
    ReaderProgress,
    StagingEvent,
)
from datacache.tiers import ByteRange, Tier

__all__ = ["StagerVerbs"]

logger = logging.getLogger(__name__)


class StagerVerbs(StagerRuntime):
    """The verbs a reader uses, shard by shard (see `Stager`)."""

    async def set_future_order(self, handle: DatasetHandle, keys: Iterable[str] | FutureOrder) -> None:
        """Tell eviction the node's future reads of the dataset (Belady).

        A `FutureOrder` holds every reader's sequence, the same from every reader;
        their positions come with `note_progress`. A plain sequence of keys is
        one reader's order, read from its start.
        """
        self._residency.set_future_order(handle.id, keys)

    async def note_progress(
        self, handle: DatasetHandle, progress: ReaderProgress, *, locate: Sequence[str] = ()
    ) -> list[Location]:
        """Record where a reader is in its `FutureOrder` sequence, and lease the shards it holds.

        Shared by the node's processes through the catalog: eviction never takes a
        shard a live reader holds, and Belady counts from the readers' positions.
        Returns where each of ``locate`` can be read now, as `locate` says: a reader
        learns where its next shards are in the same round trip. Those it holds are
        leased before they are located, so it may map them later without asking again.
        """
        await self.catalog.note_reader(
            handle.id,
            progress.reader,
            owner=progress.owner,
            epoch=progress.epoch,
            position=progress.position,
            holding=progress.holding,
        )
        return await self.locate_many(handle, locate)

    async def locate_many(self, handle: DatasetHandle, keys: Sequence[str]) -> list[Location]:
        """`locate` of each of ``keys``, the local copies found in one catalog read (and one touch).

        A window of tiny shards asked one by one paid a catalog read, a stat and a touch each. Those
        not local, with no shared tier to look at, are the origin's, with the checksums this node
        learned in one more read: `locate` of each read the catalog twice (its local row again, then
        the checksum), a reader's every note of a cold window. A resident row whose file vanished is
        not dropped here: `ensure` (the one-shard look) drops it when the reader asks for the shard.
        """
        if not keys:
            return []
        shards = [handle.manifest.shard(key) for key in keys]
        local = await (await self._ready()).local.hits(handle, shards)
        if self.shared is not None:
            return [local[key] if key in local else await self.locate(handle, key) for key in keys]
        rest = [shard for shard in shards if shard.key not in local]
        unknown = [shard.key for shard in rest if shard.checksum is None]
        learned = await self.catalog.get_many(handle.id, unknown) if unknown else {}
        for shard in rest:
            entry = learned.get(shard.key)
            checksum = entry.checksum if entry is not None and entry.version == shard.version else None
            local[shard.key] = Location(ORIGIN, None, shard, shard.checksum or checksum)
        return [local[key] for key in keys]

    # -- the public verbs -----------------------------------------------------------------

    async def ensure(
        self,
        handle: DatasetHandle,
        key: str,
        *,
        tier: str = LOCAL,
        priority: float = PRIORITY_URGENT,
        early: bool = False,
        turn: Turn | None = None,
    ) -> Location:
        """Make shard ``key`` resident on ``tier`` (waiting if it is being staged) and say where.

        If eviction declines to make room (the no-thrash or Belady policy
        keeps what is resident), the returned location is the next tier down.
        With ``early`` (a reader in this process), a shard being staged onto the
        local tier may be answered as soon as its bytes are verified in memory
        (`Location.buffer`), while its local copy is still being made durable.
        ``turn``: a warm's place (`staging.batch.Turn`; the daemon's warm): room for this shard is
        reserved only after the warm's shard before it has reserved its own; released however this ends.
        """
        job: Job | None = None
        try:
            if tier not in TIERS:
                raise ConfigError(f"unknown tier {tier!r} (choose local or shared)")
            if tier == SHARED and self.shared is None:
                raise ConfigError("no shared tier is configured (set cache.shared_dir or DATACACHE_SHARED_DIR)")
            parts = await self._ready()
            shard = handle.manifest.shard(key)
            if tier == LOCAL:
                hit = await parts.local.hit(handle, shard)
                if hit is not None:
                    self._events.hit(LOCAL)
                    self._events.emit(StagingEvent("hit", handle.id, key, LOCAL, size=shard.size))
                    return hit
            job = parts.queue.submit(handle, shard, tier, priority, turn)
        finally:
            if job is None and turn is not None:
                turn.release()  # no job will: the warm's next shard may reserve
        if early and tier == LOCAL:
            return await first_answer(job)
        return await asyncio.shield(job.future)

    async def prefetch(
        self, handle: DatasetHandle, keys: Sequence[str], *, priority: float = PRIORITY_PREFETCH
    ) -> None:
        """Queue ``keys`` for staging to the local tier, the first ones soonest; return at once.

        A shard the origin refused (missing, forbidden) is not asked for again here: the
        reader that needs it asks, and reports the error (`JobQueue.refused`).
        """
        parts = await self._ready()
        shards = [handle.manifest.shard(key) for key in keys]
        # Those resident already in one catalog read (none counted as a hit: nothing is read): each
        # was a staging job that took a node lock and read the catalog only to find it there. Not
        # those with a job queued or running: a reader asks again for the units ahead of it each time
        # it closes one (most of them still on their way), and the look-up (a catalog read and a
        # stat each) was most of what a prefetch cost; submitted again, they only move up the queue.
        queue = parts.queue
        look = [shard for shard in shards if not queue.pending(handle, shard, LOCAL)]
        resident = await parts.local.hits(handle, look) if look else {}
        for position, shard in enumerate(shards):
            if shard.key in resident:
                continue
            if parts.queue.refused(handle, shard, LOCAL):
                continue
            job = parts.queue.submit(handle, shard, LOCAL, priority + position * 1e-6)
            job.future.add_done_callback(_ignore_result)

    async def read(self, handle: DatasetHandle, key: str, byte_range: ByteRange | None = None) -> bytes:
        """Read a shard (or a range of it) from the fastest tier that holds it, without staging it.

        A whole-shard read is checked against the shard's size and, when
        known, its checksum; a bad cached copy is dropped and the shard read
        again from below (`read_verified`, the one read of every access).
        """
        await self._ready()
        shard = handle.manifest.shard(key)

        async def fetch(location: Location) -> bytes:
            if location.path is None:
                data = await handle.origin.get(key, byte_range, version=shard.version)
                self._events.count("bytes_from_origin", len(data))
                return data
            tier: Tier | None = self.local if location.tier == LOCAL else self.shared
            if tier is None:
                raise DatacacheError(f"no {location.tier} tier is configured")
            return await tier.get(handle.tier_key(key), byte_range)

        try:
            return await read_verified(
                handle.id,
                byte_range,
                locate=lambda: self.locate(handle, key),
                fetch=fetch,
                report_corrupt=lambda location: self.report_corrupt(handle, location),
            )
        except ChecksumMismatchError:
            self._events.count("checksum_failures")
            raise

    async def locate(self, handle: DatasetHandle, key: str) -> Location:
        """Say where shard ``key`` can be read right now, without moving anything.

        A local copy found here counts as used (for LRU eviction): callers ask
        in order to read it.
        """
        parts = await self._ready()
        shard = handle.manifest.shard(key)
        hit = await parts.local.hit(handle, shard)
        if hit is not None:
            return hit
        if self.shared is not None:
            try:
                info = await self.shared.stat(handle.tier_key(key))
            except InvalidKeyError:  # its path resolves outside the shared tier: never read through it
                info = None
            if info is not None and shared_copy_matches(info, handle.id, shard, self._trusted):
                return Location(SHARED, self.shared.path(handle.tier_key(key)), shard, info.metadata.get("checksum"))
        return Location(ORIGIN, None, shard, shard.checksum or await known_checksum(self.catalog, handle, shard))

    async def drop_misfit_copies(self, dataset_id: str) -> int:
        """Drop the dataset's copies whose file mode is not the one its readers now need; how many.

        A copy's mode is set when it is written (0640 for a dataset declared shared, 0600 for one
        that is not). The operator may declare or undeclare readers later: a copy staged private
        then cut the new readers off (a raw ``PermissionError`` in every loader), and one staged
        shared stayed open to the group after its readers were taken away (a trial read it). Such a
        copy is removed and staged again, with the right mode, on its next read.
        """
        await self._ready()
        dropped = 0
        for tier in (self.local, self.shared):
            if tier is None:
                continue
            if tier is self.local:
                keys = [entry.key for entry in await self.catalog.entries(dataset_id) if entry.state == "resident"]
            else:
                keys = [info.key.split("/", 1)[1] async for info in tier.list(f"{dataset_id}/")]
            misfits = await asyncio.to_thread(_misfits, tier, dataset_id, keys)
            for key in misfits:
                if tier is self.local:
                    await self.catalog.remove(dataset_id, key)
                await tier.delete(f"{dataset_id}/{key}")
            if misfits:
                logger.warning(
                    "dataset %s: %d copies on the %s tier had the file mode of another sharing; "
                    "dropped, staged again when read",
                    dataset_id,
                    len(misfits),
                    tier.kind,
                )
            dropped += len(misfits)
        return dropped

    async def report_corrupt(self, handle: DatasetHandle, location: Location) -> None:
        """A reader found ``location``'s bytes wrong: drop that copy so the next ensure re-stages it."""
        key = location.shard.key
        self._events.count("checksum_failures")
        logger.warning("dataset %s: shard %r on the %s tier is corrupt; dropping it", handle.id, key, location.tier)
        if location.tier == LOCAL:
            await self.catalog.remove(handle.id, key)
            await self.local.delete(handle.tier_key(key))
        elif location.tier == SHARED and self.shared is not None:
            await self.shared.delete(handle.tier_key(key))


def _ignore_result(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _misfits(tier: Tier, dataset_id: str, keys: Sequence[str]) -> list[str]:
    """Those of ``keys`` whose file's permission bits are not the ones `mode_for` gives now (blocking)."""
    mode_for = getattr(tier, "mode_for", None)
    if mode_for is None:
        return []
    found = []
    for key in keys:
        wanted = mode_for(f"{dataset_id}/{key}")
        try:
            st = os.lstat(tier.path(f"{dataset_id}/{key}"))
        except (OSError, ValueError):
            continue
        if wanted is None or not stat.S_ISREG(st.st_mode):
            continue
        try:
            acl: bytes | None = os.getxattr(tier.path(f"{dataset_id}/{key}"), ACL_XATTR, follow_symlinks=False)
        except OSError:
            acl = None  # none set, or a filesystem without ACLs
        # The readers are named by the bits, or by an ACL (`tiers._acl.readers_mode`): either may have changed.
        if stat.S_IMODE(st.st_mode) & 0o077 != wanted & 0o077 or acl != getattr(wanted, "acl", None):
            found.append(key)
    return found
