"""The stager: moves shards origin -> shared -> local, once each, verified, atomically.

One `Stager` per process (or one per node, inside ``datacache serve``). It
answers `Stager.ensure` ("make this shard local and tell me where it is"),
takes prefetch lists with priorities, warms whole datasets, and evicts to stay
under capacity. It is a facade over the parts of `datacache.staging`: the job
queue, the local and shared tiers' stagers, the transfer with its memory
budget, residency (what eviction keeps) and recovery; they report through
`Events` and never call back into it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from datacache.catalog import Catalog, process_owner
from datacache.checksum import hash_file
from datacache.config import DatasetConfig, Settings, resolve_dataset
from datacache.errors import (
    ChecksumMismatchError,
    ConfigError,
    DatacacheError,
    InvalidKeyError,
    StagerClosedError,
)
from datacache.manifest import ManifestStore, Shard, object_url, reading_url, take_manifest
from datacache.ownership import check_not_writable_by_others
from datacache.staging import recovery
from datacache.staging.batch import Turn, WarmBatches, make_room_for, stage_batch
from datacache.staging.events import Events, Listener
from datacache.staging.local import LocalStager
from datacache.staging.origins import Origins, close_quietly
from datacache.staging.queue import DURABLE_WAIT, JobQueue, first_answer, serve_early
from datacache.staging.reading import read_verified
from datacache.staging.residency import Residency
from datacache.staging.shared import SharedStager, evict_shared, known_checksum, shared_copy_matches
from datacache.staging.tier_activity import TierActivity
from datacache.staging.transfer import Transfer
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
    StagerStats,
    StagingEvent,
    WarmReport,
)
from datacache.staging.warm import Submit, WarmProgress, WarmSteps, bypass_reason, check_fits, run_warm
from datacache.tiers import ByteRange, LocalTier, SharedTier, Tier, redact_url
from datacache.tiers.local import PRIVATE, LocalModes

__all__ = ["Stager"]

logger = logging.getLogger(__name__)


@dataclass
class _Parts:
    """The loop-bound parts, built on first use in each event loop."""

    loop: asyncio.AbstractEventLoop
    queue: JobQueue
    local: LocalStager
    shared: SharedStager | None
    lock_waiters: concurrent.futures.ThreadPoolExecutor


class Stager:
    """Moves shards up the tiers; one per process, or one per node inside the daemon.

    Parameters
    ----------
    settings
        Tiers, capacities, concurrency and limits.
    reconcile
        Repair what killed processes left in the catalog and on disk, once, on
        first use. Loader workers turn this off: their parent already did it.
    inspect
        Only show what the cache holds (``datacache top``): whose it is is not checked.
    """

    def __init__(
        self, settings: Settings, *, reconcile: bool = True, modes: LocalModes = PRIVATE, inspect: bool = False
    ) -> None:
        _check_node_cache(settings, inspect=inspect)
        self.settings = settings
        self.local = LocalTier(
            settings.local_dir, capacity=settings.local_capacity, durable=settings.fsync, modes=modes
        )
        self.shared: SharedTier | None = (
            SharedTier(
                settings.shared_dir,
                capacity=settings.shared_capacity,
                durable=settings.fsync,
                group=settings.shared_group,
            )
            if settings.shared_dir
            else None
        )
        declared = {dataset.id: dataset.readers for dataset in settings.datasets.values() if dataset.readers}
        for tier in (self.local, self.shared):
            if tier is not None:
                tier.shared_datasets.update(declared)
                tier.dataset_readers.update({id_: (r.uids, r.gids) for id_, r in declared.items()})
        self.catalog = Catalog(settings.local_dir / "catalog.sqlite")
        manifest_dirs = [settings.local_dir / "manifests"]
        if settings.shared_dir is not None:
            manifest_dirs.append(settings.shared_dir / "manifests")
        self._trusted = settings.trusted_uids
        self.manifests = ManifestStore(*manifest_dirs, trusted_uids=self._trusted, readers=self.local.dataset_readers)
        self._reconcile_wanted = reconcile
        self._owner = process_owner()
        self._events = Events()
        self.activity = TierActivity()
        """Per-tier counters and the transfers in flight, for ``datacache top``."""
        self._events.add_listener(self.activity)
        self._residency = Residency()
        self._closing: set[asyncio.Task[None]] = set()
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        # Loop- and process-bound state, created lazily and never pickled.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._parts: _Parts | None = None
        self._reconciling: asyncio.Task[dict[str, int]] | None = None
        self._events.reset_counters()
        self._origins = Origins(self.settings)
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

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` with every `StagingEvent` (from the event loop's thread)."""
        self._events.add_listener(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._events.remove_listener(listener)

    def origin_retries(self) -> int:
        """Origin requests retried after a transient error since this stager started (any thread)."""
        return self._origins.retries()

    def stats(self) -> StagerStats:
        """Counters since this stager started, with the live queue depth."""
        queue = self._parts.queue if self._parts is not None else None
        return StagerStats(
            hits=dict(self._events.hits),
            retries=self.origin_retries(),
            queue_depth=queue.depth if queue is not None else 0,
            in_flight=queue.in_flight if queue is not None else 0,
            **self._events.counters,
        )

    # -- runtime set-up -------------------------------------------------------------------

    def _runtime(self) -> _Parts:
        """The parts bound to the running loop, built on first use in it."""
        loop = asyncio.get_running_loop()
        if self._closed:
            raise StagerClosedError("the stager is closed")
        if self._parts is None or self._loop is not loop:
            if self._loop is not None:
                self._abandon_runtime(loop)
                self._reset_runtime()
            self._loop = loop
            self._parts = self._build_parts(loop)
        return self._parts

    def _abandon_runtime(self, loop: asyncio.AbstractEventLoop) -> None:
        """Release what the runtime of an earlier event loop holds: its threads, workers and clients.

        The earlier loop is usually gone (one `asyncio.run` per call); left alone, each change
        of loop kept a lock-waiter thread pool, the origins' GET threads and sessions, and the
        queue's worker tasks.
        """
        old_loop, parts, origins = self._loop, self._parts, self._origins.tiers()
        if parts is not None:
            parts.lock_waiters.shutdown(wait=False, cancel_futures=True)
            if old_loop is not None and not old_loop.is_closed():
                for task in parts.queue.workers:
                    old_loop.call_soon_threadsafe(task.cancel)
        if origins:
            closing = loop.create_task(close_quietly(origins))
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    async def _ready(self) -> _Parts:
        parts = self._runtime()
        if parts.shared is not None:
            await parts.shared.check()  # start-up, once: warn what is wrong with the shared tier
        if self._reconcile_wanted:
            if self._reconciling is None:
                self._reconciling = parts.loop.create_task(self._reconcile(parts))
                await self._reconciling
            elif not self._reconciling.done():
                # Every verb waits for the one reconcile: nothing is staged while it repairs.
                await asyncio.shield(self._reconciling)
        return parts

    def _build_parts(self, loop: asyncio.AbstractEventLoop) -> _Parts:
        settings, events = self.settings, self._events
        transfer = Transfer(settings, events)
        shared = (
            SharedStager(
                self.shared,
                self.catalog,
                transfer,
                self._residency,
                events,
                lease_seconds=settings.lease_seconds,
                trusted=self._trusted,
            )
            if self.shared is not None
            else None
        )
        lock_waiters = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="datacache-lock")
        local = LocalStager(
            settings,
            self.local,
            self.catalog,
            owner=self._owner,
            shared=shared,
            transfer=transfer,
            residency=self._residency,
            events=events,
            lock_waiters=lock_waiters,
        )
        queue = JobQueue(self._run_job, events, settings.concurrency)
        return _Parts(loop, queue, local, shared, lock_waiters)

    async def _run_job(self, job: Job) -> Location:
        parts = self._parts
        if parts is None:
            raise StagerClosedError("the stager is not running")
        if job.tier == LOCAL:
            return await parts.local.stage(
                job.handle,
                job.shard,
                functools.partial(serve_early, job),
                wanted_now=job.priority <= PRIORITY_URGENT,
                turn=job.after,
            )
        if parts.shared is None:
            raise ConfigError("no shared tier is configured")
        path, checksum = await parts.shared.ensure(job.handle, job.shard)
        return Location(SHARED, path, job.shard, checksum)

    async def close(self, *, durable_wait: float = DURABLE_WAIT) -> None:
        """Stop the workers (abandoning queued transfers) and release clients.

        Copies whose bytes are all in get up to ``durable_wait`` seconds to become durable
        (`JobQueue.close`).
        """
        if self._closed:
            return
        self._closed = True
        parts = self._parts
        if parts is not None:
            await parts.queue.close(durable_wait=durable_wait)
        await self._origins.close()
        await self.catalog.close()
        if parts is not None:
            parts.lock_waiters.shutdown(wait=False)

    async def __aenter__(self) -> Stager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- datasets -------------------------------------------------------------------------

    async def open(self, dataset: DatasetConfig | str, *, refresh: bool = False) -> DatasetHandle:
        """Return a handle on ``dataset`` with its manifest: persisted, or listed now.

        The origin is listed only when no manifest was persisted or ``refresh``
        is asked; a refreshed manifest with changed shards makes their cached
        copies stale, and they are re-staged on their next use.
        """
        parts = await self._ready()
        config = dataset if isinstance(dataset, DatasetConfig) else resolve_dataset(dataset, self.settings)
        origin = self._origins.get(config)
        manifest = None if refresh else await self.manifests.load(config.id)
        if manifest is None:
            # One process per node lists the origin; the others wait and read what it saved.
            async with parts.local.node_lock("manifests", config.id).hold():
                manifest = None if refresh else await self.manifests.load(config.id)
                if manifest is None:
                    split = object_url(config.url)
                    parent = self._origins.get(config, split[0]) if split is not None else None
                    bounds, limit = self._origins.bounds, self.settings.listing_timeout
                    manifest = await take_manifest(config, origin, parent=parent, bounds=bounds, time_limit=limit)
                    await self.manifests.save(manifest)
        origin = self._origins.get(config, reading_url(config.url, manifest))
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
        if not locate:
            return []
        # The local copies in one catalog read (and one touch): a window of tiny shards asked
        # one by one paid a catalog read, a stat and a touch each. The rest one by one, as `locate`.
        local = await (await self._ready()).local.hits(handle, [handle.manifest.shard(key) for key in locate])
        return [local[key] if key in local else await self.locate(handle, key) for key in locate]

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
        # was a staging job that took a node lock and read the catalog only to find it there.
        resident = await parts.local.hits(handle, shards) if shards else {}
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

    async def warm(
        self,
        handle: DatasetHandle,
        shards: Sequence[Shard] | None = None,
        *,
        tier: str = LOCAL,
        verify: bool = False,
        bandwidth: float | None = None,
        progress: Callable[[WarmProgress], None] | None = None,
        submit: Submit | None = None,
    ) -> WarmReport:
        """Stage ``shards`` (default: all) onto ``tier`` and report exactly what is resident.

        With ``verify``, shards already resident are re-hashed, and re-staged if
        they do not match. ``bandwidth`` (bytes/s) paces this warm's transfers;
        ``progress`` hears after each shard. ``submit`` admits each shard's
        transfer (default: this stager's queue; the daemon passes its prefetch gate).
        This is the only warm: the CLI and the daemon adapt it, never re-implement it.

        Some of a dataset's shards (``shards``) that fit the local tier only once the dataset's
        other shards leave there make them leave, least recently used first (`make_room_for`):
        the dataset's policy (no-thrash) would keep those and refuse the ones asked for.
        """
        parts = await self._ready()
        chosen = list(handle.manifest.shards if shards is None else shards)
        check_fits(handle, chosen, tier, self._capacity(tier))
        displaced = await make_room_for(parts.local, handle, chosen) if tier == LOCAL else (0, 0)

        async def admit(shard: Shard, priority: float) -> Location:
            return await self.ensure(handle, shard.key, tier=tier, priority=priority)

        async def check(shard: Shard) -> bool:
            return await self.verify_resident(handle, shard, tier=tier)

        async def batch(shards: Sequence[Shard], turn: Turn) -> list[Location | BaseException]:
            return await stage_batch((await self._ready()).local, handle, shards, turn)

        # In this process onto the local tier: in batches (a tiny shard costs its bytes, not 5 ms).
        async with WarmBatches(batch) as batches:
            steps = WarmSteps(
                submit=submit or (batches.submit if tier == LOCAL else admit),
                residents=lambda shards: self._residents(handle, shards, tier),
                verify=check if verify else None,
                why_not_kept=lambda: bypass_reason(tier, self._capacity(tier)),
                found=(lambda shards: self._found_local(handle, shards)) if tier == LOCAL else None,
            )
            report = await run_warm(
                handle, chosen, tier=tier, events=self._events, steps=steps, bandwidth=bandwidth, progress=progress
            )
        return dataclasses.replace(report, shards_displaced=displaced[0], bytes_displaced=displaced[1])

    def _capacity(self, tier: str) -> int | None:
        target = self.local if tier == LOCAL else self.shared
        return target.capacity if target is not None else None

    async def _found_local(self, handle: DatasetHandle, shards: Sequence[Shard]) -> dict[str, Location]:
        """Those of ``shards`` resident on the local tier, in one catalog read (a read of each recorded)."""
        found = await (await self._ready()).local.hits(handle, shards)
        for _ in found:
            self._events.hit(LOCAL)
        return found

    async def _residents(self, handle: DatasetHandle, shards: Sequence[Shard], tier: str) -> set[str]:
        if tier == LOCAL:
            parts = await self._ready()
            return await parts.local.resident_keys(handle, shards)
        found: set[str] = set()
        for shard in shards:
            info = await self.shared.stat(handle.tier_key(shard.key)) if self.shared is not None else None
            if info is not None and shared_copy_matches(info, handle.id, shard, self._trusted):
                found.add(shard.key)
        return found

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
            if info is None or not shared_copy_matches(info, handle.id, shard, self._trusted):
                return False
            path = self.shared.path(handle.tier_key(shard.key))
            expected = info.metadata["checksum"]
        actual = await asyncio.to_thread(hash_file, path)
        if actual == expected:
            return True
        await self.report_corrupt(handle, Location(tier, path, shard, expected))
        return False

    async def evict(self, dataset_id: str, keys: Sequence[str] | None = None) -> tuple[int, int]:
        """Remove a dataset's shards (all, or ``keys``) from the local tier; return (shards, bytes)."""
        parts = await self._ready()
        victims = await self.catalog.mark_evicting(dataset_id, keys, self._owner)
        await parts.local.delete_victims(victims)
        return len(victims), sum(v.size for v in victims)

    async def evict_shared(self, dataset_id: str) -> tuple[int, int]:
        """Remove a dataset's shards from the shared tier; return (shards, bytes)."""
        if self.shared is None:
            return 0, 0
        return await evict_shared(self.shared, dataset_id)

    async def reconcile(self) -> dict[str, int]:
        """Repair what killed processes left: stale rows, partial files, vanished or orphan files.

        Runs under a node lock taken without waiting: if another process is
        reconciling, this one leaves it the job.
        """
        parts = self._runtime()
        if parts.shared is not None:
            await parts.shared.check()  # a daemon's start-up too: say what is wrong before its first client
        if self._reconcile_wanted and self._reconciling is None:
            # Asked for before any verb: this is the stager's one reconcile, verbs wait for it.
            self._reconciling = parts.loop.create_task(self._reconcile(parts))
            return await self._reconciling
        return await self._reconcile(parts)

    async def _reconcile(self, parts: _Parts) -> dict[str, int]:
        counts = await recovery.reconcile(
            self.settings, self.local, self.shared, self.catalog, owner=self._owner, shard_lock=parts.local.node_lock
        )
        counts["over_capacity_evicted"] = await parts.local.trim()
        return counts


