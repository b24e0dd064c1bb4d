"""File helpers shared by the tiers: atomic writes, contained paths, redacted URLs."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import threading
import uuid
from collections.abc import AsyncIterable
from pathlib import Path
from typing import Any

import aiofiles
import aiofiles.threadpool
from datacache.tiers._acl import apply_mode
from datacache.tiers._dirfd import READ_FLAGS, DirHandle, Place, UnsafeFileError, open_dir_async, server_now

__all__ = [
    "PARTIAL_NAME",
    "atomic_write",
    "create_temporary",
    "device_free",
    "partial_name",
    "redact_url",
    "remove_abandoned_partials",
    "remove_if_abandoned",
    "resolves_inside",
    "split_userinfo",
    "write_small",
]

PARTIAL_NAME = re.compile(r"^\..*\.[0-9a-f]{32}\.partial$")
# A URL inside a message: a scheme, "://", then anything up to whitespace (a secret may hold quotes).
# ASCII whitespace ends a URL; any other character (U+2000, NBSP, ...) may be part of a secret in it.
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://\S*", re.ASCII)
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


_QUERY_VALUE = re.compile(r"([?&;][^=&;#\s'\"]*=)[^&;#\s'\"<>]*")
# A fragment's parameters (OAuth's "#access_token=..."): every value, whatever separates them.
_FRAGMENT_VALUE = re.compile(r"([#&;][^=&;#\s'\"]*=)[^&;#\s'\"<>]*")
# Path parameters ("/x;jsessionid=..."): session ids and tokens ride there too.
_PATH_PARAMETER = re.compile(r"(;[^=;/?#\s'\"]*=)[^;/?#\s'\"<>]*")
# A bare component, no "=" ("#TOKEN", "?TOKEN", "&TOKEN"): a token passed without a name.
_BARE_COMPONENT = re.compile(r"([?&;#])[^=&;#\s'\"<>]+(?=[&;#\s'\"<>]|$)")


def _redact_query(rest: str) -> str:
    rest, hash_sign, fragment = rest.partition("#")
    head, sep, query = rest.partition("?")
    head = _PATH_PARAMETER.sub(rf"\g<1>{REDACTED}", head)
    if sep:
        # Presigned URLs and SAS tokens carry their signature in the query: keep the names only.
        head += _BARE_COMPONENT.sub(rf"\g<1>{REDACTED}", _QUERY_VALUE.sub(rf"\g<1>{REDACTED}", sep + query))
    if hash_sign:
        fragment = _FRAGMENT_VALUE.sub(rf"\g<1>{REDACTED}", hash_sign + fragment)
        head += _BARE_COMPONENT.sub(rf"\g<1>{REDACTED}", fragment)
    return head


def _redact_one(match: re.Match[str]) -> str:
    _, stripped = split_userinfo(match.group(0))
    scheme, _, rest = stripped.partition("://")
    return f"{scheme}://{_redact_query(rest)}"


def redact_url(url: str) -> str:
    """Return ``url`` without credentials, also of every URL inside a message.

    Removes any ``user:password@`` part (secrets with ``/`` or ``@`` included)
    and replaces with ``REDACTED`` the value of every query parameter (``?sig=``,
    ``X-Amz-Signature=``, ...), of every fragment parameter
    (``#access_token=``) and of every path parameter (``;jsessionid=``); a bare
    component with no name (``#TOKEN``, ``?TOKEN``) is replaced whole.
    """
    return _URL.sub(_redact_one, url)


def resolves_inside(path: str, root: str) -> bool:
    """Whether local ``path``, its links followed, is ``root`` (itself resolved) or below it."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip("/") + "/")


def device_free(directory: str | os.PathLike[str]) -> int | None:
    """Bytes free for an unprivileged writer on the device holding ``directory``, or None if unknown."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def partial_name(name: str) -> str:
    """The temporary name a write to ``name`` uses until it is complete (in the same directory)."""
    return f".{name}.{uuid.uuid4().hex}.partial"


class _CleanedUnderfoot(FileExistsError):
    """A cleaner removed a new temporary file between its creation and its lock."""


def _create_exclusive(dir_fd: int, name: str, mode: int | None, *, readable: bool = False) -> int:
    access = os.O_RDWR if readable else os.O_WRONLY
    fd = os.open(
        name, access | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600 if mode is not None else 0o644,
        dir_fd=dir_fd,
    )
    try:
        if mode is not None:
            apply_mode(fd, mode)  # exactly the tier's mode (and a dataset's readers' ACL), whatever the umask
        # Held until the file is closed: a cleaner that can take this lock knows the
        # writer is gone. Between the open and the lock a cleaner may take it first
        # and unlink the file; waiting for its lock and then finding no link tells.
        fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink == 0:
            raise _CleanedUnderfoot(name)
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

    def __init__(self, directory: DirHandle, name: str, mode: int | None) -> None:
        self.name = name
        self._directory = directory
        self._mode = mode
        self._lock = threading.Lock()
        self._abandoned = False
        self._file: Any = None

    def open(self) -> Any:
        return self._directory.do(self._open_in)

    def _open_in(self, dir_fd: int) -> Any:
        def opener(name: str, flags: int) -> int:
            return _create_exclusive(dir_fd, name, self._mode)

        raw = open(self.name, "xb", buffering=0, opener=opener)  # noqa: SIM115 - closed by the writer
        with self._lock:
            if not self._abandoned:
                self._file = raw
                return raw
        self._discard(raw, dir_fd)
        return None

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = True
            raw, self._file = self._file, None
        if raw is not None:
            self._directory.do(lambda dir_fd: self._discard(raw, dir_fd))

    def _discard(self, raw: Any, dir_fd: int) -> None:
        raw.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.name, dir_fd=dir_fd)


async def _open_exclusive(directory: DirHandle, name: str, mode: int | None) -> Any:
    """Create ``name`` for writing; if the writer is cancelled meanwhile, nothing is left open or on disk."""
    opening = _Opening(directory, name, mode)
    try:
        return await asyncio.to_thread(opening.open)
    except asyncio.CancelledError:
        opening.abandon()
        raise


async def close_file(raw: Any) -> None:
    """Close ``raw`` in a thread, even if the caller is cancelled meanwhile.

    Cancelling an awaited executor job that has not started yet cancels the job
    itself: a writer cancelled while closing would leave its file open.
    """
    await asyncio.shield(asyncio.get_running_loop().run_in_executor(None, raw.close))


def remove_if_abandoned(dir_fd: int, name: str, now: float, min_age: float) -> bool:
    """Unlink the partial ``name`` in ``dir_fd`` if no writer holds its lock and it is ``min_age`` old at ``now``."""
    try:
        if now - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime < min_age:
            return False
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    else:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)


def remove_abandoned_partials(root: Path | Place, *, min_age: float = 30.0) -> list[Path]:
    """Delete the temporary files of writers that died; return what was removed.

    A partial is abandoned when no process holds its lock and it has not been
    written for ``min_age`` seconds. On a local disk the lock alone is
    authoritative (``min_age=0`` is safe: a writer whose new file is removed
    before it locks it notices and starts over); on a shared filesystem, where
    ``flock`` may only see this node, ``min_age`` protects other nodes' writers.
    ``root`` is walked without following links (a `Place` names a directory whose
    own path must not be followed either).
    """
    place = root if isinstance(root, Place) else Place(root, (), ".")
    removed: list[Path] = []
    try:
        top = place.open_parent()
    except (FileNotFoundError, NotADirectoryError, PermissionError, UnsafeFileError):
        return removed  # nothing there, or nothing this user could have written there
    try:
        now = server_now(top)
        for directory, _, files, dir_fd in os.fwalk(place.name, dir_fd=top):
            for name in files:
                if PARTIAL_NAME.match(name) and remove_if_abandoned(dir_fd, name, now, min_age):
                    removed.append(place.root.joinpath(*place.parts, directory, name))
    finally:
        os.close(top)
    return removed


async def atomic_write(
    target: str | os.PathLike[str] | Place,
    chunks: AsyncIterable[bytes | memoryview],
    *,
    durable: bool = True,
    file_mode: int | None = None,
) -> int:
    """Write ``chunks`` to ``target`` atomically; return the number of bytes written.

    The bytes go to ``.<name>.<uuid>.partial`` in the same directory, are
    fsynced (when ``durable``), the file is renamed over ``target``, and the
    rename is made durable by an fsync of the directory. On any error or
    cancellation the temporary file is removed, so a reader sees either the old
    file, or the new one whole, never a partial one. The directory is opened
    once (a `Place` is walked to without following links) and every step acts
    inside it, so neither the bytes nor the temporary file can land elsewhere.
    ``file_mode``: the file's exact mode (``None``: 0644 less the umask).
    """
    place = target if isinstance(target, Place) else Place.of(target)
    directory = await open_dir_async(place, create=True)
    try:
        return await _write_in(directory, place.name, chunks, durable=durable, file_mode=file_mode)
    finally:
        directory.close()


async def _write_in(
    directory: DirHandle, name: str, chunks: AsyncIterable[bytes | memoryview], *, durable: bool, file_mode: int | None
) -> int:
    temporary = partial_name(name)
    size = 0
    try:
        for _ in range(3):
            try:
                raw = await _open_exclusive(directory, temporary, file_mode)
            except _CleanedUnderfoot:
                temporary = partial_name(name)
            else:
                break
        else:
            raise OSError(f"could not create a temporary file beside {name}")
        try:
            out = aiofiles.threadpool.wrap(raw, loop=asyncio.get_running_loop())
            async for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    written = await out.write(view)
                    view = view[written:]
                    size += written
        except BaseException:
            await close_file(raw)
            raise
        await publish_file(directory, raw, temporary, name, durable)
    except BaseException:
        with contextlib.suppress(OSError):
            directory.do(lambda fd: os.unlink(temporary, dir_fd=fd))
        raise
    return size


async def publish_file(directory: DirHandle, raw: Any, temporary: str, name: str, durable: bool) -> None:
    """fsync ``raw``, close it, rename it to ``name``, fsync the directory: in that order, in one thread job.

    One job instead of four: a thread round trip costs the event loop and the kernel more
    than these calls themselves on a small shard. A writer cancelled meanwhile waits for
    the job to end, so the file is closed, and either whole in place or left to be removed.
    """

    def publish(dir_fd: int) -> None:
        try:
            if durable:
                os.fsync(raw.fileno())
        finally:
            raw.close()
        os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if durable:
            os.fsync(dir_fd)

    def in_thread() -> None:
        try:
            directory.do(publish)
        finally:
            if not raw.closed:  # the directory was closed before the job ran: the file is still ours
                raw.close()

    # An executor job, not a task: a task is cancelled when its loop shuts down, and its thread
    # job with it if it has not started, which left the file open (a ResourceWarning in a full
    # run). A job the executor holds runs: the loop's shutdown waits for it.
    job = asyncio.get_running_loop().run_in_executor(None, in_thread)
    try:
        await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job])
        if not job.cancelled():
            job.exception()  # retrieved: the cancellation is what the caller sees
        raise


def create_temporary(dir_fd: int, name: str, file_mode: int | None, *, readable: bool = False) -> tuple[str, int]:
    """Create and lock a new temporary file for ``name`` in ``dir_fd``; its name and descriptor.

    ``readable``: opened for reading too (a shared map of it needs both).
    """
    for _ in range(3):
        temporary = partial_name(name)
        try:
            return temporary, _create_exclusive(dir_fd, temporary, file_mode, readable=readable)
        except _CleanedUnderfoot:
            continue
    raise OSError(f"could not create a temporary file beside {name}")


def write_small(place: Place, data: bytes, file_mode: int | None) -> None:
    """Write ``data`` to ``place`` atomically, not durably (blocking: run it in a thread).

    A metadata file: created beside its target, written, renamed over it; removed on error.
    """
    dir_fd = place.open_parent(create=True)
    try:
        temporary, fd = create_temporary(dir_fd, place.name, file_mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=dir_fd)
            raise
        os.close(fd)
        try:
            os.replace(temporary, place.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=dir_fd)
            raise
    finally:
        os.close(dir_fd)
