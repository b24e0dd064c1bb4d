"""A fault-injecting HTTP proxy between an S3 client and the test's S3 server (moto).

It forwards every request to the upstream server and, by configured rates and a
seeded random generator, answers some of them badly instead:

- ``error500`` / ``error503``: ``500 InternalError`` / ``503 ServiceUnavailable`` with an S3 XML body;
- ``slowdown``: S3 throttling, ``503`` with ``<Code>SlowDown</Code>``;
- ``reset``: the headers (with the right ``Content-Length``) and part of the body, then a TCP reset;
- ``truncate``: the headers (with the right ``Content-Length``) and part of the body, then a clean close;
- ``latency``: the right answer, late;
- ``stall``: the headers and part of the body, or nothing at all, and then nothing ever again
  (the client's read timeout has to fire).

Rules make faults permanent for matching requests (``403 AccessDenied``,
``404 NoSuchKey``), and a hook runs before a matching request is forwarded (to
change the origin in the middle of a transfer). The proxy counts what it
received, per ``METHOD /path``, and what it injected, per fault.

It runs its own event loop in a thread, so subprocesses (``datacache warm``,
``datacache serve``) can use it as their endpoint as well as the test itself.
"""

from __future__ import annotations

import asyncio
import random
import re
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import aiohttp
from aiohttp import web

FAULTS = ("error500", "error503", "slowdown", "reset", "truncate", "latency", "stall")
"""Every kind of transient fault the proxy injects."""

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "upgrade",
    "proxy-connection",
    "te",
    "trailer",
}
_ERRORS = {
    "error500": (500, "InternalError", "We encountered an internal error. Please try again."),
    "error503": (503, "ServiceUnavailable", "Service is unable to handle request."),
    "slowdown": (503, "SlowDown", "Please reduce your request rate."),
}


def s3_error(status: int, code: str, message: str, resource: str = "") -> web.Response:
    """An S3-style XML error response."""
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{resource}</Resource><RequestId>faultproxy</RequestId></Error>"
    ).encode()
    return web.Response(status=status, body=body, content_type="application/xml")


@dataclass
class FaultRates:
    """Probability of each fault per request (their sum is the share of requests faulted)."""

    error500: float = 0.0
    error503: float = 0.0
    slowdown: float = 0.0
    reset: float = 0.0
    truncate: float = 0.0
    latency: float = 0.0
    stall: float = 0.0
    latency_range: tuple[float, float] = (0.02, 0.2)

    @classmethod
    def spread(cls, total: float, **overrides: float) -> FaultRates:
        """``total`` shared evenly between every fault kind (then ``overrides`` applied)."""
        share = total / len(FAULTS)
        rates = cls(**dict.fromkeys(FAULTS, share))
        for name, value in overrides.items():
            setattr(rates, name, value)
        return rates

    @property
    def total(self) -> float:
        return sum(getattr(self, name) for name in FAULTS)


@dataclass
class Rule:
    """A permanent answer for requests whose ``METHOD /path`` matches ``pattern``."""

    pattern: re.Pattern[str]
    status: int
    code: str
    message: str


@dataclass
class _Forced:
    pattern: re.Pattern[str]
    kind: str
    remaining: int


@dataclass
class _State:
    counts: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    log: list[tuple[str, str]] = field(default_factory=list)


