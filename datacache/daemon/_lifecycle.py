"""The daemon's lifecycle: its directories, the node lock, the sockets, the drain on SIGTERM.

`Lifecycle` owns what must be taken exactly once per node and released on every
exit path: the cache directory's layout, ``locks/daemon.lock``, the Unix socket
(and its stale predecessor), the metrics port, the HTTP runners, and the set of
requests a graceful stop waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import stat
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from datacache._capacity import capacity_beyond_disk
from datacache.config import Settings
from datacache.daemon._http import DRAINING, STARTING, http_logger
from datacache.daemon._limits import ConnectionGate, GatedSite, fd_budget
from datacache.errors import DatacacheError
from datacache.ownership import group_name
from datacache.tiers.local import GROUP_READABLE, make_local_dirs

__all__ = ["SNAPSHOT_DIR_MODE", "Lifecycle"]

SNAPSHOT_DIR_MODE = 0o710
"""The folder of the manifests clients read: the daemon's group may pass, not list it."""

logger = logging.getLogger("datacache.daemon")

T = TypeVar("T")


def _parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - an empty host asks for every interface


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


class Lifecycle:
    """Start-up, readiness and a bounded, graceful stop of one daemon.

    Parameters
    ----------
    settings
        Where the cache, the socket and the metrics port are.
    drain_timeout
        On a stop, how long running requests may take before they are abandoned.
    socket_group
        The gid that owns the socket, so that its members may connect (default: the daemon's).
    request_timeout
        Seconds a connection may take to send a request's headers (aiohttp's keep-alive
        timer, which also runs while headers arrive).
    connections_per_client
        Connections one uid may hold; default a quarter of the file-descriptor budget.
    """

    def __init__(
        self,
        settings: Settings,
        drain_timeout: float,
        *,
        socket_group: int | None = None,
        request_timeout: float = 10.0,
        connections_per_client: int | None = None,
    ) -> None:
        self.settings = settings
        self.socket_group = socket_group
        self.request_timeout = request_timeout
        self.connections_per_client = connections_per_client
        self.gate: ConnectionGate | None = None
        self.drain_timeout = drain_timeout
        self.metrics_address: str | None = None
        self.ready = False
        self.draining = False
        self.inflight: set[asyncio.Task[Any]] = set()
        self.started = time.time()
        self._runners: list[web.AppRunner] = []
        self._lock_fd: int | None = None
        self._owns_socket = False
        self._stop = asyncio.Event()
        self._force = asyncio.Event()
        self._stopped = False

    @property
    def socket_path(self) -> Path:
        return self.settings.daemon_socket

    @property
    def snapshot_dir(self) -> Path:
        """Where manifest snapshots that clients hold are kept (0710, files 0640: its clients read theirs)."""
        return self.settings.local_dir / "daemon" / "manifests"

    def unavailable(self) -> str | None:
        """Why the daemon cannot take work now, or None."""
        if self.draining:
            return DRAINING
        return None if self.ready else STARTING

    # -- start ----------------------------------------------------------------------------

    async def bind(self, app: web.Application, metrics_app: web.Application) -> None:
        """Prepare the directories, take the node lock, serve ``app`` on the socket and ``metrics_app``."""
        await asyncio.to_thread(self._prepare_directories)
        self._take_lock()
        unix_sock = self._bind_socket()
        try:
            metrics_sock = self._bind_metrics()
        except BaseException:
            unix_sock.close()
            raise
        self.metrics_address = "{}:{}".format(*metrics_sock.getsockname()[:2])
        limit, budget = fd_budget()
        per_client = self.connections_per_client or max(4, budget // 4)
        self.gate = ConnectionGate(total=budget, per_client=per_client)
        logger.info(
            "open-file limit %d: up to %d connections, %d per client uid", limit, budget, per_client,
            extra={"event": "limits", "nofile": limit, "connections": budget, "per_client": per_client},
        )
        await self._serve(app, unix_sock, shutdown_timeout=2.0, gate=self.gate)
        await self._serve(metrics_app, metrics_sock, shutdown_timeout=1.0)

    async def _serve(
        self, app: web.Application, sock: socket.socket, *, shutdown_timeout: float, gate: ConnectionGate | None = None
    ) -> None:
        runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=shutdown_timeout,
            logger=http_logger,
            keepalive_timeout=self.request_timeout,  # also bounds a request's headers (slowloris)
            # A client that leaves cancels its request's handler: the listing it began stops with it
            # (work others share, a transfer, runs on as a `tracked` task of its own).
            handler_cancellation=True,
        )
        await runner.setup()
        self._runners.append(runner)
        site = web.SockSite(runner, sock) if gate is None else GatedSite(runner, sock, gate)
        await site.start()

    def _prepare_directories(self) -> None:
        # The shard files and snapshot manifests are for the clients of the daemon's group
        # (GROUP_READABLE: 0750/0640, whatever the umask); its locks and catalog stay its own.
        local = make_local_dirs(self.settings.local_dir, GROUP_READABLE.dir)
        mode = local.stat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            logger.warning(
                "the cache directory %s is writable by others (mode %o); 0750 is safer",
                local,
                mode & 0o777,
            )
        beyond = capacity_beyond_disk(local, self.settings.local_capacity)
        if beyond is not None:
            logger.warning("%s", beyond)
        make_local_dirs(local / "locks")
        # Its group may pass to the manifest a client was handed, never list whose datasets are open.
        make_local_dirs(self.snapshot_dir.parent, GROUP_READABLE.dir)
        make_local_dirs(self.snapshot_dir, SNAPSHOT_DIR_MODE)
        self.snapshot_dir.chmod(SNAPSHOT_DIR_MODE)  # one an earlier version made 0750
        self._say_a_group_clients_lack()
        parent = self.socket_path.parent
        if not parent.exists():
            parent.mkdir(mode=0o755, parents=True)

    def _say_a_group_clients_lack(self) -> None:
        """Warn where the daemon's files are not its socket's group: its clients could reach it but
        not read what it hands them (a trial's daemon ran with its own account's group)."""
        made = self.snapshot_dir.parent
        group = made.stat().st_gid
        if self.socket_group is None or group == self.socket_group:
            return
        logger.warning(
            "%s is group %s, the socket's is %s: the daemon's clients cannot read the manifests and shards "
            "it writes; run it with its clients' group as its primary group (systemd Group=, or setpriv "
            "--regid=GROUP --init-groups) and empty %s",
            made,
            group_name(group),
            group_name(self.socket_group),
            self.settings.local_dir,
        )

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
        if self.socket_group is not None:
            os.chown(path, -1, self.socket_group)
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

    # -- requests a stop waits for --------------------------------------------------------

    async def tracked(self, awaitable: Awaitable[T], *, with_caller: bool = False) -> T:
        """Run ``awaitable`` as a task the drain on SIGTERM waits for.

        ``with_caller``: the task is cancelled when its caller is (the client left); else it runs on.
        """
        task = asyncio.ensure_future(awaitable)
        self.track(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if with_caller:
                task.cancel()
            raise

    def track(self, task: asyncio.Task[Any]) -> None:
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)

    # -- stop -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin a graceful stop (SIGTERM, SIGINT); a second request cuts the drain short."""
        if self._stop.is_set():
            logger.warning("second stop signal: abandoning running transfers now")
            self._force.set()
        self._stop.set()

    async def wait_stopped(self) -> None:
        """Return once a stop was requested."""
        await self._stop.wait()

    def begin_drain(self) -> bool:
        """Refuse new work from now on; False if a stop already ran."""
        if self._stopped:
            return False
        self._stopped = True
        self.draining = True
        self.ready = False
        return True

    async def drain(self, *work: Awaitable[Any]) -> int:
        """Wait (bounded) for ``work`` then for requests in flight; return how many were abandoned."""
        started = time.monotonic()
        timeout = self.drain_timeout
        for awaitable in work:
            await self.bounded(awaitable, timeout)
        if self.inflight:
            remaining = max(0.0, timeout - (time.monotonic() - started))
            await self.bounded(asyncio.wait(set(self.inflight)), remaining)
        return sum(1 for task in self.inflight if not task.done())

    async def release(self) -> None:
        """Close the runners, remove the socket, drop the node lock."""
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
        if self._owns_socket:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def bounded(self, awaitable: Awaitable[Any], grace: float) -> None:
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
