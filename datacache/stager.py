"""The stager: moves shards origin -> shared -> local, once each, verified, atomically.

One `Stager` per process (or one per node, inside ``datacache serve``). It
answers `Stager.ensure` ("make this shard local and tell me where it is"),
takes prefetch lists with priorities, warms whole datasets, and evicts to stay
under capacity. Transfers run on a bounded pool of workers fed by a priority
queue: a reader blocked on a shard jumps ahead of every prefetch. Each shard
streams in parts (concurrent ranged GETs from object storage) through a
bounded memory budget, is hashed on the way, and becomes visible only by an
atomic rename once its size and checksum are right.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from datacache._rate import TokenBucket
from datacache.catalog import Catalog, CatalogEntry, process_owner
from datacache.config import DatasetConfig, Settings, resolve_dataset
from datacache.errors import (
    ChecksumMismatchError,
    ConfigError,
    DatacacheError,
    InvalidKeyError,
    TierFullError,
)
from datacache.eviction import Candidate, choose_victims
from datacache.locks import LeaseLock, NodeLock, lock_name
from datacache.manifest import Manifest, ManifestStore, Shard, take_manifest
from datacache.tiers import (
    ByteRange,
    LocalTier,
    ObjectInfo,
    SharedTier,
    Tier,
    device_free,
    open_origin,
    redact_url,
)
from datacache.tiers._files import remove_abandoned_partials
from datacache.units import format_bytes

__all__ = [
    "PRIORITY_PREFETCH",
    "PRIORITY_URGENT",
    "DatasetHandle",
    "Location",
    "Stager",
    "StagerStats",
    "StagingEvent",
    "WarmReport",
    "checksum_of",
    "new_hasher",
]

logger = logging.getLogger(__name__)

PRIORITY_URGENT = 0.0
"""A reader is blocked on this shard."""
PRIORITY_PREFETCH = 1.0
"""Prefetches start here; later positions in the read order get larger numbers."""

LOCAL, SHARED, ORIGIN = "local", "shared", "origin"
_TIERS = (LOCAL, SHARED)


def new_hasher() -> Any:
    """The hash every shard is checked with (xxh3, 64 bits: ~15 GB/s per core)."""
    return xxhash.xxh3_64()


def checksum_of(hasher: Any) -> str:
    """The checksum string a manifest records for a finished ``hasher``."""
    return f"xxh3_64:{hasher.hexdigest()}"


@dataclass(frozen=True)
class DatasetHandle:
    """An opened dataset: its configuration, the manifest snapshot it reads, and its origin."""

    config: DatasetConfig
    manifest: Manifest
    origin: Tier

    @property
    def id(self) -> str:
        return self.config.id

    def tier_key(self, shard_key: str) -> str:
        """The key of one of this dataset's shards in the shared and local tiers."""
        return f"{self.id}/{shard_key}"


@dataclass(frozen=True, slots=True)
class Location:
    """Where a shard can be read now.

    ``tier`` is ``"local"`` or ``"shared"`` (then ``path`` is a file to open) or
    ``"origin"`` (the shard was not cached: read it with `Stager.read`).
    ``checksum`` is what its bytes must hash to, when known.
    """

    tier: str
    path: Path | None
    shard: Shard
    checksum: str | None


@dataclass(frozen=True, slots=True)
class StagingEvent:
    """Something the stager did; listeners (progress bars, metrics) receive these."""

    kind: str  # "hit", "staged", "bytes", "failed", "evicted", "bypass", "retry"
    dataset: str
    key: str
    tier: str = ""
    source: str = ""
    size: int = 0
    seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True, slots=True)
class StagerStats:
    """Counters of one stager since it started."""

    bytes_from_origin: int = 0
    bytes_from_shared: int = 0
    bytes_to_shared: int = 0
    bytes_to_local: int = 0
    shards_staged: int = 0
    shards_to_shared: int = 0
    hits: Mapping[str, int] = field(default_factory=dict)
    misses: int = 0
    bypassed: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    checksum_failures: int = 0
    failures: int = 0
    retries: int = 0
    queue_depth: int = 0
    in_flight: int = 0


@dataclass(frozen=True)
class WarmReport:
    """The outcome of `Stager.warm`: honest about every shard asked for."""

    dataset: str
    tier: str
    shards_requested: int
    shards_resident: int
    bytes_requested: int
    bytes_transferred: int
    shards_transferred: int
    shards_verified: int
    seconds: float
    failures: tuple[tuple[str, str], ...] = ()

    @property
    def complete(self) -> bool:
        """Every requested shard is resident (and verified, when asked)."""
        return self.shards_resident == self.shards_requested and not self.failures

    @property
    def rate(self) -> float:
        """Bytes transferred per second."""
        return self.bytes_transferred / self.seconds if self.seconds > 0 else 0.0


@dataclass(eq=False)
class _Job:
    handle: DatasetHandle
    shard: Shard
    tier: str
    priority: float
    future: asyncio.Future[Location]
    started: bool = False