class FaultProxy:
    """The proxy; use as a context manager, and point the S3 client at `endpoint`.

    Parameters
    ----------
    upstream
        The real server, e.g. ``http://127.0.0.1:PORT``.
    rates
        Fault probabilities per request (default: no faults).
    seed
        Seed of the generator that picks which requests are faulted.
    methods
        Only requests with these methods are faulted (all are forwarded and counted).
    """

    def __init__(
        self,
        upstream: str,
        *,
        rates: FaultRates | None = None,
        seed: int = 0,
        methods: frozenset[str] = frozenset({"GET", "HEAD"}),
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.rates = rates or FaultRates()
        self.methods = methods
        self._rng = random.Random(seed)
        self._rules: list[Rule] = []
        self._hooks: list[tuple[re.Pattern[str], Callable[[str], None]]] = []
        self._client_hooks: list[tuple[re.Pattern[str], Callable[[str, str], None]]] = []
        self._forced: list[_Forced] = []
        self._state = _State()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._release: asyncio.Event | None = None
        self._stalled: set[asyncio.Task[Any]] = set()
        self.port = 0

    # -- control from the test ------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_rates(self, rates: FaultRates) -> None:
        with self._lock:
            self.rates = rates

    def add_rule(self, pattern: str, status: int, code: str, message: str = "permanent fault") -> None:
        """Answer every request whose ``METHOD /path`` matches ``pattern`` (a regex) with this error."""
        with self._lock:
            self._rules.append(Rule(re.compile(pattern), status, code, message))

    def force(self, pattern: str, kind: str, *, times: int = 1) -> None:
        """Inject fault ``kind`` into the next ``times`` requests whose ``METHOD /path`` matches ``pattern``."""
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self._forced.append(_Forced(re.compile(pattern), kind, times))

    def clear_rules(self) -> None:
        with self._lock:
            self._rules.clear()
            self._hooks.clear()
            self._client_hooks.clear()
            self._forced.clear()

    def add_hook(self, pattern: str, hook: Callable[[str], None]) -> None:
        """Call ``hook("METHOD /path")`` (in the proxy's thread) before forwarding a matching request."""
        with self._lock:
            self._hooks.append((re.compile(pattern), hook))

    def add_client_hook(self, pattern: str, hook: Callable[[str, str], None]) -> None:
        """Call ``hook("METHOD /path", access_key_id)`` (in the proxy's thread) before forwarding a matching request.

        The access key id is the one the request was signed with ("" when unsigned): clients
        given different keys are told apart, while the dataset they read stays the same.
        """
        with self._lock:
            self._client_hooks.append((re.compile(pattern), hook))

    def counts(self) -> dict[str, int]:
        """Requests received, per ``METHOD /path``."""
        with self._lock:
            return dict(self._state.counts)

    def faults(self) -> dict[str, int]:
        """Faults injected, per kind (and ``rule`` for permanent answers)."""
        with self._lock:
            return dict(self._state.faults)

    def failed_requests(self) -> int:
        """Requests answered with a transient failure (every fault but latency): each costs the client a retry."""
        with self._lock:
            return sum(n for kind, n in self._state.faults.items() if kind not in ("latency", "rule"))

    def log(self) -> list[tuple[str, str]]:
        """(fault, ``METHOD /path``) of every fault injected, in order."""
        with self._lock:
            return list(self._state.log)

    def reset_counts(self) -> None:
        with self._lock:
            self._state = _State()

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> FaultProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve())
            except BaseException as exc:  # surfaced to start()
                failure.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the fault proxy did not start")
        if failure:
            raise failure[0]

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        self._loop = self._thread = None

    async def _serve(self) -> None:
        self._release = asyncio.Event()
        self._session = aiohttp.ClientSession(
            auto_decompress=False, timeout=aiohttp.ClientTimeout(total=120), skip_auto_headers=("User-Agent",)
        )
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    async def _shutdown(self) -> None:
        if self._release is not None:
            self._release.set()
        for task in list(self._stalled):
            task.cancel()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # -- one request ----------------------------------------------------------------------

    def _choose(self, method: str) -> str | None:
        with self._lock:
            if method not in self.methods:
                return None
            draw = self._rng.random()
            edge = 0.0
            for name in FAULTS:
                edge += getattr(self.rates, name)
                if draw < edge:
                    return name
            return None

    def _pick(self, method: str, what: str) -> str | None:
        with self._lock:
            for forced in self._forced:
                if forced.remaining > 0 and forced.pattern.search(what):
                    forced.remaining -= 1
                    return forced.kind
        return self._choose(method)

    def _record(self, fault: str, what: str) -> None:
        with self._lock:
            self._state.faults[fault] += 1
            self._state.log.append((fault, what))

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        what = f"{request.method} {unquote(request.path)}"
        with self._lock:
            self._state.counts[what] += 1
            rule = next((r for r in self._rules if r.pattern.search(what)), None)
            hooks = [hook for pattern, hook in self._hooks if pattern.search(what)]
            client_hooks = [hook for pattern, hook in self._client_hooks if pattern.search(what)]
        if rule is not None:
            self._record("rule", what)
            if request.method == "HEAD":
                return web.Response(status=rule.status)
            return s3_error(rule.status, rule.code, rule.message, request.path)
        for hook in hooks:
            await asyncio.to_thread(hook, what)
        if client_hooks:
            key = _access_key(request.headers.get("Authorization", ""))
            for client_hook in client_hooks:
                await asyncio.to_thread(client_hook, what, key)
        fault = self._pick(request.method, what)
        if fault in _ERRORS:
            self._record(fault, what)
            status, code, message = _ERRORS[fault]
            if request.method == "HEAD":
                return web.Response(status=status)
            return s3_error(status, code, message, request.path)
        if fault == "latency":
            self._record(fault, what)
            with self._lock:
                low, high = self.rates.latency_range
                delay = self._rng.uniform(low, high)
            await asyncio.sleep(delay)  # sleep-ok: the injected latency is the fault under test
        if fault == "stall" and (request.method == "HEAD" or self._coin()):
            self._record(fault, what)
            await self._stall()  # before a single byte of the answer
        status, headers, data = await self._forward(request, body)
        if fault in ("reset", "truncate", "stall") and request.method != "HEAD" and len(data) > 1:
            self._record(fault, what)
            return await self._cut(request, fault, status, headers, data)
        # (A reset or truncation asked for a reply with no body to cut is not injected, nor counted.)
        response = web.Response(status=status, body=data if request.method != "HEAD" else None, headers=headers)
        if request.method == "HEAD" and "Content-Length" in headers:
            response.headers["Content-Length"] = headers["Content-Length"]
        return response

    def _coin(self) -> bool:
        with self._lock:
            return self._rng.random() < 0.5

    async def _forward(self, request: web.Request, body: bytes) -> tuple[int, dict[str, str], bytes]:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        async with self._session.request(
            request.method,
            self.upstream + request.path_qs,
            headers=headers,
            data=body or None,
            allow_redirects=False,
        ) as upstream:
            data = await upstream.read()
            out = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
            if request.method == "HEAD" and "Content-Length" in upstream.headers:
                out["Content-Length"] = upstream.headers["Content-Length"]
            return upstream.status, out, data

    async def _cut(
        self, request: web.Request, fault: str, status: int, headers: dict[str, str], data: bytes
    ) -> web.StreamResponse:
        with self._lock:
            cut = self._rng.randrange(1, len(data))
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = len(data)  # the whole length is promised...
        await response.prepare(request)
        await response.write(data[:cut])  # ...and only part of it is sent
        transport = request.transport
        if fault == "stall":
            await self._stall()
        if transport is None:
            return response
        if fault == "reset":
            # Give the kernel a moment to send what was written, then reset the connection.
            await asyncio.sleep(0.01)  # sleep-ok: lets the kernel send the partial body before the reset
            sock: socket.socket | None = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        else:
            transport.close()  # a clean close after a short body
        return response

    async def _stall(self) -> None:
        """Wait until the proxy stops: a request that never finishes."""
        assert self._release is not None
        task = asyncio.current_task()
        if task is not None:
            self._stalled.add(task)
        try:
            await self._release.wait()
        finally:
            if task is not None:
                self._stalled.discard(task)
        raise ConnectionAbortedError("the fault proxy stopped during a stall")


def _access_key(authorization: str) -> str:
    """The access key id of a SigV4 ``Authorization`` header (``Credential=KEY/date/...``), or ""."""
    found = re.search(r"Credential=([^/,\s]+)/", authorization)
    return found.group(1) if found else ""
