"""HTTP over the daemon's Unix socket, as `DaemonClient` speaks it: who listens, what a reply means.

Connecting checks the listener's uid before a byte is sent; a reply (or a streamed line) that
carries an error is raised as the exception the daemon named (`datacache._protocol`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from datacache._logging import FirstTime
from datacache._protocol import exception_from_wire
from datacache.config import DatasetConfig
from datacache.errors import ConfigError, DaemonUnavailableError, DatacacheError, NotServedError
from datacache.manifest import Manifest
from datacache.ownership import group_name
from datacache.tiers import ByteRange, redact_url

__all__ = [
    "BASE",
    "VerifiedUnixConnector",
    "decode_reply",
    "read_file",
    "read_manifest_file",
    "same_dataset",
    "say_notices",
    "streamed_events",
]

logger = logging.getLogger("datacache.client")

_NOTICES_SAID = FirstTime()
"""What the daemon's listings warned of that this process (and its run) has said."""

BASE = "http://datacache"  # the host is ignored on a Unix socket
_PEERCRED = struct.Struct("3i")


class VerifiedUnixConnector(aiohttp.UnixConnector):
    """Connects to the daemon's socket and, before a byte is sent, checks who listens there.

    Whoever can create the socket path could pose as the daemon and collect what
    clients send: the listener must be root, this process's own uid, or the
    configured daemon uid (``daemon.daemon_uid``), by ``SO_PEERCRED``.
    """

    def __init__(self, path: str, trusted: frozenset[int]) -> None:
        super().__init__(path=path, force_close=True)
        self.trusted = trusted
        self.server_uid: int | None = None

    async def _create_connection(self, req: Any, traces: Any, timeout: Any) -> Any:  # noqa: ASYNC109 - aiohttp's signature
        protocol = await super()._create_connection(req, traces, timeout)
        sock = protocol.transport.get_extra_info("socket") if protocol.transport is not None else None
        uid = -1
        if sock is not None:
            uid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[1]
        if uid not in self.trusted:
            protocol.close()
            raise DaemonUnavailableError(
                f"the process listening on {self._path} runs as uid {uid}, not as root, this user or "
                "the configured daemon uid (daemon.daemon_uid): not talking to it"
            )
        self.server_uid = uid
        return protocol


def decode_reply(status: int, raw: bytes, path: str) -> dict[str, Any]:
    """The daemon's JSON reply to ``path``; its error, if it answered one, raised as the exception it names."""
    try:
        document = json.loads(raw) if raw else {}
    except ValueError:
        document = None
    if not isinstance(document, dict):
        raise DatacacheError(f"daemon: unexpected reply to {path} (HTTP {status})")
    if status >= 400:
        error = document.get("error")
        if isinstance(error, dict):
            if error.get("not_served") is True:
                raise NotServedError(f"daemon: {error.get('message', '')}")
            raise exception_from_wire(str(error.get("code", "")), str(error.get("message", "")))
        raise DatacacheError(f"daemon: HTTP {status} for {path}")
    return document


async def streamed_events(response: aiohttp.ClientResponse, path: str) -> AsyncIterator[dict[str, Any]]:
    """The JSON lines of a streamed reply (``warm``); an error line is raised as the exception it names."""
    if response.status >= 400:
        decode_reply(response.status, await response.read(), path)
    async for line in response.content:
        if not line.strip():
            continue
        event = json.loads(line)
        if not isinstance(event, dict):
            raise DatacacheError("daemon: unexpected warm progress line")
        if event.get("event") == "error":
            raise exception_from_wire(str(event.get("code", "")), str(event.get("message", "")))
        yield event


def read_file(path: Path, byte_range: ByteRange | None) -> bytes:
    """Read a cached shard's file (or a range of it) where the daemon said it is, never through a link."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        size = os.fstat(fd).st_size
        start = byte_range.start if byte_range is not None else 0
        length = byte_range.length(size) if byte_range is not None else size
        chunks: list[bytes] = []
        while length > 0:
            chunk = os.pread(fd, min(length, 64 << 20), start)
            if not chunk:
                break
            chunks.append(chunk)
            start += len(chunk)
            length -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def say_notices(notices: object, run_dir: Path) -> None:
    """Say what the daemon warned of when it listed a dataset (its log is not the user's), once per run."""
    if not isinstance(notices, list):
        return
    for notice in notices:
        text = redact_url(str(notice))
        logger.log(_NOTICES_SAID.level(text, run_dir=run_dir), "%s", text)


def same_dataset(config: DatasetConfig, named: object) -> None:
    """Refuse a reply about another dataset than ``config`` (most often: another endpoint)."""
    # An id includes the origin's endpoint, and the daemon gets options, not the environment.
    if named != config.id:
        raise ConfigError(
            f"the daemon names {redact_url(config.url)} dataset {named!r}, this process names it {config.id!r}: "
            "they reach a different origin (most often a different endpoint: AWS_ENDPOINT_URL or "
            "FSSPEC_S3_ENDPOINT_URL set on one side only); give the daemon and its clients the same "
            "endpoint, or set endpoint_url in the dataset's storage_options"
        )


def _group_of(path: Path) -> str:
    """The name (or gid) of the group of ``path``'s directory, or of the nearest one this uid can stat."""
    for place in (path, *path.parents):
        try:
            gid = place.stat().st_gid
        except OSError:
            continue
        return group_name(gid)
    return "unknown"


def read_manifest_file(path: Path, snapshot: str) -> Manifest:
    """The manifest snapshot the daemon wrote for its clients at ``path`` (it must hold ``snapshot``)."""
    try:
        raw = path.read_bytes()
    except PermissionError:
        # A trial's daemon ran with its own account's group: its files were that group's, not its clients'.
        raise DatacacheError(
            f"cannot read the manifest {path} the daemon wrote: permission denied to uid {os.geteuid()}, "
            f"not in its group {_group_of(path)}; run the daemon with its clients' group as its primary group "
            "(systemd Group=, or setpriv --regid=GROUP --init-groups; docs/SECURITY.md, 'Setting it up'), "
            "then empty its local tier"
        ) from None
    except OSError as exc:
        raise DatacacheError(
            f"cannot read the manifest {path} the daemon wrote ({exc.strerror}); "
            "mount the cache directory at the same path as in the daemon's container"
        ) from None
    try:
        manifest = Manifest.from_json(json.loads(raw), str(path))
    except ValueError as exc:
        raise DatacacheError(f"the manifest {path} the daemon wrote is unreadable: {exc}") from None
    if manifest.snapshot != snapshot:
        raise DatacacheError(f"the manifest {path} holds snapshot {manifest.snapshot}, not {snapshot}")
    return manifest
