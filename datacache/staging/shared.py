"""The shared tier: one copy per cluster, staged from the origin once (a lease lock per shard).

Single-flight within the process (one future per shard), and across processes
and nodes by a `LeaseLock` beside the shard on the shared filesystem. Room is
made one decision at a time, counting the transfers this process has in flight.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from datacache.catalog import Catalog
from datacache.errors import InvalidKeyError, OriginError, TierAccessError, TierFullError
from datacache.eviction import Candidate
from datacache.locks import LeaseLock
from datacache.manifest import Shard
from datacache.sizes import format_bytes
from datacache.staging.events import Events
from datacache.staging.residency import Residency
from datacache.staging.transfer import Transfer
from datacache.staging.types import ORIGIN, SHARED, DatasetHandle, StagingEvent
from datacache.tiers import ObjectInfo, SharedTier
from datacache.tiers.files import Place

__all__ = ["SharedStager", "evict_shared", "known_checksum", "shared_copy_matches"]

logger = logging.getLogger(__name__)


def shared_copy_matches(info: ObjectInfo, dataset_id: str, shard: Shard, trusted: frozenset[int]) -> bool:
    """Whether a shared-tier copy may stand for this shard: its version, complete, vouched for.

    ``shard.version`` came from the reader's own listing of the origin. The
    copy's metadata binds (dataset, key, version, size, checksum) and counts
    only if a trusted uid (this user, root, the daemon) wrote both the copy and
    its metadata: anyone else who can write the shared directory could bind
    any bytes to any version (docs/SECURITY.md, "Trust in cached data").
    """
    metadata = info.metadata
    return (
        info.writers is not None
        and bool(info.writers)
        and info.writers <= trusted
        and info.size == shard.size
        and metadata.get("dataset") == dataset_id
        and metadata.get("key") == shard.key
        and metadata.get("version") == str(shard.version)
        and metadata.get("size") == str(shard.size)
        and bool(metadata.get("checksum"))
        and (shard.checksum is None or metadata.get("checksum") == shard.checksum)
    )


async def known_checksum(catalog: Catalog, handle: DatasetHandle, shard: Shard) -> str | None:
    """The checksum this node learned for the shard's current version, if any."""
    entry = await catalog.get(handle.id, shard.key)
    if entry is not None and entry.version == shard.version:
        return entry.checksum
    return None


async def evict_shared(shared: SharedTier, dataset_id: str) -> tuple[int, int]:
    """Remove a dataset's shards from the shared tier; return (shards, bytes)."""
    count = size = 0
    async for info in shared.list(f"{dataset_id}/"):
        if await shared.delete(info.key):
            count += 1
            size += info.size
    return count, size


