"""`Daemon`: one process per node that owns the local tier, the catalog and one `Stager`.

Clients reach it over a Unix domain socket with HTTP/JSON (docs/DAEMON.md);
Prometheus and the kubelet reach ``/metrics``, ``/healthz`` and ``/readyz`` on a
TCP port bound to loopback unless configured otherwise.

This module starts, stops and routes, and holds the operator's verbs; the reading verbs are in
`_reads`, the parts every verb uses in `_base`; its collaborators hold the rest: `Lifecycle`
(directories, lock, sockets, drain), the HTTP layer (`_http`: peers, parsing,
errors), `DatasetRegistry` (configurations, handles, pins, snapshots) and
`StatusBoard` (status, gauges, client reports).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time

from aiohttp import web

from datacache import __version__
from datacache._protocol import (
    API,
    MAX_BODY_BYTES,
    client_label,
)
from datacache.activity import check_reader_fields
from datacache.config import Settings, resolve_dataset
from datacache.daemon import _http as http
from datacache.daemon._limits import BodyBudget
from datacache.daemon._options import DaemonOptions
from datacache.daemon._reads import ReadVerbs
from datacache.daemon._scheduler import PrefetchScheduler, default_prefetch_slots
from datacache.daemon._status import ClientReport, dataset_rows, log_event
from datacache.daemon._warm import WarmRun
from datacache.daemon.metrics import CONTENT_TYPE
from datacache.errors import ConfigError, ShardNotFoundError
from datacache.staging import LOCAL, SHARED, Stager
from datacache.tiers import validate_key
from datacache.tiers.local import GROUP_READABLE, LocalTier
from datacache.tiers.shared import SharedTier

__all__ = ["Daemon", "DaemonOptions", "serve"]

logger = logging.getLogger("datacache.daemon")



def _refuse_unkept_readers(settings: Settings) -> None:
    """Refuse to serve where a dataset's readers can be kept only by an ACL that its tier refuses.

    docs/SECURITY.md: a declared dataset's files admit exactly its readers. Files 0640 to the
    tier's group would admit every member: never that instead.
    """
    readers = {d.id: (d.readers.uids, d.readers.gids) for d in settings.datasets.values() if d.readers}
    tiers: list[LocalTier | SharedTier] = [LocalTier(settings.local_dir, modes=GROUP_READABLE)]
    if settings.shared_dir is not None:
        tiers.append(SharedTier(settings.shared_dir))
    for tier in tiers if readers else []:
        tier.dataset_readers.update(readers)
        refused = tier.acl_refused()
        if refused:
            names = ", ".join(sorted(d.name for d in settings.datasets.values() if d.id in refused))
            raise ConfigError(
                f"{tier.root} refuses POSIX ACLs, and only an ACL keeps the files of {names} to their readers: "
                "mount that filesystem with acl, or make each one's readers its tier's group alone (@GROUP)"
            )

class Daemon(ReadVerbs):
    """The per-node cache daemon. `serve` runs one until SIGTERM.

    Parameters
    ----------
    settings
        The cache: tiers, capacities, concurrency, the socket path and the metrics address.
    options
        Serving options (prefetch pacing, drain time, who may connect).
    """

    # -- start and stop -------------------------------------------------------------------

    async def start(self) -> None:
        """Take the node's daemon lock, bind the socket and metrics port, recover, become ready."""
        settings = self.settings
        await asyncio.to_thread(_refuse_unkept_readers, settings)
        await self.lifecycle.bind(self._app(), self._metrics_app())
        logger.info(
            "datacache daemon %s listening on %s (metrics on http://%s), pid %d; recovering",
            __version__,
            self.socket_path,
            self.metrics_address,
            os.getpid(),
            extra={
                "event": "listening",
                "socket": str(self.socket_path),
                "metrics": self.metrics_address,
            },
        )
        stager = Stager(settings, reconcile=False, modes=GROUP_READABLE)  # its clients read the files
        self.stager = stager
        counts = await stager.reconcile()
        # Leases whose process is gone end with it; none outlives a restart without a live owner.
        await stager.catalog.drop_dead_leases()
        self.registry.pins = {record.id for record in await stager.catalog.datasets() if record.pinned}
        stager.add_listener(self.metrics.on_event)
        stager.add_listener(log_event)
        slots = self.options.prefetch_slots or default_prefetch_slots(settings.concurrency)
        self.scheduler = PrefetchScheduler(
            stager, slots=slots, bandwidth=self.options.prefetch_bandwidth
        )
        self.scheduler.start()
        self.metrics.prefetch_slots.set(slots)
        self.lifecycle.ready = True
        self.metrics.ready.set(1)
        logger.info(
            "datacache daemon ready: %d workers, %d prefetch slots; recovered %s",
            settings.concurrency,
            slots,
            counts,
            extra={
                "event": "ready",
                "workers": settings.concurrency,
                "prefetch_slots": slots,
                "recovered": counts,
            },
        )

    def request_stop(self) -> None:
        """Begin a graceful stop (SIGTERM, SIGINT); a second request cuts the drain short."""
        self.lifecycle.request_stop()

    async def wait_stopped(self) -> None:
        """Return once a stop was requested."""
        await self.lifecycle.wait_stopped()

    async def shutdown(self) -> None:
        """Stop serving: refuse new work, drain running transfers (bounded), release everything."""
        lifecycle = self.lifecycle
        if not lifecycle.begin_drain():
            return
        self.metrics.ready.set(0)
        if self.stager is None:
            # It never served (the node lock, the socket or the port was taken): nothing ran, nothing
            # to drain or say; the error says why it could not start.
            await lifecycle.release()
            return
        started = time.monotonic()
        logger.info(
            "stopping: finishing running transfers (up to %.0fs)",
            lifecycle.drain_timeout,
            extra={"event": "draining", "in_flight": len(lifecycle.inflight)},
        )
        work = [] if self.scheduler is None else [self.scheduler.stop(lifecycle.drain_timeout)]
        abandoned = await lifecycle.drain(*work)
        if self.stager is not None:
            # Copies whose bytes are in finish within what is left of the operator's drain bound.
            left = max(0.0, lifecycle.drain_timeout - (time.monotonic() - started))
            await self.stager.close(durable_wait=left)
        await lifecycle.release()
        logger.info(
            "stopped after %.1fs; %d requests abandoned",
            time.monotonic() - started,
            abandoned,
            extra={"event": "stopped", "abandoned": abandoned},
        )

    # -- the applications -----------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(
            client_max_size=MAX_BODY_BYTES,
            middlewares=[http.middleware(self.peers, self.metrics, self.lifecycle.unavailable)],
        )
        app[http.BODY_LIMITS] = http.BodyLimits(BodyBudget(self.options.body_memory), self.options.request_timeout)
        app.router.add_get("/healthz", self._socket_healthz, name="healthz")
        app.router.add_get("/readyz", self._readyz, name="readyz")
        app.router.add_get("/metrics", self._metrics, name="metrics")
        app.router.add_get(f"{API}/status", self._status, name="status")
        app.router.add_get(f"{API}/top", self._top, name="top")
        app.router.add_get(f"{API}/datasets", self._datasets, name="datasets")
        for verb, handler in (
            ("open", self._open),
            ("challenge", self._challenge),
            ("ensure", self._ensure),
            ("locate", self._locate),
            ("prefetch", self._prefetch),
            ("future_order", self._future_order),
            ("progress", self._progress),
            ("report_corrupt", self._report_corrupt),
            ("warm", self._warm),
            ("evict", self._evict),
            ("pin", self._pin),
            ("unpin", self._unpin),
            ("report", self._report),
        ):
            app.router.add_post(f"{API}/{verb}", handler, name=verb)
        return app

    def _metrics_app(self) -> web.Application:
        app = web.Application(client_max_size=4096)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        return app

    # -- health and metrics ---------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "pid": os.getpid(), "version": __version__})

    async def _socket_healthz(self, request: web.Request) -> web.Response:
        # Its clients' fallback stagers write this local tier while the daemon is away: they take
        # its capacity from here (the metrics port, open to the network, does not say it).
        local = {"path": str(self.settings.local_dir), "capacity_bytes": self.settings.local_capacity}
        return web.json_response({"status": "ok", "pid": os.getpid(), "version": __version__, "local": local})

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.lifecycle.ready:
            return web.json_response({"status": "ready"})
        reason = "draining" if self.lifecycle.draining else "starting"
        return web.json_response({"status": reason}, status=503)

    async def _metrics(self, request: web.Request) -> web.Response:
        await self.status.refresh_gauges(self.stager, self.scheduler)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # -- the operator's verbs and reports ----------------------------------------------

    async def _evict(self, request: web.Request) -> web.Response:
        data = await http.body(request)
        stager = self._stager()
        dataset = http.string(data, "dataset")
        records = {record.id for record in await stager.catalog.datasets()}
        dataset_id = dataset if dataset in records else resolve_dataset(dataset, self.settings).id
        keys = http.keys(data) if data.get("keys") is not None else None
        tier = data.get("tier", LOCAL)
        if tier not in (LOCAL, SHARED, "all"):
            raise http.BadRequest(f"unknown tier {tier!r} (choose local, shared or all)")
        self._may_change(request, dataset_id, "evict")
        self._pin_holder_only(request, dataset_id, "evict")
        if tier != LOCAL and not self._peer(request).is_operator:
            # The shared tier serves every node of the cluster: only an operator empties it.
            raise http.Forbidden(f"only root or the daemon's uid may evict from the {tier} tier")
        count = size = 0
        if tier in (LOCAL, "all"):
            c, s = await self.lifecycle.tracked(stager.evict(dataset_id, keys))
            count, size = count + c, size + s
        if tier in (SHARED, "all"):
            c, s = await self.lifecycle.tracked(stager.evict_shared(dataset_id))
            count, size = count + c, size + s
        logger.info(
            "evicted %d shards (%d bytes) of %s from %s",
            count,
            size,
            dataset_id,
            tier,
            extra={
                "event": "evict",
                "dataset": dataset_id,
                "shards": count,
                "bytes": size,
                "tier": tier,
            },
        )
        return web.json_response(
            {"dataset": dataset_id, "shards": count, "bytes": size, "tier": tier}
        )

    async def _set_pin(self, request: web.Request, pinned: bool) -> web.Response:
        data = await http.body(request)
        dataset = http.string(data, "dataset")
        validate_key(dataset)
        self._may_change(request, dataset, "pin" if pinned else "unpin")
        self._pin_holder_only(request, dataset, "pin" if pinned else "unpin")
        if not await self._stager().catalog.set_pinned(dataset, pinned):
            raise ShardNotFoundError(
                f"dataset {dataset!r} is unknown to this node (open or warm it first)"
            )
        self.registry.set_pinned(dataset, pinned, uid=self._peer(request).uid)
        logger.info(
            "%s dataset %s",
            "pinned" if pinned else "unpinned",
            dataset,
            extra={"event": "pin", "dataset": dataset, "pinned": pinned},
        )
        return web.json_response({"dataset": dataset, "pinned": pinned})

    async def _pin(self, request: web.Request) -> web.Response:
        return await self._set_pin(request, True)

    async def _unpin(self, request: web.Request) -> web.Response:
        return await self._set_pin(request, False)

    async def _report(self, request: web.Request) -> web.Response:
        data = await http.body(request)
        pid = self._peer(request).pid
        name = client_label(data.get("client"), f"pid-{pid}" if pid else "unknown")
        bandwidth = http.number(data, "delivered_bytes_per_s", 0.0)
        stall = http.number(data, "stall_fraction", 0.0)
        delivered = int(http.number(data, "delivered_bytes", 0.0))
        if bandwidth < 0 or not 0.0 <= stall <= 1.0 or delivered < 0:
            raise http.BadRequest(
                "'delivered_bytes_per_s' and 'delivered_bytes' must be >= 0, "
                "'stall_fraction' within [0, 1]"
            )
        dataset = data.get("dataset") if isinstance(data.get("dataset"), str) else None
        try:
            figures = check_reader_fields(data)
        except ValueError as exc:
            raise http.BadRequest(str(exc)) from None
        uid = self._peer(request).uid
        self.status.report(
            name, ClientReport(bandwidth, stall, delivered, dataset, pid, time.monotonic(), uid, figures)
        )
        return web.json_response({"client": name})

    async def _top(self, request: web.Request) -> web.Response:
        """What ``datacache top`` shows; a user sees their own clients, an operator everyone's."""
        peer = self._peer(request)
        handles = list(self.registry.latest.values())
        document = await self.status.top_document(
            self._stager(),
            handles,
            uid=peer.uid,
            operator=peer.is_operator,
            opened={handle.id for handle in handles if self.registry.opened_by(peer, handle.id)},
        )
        return web.json_response(document)

    async def _datasets(self, request: web.Request) -> web.Response:
        """What ``datacache ls`` shows; a user sees the configured datasets and those it opened."""
        peer = self._peer(request)
        settings = self._stager().settings
        rows = await dataset_rows(self._stager(), settings)
        if not peer.is_operator:
            groups = (peer.gid, *peer.groups)  # a declared dataset is named to its readers only
            configured = {
                config.id
                for config in settings.datasets.values()
                if not config.readers or config.readers.admits(peer.uid, groups)
            }
            visible = [row for row in rows if row["dataset"] in configured]
            rows = visible + [r for r in rows if r not in visible and self.registry.opened_by(peer, r["dataset"])]
        return web.json_response({"datasets": rows})

    async def _status(self, request: web.Request) -> web.Response:
        lifecycle = self.lifecycle
        serving = {
            "uptime_s": round(time.time() - lifecycle.started, 3),
            "ready": lifecycle.ready,
            "socket": str(lifecycle.socket_path),
            "metrics_address": lifecycle.metrics_address,
            "requests_in_flight": len(lifecycle.inflight),
        }
        document = await self.status.document(
            self._stager(),
            self._scheduler(),
            list(self.registry.latest.values()),
            self.registry.pins,
            serving,
            viewer=None if self._peer(request).is_operator else self._peer(request).uid,
        )
        return web.json_response(document)

    async def _warm(self, request: web.Request) -> web.StreamResponse:
        data = await http.body(request)
        peer = self._peer(request)
        config = await self._granted(data, peer)
        tier = http.tier(data)
        if tier == SHARED and self.settings.shared_dir is None:
            # Once, before a shard is asked for (it was one "no shared tier" line per shard).
            raise ConfigError(
                "no shared tier on this node (the operator gives `datacache serve` --shared-dir or cache.shared_dir)"
            )
        spec = data.get("shards")
        if spec is not None and not isinstance(spec, str):
            raise http.BadRequest("'shards' must be a string such as '0:10' or 'a.tar,b.tar'")
        bandwidth = data.get("bandwidth")
        if bandwidth is not None and (http.number(data, "bandwidth", 0.0) <= 0 or math.isinf(bandwidth)):
            raise http.BadRequest("'bandwidth' must be a positive number of bytes per second")
        refresh = bool(data.get("refresh", False))
        with self.open_gate.hold(peer.uid, config.id):
            handle = await self.lifecycle.tracked(
                self.registry.open(self._stager(), config, peer, refresh=refresh, snapshot=None), with_caller=True
            )
        shards = handle.manifest.select(spec)
        if not shards:
            raise ConfigError(f"shards {spec!r} select no shard of {handle.id}")
        if tier == LOCAL:
            async with self.lease_lock:
                await self._arrive(peer)  # room on the local tier for another uid's warm: others keep their share
        warm = WarmRun(self._stager(), self._scheduler(), handle, tier)
        pace = float(bandwidth) if bandwidth is not None else None
        return await warm.stream(request, shards, self.lifecycle, verify=bool(data.get("verify")), bandwidth=pace)



async def serve(settings: Settings, options: DaemonOptions | None = None) -> int:
    """Run a daemon until SIGTERM or SIGINT, then stop it gracefully; return the exit status."""
    daemon = Daemon(settings, options)
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for signum in signals:
        loop.add_signal_handler(signum, daemon.request_stop)
    try:
        await daemon.start()
        await daemon.wait_stopped()
    finally:
        await daemon.shutdown()
        for signum in signals:
            loop.remove_signal_handler(signum)
    return 0
