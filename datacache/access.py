"""How readers reach shards: the `ShardAccess` protocol, and `open_access` to get one.

A reader (the loader, ``datacache warm``) needs a handful of verbs: open a
dataset, ensure a shard is local, prefetch, read from wherever a shard is,
report a corrupt copy. In-process, the `Stager` answers them; on a node that
runs ``datacache serve``, a client of the daemon does, so that every process
of the node shares one cache and one transfer per shard.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

from datacache._outage import OutageAccess, OutageNotice, cannot_stage_into, outage_path, remove_outage_copies
from datacache.activity import remove_report_file, write_report_file
from datacache.client import DaemonClient
from datacache.config import DatasetConfig, Settings
from datacache.errors import DaemonUnavailableError, NotServedError
from datacache.staging import (
    PRIORITY_PREFETCH,
    PRIORITY_URGENT,
    DatasetHandle,
    FutureOrder,
    Location,
    ReaderProgress,
    Stager,
)
from datacache.tiers import ByteRange

__all__ = [
    "EMBEDDED_FALLBACK",
    "FailoverAccess",
    "ShardAccess",
    "ThroughputReporter",
    "open_access",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ShardAccess(Protocol):
    """What a reader asks of the cache. `Stager` implements it in-process."""

    @property
    def mode(self) -> str:
        """``"embedded"``, ``"daemon"``, or ``"embedded (daemon unavailable)"`` during a failover."""
        ...

    async def open(self, dataset: DatasetConfig | str, *, refresh: bool = False) -> DatasetHandle:
        """The dataset's handle, with the manifest snapshot to read."""
        ...

    async def ensure(
        self,
        handle: DatasetHandle,
        key: str,
        *,
        tier: str = "local",
        priority: float = PRIORITY_URGENT,
        early: bool = False,
    ) -> Location:
        """Make a shard resident (on the local tier by default) and say where it is.

        With ``early``, the answer may come as soon as the shard's bytes are verified in
        memory (`Location.buffer`), before its local copy is durable: what a reader in
        this process can use at once. An access that cannot answer early answers when durable.
        """
        ...

    async def prefetch(
        self, handle: DatasetHandle, keys: Sequence[str], *, priority: float = PRIORITY_PREFETCH
    ) -> None:
        """Queue shards for staging, the first ones soonest."""
        ...

    async def set_future_order(self, handle: DatasetHandle, keys: Iterable[str] | FutureOrder) -> None:
        """The node's future reads: every reader's order, or one order of keys (for Belady eviction)."""
        ...

    async def note_progress(
        self, handle: DatasetHandle, progress: ReaderProgress, *, locate: Sequence[str] = ()
    ) -> list[Location]:
        """Where a reader is in its order, and the shards it holds (never evicted while it lives).

        Returns where each of ``locate`` can be read now, moving nothing: a reader leases
        the shards it will open next and learns where they (and those it will prefetch)
        are in one call.
        """
        ...

    async def locate(self, handle: DatasetHandle, key: str) -> Location:
        """Where a shard can be read now, moving nothing."""
        ...

    async def read(
        self, handle: DatasetHandle, key: str, byte_range: ByteRange | None = None
    ) -> bytes:
        """A shard's bytes (or a range) from the fastest tier holding it."""
        ...

    async def report_corrupt(self, handle: DatasetHandle, location: Location) -> None:
        """A reader found a copy's bytes wrong: drop it so it is staged again."""
        ...

    async def close(self) -> None:
        """Release what this access holds."""
        ...

    def origin_retries(self) -> int:
        """Origin requests this process retried after a transient error (safe from any thread)."""
        ...


@runtime_checkable
class ThroughputReporter(Protocol):
    """An access that passes a reader's bandwidth and stall fraction on to the daemon's metrics."""

    async def report(
        self,
        *,
        delivered_bytes_per_s: float,
        stall_fraction: float,
        delivered_bytes: int = 0,
        dataset: str | None = None,
        **figures: Any,
    ) -> None:
        """Report what this reader delivered, and the fraction of time training waited for data.

        ``figures`` are the optional `datacache.activity.READER_FIELDS` (rank, worker, samples, ...).
        """
        ...


EMBEDDED_FALLBACK = "embedded (daemon unavailable)"