class SharedStager:
    """Stages shards onto the shared tier from the origin; bound to the running loop."""

    def __init__(
        self,
        tier: SharedTier,
        catalog: Catalog,
        transfer: Transfer,
        residency: Residency,
        events: Events,
        *,
        lease_seconds: float,
        trusted: frozenset[int],
    ) -> None:
        self.tier = tier
        self._trusted = trusted
        self._catalog = catalog
        self._transfer = transfer
        self._residency = residency
        self._events = events
        self._lease_seconds = lease_seconds
        self._flights: dict[tuple[str, str], asyncio.Future[tuple[Path, str | None]]] = {}
        self._room = asyncio.Lock()
        self._reserved: dict[tuple[str, str], int] = {}
        self._index = _SharedIndex()
        self._refusal: str | None = None
        self._checked = False

    async def check(self) -> None:
        """Check once, at start-up, that this user can use the tier; warn what is wrong; refuse it if unwritable."""
        if self._checked:
            return
        self._checked = True
        access = await asyncio.to_thread(self.tier.check_access)
        refused = await asyncio.to_thread(self.tier.acl_refused) if access.writable else []
        if refused:  # never 0640 to the whole group instead (docs/SECURITY.md)
            kept = ", ".join(refused)
            self._refusal = f"{self.tier.root} refuses POSIX ACLs, which alone keep {kept} to their readers"
            logger.warning("not using the shared tier, reading around it: %s", self._refusal)
        elif access.writable:
            for problem in access.problems:
                logger.warning("%s", problem)
        else:
            self._refusal = "; ".join(access.problems) or f"shared tier {self.tier.root}: not writable"
            logger.warning("not using the shared tier, reading around it: %s", self._refusal)

    @property
    def refusal(self) -> str | None:
        """Why this user does not use the shared tier, or None."""
        return self._refusal

    async def ensure(self, handle: DatasetHandle, shard: Shard) -> tuple[Path, str | None]:
        """Make the shard resident on the shared tier, once per process and once per cluster.

        Raises `TierAccessError` if this user cannot use the tier (callers read around it).
        """
        await self.check()
        if self._refusal is not None:
            raise TierAccessError(f"the shared tier {self.tier.root} is not used: {self._refusal}")
        ident = (handle.id, shard.key)
        flight = self._flights.get(ident)
        if flight is not None:
            return await asyncio.shield(flight)
        flight = asyncio.get_running_loop().create_future()
        self._flights[ident] = flight
        try:
            try:
                result = await self._stage(handle, shard)
            except PermissionError as exc:
                # The origin refusing this user is the origin's answer, not a tier problem:
                # reading around the tier would only ask the origin again.
                if isinstance(exc, (TierAccessError, OriginError)):
                    raise
                # A directory another member created without the group's modes, say: go around it.
                logger.warning("dataset %s: shard %r cannot use the shared tier: %s", handle.id, shard.key, exc)
                raise TierAccessError(f"shared tier {self.tier.root}: {exc}") from exc
        except BaseException as exc:
            flight.set_exception(exc)
            flight.exception()  # retrieved: waiters re-raise it, nobody else needs to
            raise
        else:
            flight.set_result(result)
            return result
        finally:
            self._flights.pop(ident, None)

    async def _stage(self, handle: DatasetHandle, shard: Shard) -> tuple[Path, str | None]:
        shared = self.tier
        tier_key = handle.tier_key(shard.key)
        info = await shared.stat(tier_key)
        if info is not None and shared_copy_matches(info, handle.id, shard, self._trusted):
            self._events.hit(SHARED)
            self._events.emit(StagingEvent("hit", handle.id, shard.key, SHARED, size=shard.size))
            return shared.path(tier_key), info.metadata["checksum"]
        lock = LeaseLock(shared.lock_place(tier_key), lease_seconds=self._lease_seconds)
        async with lock.hold():
            if lock.took_over:
                # Only the lock's holder writes this key: a dead holder's temporary file is garbage.
                # A holder on another node may only be slow: its file is kept while written within a lease.
                min_age = 0.0 if lock.holder_died_here else self._lease_seconds
                await shared.remove_partials_of(tier_key, min_age=min_age)
            info = await shared.stat(tier_key)
            if info is not None and shared_copy_matches(info, handle.id, shard, self._trusted):
                self._events.hit(SHARED)
                return shared.path(tier_key), info.metadata["checksum"]
            await self._make_room(handle, shard)
            started = time.monotonic()
            try:
                expected = shard.checksum or await known_checksum(self._catalog, handle, shard)
                info, checksum = await self._transfer.copy(
                    handle, shard, handle.origin, shard.key, shared, tier_key, expected, ORIGIN
                )
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise TierFullError(
                        f"dataset {handle.id}: no space on the shared tier for shard {shard.key!r} ({exc.strerror})"
                    ) from exc
                raise
            else:
                self._index.added(handle.id, shard.key, info.size)
            finally:
                # Written (and now counted by the index) or abandoned.
                self._reserved.pop((handle.id, shard.key), None)
            self._events.count("bytes_to_shared", info.size)
            self._events.count("shards_to_shared")
            self._events.emit(
                StagingEvent("staged", handle.id, shard.key, SHARED, ORIGIN, info.size, time.monotonic() - started)
            )
            return shared.path(tier_key), checksum

    async def _make_room(self, handle: DatasetHandle, shard: Shard) -> None:
        shared = self.tier
        if shared.capacity is None:
            return
        if shard.size > shared.capacity:
            raise TierFullError(
                f"dataset {handle.id}: shard {shard.key!r} ({format_bytes(shard.size)}) is larger than "
                f"the shared tier's capacity ({format_bytes(shared.capacity)})"
            )
        # One decision at a time, counting the transfers this process has in flight:
        # otherwise concurrent transfers all see the same free space and overfill the tier.
        async with self._room:
            if await self._index.refresh(shared, self._trusted):
                self._events.count("shared_scans")
            reserved = sum(self._reserved.values())
            need = self._index.used + reserved + shard.size - shared.capacity
            if need > 0:
                pinned = {record.id for record in await self._catalog.datasets() if record.pinned}
                candidates = [
                    Candidate(c.dataset, c.key, c.size, c.last_access, c.dataset in pinned)
                    for c in self._index.residents.values()
                    if not (c.dataset == handle.id and c.key == shard.key)
                ]
                victims = self._residency.chooser(handle)(
                    Candidate(handle.id, shard.key, shard.size, time.time()), candidates, need
                )
                if victims is None:
                    raise TierFullError(
                        f"dataset {handle.id}: the shared tier is full and its eviction policy keeps what it holds"
                    )
                for victim in victims:
                    await shared.delete(f"{victim.dataset}/{victim.key}")
                    self._index.removed(victim.dataset, victim.key)
                    self._events.emit(StagingEvent("evicted", victim.dataset, victim.key, SHARED, size=victim.size))
            self._reserved[(handle.id, shard.key)] = shard.size