class Stager:
    """Moves shards up the tiers; one per process, or one per node inside the daemon.

    Parameters
    ----------
    settings
        Tiers, capacities, concurrency and limits.
    reconcile
        Repair what killed processes left in the catalog and on disk, once, on
        first use. Loader workers turn this off: their parent already did it.
    """

    def __init__(self, settings: Settings, *, reconcile: bool = True) -> None:
        self.settings = settings
        self.local = LocalTier(settings.local_dir, capacity=settings.local_capacity, durable=settings.fsync)
        self.shared: SharedTier | None = (
            SharedTier(settings.shared_dir, capacity=settings.shared_capacity, durable=settings.fsync)
            if settings.shared_dir
            else None
        )
        self.catalog = Catalog(settings.local_dir / "catalog.sqlite")
        manifest_dirs = [settings.local_dir / "manifests"]
        if settings.shared_dir is not None:
            manifest_dirs.append(settings.shared_dir / "manifests")
        self.manifests = ManifestStore(*manifest_dirs)
        self._reconcile_wanted = reconcile
        self._owner = process_owner()
        self._listeners: list[Callable[[StagingEvent], None]] = []
        self._future_order: dict[str, dict[str, int]] = {}
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        # Loop- and process-bound state, created lazily and never pickled.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._jobs: dict[tuple[str, str, str], _Job] = {}
        self._queue: asyncio.PriorityQueue[tuple[float, int, _Job]] | None = None
        self._workers: list[asyncio.Task[None]] = []
        self._shared_flights: dict[tuple[str, str], asyncio.Future[tuple[Path, str | None]]] = {}
        self._shared_room: asyncio.Lock | None = None
        self._shared_reserved: dict[tuple[str, str], int] = {}
        self._memory: asyncio.Semaphore | None = None
        self._throttle: TokenBucket | None = None
        self._lock_waiters: concurrent.futures.ThreadPoolExecutor | None = None
        self._reconciled = False
        self._sequence = itertools.count()
        self._counters: dict[str, int] = dict.fromkeys(
            (
                "bytes_from_origin",
                "bytes_from_shared",
                "bytes_to_shared",
                "bytes_to_local",
                "shards_staged",
                "shards_to_shared",
                "misses",
                "bypassed",
                "evictions",
                "evicted_bytes",
                "checksum_failures",
                "failures",
            ),
            0,
        )
        self._hits: dict[str, int] = {LOCAL: 0, SHARED: 0}
        self._origins: dict[str, Tier] = {}
        self._closed = False

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings, "reconcile": self._reconcile_wanted, "listeners": []}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"], reconcile=state["reconcile"])  # type: ignore[misc]

    @property
    def mode(self) -> str:
        """This stager runs in the reader's own process."""
        return "embedded"

    # -- listeners and stats --------------------------------------------------------------

    def add_listener(self, listener: Callable[[StagingEvent], None]) -> None:
        """Call ``listener`` with every `StagingEvent` (from the event loop's thread)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[StagingEvent], None]) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _emit(self, event: StagingEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a broken progress bar must not break a transfer
                logger.exception("staging listener failed")

    def origin_retries(self) -> int:
        """Origin requests retried after a transient error since this stager started (any thread)."""
        return sum(origin.stats().retries for origin in list(self._origins.values()))

    def stats(self) -> StagerStats:
        """Counters since this stager started, with the live queue depth."""
        return StagerStats(
            hits=dict(self._hits),
            retries=self.origin_retries(),
            queue_depth=sum(1 for job in self._jobs.values() if not job.started),
            in_flight=sum(1 for job in self._jobs.values() if job.started),
            **self._counters,
        )

    # -- runtime set-up -------------------------------------------------------------------

    async def _ready(self) -> None:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise DatacacheError("the stager is closed")
        if self._loop is not loop:
            if self._loop is not None:
                self._reset_runtime()
            self._loop = loop
            self._queue = asyncio.PriorityQueue()
            budget = max(1, self.settings.memory_budget // self.settings.part_size)
            self._memory = asyncio.Semaphore(budget)
            self._shared_room = asyncio.Lock()
            if self.settings.bandwidth_limit:
                self._throttle = TokenBucket(self.settings.bandwidth_limit)
            self._lock_waiters = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="datacache-lock")
            self._workers = [
                asyncio.create_task(self._worker(), name=f"datacache-stager-{i}")
                for i in range(self.settings.concurrency)
            ]
        if self._reconcile_wanted and not self._reconciled:
            self._reconciled = True
            await self.reconcile()

    async def close(self) -> None:
        """Stop the workers (abandoning queued transfers) and release clients."""
        if self._closed:
            return
        self._closed = True
        workers, self._workers = self._workers, []
        for task in workers:
            task.cancel()
        for task in workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for job in self._jobs.values():
            if not job.future.done():
                job.future.set_exception(DatacacheError("the stager closed before this shard was staged"))
                job.future.exception()
        self._jobs.clear()
        for origin in self._origins.values():
            with contextlib.suppress(Exception):
                await origin.close()
        self._origins.clear()
        await self.catalog.close()
        if self._lock_waiters is not None:
            self._lock_waiters.shutdown(wait=False)

    async def __aenter__(self) -> Stager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- datasets -------------------------------------------------------------------------

    def _origin_for(self, dataset: DatasetConfig) -> Tier:
        origin = self._origins.get(dataset.id)
        if origin is None:
            self._check_origin_outside_tiers(dataset.url)
            origin = open_origin(dataset.url, storage_options=dataset.storage_options, retry=self.settings.retry)
            self._origins[dataset.id] = origin
        return origin

    def _check_origin_outside_tiers(self, url: str) -> None:
        if "://" in url and not url.startswith("file://"):
            return
        path = Path(url.removeprefix("file://")).absolute()
        for tier_dir in (self.settings.local_dir, self.settings.shared_dir):
            if tier_dir is not None and (path == tier_dir or tier_dir in path.parents):
                raise ConfigError(f"origin {path} lies inside the cache directory {tier_dir}; use another folder")

    async def open(self, dataset: DatasetConfig | str, *, refresh: bool = False) -> DatasetHandle:
        """Return a handle on ``dataset`` with its manifest: persisted, or listed now.

        The origin is listed only when no manifest was persisted or ``refresh``
        is asked; a refreshed manifest with changed shards makes their cached
        copies stale, and they are re-staged on their next use.
        """
        await self._ready()
        config = dataset if isinstance(dataset, DatasetConfig) else resolve_dataset(dataset, self.settings)
        origin = self._origin_for(config)
        manifest = None if refresh else await self.manifests.load(config.id)
        if manifest is None:
            # One process per node lists the origin; the others wait and read what it saved.
            async with self._node_lock("manifests", config.id).hold():
                manifest = None if refresh else await self.manifests.load(config.id)
                if manifest is None:
                    manifest = await take_manifest(config, origin)
                    await self.manifests.save(manifest)
        await self.catalog.record_dataset(
            config.id,
            url=redact_url(config.url),  # the catalog is a file on disk: no credentials in it
            policy=config.policy,
            pinned=config.pinned,
            snapshot=manifest.snapshot,
            format=manifest.format.value,
            shard_count=len(manifest.shards),
            total_bytes=manifest.total_bytes,
        )
        return DatasetHandle(config=config, manifest=manifest, origin=origin)

    async def set_future_order(self, handle: DatasetHandle, keys: Iterable[str]) -> None:
        """Tell eviction the order in which the dataset's shards will be read next (Belady)."""
        order: dict[str, int] = {}
        for position, key in enumerate(keys):
            order.setdefault(key, position)
        self._future_order[handle.id] = order

    def _choose(self, handle: DatasetHandle) -> Callable[[Candidate, list[Candidate], int], list[Candidate] | None]:
        policy = handle.config.policy
        next_use = self._future_order.get(handle.id)

        def choose(incoming: Candidate, residents: list[Candidate], need: int) -> list[Candidate] | None:
            if handle.config.pinned:
                incoming = Candidate(incoming.dataset, incoming.key, incoming.size, incoming.last_access, True)
            return choose_victims(incoming, residents, need, policy=policy, next_use=next_use)

        return choose

    # -- the public verbs -----------------------------------------------------------------

    async def ensure(
        self, handle: DatasetHandle, key: str, *, tier: str = LOCAL, priority: float = PRIORITY_URGENT
    ) -> Location:
        """Make shard ``key`` resident on ``tier`` (waiting if it is being staged) and say where.

        If eviction declines to make room (the no-thrash or Belady policy
        keeps what is resident), the returned location is the next tier down.
        """
        if tier not in _TIERS:
            raise ConfigError(f"unknown tier {tier!r} (choose local or shared)")
        if tier == SHARED and self.shared is None:
            raise ConfigError("no shared tier is configured (set cache.shared_dir or DATACACHE_SHARED_DIR)")
        await self._ready()
        shard = handle.manifest.shard(key)
        if tier == LOCAL:
            hit = await self._local_hit(handle, shard)
            if hit is not None:
                self._hits[LOCAL] += 1
                self._emit(StagingEvent("hit", handle.id, key, LOCAL, size=shard.size))
                return hit
        job = self._submit(handle, shard, tier, priority)
        return await asyncio.shield(job.future)

    async def prefetch(
        self, handle: DatasetHandle, keys: Sequence[str], *, priority: float = PRIORITY_PREFETCH
    ) -> None:
        """Queue ``keys`` for staging to the local tier, the first ones soonest; return at once."""
        await self._ready()
        for position, key in enumerate(keys):
            shard = handle.manifest.shard(key)
            job = self._submit(handle, shard, LOCAL, priority + position * 1e-6)
            job.future.add_done_callback(_ignore_result)

    async def read(self, handle: DatasetHandle, key: str, byte_range: ByteRange | None = None) -> bytes:
        """Read a shard (or a range of it) from the fastest tier that holds it, without staging it.

        A whole-shard read is checked against the shard's size and, when
        known, its checksum.
        """
        await self._ready()
        data, location, problem = await self._read_once(handle, key, byte_range)
        if problem and location.tier != ORIGIN:
            # A bad cached copy is dropped and never served: read it again from below.
            await self.report_corrupt(handle, location)
            data, location, problem = await self._read_once(handle, key, byte_range)
        if problem:
            self._counters["checksum_failures"] += 1
            raise ChecksumMismatchError(f"dataset {handle.id}: shard {key!r} from the {location.tier}: {problem}")
        return data

    async def _read_once(
        self, handle: DatasetHandle, key: str, byte_range: ByteRange | None
    ) -> tuple[bytes, Location, str]:
        """Read from the fastest tier; return the bytes, where from, and what is wrong with them."""
        shard = handle.manifest.shard(key)
        location = await self.locate(handle, key)
        if location.path is not None:
            tier: Tier | None = self.local if location.tier == LOCAL else self.shared
            if tier is None:
                raise DatacacheError(f"no {location.tier} tier is configured")
            data = await tier.get(handle.tier_key(key), byte_range)
        else:
            data = await handle.origin.get(key, byte_range, version=shard.version)
            self._counters["bytes_from_origin"] += len(data)
        if byte_range is None or (byte_range.start == 0 and byte_range.end is None):
            if len(data) != shard.size:
                return data, location, f"read {len(data)} bytes, the manifest says {shard.size}"
            if location.checksum is not None:
                hasher = new_hasher()
                hasher.update(data)
                if checksum_of(hasher) != location.checksum:
                    return data, location, "does not match its checksum"
        return data, location, ""

    async def locate(self, handle: DatasetHandle, key: str) -> Location:
        """Say where shard ``key`` can be read right now, without moving anything.

        A local copy found here counts as used (for LRU eviction): callers ask
        in order to read it.
        """
        await self._ready()
        shard = handle.manifest.shard(key)
        hit = await self._local_hit(handle, shard)
        if hit is not None:
            return hit
        if self.shared is not None:
            try:
                info = await self.shared.stat(handle.tier_key(key))
            except InvalidKeyError:  # its path resolves outside the shared tier: never read through it
                info = None
            if info is not None and self._shared_copy_matches(info, shard):
                return Location(SHARED, self.shared.path(handle.tier_key(key)), shard, info.metadata.get("checksum"))
        return Location(ORIGIN, None, shard, shard.checksum or await self._known_checksum(handle, shard))

    async def report_corrupt(self, handle: DatasetHandle, location: Location) -> None:
        """A reader found ``location``'s bytes wrong: drop that copy so the next ensure re-stages it."""
        key = location.shard.key
        self._counters["checksum_failures"] += 1
        logger.warning("dataset %s: shard %r on the %s tier is corrupt; dropping it", handle.id, key, location.tier)
        if location.tier == LOCAL:
            await self.catalog.remove(handle.id, key)
            await self.local.delete(handle.tier_key(key))
        elif location.tier == SHARED and self.shared is not None:
            await self.shared.delete(handle.tier_key(key))

    async def warm(
        self,
        handle: DatasetHandle,
        shards: Sequence[Shard] | None = None,
        *,
        tier: str = LOCAL,
        verify: bool = False,
    ) -> WarmReport:
        """Stage ``shards`` (default: all) onto ``tier`` and report exactly what is resident.

        With ``verify``, shards already resident are re-hashed, and re-staged if
        they do not match. Progress reaches the listeners as events.
        """
        await self._ready()
        chosen = list(handle.manifest.shards if shards is None else shards)
        target = self.local if tier == LOCAL else self.shared
        capacity = target.capacity if target is not None else None
        too_big = [shard for shard in chosen if capacity is not None and shard.size > capacity]
        if too_big and capacity is not None:
            # Nothing could ever succeed for these: say so once, before moving a byte.
            largest = max(too_big, key=lambda shard: shard.size)
            raise TierFullError(
                f"dataset {handle.id}: the {tier} tier's capacity ({format_bytes(capacity)}) is smaller than "
                f"{len(too_big)} of the requested shards "
                f"(the largest, {largest.key!r}, is {format_bytes(largest.size)})"
            )
        started = time.monotonic()
        before = self._counters["bytes_to_local" if tier == LOCAL else "bytes_to_shared"]
        staged_counter = "shards_staged" if tier == LOCAL else "shards_to_shared"
        staged_before = self._counters[staged_counter]
        verified = 0
        failures: list[tuple[str, str]] = []
        if verify:
            results = await asyncio.gather(
                *(self.verify_resident(handle, shard, tier=tier) for shard in chosen), return_exceptions=True
            )
            verified = sum(1 for result in results if result is True)
        tasks = [
            asyncio.ensure_future(self.ensure(handle, shard.key, tier=tier, priority=PRIORITY_PREFETCH + index * 1e-6))
            for index, shard in enumerate(chosen)
        ]
        resident = 0
        placed: list[Shard] = []
        for shard, outcome in zip(chosen, await asyncio.gather(*tasks, return_exceptions=True)):
            if isinstance(outcome, BaseException):
                if isinstance(outcome, asyncio.CancelledError):
                    raise outcome
                failures.append((shard.key, str(outcome)))
            elif outcome.tier == tier:
                placed.append(shard)
            else:
                failures.append((shard.key, f"not kept on the {tier} tier: {self._bypass_reason(shard, tier)}"))
        # Honest to the end: a shard staged early may have been evicted by a later one.
        for shard in placed:
            if await self._is_resident(handle, shard, tier):
                resident += 1
            else:
                failures.append(
                    (shard.key, f"evicted from the {tier} tier during the warm-up: {self._bypass_reason(shard, tier)}")
                )
        transferred = self._counters["bytes_to_local" if tier == LOCAL else "bytes_to_shared"] - before
        return WarmReport(
            dataset=handle.id,
            tier=tier,
            shards_requested=len(chosen),
            shards_resident=resident,
            bytes_requested=sum(shard.size for shard in chosen),
            bytes_transferred=transferred,
            shards_transferred=self._counters[staged_counter] - staged_before,
            shards_verified=verified,
            seconds=time.monotonic() - started,
            failures=tuple(failures),
        )

    async def _is_resident(self, handle: DatasetHandle, shard: Shard, tier: str) -> bool:
        if tier == LOCAL:
            return await self._local_hit(handle, shard, touch=False) is not None
        if self.shared is None:
            return False
        info = await self.shared.stat(handle.tier_key(shard.key))
        return info is not None and self._shared_copy_matches(info, shard)

    def _bypass_reason(self, shard: Shard, tier: str) -> str:
        tier_object = self.local if tier == LOCAL else self.shared
        capacity = tier_object.capacity if tier_object is not None else None
        if capacity is not None:
            return f"the tier is full (capacity {format_bytes(capacity)}) and the eviction policy keeps what it holds"
        return "the disk is nearly full"

    async def verify_resident(self, handle: DatasetHandle, shard: Shard, *, tier: str = LOCAL) -> bool:
        """Re-hash a resident copy; drop it if wrong. Return whether it was resident and right."""
        if tier == LOCAL:
            entry = await self.catalog.get(handle.id, shard.key)
            if entry is None or entry.state != "resident" or entry.checksum is None:
                return False
            path = self.local.path(handle.tier_key(shard.key))
            expected = entry.checksum
        else:
            if self.shared is None:
                return False
            info = await self.shared.stat(handle.tier_key(shard.key))
            if info is None or not self._shared_copy_matches(info, shard):
                return False
            path = self.shared.path(handle.tier_key(shard.key))
            expected = info.metadata["checksum"]
        actual = await asyncio.to_thread(_hash_file, path)
        if actual == expected:
            return True
        await self.report_corrupt(handle, Location(tier, path, shard, expected))
        return False

    async def evict(self, dataset_id: str, keys: Sequence[str] | None = None) -> tuple[int, int]:
        """Remove a dataset's shards (all, or ``keys``) from the local tier; return (shards, bytes)."""
        await self._ready()
        victims = await self.catalog.mark_evicting(dataset_id, keys, self._owner)
        await self._delete_victims(victims)
        return len(victims), sum(v.size for v in victims)

    async def evict_shared(self, dataset_id: str) -> tuple[int, int]:
        """Remove a dataset's shards from the shared tier; return (shards, bytes)."""
        if self.shared is None:
            return 0, 0
        count = size = 0
        async for info in self.shared.list(f"{dataset_id}/"):
            if await self.shared.delete(info.key):
                count += 1
                size += info.size
        return count, size

    # -- the queue ------------------------------------------------------------------------

    def _submit(self, handle: DatasetHandle, shard: Shard, tier: str, priority: float) -> _Job:
        if self._loop is None or self._queue is None:
            raise DatacacheError("the stager is not running in this event loop")
        ident = (handle.id, shard.key, tier)
        job = self._jobs.get(ident)
        if job is None or job.future.done():
            job = _Job(handle, shard, tier, priority, self._loop.create_future())
            self._jobs[ident] = job
            job.future.add_done_callback(lambda _: self._forget(ident, job))
        elif priority < job.priority and not job.started:
            job.priority = priority  # a reader now waits on it: it jumps the queue
        else:
            return job
        self._queue.put_nowait((job.priority, next(self._sequence), job))
        return job

    def _forget(self, ident: tuple[str, str, str], job: _Job) -> None:
        if self._jobs.get(ident) is job:
            del self._jobs[ident]

    async def _next_job(self) -> _Job:
        queue = self._queue
        if queue is None:
            raise DatacacheError("the stager is not running")
        while True:
            priority, _, job = await queue.get()
            if job.started or job.future.done() or priority != job.priority:
                continue  # a stale entry: the job was re-queued sooner, or is done
            job.started = True
            return job

    async def _worker(self) -> None:
        while True:
            job = await self._next_job()
            try:
                if job.tier == LOCAL:
                    location = await self._stage_local(job.handle, job.shard)
                else:
                    path, checksum = await self._ensure_shared(job.handle, job.shard)
                    location = Location(SHARED, path, job.shard, checksum)
            except asyncio.CancelledError:
                if not job.future.done():
                    job.future.set_exception(DatacacheError("the stager stopped before this shard was staged"))
                raise
            except Exception as exc:
                self._counters["failures"] += 1
                self._emit(StagingEvent("failed", job.handle.id, job.shard.key, job.tier, error=str(exc)))
                if not job.future.done():
                    job.future.set_exception(exc)
            else:
                if not job.future.done():
                    job.future.set_result(location)

    # -- the local tier -------------------------------------------------------------------

    async def _local_hit(self, handle: DatasetHandle, shard: Shard, *, touch: bool = True) -> Location | None:
        entry = await self.catalog.get(handle.id, shard.key)
        if entry is None or entry.state != "resident" or entry.version != shard.version:
            return None
        path = self.local.path(handle.tier_key(shard.key))
        try:
            size = (await asyncio.to_thread(os.lstat, path)).st_size
        except FileNotFoundError:
            size = -1
        if size != shard.size:
            logger.warning("dataset %s: shard %r vanished or changed on the local tier", handle.id, shard.key)
            await self.catalog.remove(handle.id, shard.key)
            return None
        if touch:
            await self.catalog.touch(handle.id, shard.key)
        return Location(LOCAL, path, shard, entry.checksum)

    def _node_lock(self, *parts: str) -> NodeLock:
        if self._lock_waiters is None:
            raise DatacacheError("the stager is not running")
        return NodeLock(self.settings.local_dir / "locks" / lock_name(*parts), self._lock_waiters)

    async def _stage_local(self, handle: DatasetHandle, shard: Shard) -> Location:
        tier_key = handle.tier_key(shard.key)
        capacity = self.local.capacity
        if capacity is not None and shard.size > capacity:
            raise TierFullError(
                f"dataset {handle.id}: shard {shard.key!r} ({format_bytes(shard.size)}) is larger than "
                f"the local tier's capacity ({format_bytes(capacity)})"
            )
        async with self._node_lock(handle.id, shard.key).hold():
            hit = await self._local_hit(handle, shard)
            if hit is not None:  # another process staged it while we waited
                self._hits[LOCAL] += 1
                return hit
            self._counters["misses"] += 1
            reservation = await self.catalog.reserve(
                handle.id,
                shard.key,
                size=shard.size,
                version=shard.version,
                owner=self._owner,
                capacity=capacity,
                device_free=lambda: device_free(self.settings.local_dir),
                reserve_free=_reserve_for(self.settings.local_dir),
                choose=self._choose(handle),
            )
            await self._delete_victims(reservation.victims)
            if not reservation.granted:
                self._counters["bypassed"] += 1
                self._emit(StagingEvent("bypass", handle.id, shard.key, LOCAL))
                return await self._next_tier_location(handle, shard)
            started = time.monotonic()
            try:
                source, source_key, expected, source_name = await self._source_for_local(handle, shard)
                try:
                    info, checksum = await self._copy(
                        handle, shard, source, source_key, self.local, tier_key, expected, source_name
                    )
                except ChecksumMismatchError:
                    if source_name != SHARED or self.shared is None:
                        raise
                    # The shared copy is bad: drop it and go to the origin once.
                    await self.shared.delete(tier_key)
                    source, source_key, expected, source_name = await self._source_for_local(handle, shard)
                    info, checksum = await self._copy(
                        handle, shard, source, source_key, self.local, tier_key, expected, source_name
                    )
                await self.catalog.commit(
                    handle.id, shard.key, size=info.size, version=shard.version, checksum=checksum
                )
            except BaseException as exc:
                await asyncio.shield(self.catalog.abandon(handle.id, shard.key, self._owner))
                if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise TierFullError(
                        f"dataset {handle.id}: no space on the local tier for shard {shard.key!r} ({exc.strerror})"
                    ) from exc
                raise
            self._counters["shards_staged"] += 1
            self._counters["bytes_to_local"] += info.size
            self._emit(
                StagingEvent("staged", handle.id, shard.key, LOCAL, source_name, info.size, time.monotonic() - started)
            )
            return Location(LOCAL, self.local.path(tier_key), shard, checksum)

    async def _source_for_local(self, handle: DatasetHandle, shard: Shard) -> tuple[Tier, str, str | None, str]:
        if self.shared is not None:
            try:
                _, checksum = await self._ensure_shared(handle, shard)
            except (TierFullError, InvalidKeyError) as exc:
                # Full, or its path resolves outside the tier (a symlink planted there): go around it.
                logger.info("dataset %s: shard %r bypasses the shared tier: %s", handle.id, shard.key, exc)
            else:
                return self.shared, handle.tier_key(shard.key), checksum, SHARED
        expected = shard.checksum or await self._known_checksum(handle, shard)
        return handle.origin, shard.key, expected, ORIGIN

    async def _next_tier_location(self, handle: DatasetHandle, shard: Shard) -> Location:
        if self.shared is not None:
            try:
                path, checksum = await self._ensure_shared(handle, shard)
            except (TierFullError, InvalidKeyError):
                pass
            else:
                return Location(SHARED, path, shard, checksum)
        return Location(ORIGIN, None, shard, shard.checksum or await self._known_checksum(handle, shard))

    async def _known_checksum(self, handle: DatasetHandle, shard: Shard) -> str | None:
        entry = await self.catalog.get(handle.id, shard.key)
        if entry is not None and entry.version == shard.version:
            return entry.checksum
        return None

    async def _delete_victims(self, victims: Sequence[CatalogEntry]) -> None:
        if not victims:
            return
        for victim in victims:
            await self.local.delete(f"{victim.dataset}/{victim.key}")
            self._emit(StagingEvent("evicted", victim.dataset, victim.key, LOCAL, size=victim.size))
        await self.catalog.evicted(victims)
        self._counters["evictions"] += len(victims)
        self._counters["evicted_bytes"] += sum(v.size for v in victims)

    # -- the shared tier ------------------------------------------------------------------

    @staticmethod
    def _shared_copy_matches(info: ObjectInfo, shard: Shard) -> bool:
        return (
            info.size == shard.size
            and info.metadata.get("version") == str(shard.version)
            and bool(info.metadata.get("checksum"))
            and (shard.checksum is None or info.metadata.get("checksum") == shard.checksum)
        )

    async def _ensure_shared(self, handle: DatasetHandle, shard: Shard) -> tuple[Path, str | None]:
        """Make the shard resident on the shared tier, once per process and once per cluster."""
        ident = (handle.id, shard.key)
        flight = self._shared_flights.get(ident)
        if flight is not None:
            return await asyncio.shield(flight)
        loop = asyncio.get_running_loop()
        flight = loop.create_future()
        self._shared_flights[ident] = flight
        try:
            result = await self._stage_shared(handle, shard)
        except BaseException as exc:
            flight.set_exception(exc)
            flight.exception()  # retrieved: waiters re-raise it, nobody else needs to
            raise
        else:
            flight.set_result(result)
            return result
        finally:
            self._shared_flights.pop(ident, None)

    async def _stage_shared(self, handle: DatasetHandle, shard: Shard) -> tuple[Path, str | None]:
        shared = self.shared
        if shared is None:
            raise ConfigError("no shared tier is configured")
        tier_key = handle.tier_key(shard.key)
        info = await shared.stat(tier_key)
        if info is not None and self._shared_copy_matches(info, shard):
            self._hits[SHARED] += 1
            self._emit(StagingEvent("hit", handle.id, shard.key, SHARED, size=shard.size))
            return shared.path(tier_key), info.metadata["checksum"]
        lock = LeaseLock(shared.lock_path(tier_key), lease_seconds=self.settings.lease_seconds)
        async with lock.hold():
            if lock.took_over:
                # Only the lock's holder writes this key: a dead holder's temporary file is garbage.
                await shared.remove_partials_of(tier_key)
            info = await shared.stat(tier_key)
            if info is not None and self._shared_copy_matches(info, shard):
                self._hits[SHARED] += 1
                return shared.path(tier_key), info.metadata["checksum"]
            await self._make_room_shared(handle, shard)
            started = time.monotonic()
            try:
                expected = shard.checksum or await self._known_checksum(handle, shard)
                info, checksum = await self._copy(
                    handle, shard, handle.origin, shard.key, shared, tier_key, expected, ORIGIN
                )
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise TierFullError(
                        f"dataset {handle.id}: no space on the shared tier for shard {shard.key!r} ({exc.strerror})"
                    ) from exc
                raise
            finally:
                # Written (and now counted by the tier's usage) or abandoned.
                self._shared_reserved.pop((handle.id, shard.key), None)
            self._counters["bytes_to_shared"] += info.size
            self._counters["shards_to_shared"] += 1
            if self.shared is not None:
                self._emit(
                    StagingEvent("staged", handle.id, shard.key, SHARED, ORIGIN, info.size, time.monotonic() - started)
                )
            return shared.path(tier_key), checksum

    async def _make_room_shared(self, handle: DatasetHandle, shard: Shard) -> None:
        shared = self.shared
        if shared is None or shared.capacity is None:
            return
        if shard.size > shared.capacity:
            raise TierFullError(
                f"dataset {handle.id}: shard {shard.key!r} ({format_bytes(shard.size)}) is larger than "
                f"the shared tier's capacity ({format_bytes(shared.capacity)})"
            )
        if self._shared_room is None:
            raise DatacacheError("the stager is not running")
        # One decision at a time, counting the transfers this process has in flight:
        # otherwise concurrent transfers all see the same free space and overfill the tier.
        async with self._shared_room:
            usage = await shared.usage()
            reserved = sum(self._shared_reserved.values())
            need = usage.used_bytes + reserved + shard.size - shared.capacity
            if need > 0:
                residents = await asyncio.to_thread(_shared_candidates, shared)
                pinned = {record.id for record in await self.catalog.datasets() if record.pinned}
                candidates = [
                    Candidate(c.dataset, c.key, c.size, c.last_access, c.dataset in pinned)
                    for c in residents
                    if not (c.dataset == handle.id and c.key == shard.key)
                ]
                victims = self._choose(handle)(
                    Candidate(handle.id, shard.key, shard.size, time.time()), candidates, need
                )
                if victims is None:
                    raise TierFullError(
                        f"dataset {handle.id}: the shared tier is full and its eviction policy keeps what it holds"
                    )
                for victim in victims:
                    await shared.delete(f"{victim.dataset}/{victim.key}")
                    self._emit(StagingEvent("evicted", victim.dataset, victim.key, SHARED, size=victim.size))
            self._shared_reserved[(handle.id, shard.key)] = shard.size

    # -- one transfer ---------------------------------------------------------------------

    async def _copy(
        self,
        handle: DatasetHandle,
        shard: Shard,
        source: Tier,
        source_key: str,
        destination: Tier,
        destination_key: str,
        expected: str | None,
        source_name: str,
    ) -> tuple[ObjectInfo, str]:
        """Stream one shard from ``source`` into ``destination``, verified; return its info and checksum."""
        hasher = new_hasher()
        received = 0
        version = shard.version if source_name == ORIGIN else None
        counter = "bytes_from_origin" if source_name == ORIGIN else "bytes_from_shared"

        async def verified_chunks() -> AsyncIterator[bytes]:
            nonlocal received
            async for chunk in self._parts(source, source_key, shard.size, version):
                received += len(chunk)
                if received > shard.size:
                    break
                hasher.update(chunk)
                self._counters[counter] += len(chunk)
                if self._throttle is not None and source_name == ORIGIN:
                    await self._throttle.take(len(chunk))
                self._emit(StagingEvent("bytes", handle.id, shard.key, destination.kind, source_name, len(chunk)))
                yield chunk
            if received != shard.size:
                raise ChecksumMismatchError(
                    f"dataset {handle.id}: shard {shard.key!r} from the {source_name}: got {received} bytes, "
                    f"the manifest says {shard.size} (the object changed or the transfer was cut short)"
                )
            if expected is not None and checksum_of(hasher) != expected:
                self._counters["checksum_failures"] += 1
                raise ChecksumMismatchError(
                    f"dataset {handle.id}: shard {shard.key!r} from the {source_name} does not match its checksum"
                )
            # Tiers read metadata once the chunks are exhausted (see Tier.put).
            metadata["checksum"] = checksum_of(hasher)

        metadata = {"version": str(shard.version), "size": str(shard.size)}
        info = await destination.put(destination_key, verified_chunks(), metadata=metadata)
        checksum = checksum_of(hasher)
        if source_name == ORIGIN and shard.checksum is None:
            logger.debug("dataset %s: learned checksum of %r: %s", handle.id, shard.key, checksum)
        return info, checksum

    async def _parts(self, source: Tier, key: str, size: int, version: str | None) -> AsyncIterator[bytes]:
        """Yield the object's bytes in order, fetching up to a few parts ahead concurrently.

        Each part in flight holds one permit of the memory budget until it has
        been handed on, so memory stays bounded however many transfers run.
        """
        memory = self._memory
        if memory is None:
            raise DatacacheError("the stager is not running")
        if size == 0:
            return
        part_size = self.settings.part_size
        if size <= part_size or source.kind != "object":
            # One part, or a file: a single stream in order, nothing buffered. On
            # object stores one GET per shard is also the cheapest in requests.
            async for chunk in source.stream(key, chunk_size=8 << 20, version=version):
                yield chunk
            return
        window = 4
        spans = [ByteRange(start, min(start + part_size, size)) for start in range(0, size, part_size)]
        pending: deque[asyncio.Task[bytes]] = deque()

        def launch(span: ByteRange) -> asyncio.Task[bytes]:
            return asyncio.ensure_future(source.get(key, span, version=version))

        try:
            for span in spans:
                while pending and (len(pending) >= window or memory.locked()):
                    head = pending.popleft()
                    try:
                        yield await head
                    finally:
                        memory.release()
                await memory.acquire()
                pending.append(launch(span))
            while pending:
                head = pending.popleft()
                try:
                    yield await head
                finally:
                    memory.release()
        finally:
            for task in pending:
                task.cancel()
                memory.release()
            for task in pending:
                with contextlib.suppress(BaseException):
                    await task

    # -- recovery -------------------------------------------------------------------------

    async def reconcile(self) -> dict[str, int]:
        """Repair what killed processes left: stale rows, partial files, vanished or orphan files.

        Runs under a node lock taken without waiting: if another process is
        reconciling, this one leaves it the job.
        """
        counts = {"stale_rows": 0, "missing_files": 0, "partials": 0, "orphans_adopted": 0, "orphans_removed": 0}
        lock_path = self.settings.local_dir / "locks" / "reconcile.lock"
        await asyncio.to_thread(lock_path.parent.mkdir, parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            import fcntl

            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return counts
            for entry in await self.catalog.stale_entries():
                await self.local.delete(f"{entry.dataset}/{entry.key}")
                await self.catalog.remove(entry.dataset, entry.key)
                counts["stale_rows"] += 1
            known: set[tuple[str, str]] = set()
            for entry in await self.catalog.entries():
                known.add((entry.dataset, entry.key))
                if entry.state != "resident":
                    continue
                try:
                    size = (await asyncio.to_thread(os.lstat, self.local.path(f"{entry.dataset}/{entry.key}"))).st_size
                except (FileNotFoundError, DatacacheError):
                    size = -1
                if size != entry.size:
                    await self.catalog.remove(entry.dataset, entry.key)
                    counts["missing_files"] += 1
            # On the node's own disk the writer's flock is authoritative: no grace period.
            counts["partials"] = await self.local.remove_abandoned_partials(min_age=0)
            # Manifests are written atomically too; a killed save leaves its temporary file.
            for directory, min_age in self._manifest_dirs():
                if directory.exists():
                    removed = await asyncio.to_thread(remove_abandoned_partials, directory, min_age=min_age)
                    counts["partials"] += len(removed)
            async for info in self.local.list():
                dataset, _, key = info.key.partition("/")
                if (dataset, key) in known or not key:
                    continue
                adopted = await self._adopt(dataset, key, info)
                counts["orphans_adopted" if adopted else "orphans_removed"] += 1
            if self.shared is not None:
                counts["partials"] += await self.shared.remove_abandoned_partials()
        finally:
            os.close(fd)
        if any(counts.values()):
            logger.info("reconciled the local tier: %s", counts)
        return counts

    def _manifest_dirs(self) -> list[tuple[Path, float]]:
        """The manifest directories, each with the grace period its partial files get."""
        found = [(self.settings.local_dir / "manifests", 0.0)]
        if self.settings.shared_dir is not None:
            found.append((self.settings.shared_dir / "manifests", 30.0))
        return found

    async def _adopt(self, dataset: str, key: str, info: ObjectInfo) -> bool:
        full = await self.local.stat(f"{dataset}/{key}")
        metadata = full.metadata if full is not None else {}
        if full is not None and metadata.get("checksum") and metadata.get("size") == str(full.size):
            reservation = await self.catalog.reserve(
                dataset,
                key,
                size=full.size,
                version=metadata.get("version"),
                owner=self._owner,
                capacity=None,
                device_free=lambda: None,
                reserve_free=0,
                choose=lambda *_: [],
            )
            if reservation.granted:
                version = metadata.get("version")
                await self.catalog.commit(
                    dataset, key, size=full.size, version=None if version == "None" else version,
                    checksum=metadata["checksum"],
                )
                return True
        await self.local.delete(f"{dataset}/{key}")
        return False


def _ignore_result(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _hash_file(path: Path) -> str:
    hasher = new_hasher()
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(buffer)
            if not count:
                break
            hasher.update(view[:count])
    return checksum_of(hasher)


def _reserve_for(directory: Path) -> int:
    """Bytes to leave free on the device: 2% of it, at most 10 GB."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return min(st.f_blocks * st.f_frsize // 50, 10 * 10**9)


@dataclass(frozen=True, slots=True)
class _SharedResident:
    dataset: str
    key: str
    size: int
    last_access: float


def _shared_candidates(shared: SharedTier) -> list[_SharedResident]:
    found: list[_SharedResident] = []
    root = shared.root / "data"
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            key = os.path.relpath(path, root).replace(os.sep, "/")
            dataset, _, shard_key = key.partition("/")
            if not shard_key or name.endswith(".partial"):
                continue
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            found.append(_SharedResident(dataset, shard_key, st.st_size, max(st.st_atime, st.st_mtime)))
    return found
