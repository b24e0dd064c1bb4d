"""Bounds on what clients can make the daemon hold: connections, file descriptors, body memory.

One client must not starve the others: each uid holds at most a share of the
daemon's connections, all connections together stay inside a file-descriptor
budget derived from the process's own limit (raised to its hard limit at start,
whatever ``LimitNOFILE`` the unit set), and request bodies waiting to be parsed
share one memory budget. A connection over a cap is closed at once, before a
byte of it is read; a body over the budget gets ``503`` (the client reads
without the daemon meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import struct
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from datacache.errors import ConfigError

__all__ = ["BodyBudget", "ConnectionGate", "GatedSite", "OpenGate", "TooManyOpensError", "fd_budget"]

logger = logging.getLogger("datacache.daemon")

_PEERCRED = struct.Struct("3i")
ACCEPT_BACKLOG = 32
"""Connections accepted in one burst (each an fd before the gate sees it): kept small."""


def fd_budget(*, want: int = 65536) -> tuple[int, int]:
    """Raise this process's open-file limit toward its hard limit; return (limit, connections).

    The connections' share leaves room for the daemon's own files, the origin's
    sockets, the catalog and one burst of accepted connections.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass  # keep the limit we have; the budget follows it
    limit = soft if soft != resource.RLIM_INFINITY else want
    reserve = min(limit // 2, 64 + 2 * ACCEPT_BACKLOG + 128)
    return limit, max(8, limit - reserve)


@dataclass
class ConnectionGate:
    """How many connections the daemon holds, in all and per uid."""

    total: int
    per_client: int

    def __post_init__(self) -> None:
        self.open = 0
        self.by_uid: Counter[int] = Counter()
        self.refused = 0
        self._last_warning = 0.0

    def admit(self, uid: int) -> bool:
        if self.open >= self.total or self.by_uid[uid] >= self.per_client:
            self.refused += 1
            now = time.monotonic()
            if now - self._last_warning > 10.0:  # one line per 10 s, however many are refused
                self._last_warning = now
                logger.warning(
                    "refusing connections: %d open (limit %d), uid %d holds %d (limit %d); %d refused so far",
                    self.open,
                    self.total,
                    uid,
                    self.by_uid[uid],
                    self.per_client,
                    self.refused,
                    extra={"event": "connection_refused", "uid": uid},
                )
            return False
        self.open += 1
        self.by_uid[uid] += 1
        return True

    def release(self, uid: int) -> None:
        self.open -= 1
        self.by_uid[uid] -= 1
        if self.by_uid[uid] <= 0:
            del self.by_uid[uid]


def _peer_uid(transport: asyncio.BaseTransport) -> int:
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return -1
    try:
        return int(_PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1])
    except OSError:
        return -1


class _Gated(asyncio.Protocol):
    """aiohttp's request handler behind the gate: admitted connections only, released when lost."""

    def __init__(self, inner: Any, gate: ConnectionGate) -> None:
        self._inner = inner
        self._gate = gate
        self._uid: int | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        uid = _peer_uid(transport)
        if not self._gate.admit(uid):
            if isinstance(transport, asyncio.Transport):
                transport.abort()
            else:  # pragma: no cover - a Unix stream server's transports are Transports
                transport.close()
            return
        self._uid = uid
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._uid is None:
            return
        self._gate.release(self._uid)
        self._uid = None
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._uid is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._uid is not None else None

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class GatedSite(web.SockSite):
    """A `web.SockSite` whose connections pass a `ConnectionGate` first."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, gate: ConnectionGate) -> None:
        super().__init__(runner, sock, backlog=ACCEPT_BACKLOG)
        self.gate = gate

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        if server is None:  # pragma: no cover - the runner was set up before the site
            raise RuntimeError("the runner is not set up")
        gate = self.gate
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: _Gated(server(), gate), sock=self._sock, backlog=self._backlog
        )


class BodyBudget:
    """Bytes of request bodies held at once, across every connection."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size


class TooManyOpensError(ConfigError):
    """A uid asked to open more datasets at once than the daemon lets one uid (``--opens-per-client``)."""


@dataclass
class OpenGate:
    """Which datasets each uid is opening (each open may list an origin); past ``per_client``, refused at once.

    A listing holds memory and origin requests up to the listing bounds; this keeps one uid
    to a few of them, so that its opens cannot take the daemon from the others. Opens of one
    dataset count once (the ranks and workers of one job open it together; one lists it).
    """

    per_client: int

    def __post_init__(self) -> None:
        self.by_uid: dict[int, Counter[str]] = {}

    @contextlib.contextmanager
    def hold(self, uid: int, dataset: str) -> Iterator[None]:
        mine = self.by_uid.setdefault(uid, Counter())
        if dataset not in mine and len(mine) >= self.per_client:
            raise TooManyOpensError(
                f"uid {uid} is opening {len(mine)} datasets at once, this daemon's bound per uid "
                "(--opens-per-client); wait for them, or ask the operator to raise it"
            )
        mine[dataset] += 1
        try:
            yield
        finally:
            mine[dataset] -= 1
            if not mine[dataset]:
                del mine[dataset]
            if not mine:
                self.by_uid.pop(uid, None)
