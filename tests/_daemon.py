"""Helpers for the daemon tests: ``datacache serve`` as a subprocess, and a tiny HTTP client over its socket."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

REPO = Path(__file__).resolve().parent.parent


def wait_until(condition: Callable[[], Any], *, timeout: float = 30.0, what: str = "a condition") -> Any:
    """Poll ``condition`` until it returns something true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        # The condition decides when the wait ends; the pause only spaces the polls.
        time.sleep(delay)  # sleep-ok: spaces the polls; the condition ends the wait
        delay = min(delay * 2, 0.05)


def make_shards(directory: Path, count: int, size: int, *, seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    shards = {f"shard-{i:04d}.tar": rng.randbytes(size) for i in range(count)}
    directory.mkdir(parents=True, exist_ok=True)
    for key, data in shards.items():
        (directory / key).write_bytes(data)
    return shards


def checksum(data: bytes) -> str:
    return f"xxh3_64:{xxhash.xxh3_64(data).hexdigest()}"


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path, timeout: float) -> None:
        super().__init__("datacache", timeout=timeout)
        self._path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except BaseException:
            sock.close()
            raise
        self.sock = sock


def unix_request(
    path: Path, method: str, target: str, body: Any = None, *, raw: bytes | None = None, timeout: float = 30.0
) -> tuple[int, Any]:
    """One HTTP request over the Unix socket ``path``; return (status, decoded JSON or text)."""
    connection = _UnixHTTPConnection(path, timeout)
    try:
        payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        connection.request(method, target, body=payload, headers=headers)
        response = connection.getresponse()
        data = response.read()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, data.decode(errors="replace")
    finally:
        connection.close()


def raw_exchange(path: Path, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send ``data`` as-is on the socket and return the reply's first bytes (its status line at least)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
        sock.sendall(data)
        return read_reply(sock, until=b"\r\n")
    finally:
        sock.close()


def read_reply(sock: socket.socket, *, until: bytes = b"\r\n\r\n") -> bytes:
    """What arrives on ``sock`` up to ``until`` (the end of the status line or of the headers), or its end."""
    received = b""
    while until not in received:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


@dataclass
class DaemonProcess:
    """A ``datacache serve`` subprocess with its own cache directory and socket."""

    process: subprocess.Popen[bytes]
    local_dir: Path
    socket: Path
    log: Path
    env: dict[str, str] = field(repr=False)

    def request(self, method: str, target: str, body: Any = None, **kw: Any) -> tuple[int, Any]:
        return unix_request(self.socket, method, target, body, **kw)

    def status(self) -> dict[str, Any]:
        code, document = self.request("GET", "/v1/status")
        assert code == 200, document
        assert isinstance(document, dict)
        return document

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"the daemon exited with {self.process.returncode}:\n{self.log_text()}")
        try:
            code, _ = self.request("GET", "/readyz", timeout=5)
        except OSError:
            return False
        return code == 200

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def signal(self, signum: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signum)

    def stop(self, *, timeout: float = 30.0) -> int:
        """SIGTERM, then wait (bounded) for the exit status."""
        self.signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


def daemon_env(base: Mapping[str, str], local_dir: Path, socket_path: Path) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith("DATACACHE_")}
    env["DATACACHE_LOCAL_DIR"] = str(local_dir)
    env["DATACACHE_SOCKET"] = str(socket_path)
    env["PYTHONPATH"] = str(REPO)
    return env


def start_daemon(
    base_env: Mapping[str, str],
    local_dir: Path,
    *args: str,
    socket_path: Path | None = None,
    log: Path | None = None,
    wait: bool = True,
    preexec_fn: Callable[[], None] | None = None,
    config: Path | None = None,
    group: int | None = None,
) -> DaemonProcess:
    """Start ``datacache serve`` (metrics on a free loopback port) and wait until it is ready.

    ``config``: the daemon's (and its `DaemonProcess.env`'s clients') ``DATACACHE_CONFIG``; ``group``: its gid.
    """
    socket_path = socket_path or local_dir / "daemon.sock"
    log = log or local_dir.parent / f"daemon-{local_dir.name}-{time.monotonic_ns()}.log"
    env = daemon_env(base_env, local_dir, socket_path)
    if config is not None:
        env["DATACACHE_CONFIG"] = str(config)
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "datacache.cli", "serve", "--metrics-address", "127.0.0.1:0", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            preexec_fn=preexec_fn,  # noqa: PLW1509 - only resource limits, before exec
            group=group,
        )
    daemon = DaemonProcess(process=process, local_dir=local_dir, socket=socket_path, log=log, env=env)
    if wait:
        try:
            wait_until(daemon.ready, timeout=60, what="the daemon to become ready")
        except BaseException:
            daemon.kill()
            raise
    return daemon


def catalog_rows(local_dir: Path) -> list[tuple[str, str, int, str | None, str]]:
    """(dataset, key, size, checksum, state) of every row of the node's catalog."""
    connection = sqlite3.connect(local_dir / "catalog.sqlite", timeout=30)
    try:
        return list(connection.execute("SELECT dataset, key, size, checksum, state FROM shards ORDER BY key"))
    finally:
        connection.close()


def visible_files(local_dir: Path) -> list[Path]:
    data = local_dir / "data"
    if not data.exists():
        return []
    return sorted(p for p in data.rglob("*") if p.is_file() and not p.name.startswith("."))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
