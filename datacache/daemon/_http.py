"""The daemon's HTTP layer: who may call, how a request is parsed, how an error is answered.

Everything here is about the transport, nothing about datasets: the verbs
(`datacache.daemon._server`, `_reads`) parse their bodies with these helpers and raise;
the middleware turns what they raise into one JSON error line (docs/DAEMON.md).
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from datacache._protocol import MAX_BODY_BYTES, error_for
from datacache.daemon._limits import BodyBudget
from datacache.daemon.metrics import DaemonMetrics
from datacache.errors import ConfigError, DaemonUnavailableError, DatacacheError
from datacache.staging import LOCAL, SHARED
from datacache.tiers import redact_url, validate_key

__all__ = [
    "BODY_LIMITS",
    "DRAINING",
    "STARTING",
    "BadRequest",
    "BodyLimits",
    "Forbidden",
    "NotServed",
    "Peer",
    "PeerPolicy",
    "body",
    "error",
    "http_logger",
    "keys",
    "middleware",
    "number",
    "peer",
    "string",
    "tier",
]

logger = logging.getLogger("datacache.daemon")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_PEERCRED = struct.Struct("3i")
# Routes that answer whatever the daemon's state (probes of the kubelet and Prometheus).
_ALWAYS = ("healthz", "readyz", "metrics", "unknown")
STARTING = "the daemon is starting (recovering its catalog)"
DRAINING = "the daemon is shutting down"


class _OneLineBadRequests(logging.Filter):
    """aiohttp logs every malformed request with a traceback: one line is enough for a bad client."""

    def filter(self, record: logging.LogRecord) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            reason = (exc.message or "").strip().splitlines()
            record.msg, record.args = "malformed request: %d %s", (exc.code, redact_url(reason[0] if reason else ""))
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


http_logger = logging.getLogger("datacache.daemon.http")
http_logger.addFilter(_OneLineBadRequests())


class BadRequest(ConfigError):
    code = "bad_request"


class Forbidden(ConfigError):
    code = "forbidden"


class NotServed(Forbidden):
    """A dataset this daemon does not serve to the caller: the reply says so (``"not_served": true``), and a
    loader reads it in its own process (a job user's private data is its own, never the daemon's)."""


@dataclass(frozen=True)
class Peer:
    """The process at the other end of the socket, by ``SO_PEERCRED`` (and its groups, ``SO_PEERGROUPS``)."""

    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()
    """Its supplementary groups when it connected: on a cluster the allowed group is one of these."""

    @property
    def is_operator(self) -> bool:
        """Root or the daemon's own uid: nothing the daemon holds is more than it holds itself."""
        return self.uid in (0, os.getuid())


@dataclass(frozen=True)
class PeerPolicy:
    """Who may use the daemon, by the peer's ``SO_PEERCRED``: root, the daemon's uid and gid, and these."""

    allow_uids: frozenset[int] = frozenset()
    allow_gids: frozenset[int] = frozenset()

    def check(self, peer: Peer) -> None:
        """Raise `Forbidden` unless ``peer`` may use the daemon."""
        if peer.is_operator or peer.uid in self.allow_uids:
            return
        allowed = self.allow_gids | {os.getgid()}
        if peer.gid in allowed or not allowed.isdisjoint(peer.groups):
            return
        raise Forbidden(
            f"uid {peer.uid} gid {peer.gid} may not use this daemon (allow it: --allow-uid or --allow-gid)"
        )


