"""File helpers shared by the tiers: atomic writes, contained paths, redacted URLs."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import threading
import time
import uuid
from collections.abc import AsyncIterable
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.threadpool

__all__ = [
    "PARTIAL_NAME",
    "atomic_write",
    "device_free",
    "fsync_directory",
    "partial_name",
    "redact_url",
    "remove_abandoned_partials",
    "split_userinfo",
]

PARTIAL_NAME = re.compile(r"^\..*\.[0-9a-f]{32}\.partial$")
# A URL inside a message: a scheme, "://", then anything up to whitespace (a secret may hold quotes).
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S*")
# "host:port/..." (not "user:secret/with/slash@..."), for schemes whose URLs carry ports.
_PORT = re.compile(r"^[^:/@]*:\d{1,5}(/|$)")
# Object stores name a bucket, never a port: a ":" in the bucket part starts a secret.
_PORTLESS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})
REDACTED = "REDACTED"


def split_userinfo(url: str) -> tuple[str | None, str]:
    """Return ``(userinfo, url_without_it)``; ``userinfo`` is None when ``url`` carries none.

    AWS secrets often contain ``/`` and passwords ``@``, unescaped: in
    ``s3://AKIA:se/cret@bucket/p`` the userinfo runs to the last ``@`` before
    the query, since a ``user:`` part cannot be a bucket or host name (a port
    excepted, for schemes that have ports). Ambiguous input is taken as
    userinfo: a key containing ``@`` is redacted too much rather than a secret
    too little.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return None, url
    authority = rest.split("/", 1)[0]  # not cut at "?" or "#": a userinfo may hold them
    at = authority.rfind("@")
    portless = scheme.lower() in _PORTLESS
    if ":" in authority and (portless or at < 0):
        tail = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
        if portless or not _PORT.match(rest[:tail]):
            at = max(at, rest.rfind("@", 0, tail))
    if at < 0:
        return None, url
    return rest[:at], f"{scheme}://{rest[at + 1 :]}"


_QUERY_VALUE = re.compile(r"([?&][^=&#\s'\"]*=)[^&#\s'\"<>]*")


def _redact_query(rest: str) -> str:
    head, sep, query = rest.partition("?")
    if not sep:
        return rest
    # Presigned URLs and SAS tokens carry their signature in the query: keep the names only.
    return head + _QUERY_VALUE.sub(rf"\g<1>{REDACTED}", sep + query)


def _redact_one(match: re.Match[str]) -> str:
    _, stripped = split_userinfo(match.group(0))
    scheme, _, rest = stripped.partition("://")
    return f"{scheme}://{_redact_query(rest)}"


def redact_url(url: str) -> str:
    """Return ``url`` without credentials, also of every URL inside a message.

    Removes any ``user:password@`` part (secrets with ``/`` or ``@`` included)
    and replaces the value of every query parameter (``?sig=``,
    ``X-Amz-Signature=``, ...) with ``REDACTED``.
    """
    return _URL.sub(_redact_one, url)


def device_free(directory: str | os.PathLike[str]) -> int | None:
    """Bytes free for an unprivileged writer on the device holding ``directory``, or None if unknown."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def partial_name(target: Path) -> Path:
    """The temporary name a write to ``target`` uses until it is complete."""
    return target.with_name(f".{target.name}.{uuid.uuid4().hex}.partial")


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _CleanedUnderfoot(FileExistsError):
    """A cleaner removed a new temporary file between its creation and its lock."""


def _create_exclusive(path: str, flags: int) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        # Held until the file is closed: a cleaner that can take this lock knows the
        # writer is gone. Between the open and the lock a cleaner may take it first
        # and unlink the file; waiting for its lock and then finding no link tells.
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink == 0:
            raise _CleanedUnderfoot(path)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Opening:
    """Creating a temporary file in a thread, such that a writer cancelled meanwhile leaves nothing behind.

    Whichever comes second, the open or the cancellation, closes the file and
    removes it: neither the thread's result nor the event loop needs to be
    alive by then (a loop shut down during the open never receives it).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._abandoned = False
        self._file: Any = None

    def open(self) -> Any:
        raw = open(self.path, "xb", buffering=0, opener=_create_exclusive)  # noqa: SIM115 - closed by the writer
        with self._lock:
            if not self._abandoned:
                self._file = raw
                return raw
        self._discard(raw)
        return None

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            raw, self._file = self._file, None
        if raw is not None:
            self._discard(raw)

    def _discard(self, raw: Any) -> None:
        raw.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


async def _open_exclusive(temporary: Path) -> Any:
    """Create ``temporary`` for writing; if the writer is cancelled meanwhile, nothing is left open or on disk."""
    opening = _Opening(temporary)
    try:
        return await asyncio.to_thread(opening.open)
    except asyncio.CancelledError:
        opening.abandon()
        raise


async def _close(raw: Any) -> None:
    """Close ``raw`` in a thread, even if the caller is cancelled meanwhile.

    Cancelling an awaited executor job that has not started yet cancels the job
    itself: a writer cancelled while closing would leave its file open.
    """
    await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, raw.close))


def remove_abandoned_partials(root: Path, *, min_age: float = 30.0) -> list[Path]:
    """Delete the temporary files of writers that died; return what was removed.

    A partial is abandoned when no process holds its lock and it has not been
    written for ``min_age`` seconds. On a local disk the lock alone is
    authoritative (``min_age=0`` is safe: a writer whose new file is removed
    before it locks it notices and starts over); on a shared filesystem, where
    ``flock`` may only see this node, ``min_age`` protects other nodes' writers.
    """
    removed: list[Path] = []
    now = time.time()
    for directory, _, files in os.walk(root):
        for name in files:
            if not PARTIAL_NAME.match(name):
                continue
            path = Path(directory, name)
            try:
                if now - path.lstat().st_mtime < min_age:
                    continue
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
            finally:
                os.close(fd)
    return removed


async def atomic_write(
    target: str | os.PathLike[str], chunks: AsyncIterable[bytes | memoryview], *, durable: bool = True
) -> int:
    """Write ``chunks`` to ``target`` atomically; return the number of bytes written.

    The bytes go to ``.<name>.<uuid>.partial`` in the same directory, are
    fsynced (when ``durable``), and the file is renamed over ``target``. On any
    error or cancellation the temporary file is removed, so a reader sees
    either the old file, or the new one whole, never a partial one.
    """
    target = Path(target)
    await asyncio.to_thread(target.parent.mkdir, parents=True, exist_ok=True)
    temporary = partial_name(target)
    size = 0
    try:
        for _ in range(3):
            try:
                raw = await _open_exclusive(temporary)
            except _CleanedUnderfoot:
                temporary = partial_name(target)
            else:
                break
        else:
            raise OSError(f"could not create a temporary file beside {target}")
        try:
            out = aiofiles.threadpool.wrap(raw, loop=asyncio.get_running_loop())
            async for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    written = await out.write(view)
                    view = view[written:]
                    size += written
            if durable:
                await asyncio.to_thread(os.fsync, raw.fileno())
        finally:
            await _close(raw)
        await asyncio.to_thread(os.replace, temporary, target)
        if durable:
            await asyncio.to_thread(fsync_directory, target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return size