class FailoverAccess:
    """The daemon first; an in-process `Stager` while it is unreachable; then the daemon again.

    Every verb goes to ``primary`` (a `DaemonClient`) unless it was found
    unreachable less than ``retry_interval`` seconds ago. A verb that fails
    with `DaemonUnavailableError` (refused connection, daemon killed during
    the request, daemon shutting down) is answered by the fallback stager,
    created on first need, so a reader goes on through a daemon restart
    without losing or repeating a shard. Handles from either side work with
    both: a handle names its dataset, manifest snapshot and origin.

    Where this process may not write the daemon's cache (the daemon runs as its own account,
    deploy/slurm), the fallback is an `OutageAccess`: the daemon's resident shards read where
    they are, the rest staged into a directory of this uid's own.

    Parameters
    ----------
    primary
        The client of the node's daemon.
    settings
        Settings for the fallback stager (the same cache directories).
    retry_interval
        Seconds between attempts to reach the daemon again once it failed.
    down
        The daemon did not answer when this access was made: start on the fallback.
    notice
        Says the outage once per training process and outage (`datacache._outage.OutageNotice`).
    """

    def __init__(
        self,
        primary: DaemonClient,
        settings: Settings,
        *,
        retry_interval: float = 3.0,
        down: bool = False,
        notice: OutageNotice | None = None,
    ) -> None:
        self.primary = primary
        self.settings = settings
        self.notice = notice if notice is not None else OutageNotice(settings.local_dir)
        self.retry_interval = retry_interval
        self._fallback: Stager | OutageAccess | None = None
        self._own: OutageAccess | None = None
        """Where the node cache is the daemon's: this uid's own cache of the datasets it does not serve."""
        self._down_until: float | None = time.monotonic() + retry_interval if down else None
        self._down = down
        self._orders: dict[str, tuple[DatasetHandle, list[str] | FutureOrder]] = {}
        self._private: set[str] = set()
        """Datasets the daemon does not serve to this uid: read by the fallback, whoever answers (`open`)."""
        self._own_reports: set[str] = set()
        """Report files this process wrote while the daemon was away (removed once it answers again)."""
        self._closing = False
        self.failovers = 0
        self.reconnects = 0

    def __getstate__(self) -> dict[str, Any]:
        return {
            "primary": self.primary,
            "settings": self.settings,
            "retry_interval": self.retry_interval,
            "notice": self.notice,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["primary"], state["settings"], retry_interval=state["retry_interval"], notice=state["notice"]
        )

    @property
    def mode(self) -> str:
        """``"daemon"``, or ``"embedded (daemon unavailable)"`` while the fallback answers."""
        return EMBEDDED_FALLBACK if self._down else "daemon"

    def mode_of(self, dataset_id: str) -> str:
        """`mode` for one dataset: ``"embedded"`` for a job user's own, read in this process (`_private`)."""
        return "embedded" if dataset_id in self._private else self.mode

    def _fallback_stager(self) -> Stager | OutageAccess:
        if self._fallback is None:
            if cannot_stage_into(self.settings.local_dir):
                self._fallback = OutageAccess(self.settings, self.notice)
            else:
                # The daemon (or its successor) reconciles the catalog; readers never do.
                self._fallback = Stager(self.settings, reconcile=False)
        return self._fallback

    def _private_stager(self) -> Stager | OutageAccess:
        """For the datasets the daemon does not serve this uid: apart from an outage's copies (removed after it)."""
        if not cannot_stage_into(self.settings.local_dir):
            return self._fallback_stager()
        if self._own is None:
            self._own = OutageAccess(self.settings, self.notice, kind="own")
        return self._own

    async def _route(self, call: Callable[[ShardAccess], Awaitable[T]], handle: DatasetHandle | None = None) -> T:
        if handle is not None and handle.id in self._private:
            return await call(self._private_stager())
        if not self._down or (
            self._down_until is not None and time.monotonic() >= self._down_until
        ):
            try:
                result = await call(self.primary)
            except DaemonUnavailableError as exc:
                if self._closing:
                    # This process closed its own connections under the request (a DataLoader
                    # worker leaving at its epoch's end, its prefetches in flight): the daemon
                    # is fine, and nothing here needs the answer any more.
                    raise
                if not self._down:
                    self.failovers += 1
                    self.notice.say("%s; reading through this process's own stager until it is back", exc)
                self._down = True
                self._down_until = time.monotonic() + self.retry_interval
            else:
                if self._down:
                    self._down = False
                    self._down_until = None
                    self.reconnects += 1
                    self.notice.over("reconnected to the datacache daemon on %s", self.primary.socket_path)
                    await self._replay_orders(self.primary)
                return result
        fallback = self._fallback_stager()
        return await call(fallback)

    async def _replay_orders(self, access: ShardAccess) -> None:
        for handle, keys in list(self._orders.values()):
            try:
                await access.set_future_order(handle, keys)
            except DaemonUnavailableError:
                return

    async def open(self, dataset: DatasetConfig | str, *, refresh: bool = False) -> DatasetHandle:
        try:
            return await self._route(lambda access: access.open(dataset, refresh=refresh))
        except NotServedError as exc:
            # A job user's own dataset (a private bucket, a 0700 directory): the daemon holds no grant to
            # it, and this process reads it with its own credentials into a cache of its own uid.
            handle = await self._private_stager().open(dataset, refresh=refresh)
            if handle.id not in self._private:
                logger.warning("%s; reading it in this process, into a cache of this user's own", exc)
            self._private.add(handle.id)
            return handle

    async def ensure(
        self,
        handle: DatasetHandle,
        key: str,
        *,
        tier: str = "local",
        priority: float = PRIORITY_URGENT,
        early: bool = False,
    ) -> Location:
        return await self._route(
            lambda access: access.ensure(handle, key, tier=tier, priority=priority, early=early), handle
        )

    async def prefetch(
        self, handle: DatasetHandle, keys: Sequence[str], *, priority: float = PRIORITY_PREFETCH
    ) -> None:
        await self._route(lambda access: access.prefetch(handle, keys, priority=priority), handle)

    async def set_future_order(self, handle: DatasetHandle, keys: Iterable[str] | FutureOrder) -> None:
        order = keys if isinstance(keys, FutureOrder) else list(keys)
        self._orders[handle.id] = (handle, order)
        was_down = self._down
        await self._route(lambda access: access.set_future_order(handle, order), handle)
        if self._down and not was_down and handle.id not in self._private:
            await self._fallback_stager().set_future_order(handle, order)  # not private: routed above

    async def note_progress(
        self, handle: DatasetHandle, progress: ReaderProgress, *, locate: Sequence[str] = ()
    ) -> list[Location]:
        return await self._route(lambda access: access.note_progress(handle, progress, locate=locate), handle)

    async def locate(self, handle: DatasetHandle, key: str) -> Location:
        return await self._route(lambda access: access.locate(handle, key), handle)

    async def read(
        self, handle: DatasetHandle, key: str, byte_range: ByteRange | None = None
    ) -> bytes:
        return await self._route(lambda access: access.read(handle, key, byte_range), handle)

    async def report_corrupt(self, handle: DatasetHandle, location: Location) -> None:
        await self._route(lambda access: access.report_corrupt(handle, location), handle)

    def origin_retries(self) -> int:
        """Retries of this process's own origin reads and of its fallback stager (the daemon counts its own)."""
        mine = [access.origin_retries() for access in (self._fallback, self._own) if access is not None]
        return self.primary.origin_retries() + sum(mine)

    async def report(
        self,
        *,
        delivered_bytes_per_s: float,
        stall_fraction: float,
        delivered_bytes: int = 0,
        dataset: str | None = None,
        **figures: Any,
    ) -> None:
        """Pass a reader's throughput to the daemon's metrics; while it is unreachable, to a report file.

        What this process staged itself (its fallback: through an outage, or a dataset the daemon does
        not serve it) goes along as ``own_bytes_in`` and ``own_transfers``, so that ``datacache top``
        says so through the daemon; while the daemon is away the reader's figures, its fallback's
        counters and transfers go to a report file in the fallback's own cache, which ``top`` reads
        without the daemon (a job user's own directory, where the node's cache is the daemon's).
        """
        own = self._own_stager(dataset)
        if own is not None:
            figures = {**figures, "own_bytes_in": sum(own.activity.bytes_in.values()),
                       "own_transfers": len(own.activity.transfers)}
        reader = {"delivered_bytes_per_s": delivered_bytes_per_s, "stall_fraction": stall_fraction,
                  "delivered_bytes": delivered_bytes, "dataset": dataset, **figures}
        if self._down:
            if own is not None:
                name = await asyncio.to_thread(_write_own_report, own, reader)
                if name is not None:
                    self._own_reports.add(name)
            return
        try:
            await self.primary.report(**reader)
        except DaemonUnavailableError:
            logger.debug("the daemon is unreachable: throughput report dropped")
        else:
            if own is not None and self._own_reports:
                for name in self._own_reports:  # the daemon shows this reader again
                    remove_report_file(own.settings.local_dir, name)
                self._own_reports.clear()

    def _own_stager(self, dataset: str | None) -> Stager | None:
        """The stager of this process that reads ``dataset`` when the daemon does not, once made."""
        fallback = self._own if dataset in self._private and self._own is not None else self._fallback
        return fallback.private if isinstance(fallback, OutageAccess) else fallback

    async def close(self) -> None:
        self._closing = True
        await self.primary.close()
        if self._own is not None:
            own, self._own = self._own, None
            await own.close()
        if self._fallback is not None:
            fallback, self._fallback = self._fallback, None
            await fallback.close()
            if isinstance(fallback, OutageAccess) and not self._down:
                await asyncio.to_thread(remove_outage_copies, self.settings.local_dir)