def peer(transport: asyncio.BaseTransport | None) -> Peer | None:
    """The process at the other end of a Unix socket; None over TCP."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    except OSError:
        return None
    pid, uid, gid = _PEERCRED.unpack(raw)
    return Peer(pid, uid, gid, _peer_groups(sock))


# Linux >= 4.13; the constant is missing from Python's socket module.
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_NGROUPS_MAX = 65536


def _peer_groups(sock: socket.socket) -> tuple[int, ...]:
    """The peer's supplementary groups as the kernel recorded them at connect (empty if it cannot tell)."""
    size = 64 * 4
    while True:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE and size < _NGROUPS_MAX * 4:
                size = _NGROUPS_MAX * 4
                continue
            return ()
        return struct.unpack(f"={len(raw) // 4}I", raw[: len(raw) // 4 * 4])


def error(code: str, status: int, message: str, *, not_served: bool = False) -> web.Response:
    """The one form of every error reply: a code and a one-line, redacted message."""
    line = redact_url(message.strip().splitlines()[0]) if message.strip() else code
    body: dict[str, Any] = {"code": code, "message": line}
    if not_served:
        body["not_served"] = True
    return web.json_response({"error": body}, status=status)


# -- request parsing ----------------------------------------------------------------------


@dataclass(frozen=True)
class BodyLimits:
    """How much body memory all requests may hold, and how long a body may take to arrive."""

    budget: BodyBudget
    timeout: float


BODY_LIMITS = web.AppKey("datacache_body_limits", BodyLimits)


async def body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object (an empty body is an empty object), read within the app's limits."""
    limits = request.app.get(BODY_LIMITS)
    if limits is None or not request.body_exists:
        return _parse(await request.read())
    size = request.content_length if request.content_length is not None else MAX_BODY_BYTES
    if not limits.budget.take(size):
        raise DaemonUnavailableError(
            f"the daemon holds request bodies of {limits.budget.held} bytes already (limit {limits.budget.limit}); "
            "go on without it and try again"
        )
    try:
        async with asyncio.timeout(limits.timeout):
            raw = await request.read()
    except TimeoutError:
        raise BadRequest(f"the request body did not arrive within {limits.timeout:g}s") from None
    finally:
        limits.budget.give(size)
    return _parse(raw)


def _parse(raw: bytes) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


def string(data: Mapping[str, Any], name: str, default: str | None = None) -> str:
    value = data.get(name, default)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{name}' must be a non-empty string")
    return value


def number(data: Mapping[str, Any], name: str, default: float) -> float:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise BadRequest(f"'{name}' must be a number")
    return float(value)


def keys(data: Mapping[str, Any], name: str = "keys") -> list[str]:
    value = data.get(name)
    if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
        raise BadRequest(f"'{name}' must be a list of shard keys")
    for key in value:
        validate_key(key)
    return value


def tier(data: Mapping[str, Any]) -> str:
    value = data.get("tier", LOCAL)
    if value not in (LOCAL, SHARED):
        raise BadRequest(f"unknown tier {value!r} (choose local or shared)")
    return str(value)


# -- the middleware -----------------------------------------------------------------------


def middleware(
    peers: PeerPolicy, metrics: DaemonMetrics, unavailable: Callable[[], str | None]
) -> Any:
    """Check the peer, refuse work while starting or draining, turn exceptions into error replies.

    ``unavailable`` says why the daemon cannot take work now (None when it can).
    """

    @web.middleware
    async def handle(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = request.match_info.route
        verb = route.name if route is not None and route.name else "unknown"
        started = time.monotonic()
        code = "ok"
        try:
            who = peer(request.transport)
            if who is not None:
                peers.check(who)
                request["peer"] = who
            elif verb not in _ALWAYS:
                raise Forbidden("cannot tell which user is calling (no SO_PEERCRED on this connection)")
            if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
                code = "too_large"
                return error(code, 413, f"request body over {MAX_BODY_BYTES} bytes")
            if verb not in _ALWAYS:
                reason = unavailable()
                if reason is not None:
                    raise DaemonUnavailableError(reason)
            return await handler(request)
        except asyncio.CancelledError:
            code = "client_gone"  # the client closed its connection: the handler's work was cancelled
            raise
        except web.HTTPException as exc:
            code, reply = _http_error(request, exc)
            return reply
        except (BadRequest, Forbidden) as exc:
            code = exc.code
            status = 403 if isinstance(exc, Forbidden) else 400
            return error(code, status, str(exc), not_served=isinstance(exc, NotServed))
        except (DatacacheError, ValueError, OSError) as exc:
            code, reply = _failure(verb, exc, draining=unavailable() == DRAINING)
            return reply
        except Exception:
            code = "internal"
            logger.exception("request %s failed", verb)
            return error(code, 500, f"internal error answering {verb} (see the daemon's log)")
        finally:
            metrics.requests.labels(verb, code).inc()
            metrics.request_seconds.labels(verb).observe(time.monotonic() - started)

    return handle


def _http_error(request: web.Request, exc: web.HTTPException) -> tuple[str, web.Response]:
    if exc.status == 404:
        message = f"unknown request {request.method} {request.path} (see docs/DAEMON.md)"
        return "unknown_request", error("unknown_request", 404, message)
    if exc.status == 405:
        return "unknown_request", error("unknown_request", 405, f"{request.path} does not take {request.method}")
    if exc.status == 413:
        return "too_large", error("too_large", 413, f"request body over {MAX_BODY_BYTES} bytes")
    return "bad_request", error("bad_request", exc.status, exc.reason or "bad request")


def _failure(verb: str, exc: BaseException, *, draining: bool) -> tuple[str, web.Response]:
    code, status = error_for(exc)
    if draining and status >= 500:
        # Abandoned by the shutdown: the client should go on without the daemon.
        exc = DaemonUnavailableError(f"the daemon shut down before answering ({exc})")
        code, status = "shutting_down", 503
    if status >= 500 and code != "shutting_down":
        logger.warning("%s failed: %s", verb, redact_url(str(exc)), extra={"event": "request_failed"})
    return code, error(code, status, str(exc) or type(exc).__name__)
