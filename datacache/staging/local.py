"""The local tier: stage a shard onto the node's disk once per node, under capacity, catalogued.

The catalog (SQLite on the local tier) is the truth of what is resident; a
node lock per shard makes one process of the node do each transfer, and the
catalog's reservation makes room by the dataset's eviction policy first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from datacache._logging import FirstTime
from datacache.catalog import CATALOG_ROOM, Catalog, CatalogEntry, Claim, Reservation, Room
from datacache.config import Settings
from datacache.errors import ChecksumMismatchError, InvalidKeyError, TierAccessError, TierFullError
from datacache.locks import NodeLock, lock_name
from datacache.manifest import Shard
from datacache.sizes import format_bytes
from datacache.staging.events import Events
from datacache.staging.residency import Residency
from datacache.staging.shared import SharedStager, known_checksum
from datacache.staging.transfer import Transfer
from datacache.staging.types import LOCAL, ORIGIN, SHARED, WANTED_NOW, WARMING, DatasetHandle, Location, StagingEvent
from datacache.tiers import LocalTier, Tier, device_free

if TYPE_CHECKING:
    from datacache.staging.batch import Turn

__all__ = ["LocalStager", "reserve_for"]

logger = logging.getLogger(__name__)

_BYPASS_SAID = FirstTime()
"""Datasets this process has said it reads past the local tier for."""


class LocalStager:
    """Stages shards onto the local tier, from the shared tier when there is one; bound to the running loop."""

    def __init__(
        self,
        settings: Settings,
        tier: LocalTier,
        catalog: Catalog,
        *,
        owner: str,
        shared: SharedStager | None,
        transfer: Transfer,
        residency: Residency,
        events: Events,
        lock_waiters: concurrent.futures.ThreadPoolExecutor,
    ) -> None:
        self.settings = settings
        self.tier = tier
        self.catalog = catalog
        self.owner = owner
        self._shared = shared
        self.transfer = transfer
        self._residency = residency
        self.events = events
        self._lock_waiters = lock_waiters

    async def hit(self, handle: DatasetHandle, shard: Shard, *, touch: bool = True) -> Location | None:
        """The shard's local copy if the catalog has it resident and its file is whole; else None."""
        entry = await self.catalog.get(handle.id, shard.key)
        if entry is None or entry.state != "resident" or entry.version != shard.version:
            return None
        path = self.tier.path(handle.tier_key(shard.key))
        try:
            size = (await asyncio.to_thread(os.lstat, path)).st_size
        except FileNotFoundError:
            size = -1
        if size != shard.size:
            again = await self.catalog.get(handle.id, shard.key)
            if again is None or again.state != "resident":
                return None  # evicted between the two looks: gone by the rules, not vanished
            logger.warning("dataset %s: shard %r vanished or changed on the local tier", handle.id, shard.key)
            await self.catalog.remove(handle.id, shard.key)
            return None
        if touch:
            await self.catalog.touch(handle.id, shard.key)
        return Location(LOCAL, path, shard, entry.checksum)

    @property
    def through_shared(self) -> bool:
        """Whether shards come to this tier through the shared tier (one configured)."""
        return self._shared is not None

    async def hits(self, handle: DatasetHandle, shards: Sequence[Shard], *, touch: bool = True) -> dict[str, Location]:
        """`hit` for many shards: one catalog read and one thread job of ``lstat`` (a read recorded if ``touch``).

        A resident row whose file vanished or changed is left for `hit` (the one-shard way) to drop.
        """
        entries = await self.catalog.get_many(handle.id, [shard.key for shard in shards])
        candidates: list[tuple[Shard, CatalogEntry]] = []
        for shard in shards:
            entry = entries.get(shard.key)
            if entry is not None and entry.state == "resident" and entry.version == shard.version:
                candidates.append((shard, entry))
        looked = await asyncio.to_thread(_sizes, self.tier, [handle.tier_key(shard.key) for shard, _ in candidates])
        found = {
            shard.key: Location(LOCAL, path, shard, entry.checksum)
            for (shard, entry), (path, size) in zip(candidates, looked, strict=True)
            if size == shard.size
        }
        if touch:
            await self.catalog.touch_many(handle.id, list(found))
        return found

    async def present(self, handle: DatasetHandle, shards: Sequence[Shard]) -> set[str]:
        """The keys of those of ``shards`` resident at their version whose file is whole: a warm's look-up.

        One catalog read for them all (`Catalog.resident_versions`), one thread job of file sizes, and
        their reads recorded; no `Location` is made (a warm asks only whether each is there). A file
        removed or cut short behind the catalog's back is not present: the warm stages it again.
        """
        versions = await self.catalog.resident_versions(handle.id, [shard.key for shard in shards])
        candidates = [shard for shard in shards if shard.key in versions and versions[shard.key] == shard.version]
        keys = [handle.tier_key(shard.key) for shard in candidates]
        sizes = await asyncio.to_thread(self.tier.file_sizes, keys)
        found = [shard.key for shard, size in zip(candidates, sizes, strict=True) if size == shard.size]
        await self.catalog.touch_many(handle.id, found)
        return set(found)

    async def resident_keys(self, handle: DatasetHandle, shards: Sequence[Shard]) -> set[str]:
        """Those of ``shards`` the catalog has resident at their version, in one read (no file is looked at).

        What a warm asks at its end, of shards it found or placed: an eviction since goes through the
        catalog, so its rows alone say whether one took them.
        """
        entries = await self.catalog.get_many(handle.id, [shard.key for shard in shards])
        return {
            shard.key
            for shard in shards
            if (entry := entries.get(shard.key)) is not None
            and entry.state == "resident"
            and entry.version == shard.version
        }

    def lock_path(self, name: str) -> Path:
        """Where the node lock named ``name`` (`lock_name`) lives."""
        return self.settings.local_dir / "locks" / name

    def node_lock(self, *parts: str) -> NodeLock:
        """A lock shared by the processes of this node, named by ``parts``."""
        return NodeLock(self.lock_path(lock_name(*parts)), self._lock_waiters)

    async def stage(
        self,
        handle: DatasetHandle,
        shard: Shard,
        on_verified: Callable[[bytes | memoryview, str], None] | None = None,
        *,
        wanted_now: bool = False,
        turn: Turn | None = None,
    ) -> Location:
        """Make the shard local (or say which lower tier to read, if eviction declines to make room).

        ``on_verified`` receives the shard's verified bytes before its local copy is durable
        (see `Transfer.copy`). ``wanted_now``: a reader is blocked on it (see `Residency.chooser`).
        ``turn``: its warm's place; room is reserved after the warm's shard before has reserved.
        """
        capacity = self.tier.capacity
        if capacity is not None and shard.size > capacity:
            raise TierFullError(
                f"dataset {handle.id}: shard {shard.key!r} ({format_bytes(shard.size)}) is larger than "
                f"the local tier's capacity ({format_bytes(capacity)})"
            )
        async with self.node_lock(handle.id, shard.key).hold():
            hit = await self.hit(handle, shard)
            if hit is not None:  # another process staged it while we waited
                self.events.hit(LOCAL)
                return hit
            self.events.count("misses")
            # A full device behaves like a full capacity: make room by the policy, else read
            # from the next tier. Twice: the device may fill between the reservation and the
            # write (a writer that is not datacache); the second reservation sees that.
            for attempt in (1, 2):
                try:
                    if turn is not None:
                        await turn.wait()
                    reservation = await self._reserve(handle, shard, wanted_now)
                except TierFullError as exc:  # the catalog itself found no room
                    return await self.bypass(handle, shard, str(exc))
                finally:
                    if turn is not None:
                        turn.release()  # reserved, or not: the warm's next shard may
                await self.delete_victims(reservation.victims)
                if not reservation.granted:
                    return await self.bypass(handle, shard, reservation.reason)
                try:
                    return await self.transfer_in(handle, shard, on_verified)
                except TierFullError as exc:
                    if attempt == 2:
                        return await self.bypass(handle, shard, str(exc), refused=True)
            raise AssertionError("unreachable")  # pragma: no cover

    async def _reserve(self, handle: DatasetHandle, shard: Shard, wanted_now: bool) -> Reservation:
        claim = Claim(shard.key, shard.size, shard.version)
        return (await self.catalog.reserve_many(handle.id, [claim], await self.room(handle, wanted_now)))[0]

    async def room(self, handle: DatasetHandle, wanted_now: bool = False) -> Room:
        """What a reservation for ``handle``'s shards is measured against: capacity, device, policy."""
        # Whatever a reader holds open or will open next is never a victim (issue 13).
        readers = await self.catalog.readers(handle.id) if self._residency.knows(handle.id) else []
        return Room(
            owner=self.owner,
            capacity=self.tier.capacity,
            device_free=lambda: device_free(self.settings.local_dir),
            reserve_free=reserve_for(self.settings.local_dir),
            choose=self._residency.chooser(handle, readers, wanted_now=wanted_now),
        )

    async def bypass(self, handle: DatasetHandle, shard: Shard, reason: str, *, refused: bool = False) -> Location:
        """Read ``shard`` from the next tier, saying why the local tier could not take it.

        ``refused``: the device failed the write (a file-size limit, a quota): said at once, warm or not,
        since it is no lack of room the warm's summary would explain.
        """
        self.events.count("bypassed")
        self.events.emit(StagingEvent("bypass", handle.id, shard.key, LOCAL, error=reason))
        location = await self.next_tier_location(handle, shard)
        if refused:
            tier = location.tier
            logger.warning("dataset %s: shard %r read from the %s tier: %s", handle.id, shard.key, tier, reason)
            return location
        if WARMING.get() and not WANTED_NOW.get()():
            # A warm-up: nobody reads the shard now, and the warm says what was not kept in its summary.
            # (A training run's prefetch still says it: its reader may take the location it returns.)
            logger.debug("dataset %s: shard %r not kept on the local tier: %s", handle.id, shard.key, reason)
            return location
        # A cache smaller than the dataset is the expected case: news once per dataset and run.
        level = _BYPASS_SAID.level(handle.id, run_dir=self.settings.local_dir / "notices")
        tier = location.tier
        logger.log(level, "dataset %s: shard %r is read from the %s tier: %s", handle.id, shard.key, tier, reason)
        return location

    async def transfer_in(
        self,
        handle: DatasetHandle,
        shard: Shard,
        on_verified: Callable[[bytes | memoryview, str], None] | None = None,
    ) -> Location:
        """Copy a shard whose room is reserved onto the local tier and commit it to the catalog."""
        tier_key = handle.tier_key(shard.key)
        started = time.monotonic()
        try:
            source, source_key, expected, source_name = await self.source(handle, shard)
            try:
                info, checksum = await self.transfer.copy(
                    handle, shard, source, source_key, self.tier, tier_key, expected, source_name, on_verified
                )
            except ChecksumMismatchError:
                if source_name != SHARED or self._shared is None:
                    raise
                # The shared copy is bad: drop it and go to the origin once.
                await self._shared.tier.delete(tier_key)
                source, source_key, expected, source_name = await self.source(handle, shard)
                info, checksum = await self.transfer.copy(
                    handle, shard, source, source_key, self.tier, tier_key, expected, source_name, on_verified
                )
            await self.catalog.commit(handle.id, shard.key, size=info.size, version=shard.version, checksum=checksum)
        except BaseException as exc:
            try:
                await asyncio.shield(self.catalog.abandon(handle.id, shard.key, self.owner))
            except TierFullError as full:
                # The row stays ours (reserved, never resident); reconcile drops it after this process.
                logger.warning("dataset %s: shard %r: its reservation stays: %s", handle.id, shard.key, full)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise TierFullError(f"the local device cannot take shard {shard.key!r} ({exc.strerror})") from exc
            raise
        self.events.count("shards_staged")
        self.events.count("bytes_to_local", info.size)
        self.events.emit(
            StagingEvent("staged", handle.id, shard.key, LOCAL, source_name, info.size, time.monotonic() - started)
        )
        return Location(LOCAL, self.tier.path(tier_key), shard, checksum)

    async def source(
        self, handle: DatasetHandle, shard: Shard, *, learned: bool = True
    ) -> tuple[Tier, str, str | None, str]:
        """Where to copy ``shard`` from: the shared tier if it holds (or takes) it, else the origin.

        ``learned``: also look up a checksum this node learned for it (none while its row is reserved).
        """
        if self._shared is not None:
            try:
                _, checksum = await self._shared.ensure(handle, shard)
            except (TierFullError, TierAccessError, InvalidKeyError) as exc:
                # Full, not this user's to write, or a link planted on its way: go around it.
                logger.info("dataset %s: shard %r bypasses the shared tier: %s", handle.id, shard.key, exc)
            else:
                return self._shared.tier, handle.tier_key(shard.key), checksum, SHARED
        expected = shard.checksum or (await known_checksum(self.catalog, handle, shard) if learned else None)
        return handle.origin, shard.key, expected, ORIGIN

    async def next_tier_location(self, handle: DatasetHandle, shard: Shard) -> Location:
        """Where to read a shard the local tier declined: the shared tier if it can hold it, else the origin."""
        if self._shared is not None:
            try:
                path, checksum = await self._shared.ensure(handle, shard)
            except (TierFullError, TierAccessError, InvalidKeyError):
                pass
            else:
                return Location(SHARED, path, shard, checksum)
        return Location(ORIGIN, None, shard, shard.checksum or await known_checksum(self.catalog, handle, shard))

    async def delete_victims(self, victims: Sequence[CatalogEntry]) -> None:
        """Delete shards the catalog marked as evicting, and record them gone."""
        if not victims:
            return
        for victim in victims:
            await self.tier.delete(f"{victim.dataset}/{victim.key}")
            self.events.emit(StagingEvent("evicted", victim.dataset, victim.key, LOCAL, size=victim.size))
        await self.catalog.evicted(victims)
        self.events.count("evictions", len(victims))
        self.events.count("evicted_bytes", sum(v.size for v in victims))

    async def trim(self) -> int:
        """Evict down to the tier's capacity (least recently used first); return the shards evicted.

        A tier is found over it when a process that ran with another capacity, or none, filled it
        (a reader's fallback while the daemon was down), or when the operator lowered it.
        """
        capacity = self.tier.capacity
        if capacity is None:
            return 0
        used, _ = await self.catalog.usage()
        if used <= capacity:
            return 0
        await self.catalog.drop_dead_leases()  # a killed reader's holdings keep nothing
        victims = await self.catalog.trim(capacity, self.owner)
        await self.delete_victims(victims)
        freed = sum(v.size for v in victims)
        left = "" if used - freed <= capacity else "; the rest is pinned or held by live readers"
        logger.warning(
            "the local tier %s held %s, over its capacity of %s: evicted %d shard(s), %s%s",
            self.settings.local_dir,
            format_bytes(used),
            format_bytes(capacity),
            len(victims),
            format_bytes(freed),
            left,
        )
        return len(victims)


def _sizes(tier: LocalTier, keys: Sequence[str]) -> list[tuple[Path, int]]:
    """Each file's path and size, -1 for one that is not there (blocking: one thread job for many)."""
    return tier.sizes(keys)


def reserve_for(directory: Path) -> int:
    """Bytes to leave free on the device: 2% of it, at most 10 GB, and at least the catalog's room."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return CATALOG_ROOM
    return max(CATALOG_ROOM, min(st.f_blocks * st.f_frsize // 50, 10 * 10**9))