class _SharedIndex:
    """The shared tier's residents as this process knows them: one walk, then kept up to date.

    Walking the whole shared tree per shard (under the room lock) made each shard cost more
    than the last. This process's own writes and evictions update the index as they happen;
    what other processes and nodes write is picked up by a new walk every `REFRESH_SECONDS`.
    """

    REFRESH_SECONDS = 60.0

    def __init__(self) -> None:
        self.residents: dict[tuple[str, str], _SharedResident] = {}
        self.used = 0
        self._walked_at: float | None = None

    async def refresh(self, shared: SharedTier, trusted: frozenset[int]) -> bool:
        """Walk the tier if never walked or the last walk is stale; return whether it walked.

        Only the copies of ``trusted`` writers (this user, root, the daemon) count against the
        capacity and are evicted: another member's files, which this user may not be able to
        remove, never make it evict its own copies (issue 33, item 9).
        """
        now = time.monotonic()
        if self._walked_at is not None and now - self._walked_at < self.REFRESH_SECONDS:
            return False
        found = [r for r in await asyncio.to_thread(_shared_candidates, shared) if r.owner in trusted]
        self.residents = {(r.dataset, r.key): r for r in found}
        self.used = sum(r.size for r in found)
        self._walked_at = now
        return True

    def added(self, dataset: str, key: str, size: int) -> None:
        self.removed(dataset, key)
        self.residents[(dataset, key)] = _SharedResident(dataset, key, size, time.time(), os.geteuid())
        self.used += size

    def removed(self, dataset: str, key: str) -> None:
        old = self.residents.pop((dataset, key), None)
        if old is not None:
            self.used -= old.size


@dataclass(frozen=True, slots=True)
class _SharedResident:
    dataset: str
    key: str
    size: int
    last_access: float
    owner: int


def _shared_candidates(shared: SharedTier) -> list[_SharedResident]:
    """Every shard file on the shared tier, walked without following links (a linked ``data/`` lists nothing)."""
    found: list[_SharedResident] = []
    try:
        top = Place(shared.root, ("data",), ".").open_parent()
    except (FileNotFoundError, NotADirectoryError, InvalidKeyError):
        return found
    try:
        for directory, _, files, dir_fd in os.fwalk(".", dir_fd=top):
            for name in files:
                key = os.path.normpath(os.path.join(directory, name))
                dataset, _, shard_key = key.partition("/")
                if not shard_key or name.endswith(".partial"):
                    continue
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append(
                        _SharedResident(dataset, shard_key, st.st_size, max(st.st_atime, st.st_mtime), st.st_uid)
                    )
    finally:
        os.close(top)
    return found
