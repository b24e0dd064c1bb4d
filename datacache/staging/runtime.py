"""The stager's life: its parts built per event loop, a dataset opened, the stager closed, recovery.

`StagerRuntime` is the base of the `datacache.staging.stager.Stager` facade: what every verb
stands on (`_ready`: the loop-bound parts, the one reconcile), kept apart from the verbs
(`datacache.staging.verbs`) and the warm (`datacache.staging.stager`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

from datacache.catalog import Catalog, process_owner
from datacache.config import DatasetConfig, Settings, resolve_dataset
from datacache.errors import (
    ConfigError,
    DatacacheError,
    StagerClosedError,
)
from datacache.manifest import ManifestStore, object_url, reading_url, take_manifest
from datacache.ownership import check_not_writable_by_others, operator_writes
from datacache.staging import recovery
from datacache.staging.batch import SMALL, stage_batch
from datacache.staging.events import Events, Listener
from datacache.staging.local import LocalStager
from datacache.staging.origins import Origins, close_quietly
from datacache.staging.queue import DURABLE_WAIT, JobQueue, serve_early
from datacache.staging.residency import Residency
from datacache.staging.sessions import TierSession
from datacache.staging.shared import SharedStager
from datacache.staging.tier_activity import TierActivity
from datacache.staging.transfer import Transfer
from datacache.staging.types import (
    LOCAL,
    PRIORITY_URGENT,
    SHARED,
    DatasetHandle,
    Job,
    Location,
    StagerStats,
)
from datacache.tiers import LocalTier, ObjectTier, SharedTier, redact_url
from datacache.tiers.local import PRIVATE, LocalModes

__all__ = ["StagerRuntime"]

logger = logging.getLogger(__name__)


@dataclass
class _Parts:
    """The loop-bound parts, built on first use in each event loop."""

    loop: asyncio.AbstractEventLoop
    queue: JobQueue
    local: LocalStager
    shared: SharedStager | None
    lock_waiters: concurrent.futures.ThreadPoolExecutor


class StagerRuntime:
    """A stager's configuration, its loop-bound parts, and its start-up and shutdown (see `Stager`)."""

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
        self.manifests = ManifestStore(
            *manifest_dirs,
            trusted_uids=self._trusted,
            readers=self.local.dataset_readers,
            group_copies=operator_writes(settings.daemon_uid),
            shared_max_age=settings.shared_manifest_age,
        )
        self._reconcile_wanted = reconcile
        self._owner = process_owner()
        self._session = None if inspect else TierSession(settings.local_dir, self._owner, self.local.dir_mode)
        """This process's use of the local tier (`staging.sessions`): opened with the first runtime."""
        self._session_opened = False
        self._session_lock = threading.Lock()
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

    def _open_session(self) -> None:
        """Register this process as the tier's user, once (a thread's job: it locks and fsyncs)."""
        with self._session_lock:
            if self._session is not None and not self._session_opened:
                self._session.open()
                self._session_opened = True

    async def _ready(self) -> _Parts:
        parts = self._runtime()
        if not self._session_opened and self._session is not None:
            # Before anything is staged (from here a crash is recovered), off the loop: its fsyncs
            # held a stager's loop, every transfer with it, while the disk was slow.
            await asyncio.to_thread(self._open_session)
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
        queue = JobQueue(
            self._run_job, events, settings.concurrency, run_batch=self._run_batch, batchable=self._batchable
        )
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

    def _batchable(self, job: Job) -> bool:
        """Whether ``job`` may be staged in a batch (`JobQueue`): a prefetch of a small shard onto the local tier,
        read from an origin on this machine's filesystem, with no bandwidth limit.

        A batch lands whole: a reader that comes to wait for one of its shards waits for all of them.
        So not a job a reader waits for already (the one-shard way hands it the bytes before they are
        durable), nor shards read one request each (from object storage, or through the shared tier),
        nor under a bandwidth limit (the batch takes its whole share of the rate first); nor a warm's
        (its turn orders its reservations), nor a shard larger than the local tier (refused).
        """
        parts = self._parts
        if parts is None or job.tier != LOCAL or job.after is not None or job.priority <= PRIORITY_URGENT:
            return False
        origin = job.handle.origin
        if self.settings.bandwidth_limit or parts.local.through_shared:
            return False
        if not isinstance(origin, ObjectTier) or not origin.has_local_paths:
            return False
        capacity = parts.local.tier.capacity
        small = min(parts.local.transfer.keep_limit, SMALL)
        return job.shard.size <= small and (capacity is None or job.shard.size <= capacity)

    async def _run_batch(self, jobs: Sequence[Job]) -> list[Location | BaseException]:
        parts = self._parts
        if parts is None:
            raise StagerClosedError("the stager is not running")
        return await stage_batch(parts.local, jobs[0].handle, [job.shard for job in jobs])

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
        if self._session is not None and self._session_opened:
            await asyncio.to_thread(self._session.close)  # the last user leaves the tier marked clean

    async def __aenter__(self) -> Self:
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
                if manifest is None and not refresh:
                    # Another node's listing by this user, young enough: the cluster lists the origin once.
                    manifest = await self.manifests.load_shared(config.id)
                    if manifest is not None:
                        await self.manifests.save(manifest, shared=False)  # its age stays the listing's
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

    async def reconcile(self) -> dict[str, int]:
        """Repair what killed processes left: stale rows, partial files, vanished or orphan files.

        Runs under a node lock taken without waiting: if another process is
        reconciling, this one leaves it the job.
        """
        parts = self._runtime()
        if not self._session_opened and self._session is not None:
            await asyncio.to_thread(self._open_session)  # its `found_clean` decides what recovery lists
        if parts.shared is not None:
            await parts.shared.check()  # a daemon's start-up too: say what is wrong before its first client
        if self._reconcile_wanted and self._reconciling is None:
            # Asked for before any verb: this is the stager's one reconcile, verbs wait for it.
            self._reconciling = parts.loop.create_task(self._reconcile(parts))
            return await self._reconciling
        return await self._reconcile(parts)

    async def _reconcile(self, parts: _Parts) -> dict[str, int]:
        counts = await recovery.reconcile(
            self.settings,
            self.local,
            self.shared,
            self.catalog,
            owner=self._owner,
            shard_lock=parts.local.node_lock,
            clean=self._session is not None and self._session.found_clean,
        )
        counts["over_capacity_evicted"] = await parts.local.trim()
        return counts


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
