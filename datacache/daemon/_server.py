"""`Daemon`: one process per node that owns the local tier, the catalog and one `Stager`.

Clients reach it over a Unix domain socket with HTTP/JSON (docs/DAEMON.md);
Prometheus and the kubelet reach ``/metrics``, ``/healthz`` and ``/readyz`` on a
TCP port bound to loopback unless configured otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import json
import logging
import math
import os
import signal
import socket
import stat
import struct
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from datacache import __version__
from datacache._protocol import (
    API,
    MAX_BODY_BYTES,
    UnknownDatasetError,
    client_label,
    config_from_wire,
    error_for,
    location_to_wire,
)
from datacache.config import DatasetConfig, Settings, resolve_dataset
from datacache.daemon._scheduler import PrefetchScheduler, default_prefetch_slots
from datacache.errors import ConfigError, DaemonUnavailableError, DatacacheError, ShardNotFoundError
from datacache.manifest import Manifest, Shard
from datacache.metrics import CONTENT_TYPE, DaemonMetrics
from datacache.stager import (
    LOCAL,
    PRIORITY_PREFETCH,
    PRIORITY_URGENT,
    SHARED,
    DatasetHandle,
    Location,
    Stager,
    StagingEvent,
)
from datacache.tiers import device_free, redact_url, validate_key

__all__ = ["Daemon", "DaemonOptions", "serve"]

logger = logging.getLogger("datacache.daemon")


class _OneLineBadRequests(logging.Filter):
    """aiohttp logs every malformed request with a traceback: one line is enough for a bad client."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            reason = (error.message or "").strip().splitlines()
            record.msg, record.args = "malformed request: %d %s", (error.code, redact_url(reason[0] if reason else ""))
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_http_logger = logging.getLogger("datacache.daemon.http")
_http_logger.addFilter(_OneLineBadRequests())

T = TypeVar("T")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_PEERCRED = struct.Struct("3i")


@dataclass(frozen=True)
class DaemonOptions:
    """How the daemon serves, beyond the cache `Settings`.

    Parameters
    ----------
    prefetch_slots
        Prefetch transfers run at once; default: three quarters of
        ``settings.concurrency``, so that readers always find a free worker.
    prefetch_bandwidth
        Optional cap on prefetch and warm traffic, bytes per second.
    drain_timeout
        On SIGTERM, how long running transfers may take to finish before
        they are abandoned (cleanly: nothing half-written stays visible).
    allow_uids, allow_gids
        Peers (by ``SO_PEERCRED``) allowed besides root, the daemon's own
        uid and its primary gid.
    allow_datasets
        If set, only configured dataset names and URLs starting with one of
        these prefixes may be opened.
    client_ttl
        A client that stopped reporting for this long leaves the metrics.
    """

    prefetch_slots: int | None = None
    prefetch_bandwidth: float | None = None
    drain_timeout: float = 10.0
    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()
    allow_datasets: tuple[str, ...] = ()
    client_ttl: float = 300.0


@dataclass
class _ClientReport:
    bandwidth: float
    stall_fraction: float
    delivered: int
    dataset: str | None
    pid: int | None
    seen: float


class _BadRequest(ConfigError):
    code = "bad_request"


class _Forbidden(ConfigError):
    code = "forbidden"


def _parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - an empty host asks for every interface


def _peer(request: web.Request) -> tuple[int, int, int] | None:
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except OSError:
        return None
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