def _ignore_result(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _check_node_cache(settings: Settings, *, inspect: bool) -> None:
    """Refuse a node cache this process cannot write, or one another user could have planted.

    ``inspect``: the stager only shows what the cache holds (``datacache top`` as root, over a
    user's cache); it serves nothing, so whose the cache is is not checked.
    """
    local = settings.local_dir
    if local.exists() and not os.access(local, os.W_OK | os.X_OK):
        # A node cache that is another user's (the daemon's, deploy/slurm): staging into it would
        # fail later, shard by shard, with a raw PermissionError. Say it once, now.
        raise DatacacheError(
            f"the node cache {local} is not writable by uid {os.getuid()} (it is the node daemon's) and no "
            f"daemon this process may use answers at {settings.daemon_socket}: start the node's daemon, "
            "or set DATACACHE_LOCAL_DIR to a cache of your own"
        )
    if inspect:
        return
    # On a world-writable scratch another uid may have made the directory (or its catalog) first,
    # with copies and records of its own: its bytes would be served as this user's confirmed ones.
    trusted = settings.trusted_uids
    # Its mode alone is not refused (a pod's emptyDir is 0777; the daemon warns of it): what is in it is.
    check_not_writable_by_others(local, "the node cache", trusted=trusted, parent=False, owner_only=True)
    check_not_writable_by_others(local / "catalog.sqlite", "the node cache's catalog", trusted=trusted, parent=False)