def _own_report_name(reader: dict[str, Any]) -> str:
    return f"{os.getpid()}-{str(reader.get('dataset'))[:24]}-r{reader.get('rank', 0)}w{reader.get('worker', 0)}"


def _write_own_report(stager: Stager, reader: dict[str, Any]) -> str | None:
    """The report file of a reader whose daemon is away, as an embedded reader's (`loaders.stats`); its name."""
    host, pid = socket.gethostname(), os.getpid()
    document = {
        "version": 1,
        "host": host,
        "pid": pid,
        "written": time.time(),
        "client": f"{host}:{pid}:r{reader.get('rank', 0)}w{reader.get('worker', 0)}",
        "reader": reader,
        "stager": dataclasses.asdict(stager.stats()),
        "activity": stager.activity.counters(),
        "transfers": [t.to_json() for t in stager.activity.in_flight()],
    }
    name = _own_report_name(reader)
    try:
        write_report_file(stager.settings.local_dir, name, document)
    except OSError as exc:  # a full or read-only disk must not stop a reader
        logger.debug("cannot write the report file for datacache top: %s", exc)
        return None
    return name


async def open_access(settings: Settings, *, reconcile: bool = True, notice_owner: int | None = None) -> ShardAccess:
    """Return the way this process should reach shards.

    If the node's daemon answers on ``settings.daemon_socket``, a
    `FailoverAccess` over a `DaemonClient` (every process of the node shares
    the daemon's cache; if the daemon goes away, this process goes on with its
    own stager and returns to the daemon when it is back). Otherwise an
    in-process `Stager` (``reconcile`` repairs what killed processes left), or,
    where the cache is the daemon's and this process may not write it, a
    `FailoverAccess` that starts without the daemon and goes to it once it answers.
    ``notice_owner`` is the process the outage is said once for (a DataLoader worker's
    training process; by default this one).
    """
    socket_path = settings.daemon_socket
    notice = OutageNotice(settings.local_dir, notice_owner)
    if socket_path.exists():
        client = DaemonClient(settings)
        try:
            health = await client.health()
        except DaemonUnavailableError as exc:
            await client.close()
            if cannot_stage_into(settings.local_dir):
                notice.say("%s; reading through this process's own stager until it is back", exc)
                return FailoverAccess(DaemonClient(settings), settings, down=True, notice=notice)
            logger.info("%s; using an in-process stager", exc)
        else:
            notice.over("reconnected to the datacache daemon on %s", socket_path)
            if outage_path(settings.local_dir).exists():  # what an outage left, if no process uses it now
                await asyncio.to_thread(remove_outage_copies, settings.local_dir)
            return FailoverAccess(client, fallback_settings(settings, health), notice=notice)
    elif cannot_stage_into(settings.local_dir):
        notice.say(
            "no datacache daemon answers at %s (no socket); reading through this process's own stager "
            "until one does",
            socket_path,
        )
        return FailoverAccess(DaemonClient(settings), settings, down=True, notice=notice)
    return Stager(settings, reconcile=reconcile)


def fallback_settings(settings: Settings, health: dict[str, Any]) -> Settings:
    """``settings`` for a fallback stager that writes the daemon's local tier: within the daemon's capacity.

    A reader's own settings often say no capacity (the daemon's configuration does); its
    fallback would fill the tier past the daemon's limit while the daemon is away.
    """
    local = health.get("local")
    if not isinstance(local, dict):
        return settings  # a daemon of an older version
    capacity = local.get("capacity_bytes")
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
        return settings
    try:
        same = os.path.samefile(str(local.get("path")), settings.local_dir)
    except (OSError, TypeError, ValueError):
        same = False
    if not same or (settings.local_capacity is not None and settings.local_capacity <= capacity):
        return settings
    return settings.with_overrides(local_capacity=capacity)