def _socket_answers(path: Path, timeout: float = 2.0) -> bool:
    """Whether a live process accepts connections and answers HTTP on ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(timeout)
    try:
        probe.connect(str(path))
        probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: datacache\r\nConnection: close\r\n\r\n")
        return probe.recv(16).startswith(b"HTTP/")
    except OSError:
        return False
    finally:
        probe.close()


class Daemon:
    """The per-node cache daemon. `serve` runs one until SIGTERM.

    Parameters
    ----------
    settings
        The cache: tiers, capacities, concurrency, the socket path and the metrics address.
    options
        Serving options (prefetch pacing, drain time, who may connect).
    """

    def __init__(self, settings: Settings, options: DaemonOptions | None = None) -> None:
        self.settings = settings
        self.options = options or DaemonOptions()
        self.stager: Stager | None = None
        self.metrics = DaemonMetrics(self._stats)
        self.scheduler: PrefetchScheduler | None = None
        self.metrics_address: str | None = None
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self._lock_fd: int | None = None
        self._owns_socket = False
        self._ready = False
        self._draining = False
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._stopped = False
        self._started = time.time()
        self._handles: dict[tuple[str, str], DatasetHandle] = {}
        self._latest: dict[str, DatasetHandle] = {}
        self._pins: set[str] = set()
        self._clients: dict[str, _ClientReport] = {}
        self._inflight: set[asyncio.Task[Any]] = set()
        self._shared_usage: tuple[float, Any] | None = None

    @property
    def socket_path(self) -> Path:
        return self.settings.daemon_socket

    def _stats(self) -> Any:
        return self.stager.stats() if self.stager is not None else None

    # -- start and stop -------------------------------------------------------------------

    async def start(self) -> None:
        """Take the node's daemon lock, bind the socket and metrics port, recover, become ready."""
        settings = self.settings
        await asyncio.to_thread(self._prepare_directories)
        self._take_lock()
        unix_sock = self._bind_socket()
        try:
            metrics_sock = self._bind_metrics()
        except BaseException:
            unix_sock.close()
            raise
        self.metrics_address = "{}:{}".format(*metrics_sock.getsockname()[:2])
        self._runner = web.AppRunner(
            self._app(), handle_signals=False, access_log=None, shutdown_timeout=2.0, logger=_http_logger
        )
        await self._runner.setup()
        await web.SockSite(self._runner, unix_sock, shutdown_timeout=2.0).start()
        self._metrics_runner = web.AppRunner(
            self._metrics_app(), handle_signals=False, access_log=None, logger=_http_logger
        )
        await self._metrics_runner.setup()
        await web.SockSite(self._metrics_runner, metrics_sock, shutdown_timeout=1.0).start()
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
        stager = Stager(settings, reconcile=False)
        self.stager = stager
        counts = await stager.reconcile()
        self._pins = {record.id for record in await stager.catalog.datasets() if record.pinned}
        stager.add_listener(self.metrics.on_event)
        stager.add_listener(self._log_event)
        slots = self.options.prefetch_slots or default_prefetch_slots(settings.concurrency)
        self.scheduler = PrefetchScheduler(
            stager, slots=slots, bandwidth=self.options.prefetch_bandwidth
        )
        self.scheduler.start()
        self.metrics.prefetch_slots.set(slots)
        self._ready = True
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

    def _prepare_directories(self) -> None:
        local = self.settings.local_dir
        if not local.exists():
            local.mkdir(mode=0o700, parents=True)
        mode = local.stat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            logger.warning(
                "the cache directory %s is writable by others (mode %o); 0700 is safer",
                local,
                mode & 0o777,
            )
        (local / "locks").mkdir(mode=0o700, exist_ok=True)
        (local / "daemon").mkdir(mode=0o700, exist_ok=True)
        (local / "daemon" / "manifests").mkdir(mode=0o700, exist_ok=True)
        parent = self.socket_path.parent
        if not parent.exists():
            parent.mkdir(mode=0o755, parents=True)

    def _take_lock(self) -> None:
        path = self.settings.local_dir / "locks" / "daemon.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise DatacacheError(
                f"another datacache daemon (pid {holder}) already serves {self.settings.local_dir}"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _bind_socket(self) -> socket.socket:
        path = self.socket_path
        try:
            existing = path.lstat()
        except FileNotFoundError:
            existing = None
        if existing is not None:
            if not stat.S_ISSOCK(existing.st_mode):
                raise DatacacheError(
                    f"{path} exists and is not a socket; remove it or choose another --socket"
                )
            if _socket_answers(path):
                raise DatacacheError(
                    f"another datacache daemon answers on {path}; not starting a second one"
                )
            logger.info("removing the stale socket %s left by a daemon that died", path)
            path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        previous = os.umask(0o117)  # the socket is never visible with wider permissions
        try:
            sock.bind(str(path))
        except OSError as exc:
            sock.close()
            raise DatacacheError(f"cannot create the socket {path}: {exc.strerror}") from None
        finally:
            os.umask(previous)
        path.chmod(0o660)
        sock.listen(256)
        sock.setblocking(False)
        self._owns_socket = True
        return sock

    def _bind_metrics(self) -> socket.socket:
        host, port = _parse_address(self.settings.metrics_address)
        try:
            sock = socket.create_server(
                (host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET
            )
        except OSError as exc:
            raise DatacacheError(
                f"cannot listen for metrics on {self.settings.metrics_address}: {exc.strerror} "
                "(set daemon.metrics_address or --metrics-address)"
            ) from None
        sock.setblocking(False)
        return sock

    def request_stop(self) -> None:
        """Begin a graceful stop (SIGTERM, SIGINT); a second request cuts the drain short."""
        if self._stop.is_set():
            logger.warning("second stop signal: abandoning running transfers now")
            self._force.set()
        self._stop.set()

    async def wait_stopped(self) -> None:
        """Return once a stop was requested."""
        await self._stop.wait()

    async def shutdown(self) -> None:
        """Stop serving: refuse new work, drain running transfers (bounded), release everything."""
        if self._stopped:
            return
        self._stopped = True
        self._draining = True
        self._ready = False
        self.metrics.ready.set(0)
        started = time.monotonic()
        timeout = self.options.drain_timeout
        logger.info(
            "stopping: finishing running transfers (up to %.0fs)",
            timeout,
            extra={"event": "draining", "in_flight": len(self._inflight)},
        )
        if self.scheduler is not None:
            await self._bounded(self.scheduler.stop(timeout), timeout)
        if self._inflight:
            remaining = max(0.0, timeout - (time.monotonic() - started))
            await self._bounded(asyncio.wait(set(self._inflight)), remaining)
        abandoned = sum(1 for task in self._inflight if not task.done())
        if self.stager is not None:
            await self.stager.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._metrics_runner is not None:
            await self._metrics_runner.cleanup()
        if self._owns_socket:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        logger.info(
            "stopped after %.1fs; %d requests abandoned",
            time.monotonic() - started,
            abandoned,
            extra={"event": "stopped", "abandoned": abandoned},
        )

    async def _bounded(self, awaitable: Awaitable[Any], grace: float) -> None:
        """Wait for ``awaitable`` at most ``grace`` s, or until a second stop signal."""
        work = asyncio.ensure_future(awaitable)
        forced = asyncio.ensure_future(self._force.wait())
        try:
            await asyncio.wait({work, forced}, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        finally:
            forced.cancel()
            if not work.done():
                work.cancel()
            for task in (work, forced):
                with contextlib.suppress(BaseException):
                    await task

    # -- the applications -----------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._middleware()])
        app.router.add_get("/healthz", self._healthz, name="healthz")
        app.router.add_get("/readyz", self._readyz, name="readyz")
        app.router.add_get("/metrics", self._metrics, name="metrics")
        app.router.add_get(f"{API}/status", self._status, name="status")
        for verb, handler in (
            ("open", self._open),
            ("ensure", self._ensure),
            ("locate", self._locate),
            ("prefetch", self._prefetch),
            ("future_order", self._future_order),
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

    def _middleware(self) -> Any:
        @web.middleware
        async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
            route = request.match_info.route
            verb = route.name if route is not None and route.name else "unknown"
            started = time.monotonic()
            code = "ok"
            try:
                peer = _peer(request)
                if peer is not None:
                    self._check_peer(*peer)
                    request["peer_pid"] = peer[0]
                if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
                    code = "too_large"
                    return self._error(code, 413, f"request body over {MAX_BODY_BYTES} bytes")
                if verb not in ("healthz", "readyz", "metrics", "unknown"):
                    if self._draining:
                        raise DaemonUnavailableError("the daemon is shutting down")
                    if not self._ready:
                        raise DaemonUnavailableError(
                            "the daemon is starting (recovering its catalog)"
                        )
                return await handler(request)
            except web.HTTPException as exc:
                if exc.status == 404:
                    code = "unknown_request"
                    return self._error(
                        code,
                        404,
                        f"unknown request {request.method} {request.path} (see docs/DAEMON.md)",
                    )
                if exc.status == 405:
                    code = "unknown_request"
                    return self._error(code, 405, f"{request.path} does not take {request.method}")
                if exc.status == 413:
                    code = "too_large"
                    return self._error(code, 413, f"request body over {MAX_BODY_BYTES} bytes")
                code = "bad_request"
                return self._error(code, exc.status, exc.reason or "bad request")
            except (_BadRequest, _Forbidden) as exc:
                code = exc.code
                return self._error(code, 403 if isinstance(exc, _Forbidden) else 400, str(exc))
            except (DatacacheError, ValueError, OSError) as exc:
                code, status = error_for(exc)
                if self._draining and status >= 500:
                    # Abandoned by the shutdown: the client should go on without the daemon.
                    exc = DaemonUnavailableError(f"the daemon shut down before answering ({exc})")
                    code, status = "shutting_down", 503
                if status >= 500 and code != "shutting_down":
                    logger.warning(
                        "%s failed: %s",
                        verb,
                        redact_url(str(exc)),
                        extra={"event": "request_failed"},
                    )
                return self._error(code, status, str(exc) or type(exc).__name__)
            except Exception:
                code = "internal"
                logger.exception("request %s failed", verb)
                return self._error(
                    code, 500, f"internal error answering {verb} (see the daemon's log)"
                )
            finally:
                self.metrics.requests.labels(verb, code).inc()
                self.metrics.request_seconds.labels(verb).observe(time.monotonic() - started)

        return middleware

    def _check_peer(self, pid: int, uid: int, gid: int) -> None:
        if uid in (0, os.getuid()) or uid in self.options.allow_uids:
            return
        if gid == os.getgid() or gid in self.options.allow_gids:
            return
        raise _Forbidden(
            f"uid {uid} gid {gid} may not use this daemon (allow it: --allow-uid or --allow-gid)"
        )

    @staticmethod
    def _error(code: str, status: int, message: str) -> web.Response:
        line = redact_url(message.strip().splitlines()[0]) if message.strip() else code
        return web.json_response({"error": {"code": code, "message": line}}, status=status)

    # -- request helpers ------------------------------------------------------------------

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw:
            return {}
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise _BadRequest("the request body is not valid JSON") from None
        if not isinstance(data, dict):
            raise _BadRequest("the request body must be a JSON object")
        return data

    @staticmethod
    def _string(data: Mapping[str, Any], name: str, default: str | None = None) -> str:
        value = data.get(name, default)
        if not isinstance(value, str) or not value:
            raise _BadRequest(f"'{name}' must be a non-empty string")
        return value

    @staticmethod
    def _number(data: Mapping[str, Any], name: str, default: float) -> float:
        value = data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise _BadRequest(f"'{name}' must be a number")
        return float(value)

    @staticmethod
    def _keys(data: Mapping[str, Any], name: str = "keys") -> list[str]:
        keys = data.get(name)
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise _BadRequest(f"'{name}' must be a list of shard keys")
        for key in keys:
            validate_key(key)
        return keys

    def _tier(self, data: Mapping[str, Any]) -> str:
        tier = data.get("tier", LOCAL)
        if tier not in (LOCAL, SHARED):
            raise _BadRequest(f"unknown tier {tier!r} (choose local or shared)")
        return str(tier)

    def _handle(self, data: Mapping[str, Any]) -> DatasetHandle:
        dataset = self._string(data, "dataset")
        snapshot = data.get("snapshot")
        if snapshot is None:
            handle = self._latest.get(dataset)
        elif isinstance(snapshot, str):
            handle = self._handles.get((dataset, snapshot))
        else:
            raise _BadRequest("'snapshot' must be a string")
        if handle is None:
            which = f"dataset {dataset!r}" + (f" at snapshot {snapshot}" if snapshot else "")
            raise UnknownDatasetError(f"{which} is not open in this daemon; open it first")
        return handle

    def _shard(self, handle: DatasetHandle, key: str) -> Shard:
        validate_key(key)
        return handle.manifest.shard(key)

    async def _tracked(self, awaitable: Awaitable[T]) -> T:
        """Run ``awaitable`` as a task the drain on SIGTERM waits for."""
        task = asyncio.ensure_future(awaitable)
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        return await asyncio.shield(task)

    def _stager(self) -> Stager:
        if self.stager is None:
            raise DaemonUnavailableError("the daemon is starting")
        return self.stager

    def _scheduler(self) -> PrefetchScheduler:
        if self.scheduler is None:
            raise DaemonUnavailableError("the daemon is starting")
        return self.scheduler

    # -- health and metrics ---------------------------------------------------------------

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "pid": os.getpid(), "version": __version__})

    async def _readyz(self, request: web.Request) -> web.Response:
        if self._ready:
            return web.json_response({"status": "ready"})
        reason = "draining" if self._draining else "starting"
        return web.json_response({"status": reason}, status=503)

    async def _metrics(self, request: web.Request) -> web.Response:
        await self._refresh_gauges()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _refresh_gauges(self) -> None:
        self._expire_clients()
        if self.scheduler is not None:
            self.metrics.prefetch_pending.set(self.scheduler.pending)
        for usage in await self._tier_usage():
            tier = usage["tier"]
            self.metrics.tier_used.labels(tier).set(usage["used_bytes"])
            self.metrics.tier_shards.labels(tier).set(usage["shards"])
            if usage["capacity_bytes"] is not None:
                self.metrics.tier_capacity.labels(tier).set(usage["capacity_bytes"])
            if usage["device_free_bytes"] is not None:
                self.metrics.tier_free.labels(tier).set(usage["device_free_bytes"])

    async def _tier_usage(self) -> list[dict[str, Any]]:
        stager = self.stager
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
            if self._shared_usage is None or now - self._shared_usage[0] > 60:
                # Walking a distributed filesystem is slow: once a minute at most.
                self._shared_usage = (now, await stager.shared.usage())
            shared = self._shared_usage[1]
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

    def _expire_clients(self) -> None:
        cutoff = time.monotonic() - self.options.client_ttl
        for name in [name for name, report in self._clients.items() if report.seen < cutoff]:
            del self._clients[name]
            self.metrics.forget_client(name)
        self.metrics.clients.set(len(self._clients))

    # -- datasets -------------------------------------------------------------------------

    def _allowed(self, config: DatasetConfig) -> None:
        prefixes = self.options.allow_datasets
        if not prefixes:
            return
        configured = self.settings.datasets.get(config.name)
        if configured is not None and configured.url == config.url:
            return
        url = redact_url(config.url)
        if any(url.startswith(prefix) or config.url.startswith(prefix) for prefix in prefixes):
            return
        raise _Forbidden(f"dataset {url} is not in this daemon's allowlist (--allow-dataset)")

    def _config(self, data: Mapping[str, Any]) -> DatasetConfig:
        spec = data.get("dataset")
        if isinstance(spec, str):
            config = resolve_dataset(spec, self.settings)
        else:
            config = config_from_wire(spec)
            validate_key(config.name)
            configured = self.settings.datasets.get(config.name)
            if configured is not None and configured.url.rstrip("/") != config.url.rstrip("/"):
                raise ConfigError(
                    f"dataset name {config.name!r} is configured in the daemon for another URL "
                    f"({redact_url(configured.url)})"
                )
            scheme = config.url.split("://", 1)[0] if "://" in config.url else "file"
            defaults = self.settings.storage_options.get(scheme, {})
            if defaults:
                config = replace(config, storage_options={**defaults, **config.storage_options})
        self._allowed(config)
        if config.id in self._pins and not config.pinned:
            config = replace(config, pinned=True)
        return config

    async def _open_handle(
        self, config: DatasetConfig, *, refresh: bool, snapshot: str | None
    ) -> DatasetHandle:
        if snapshot is not None and not refresh:
            known = self._handles.get((config.id, snapshot))
            if known is not None:
                return known
        handle = await self._stager().open(config, refresh=refresh)
        if snapshot is not None and not refresh and handle.manifest.snapshot != snapshot:
            manifest = await asyncio.to_thread(self._load_snapshot, config.id, snapshot)
            if manifest is None:
                raise UnknownDatasetError(
                    f"dataset {config.id}: snapshot {snapshot} is unknown to this daemon "
                    f"(it serves {handle.manifest.snapshot}); open the dataset again"
                )
            handle = DatasetHandle(config=handle.config, manifest=manifest, origin=handle.origin)
        else:
            self._latest[config.id] = handle
        self._handles[(config.id, handle.manifest.snapshot)] = handle
        await asyncio.to_thread(self._save_snapshot, handle.manifest)
        return handle

    def _snapshot_path(self, dataset_id: str, snapshot: str) -> Path:
        validate_key(dataset_id)
        validate_key(snapshot)
        return self.settings.local_dir / "daemon" / "manifests" / f"{dataset_id}@{snapshot}.json"

    def _save_snapshot(self, manifest: Manifest) -> Path:
        path = self._snapshot_path(manifest.dataset, manifest.snapshot)
        if not path.exists():
            temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
            temporary.write_bytes(json.dumps(manifest.to_json(), separators=(",", ":")).encode())
            temporary.chmod(0o644)
            temporary.replace(path)
        return path

    def _load_snapshot(self, dataset_id: str, snapshot: str) -> Manifest | None:
        path = self._snapshot_path(dataset_id, snapshot)
        try:
            manifest = Manifest.from_json(json.loads(path.read_bytes()), str(path))
        except FileNotFoundError:
            return None
        except (ValueError, DatacacheError) as exc:
            logger.warning("ignoring the unreadable manifest snapshot %s: %s", path, exc)
            return None
        return manifest if manifest.snapshot == snapshot else None

    # -- the verbs ------------------------------------------------------------------------

    async def _open(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        config = self._config(data)
        snapshot = data.get("snapshot")
        if snapshot is not None and not isinstance(snapshot, str):
            raise _BadRequest("'snapshot' must be a string")
        handle = await self._tracked(
            self._open_handle(config, refresh=bool(data.get("refresh", False)), snapshot=snapshot)
        )
        manifest = handle.manifest
        return web.json_response(
            {
                "dataset_id": handle.id,
                "snapshot": manifest.snapshot,
                "manifest_path": str(self._snapshot_path(handle.id, manifest.snapshot)),
                "format": manifest.format.value,
                "shards": len(manifest.shards),
                "total_bytes": manifest.total_bytes,
                "policy": handle.config.policy,
                "pinned": handle.config.pinned,
            }
        )

    async def _ensure(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        handle = self._handle(data)
        key = self._string(data, "key")
        self._shard(handle, key)
        tier = self._tier(data)
        priority = self._number(data, "priority", PRIORITY_URGENT)
        if priority < PRIORITY_PREFETCH:
            # A reader waits on this shard: straight to the stager, whose queue puts it first.
            location = await self._tracked(
                self._stager().ensure(handle, key, tier=tier, priority=priority)
            )
        else:
            future = self._scheduler().submit(handle, key, tier=tier, priority=priority, wait=True)
            if future is None:  # pragma: no cover - waited submissions are never dropped
                raise DatacacheError("the prefetch backlog is full")
            location = await self._tracked(future)
        return web.json_response(location_to_wire(location))

    async def _locate(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        handle = self._handle(data)
        key = self._string(data, "key")
        self._shard(handle, key)
        location = await self._stager().locate(handle, key)
        return web.json_response(location_to_wire(location))

    async def _prefetch(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        handle = self._handle(data)
        keys = self._keys(data)
        for key in keys:
            self._shard(handle, key)
        tier = self._tier(data)
        priority = max(self._number(data, "priority", PRIORITY_PREFETCH), PRIORITY_PREFETCH)
        scheduler = self._scheduler()
        for position, key in enumerate(keys):
            scheduler.submit(handle, key, tier=tier, priority=priority + position * 1e-6)
        return web.json_response({"queued": len(keys), "pending": scheduler.pending})

    async def _future_order(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        handle = self._handle(data)
        keys = self._keys(data)
        await self._stager().set_future_order(handle, keys)
        return web.json_response({"keys": len(keys)})

    async def _report_corrupt(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        handle = self._handle(data)
        key = self._string(data, "key")
        shard = self._shard(handle, key)
        tier = self._tier(data)
        stager = self._stager()
        path = stager.local.path(handle.tier_key(key)) if tier == LOCAL else None
        await stager.report_corrupt(handle, Location(tier, path, shard, None))
        logger.warning(
            "a client reported shard %s/%s corrupt on the %s tier; dropped it",
            handle.id,
            key,
            tier,
            extra={"event": "corrupt", "dataset": handle.id, "key": key, "tier": tier},
        )
        return web.json_response({"dropped": True})

    async def _evict(self, request: web.Request) -> web.Response:
        data = await self._body(request)
        stager = self._stager()
        dataset = self._string(data, "dataset")
        records = {record.id for record in await stager.catalog.datasets()}
        dataset_id = dataset if dataset in records else resolve_dataset(dataset, self.settings).id
        keys = self._keys(data) if data.get("keys") is not None else None
        tier = data.get("tier", LOCAL)
        if tier not in (LOCAL, SHARED, "all"):
            raise _BadRequest(f"unknown tier {tier!r} (choose local, shared or all)")
        count = size = 0
        if tier in (LOCAL, "all"):
            c, s = await self._tracked(stager.evict(dataset_id, keys))
            count, size = count + c, size + s
        if tier in (SHARED, "all"):
            c, s = await self._tracked(stager.evict_shared(dataset_id))
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
        data = await self._body(request)
        dataset = self._string(data, "dataset")
        validate_key(dataset)
        if not await self._stager().catalog.set_pinned(dataset, pinned):
            raise ShardNotFoundError(
                f"dataset {dataset!r} is unknown to this node (open or warm it first)"
            )
        if pinned:
            self._pins.add(dataset)
        else:
            self._pins.discard(dataset)
        for ident, handle in list(self._handles.items()):
            if ident[0] == dataset:
                self._handles[ident] = replace(handle, config=replace(handle.config, pinned=pinned))
        if dataset in self._latest:
            latest = self._latest[dataset]
            self._latest[dataset] = replace(latest, config=replace(latest.config, pinned=pinned))
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
        data = await self._body(request)
        pid = request.get("peer_pid")
        name = client_label(data.get("client"), f"pid-{pid}" if pid else "unknown")
        bandwidth = self._number(data, "delivered_bytes_per_s", 0.0)
        stall = self._number(data, "stall_fraction", 0.0)
        delivered = int(self._number(data, "delivered_bytes", 0.0))
        if bandwidth < 0 or not 0.0 <= stall <= 1.0 or delivered < 0:
            raise _BadRequest(
                "'delivered_bytes_per_s' and 'delivered_bytes' must be >= 0, "
                "'stall_fraction' within [0, 1]"
            )
        dataset = data.get("dataset") if isinstance(data.get("dataset"), str) else None
        self._clients[name] = _ClientReport(
            bandwidth, stall, delivered, dataset, pid, time.monotonic()
        )
        self.metrics.client_report(
            name, bandwidth=bandwidth, stall_fraction=stall, delivered=delivered
        )
        self.metrics.clients.set(len(self._clients))
        return web.json_response({"client": name})

    async def _status(self, request: web.Request) -> web.Response:
        stager = self._stager()
        self._expire_clients()
        now = time.monotonic()
        datasets = [
            {
                "id": handle.id,
                "url": redact_url(handle.config.url),
                "snapshot": handle.manifest.snapshot,
                "format": handle.manifest.format.value,
                "shards": len(handle.manifest.shards),
                "bytes": handle.manifest.total_bytes,
                "policy": handle.config.policy,
                "pinned": handle.id in self._pins or handle.config.pinned,
            }
            for handle in self._latest.values()
        ]
        scheduler = self._scheduler()
        return web.json_response(
            {
                "version": __version__,
                "pid": os.getpid(),
                "uptime_s": round(time.time() - self._started, 3),
                "ready": self._ready,
                "socket": str(self.socket_path),
                "metrics_address": self.metrics_address,
                "workers": self.settings.concurrency,
                "prefetch": {
                    "slots": scheduler.slots,
                    "pending": scheduler.pending,
                    "running": scheduler.running,
                    "dropped": scheduler.dropped,
                    "bandwidth_limit": self.options.prefetch_bandwidth,
                },
                "requests_in_flight": len(self._inflight),
                "stats": dataclasses.asdict(stager.stats()),
                "tiers": await self._tier_usage(),
                "datasets": datasets,
                "clients": [
                    {
                        "client": name,
                        "pid": report.pid,
                        "dataset": report.dataset,
                        "delivered_bytes_per_s": report.bandwidth,
                        "stall_fraction": report.stall_fraction,
                        "seconds_since_report": round(now - report.seen, 3),
                    }
                    for name, report in sorted(self._clients.items())
                ],
            }
        )

    async def _warm(self, request: web.Request) -> web.StreamResponse:
        data = await self._body(request)
        config = self._config(data)
        tier = self._tier(data)
        spec = data.get("shards")
        if spec is not None and not isinstance(spec, str):
            raise _BadRequest("'shards' must be a string such as '0:10' or 'a.tar,b.tar'")
        handle = await self._tracked(
            self._open_handle(config, refresh=bool(data.get("refresh", False)), snapshot=None)
        )
        shards = handle.manifest.select(spec)
        if not shards:
            raise ConfigError(f"shards {spec!r} select no shard of {handle.id}")
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        warm = asyncio.ensure_future(
            self._run_warm(handle, shards, tier, bool(data.get("verify")), response)
        )
        self._inflight.add(warm)
        warm.add_done_callback(self._inflight.discard)
        try:
            await asyncio.shield(warm)
        except asyncio.CancelledError:
            warm.cancel()
            raise
        except ConnectionResetError:
            warm.cancel()  # the client went away: stop queueing its shards
            return response
        except Exception as exc:  # the reply has begun: the error travels as the last line
            code, _ = error_for(exc)
            line = redact_url((str(exc) or type(exc).__name__).strip().splitlines()[0])
            await response.write(
                (json.dumps({"event": "error", "code": code, "message": line}) + "\n").encode()
            )
        await response.write_eof()
        return response

    async def _run_warm(
        self,
        handle: DatasetHandle,
        shards: Sequence[Shard],
        tier: str,
        verify: bool,
        response: web.StreamResponse,
    ) -> None:
        stager = self._stager()
        scheduler = self._scheduler()
        started = time.monotonic()
        moved = 0
        staged = 0
        wanted = {shard.key for shard in shards}

        def count(event: StagingEvent) -> None:
            nonlocal moved, staged
            if event.dataset != handle.id or event.tier != tier or event.key not in wanted:
                return
            if event.kind == "bytes":
                moved += event.size
            elif event.kind == "staged":
                staged += 1

        async def send(document: dict[str, Any]) -> None:
            await response.write((json.dumps(document) + "\n").encode())

        await send(
            {
                "event": "start",
                "dataset": handle.id,
                "tier": tier,
                "shards": len(shards),
                "bytes": sum(s.size for s in shards),
            }
        )
        verified = 0
        if verify:
            gate = asyncio.Semaphore(4)

            async def check(shard: Shard) -> bool:
                async with gate:
                    return await stager.verify_resident(handle, shard, tier=tier)

            results = await asyncio.gather(
                *(check(shard) for shard in shards), return_exceptions=True
            )
            verified = sum(1 for result in results if result is True)
        stager.add_listener(count)
        done = resident = done_bytes = 0
        failures: list[tuple[str, str]] = []
        window = max(4 * scheduler.slots, 64)
        outstanding: dict[asyncio.Future[Location], Shard] = {}
        last_progress = time.monotonic()
        try:
            queue = iter(enumerate(shards))
            exhausted = False
            while outstanding or not exhausted:
                while not exhausted and len(outstanding) < window:
                    try:
                        index, shard = next(queue)
                    except StopIteration:
                        exhausted = True
                        break
                    future = scheduler.submit(
                        handle,
                        shard.key,
                        tier=tier,
                        priority=PRIORITY_PREFETCH + index * 1e-6,
                        wait=True,
                    )
                    if future is not None:
                        outstanding[future] = shard
                if not outstanding:
                    break
                finished, _ = await asyncio.wait(
                    outstanding, timeout=1.0, return_when=asyncio.FIRST_COMPLETED
                )
                for future in finished:
                    shard = outstanding.pop(future)
                    done += 1
                    done_bytes += shard.size
                    error = future.exception()
                    if error is not None:
                        failures.append((shard.key, str(error)))
                    elif future.result().tier == tier:
                        resident += 1
                    else:
                        failures.append(
                            (shard.key, f"not kept on the {tier} tier (the tier is full)")
                        )
                now = time.monotonic()
                if now - last_progress >= 1.0 or not (outstanding or not exhausted):
                    last_progress = now
                    elapsed = max(now - started, 1e-6)
                    await send(
                        {
                            "event": "progress",
                            "shards_done": done,
                            "shards_total": len(shards),
                            "bytes_done": done_bytes,
                            "bytes_transferred": moved,
                            "rate_bytes_per_s": round(moved / elapsed, 1),
                        }
                    )
        finally:
            stager.remove_listener(count)
            for future in outstanding:
                future.cancel()
        seconds = time.monotonic() - started
        await send(
            {
                "event": "done",
                "dataset": handle.id,
                "url": redact_url(handle.config.url),
                "tier": tier,
                "complete": resident == len(shards) and not failures,
                "shards_requested": len(shards),
                "shards_resident": resident,
                "shards_verified": verified,
                "shards_transferred": staged,
                "bytes_requested": sum(s.size for s in shards),
                "bytes_transferred": moved,
                "seconds": round(seconds, 3),
                "rate_bytes_per_s": round(moved / seconds, 1) if seconds > 0 else 0.0,
                "failures": [{"shard": key, "error": redact_url(error)} for key, error in failures],
            }
        )

    # -- structured logs ------------------------------------------------------------------

    @staticmethod
    def _log_event(event: StagingEvent) -> None:
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
            logger.info(
                "%s %s/%s on %s", kind, event.dataset, event.key, event.tier or LOCAL, extra=fields
            )
        else:
            logger.debug("%s %s/%s on %s", kind, event.dataset, event.key, event.tier, extra=fields)


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
