"""What the daemon tells about itself: tier usage, client reports, gauges, structured logs.

`StatusBoard` keeps the readers' reports (``/v1/report``) and the tiers' usage,
refreshes the Prometheus gauges before each scrape, and builds the ``/v1/status``
document; `log_event` turns the stager's events into the daemon's JSON log lines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from datacache import __version__
from datacache.activity import user_name
from datacache.config import Settings
from datacache.daemon._scheduler import PrefetchScheduler
from datacache.daemon.metrics import DaemonMetrics
from datacache.staging import LOCAL, SHARED, DatasetHandle, Stager, StagingEvent
from datacache.tiers import device_free, redact_url

__all__ = ["ClientReport", "StatusBoard", "dataset_rows", "log_event"]

logger = logging.getLogger("datacache.daemon")

ALL_CLIENTS = "all"
"""The one ``client`` label of the metrics unless the operator sets ``metrics_clients``."""


@dataclass
class ClientReport:
    bandwidth: float
    stall_fraction: float
    delivered: int
    dataset: str | None
    pid: int | None
    seen: float
    uid: int = -1
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The optional `datacache.activity.READER_FIELDS` the client sent."""


class StatusBoard:
    """Client reports, tier usage and gauges of one daemon.

    Parameters
    ----------
    settings
        The cache (its tiers and capacities).
    metrics
        The daemon's Prometheus registry.
    client_ttl
        A client that stopped reporting for this long leaves the metrics.
    names_per_uid
        Client names one uid may have in the metrics (each name is a label: the set stays bounded).
    """

    def __init__(
        self, settings: Settings, metrics: DaemonMetrics, client_ttl: float, *, names_per_uid: int = 64
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.client_ttl = client_ttl
        self.names_per_uid = names_per_uid
        self.clients: dict[str, ClientReport] = {}  # in the order they last reported
        self._shared_usage: tuple[float, Any, tuple[int, int]] | None = None

    def report(self, name: str, report: ClientReport) -> None:
        """Record a reader's report (``/v1/report``); each uid keeps at most its newest names."""
        previous = self.clients.pop(name, None)
        mine = [other for other, known in self.clients.items() if known.uid == report.uid]
        for other in mine[: max(0, len(mine) - self.names_per_uid + 1)]:  # oldest first: dicts keep order
            del self.clients[other]
            self.metrics.forget_client(other)
        self.clients[name] = report
        delivered = _newly_delivered(previous, report)
        if self.settings.metrics_clients:  # the operator asked for each client by name (host, pid, rank)
            self.metrics.client_report(
                name,
                bandwidth=report.bandwidth,
                stall_fraction=report.stall_fraction,
                delivered=delivered,
                remote_workers=report.figures.get("remote_workers"),
            )
        else:
            self._publish_total(delivered)
        self.metrics.clients.set(len(self.clients))

    def _publish_total(self, delivered: int = 0) -> None:
        """The clients as one: any local uid can scrape the port, and a client's name holds its host and pid."""
        if not self.clients:
            self.metrics.forget_client(ALL_CLIENTS)
            return
        self.metrics.client_report(
            ALL_CLIENTS,
            bandwidth=sum(known.bandwidth for known in self.clients.values()),
            stall_fraction=max(known.stall_fraction for known in self.clients.values()),
            delivered=delivered,
            remote_workers=_total_remote_workers(self.clients.values()),
        )

    def expire_clients(self) -> None:
        """Forget clients silent for the TTL, and at once those whose process has ended (a DataLoader's
        workers of the last epoch: `top` listed them as readers for the TTL after they died)."""
        cutoff = time.monotonic() - self.client_ttl
        gone = [name for name, report in self.clients.items() if report.seen < cutoff or _ended(report.pid)]
        for name in gone:
            del self.clients[name]
            self.metrics.forget_client(name)
        if gone and not self.settings.metrics_clients:
            self._publish_total()
        self.metrics.clients.set(len(self.clients))

    async def refresh_gauges(self, stager: Stager | None, scheduler: PrefetchScheduler | None) -> None:
        """Bring the gauges up to date before a scrape."""
        self.expire_clients()
        if scheduler is not None:
            self.metrics.prefetch_pending.set(scheduler.pending)
        for usage in await self.tier_usage(stager):
            tier = usage["tier"]
            self.metrics.tier_used.labels(tier).set(usage["used_bytes"])
            self.metrics.tier_shards.labels(tier).set(usage["shards"])
            if usage["capacity_bytes"] is not None:
                self.metrics.tier_capacity.labels(tier).set(usage["capacity_bytes"])
            if usage["device_free_bytes"] is not None:
                self.metrics.tier_free.labels(tier).set(usage["device_free_bytes"])

    async def tier_usage(self, stager: Stager | None) -> list[dict[str, Any]]:
        if stager is None:
            return []
        used, count = await stager.catalog.usage()
        free = await asyncio.to_thread(device_free, self.settings.local_dir)
        tiers = [
            {
                "tier": LOCAL,
                "path": str(self.settings.local_dir),
                "used_bytes": used,
                "shards": count,
                "capacity_bytes": self.settings.local_capacity,
                "device_free_bytes": free,
            }
        ]
        if stager.shared is not None:
            now = time.monotonic()
            change = stager.activity.held_change(SHARED)
            if self._shared_usage is None or now - self._shared_usage[0] > 60:
                # Walking a distributed filesystem is slow: once a minute at most. What this daemon
                # stored or evicted there since is added at once (a new user's top showed it empty
                # while the daemon filled it); other nodes' writes show with the next walk.
                self._shared_usage = (now, await stager.shared.usage(), change)
            _, walked, then = self._shared_usage
            shared = dataclasses.replace(
                walked,
                used_bytes=max(0, walked.used_bytes + change[0] - then[0]),
                object_count=max(0, walked.object_count + change[1] - then[1]),
            )
            tiers.append(
                {
                    "tier": SHARED,
                    "path": str(self.settings.shared_dir),
                    "used_bytes": shared.used_bytes,
                    "shards": shared.object_count,
                    "capacity_bytes": self.settings.shared_capacity,
                    "device_free_bytes": shared.device_free_bytes,
                }
            )
        return tiers

    async def document(
        self,
        stager: Stager,
        scheduler: PrefetchScheduler,
        handles: list[DatasetHandle],
        pins: set[str],
        serving: dict[str, Any],
        *,
        viewer: int | None = None,
    ) -> dict[str, Any]:
        """The ``/v1/status`` reply; ``serving`` holds the lifecycle's own fields.

        ``viewer``: the uid of a caller who is not an operator, who sees only their own clients.
        """
        self.expire_clients()
        now = time.monotonic()
        return {
            "version": __version__,
            "pid": os.getpid(),
            **serving,
            "workers": self.settings.concurrency,
            "prefetch": {
                "slots": scheduler.slots,
                "pending": scheduler.pending,
                "running": scheduler.running,
                "dropped": scheduler.dropped,
                "bandwidth_limit": scheduler.bandwidth,
            },
            "stats": dataclasses.asdict(stager.stats()),
            "tiers": await self.tier_usage(stager),
            "datasets": [_dataset_document(handle, pins) for handle in handles],
            "clients": [
                {
                    "client": name,
                    "pid": report.pid,
                    "dataset": report.dataset,
                    "delivered_bytes_per_s": report.bandwidth,
                    "stall_fraction": report.stall_fraction,
                    "seconds_since_report": round(now - report.seen, 3),
                }
                for name, report in sorted(self.clients.items())
                if viewer is None or report.uid == viewer
            ],
        }


    async def top_document(
        self,
        stager: Stager,
        handles: list[DatasetHandle],
        *,
        uid: int,
        operator: bool,
        opened: set[str],
    ) -> dict[str, Any]:
        """The ``/v1/top`` reply: node figures, and what belongs to ``uid`` (all of it for an operator).

        A user sees their own clients and the transfers and datasets of what they opened;
        tier usage and the stager's counters are the node's, as in ``/v1/status``.
        """
        self.expire_clients()
        wall = time.time()
        clients = self._client_rows(uid, operator)
        visible = {handle.id for handle in handles if operator or handle.id in opened}
        size = _shard_sizes(handles)
        activity = stager.activity
        return {
            "version": __version__,
            "pid": os.getpid(),
            "time": wall,
            "uid": uid,
            "operator": operator,
            "stats": dataclasses.asdict(stager.stats()),
            "activity": activity.counters(),
            "tiers": await self.tier_usage(stager),
            "transfers": [
                transfer.to_json(size(transfer.dataset, transfer.key))
                for transfer in activity.in_flight()
                if transfer.dataset in visible
            ],
            "datasets": [
                {
                    "id": handle.id,
                    "name": handle.config.name,
                    "url": redact_url(handle.config.url),
                    "policy": handle.config.policy,
                }
                for handle in handles
                if handle.id in visible
            ],
            "clients": clients,
        }

    def _client_rows(self, uid: int, operator: bool) -> list[dict[str, Any]]:
        """The clients' latest reports, as rows of ``datacache top``: ``uid``'s, or all for an operator."""
        now = time.monotonic()
        return [
            {
                "client": name,
                "uid": report.uid,
                "user": user_name(report.uid),
                "pid": report.pid,
                "dataset": report.dataset,
                "delivered_bytes_per_s": report.bandwidth,
                "stall_fraction": report.stall_fraction,
                "delivered_bytes": report.delivered,
                "seconds_since_report": round(now - report.seen, 3),
                **report.figures,
            }
            for name, report in sorted(self.clients.items())
            if operator or report.uid == uid
        ]


def _shard_sizes(handles: list[DatasetHandle]) -> Callable[[str, str], int | None]:
    """A shard's size by dataset id and key, from the open datasets' manifests (None: not known)."""
    by_id = {handle.id: handle for handle in handles}

    def size(dataset: str, key: str) -> int | None:
        handle = by_id.get(dataset)
        try:
            return handle.manifest.shard(key).size if handle is not None else None
        except (LookupError, OSError):
            return None

    return size


def _total_remote_workers(reports: Iterable[ClientReport]) -> int | None:
    """The remote workers making the clients' batches, all told; None where no client has a pool."""
    pools = [int(known.figures["remote_workers"]) for known in reports if "remote_workers" in known.figures]
    return sum(pools) if pools else None


def _newly_delivered(previous: ClientReport | None, report: ClientReport) -> int:
    """Bytes delivered since the client's last report: reports carry the epoch's running total."""
    if previous is None or report.delivered < previous.delivered:
        return report.delivered  # a first report, or a new epoch
    return report.delivered - previous.delivered


async def dataset_rows(stager: Stager, settings: Settings) -> list[dict[str, Any]]:
    """What ``datacache ls`` shows: a row per dataset the catalog knows, its configured names and residency per tier."""
    # Tiers key copies by the origin's id; users know their datasets by the config's names.
    names: dict[str, list[str]] = {}
    for name, config in sorted(settings.datasets.items()):
        names.setdefault(config.id, []).append(name)
    entries = await stager.catalog.entries()
    rows: list[dict[str, Any]] = []
    for record in await stager.catalog.datasets():
        local = [e for e in entries if e.dataset == record.id and e.state == "resident"]
        shared_count = shared_bytes = 0
        if stager.shared is not None:
            async for info in stager.shared.list(f"{record.id}/"):
                shared_count += 1
                shared_bytes += info.size
        rows.append(
            {
                "dataset": record.id,
                "names": names.get(record.id, []),
                "url": redact_url(record.url),
                "format": record.format,
                "policy": record.policy,
                "pinned": record.pinned,
                "shards": record.shard_count,
                "bytes": record.total_bytes,
                "local_shards": len(local),
                "local_bytes": sum(e.size for e in local),
                "shared_shards": shared_count if stager.shared is not None else None,
                "shared_bytes": shared_bytes if stager.shared is not None else None,
            }
        )
    return rows


def _dataset_document(handle: DatasetHandle, pins: set[str]) -> dict[str, Any]:
    return {
        "id": handle.id,
        "url": redact_url(handle.config.url),
        "snapshot": handle.manifest.snapshot,
        "format": handle.manifest.format.value,
        "shards": len(handle.manifest.shards),
        "bytes": handle.manifest.total_bytes,
        "policy": handle.config.policy,
        "pinned": handle.id in pins or handle.config.pinned,
    }


def _ended(pid: int | None) -> bool:
    """Whether the process ``pid`` (the kernel's, of the socket's peer) no longer exists.

    No pid (a peer in another pid namespace) is never taken as ended: the TTL decides.
    """
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's process, alive
    return False


def log_event(event: StagingEvent) -> None:
    """One structured log line per staging event worth an operator's attention."""
    kind = event.kind
    if kind == "bytes":
        return
    fields = {
        "event": kind,
        "dataset": event.dataset,
        "key": event.key,
        "tier": event.tier,
        "source": event.source,
        "bytes": event.size,
        "seconds": round(event.seconds, 4),
    }
    if kind == "staged":
        logger.info(
            "staged %s/%s onto %s from %s (%d bytes, %.3fs)",
            event.dataset,
            event.key,
            event.tier,
            event.source,
            event.size,
            event.seconds,
            extra=fields,
        )
    elif kind == "failed":
        logger.warning(
            "staging %s/%s onto %s failed: %s",
            event.dataset,
            event.key,
            event.tier,
            redact_url(event.error),
            extra={**fields, "error": redact_url(event.error)},
        )
    elif kind in ("evicted", "bypass"):
        logger.info("%s %s/%s on %s", kind, event.dataset, event.key, event.tier or LOCAL, extra=fields)
    else:
        logger.debug("%s %s/%s on %s", kind, event.dataset, event.key, event.tier, extra=fields)

