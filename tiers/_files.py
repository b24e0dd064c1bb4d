"""File helpers shared by the tiers: atomic writes, contained paths, redacted URLs."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import time
import uuid
from collections.abc import AsyncIterable
from pathlib import Path

import aiofiles

__all__ = [
    "PARTIAL_NAME",
    "atomic_write",
    "fsync_directory",
    "partial_name",
    "redact_url",
    "remove_abandoned_partials",
]

PARTIAL_NAME = re.compile(r"^\..*\.[0-9a-f]{32}\.partial$")
_USERINFO = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")


def redact_url(url: str) -> str:
    """Return ``url`` without any ``user:password@`` part."""
    return _USERINFO.sub(r"\1", url)


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
                out = await aiofiles.open(temporary, "xb", buffering=0, opener=_create_exclusive)
            except _CleanedUnderfoot:
                temporary = partial_name(target)
            else:
                break
        else:
            raise OSError(f"could not create a temporary file beside {target}")
        try:
            async for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    written = await out.write(view)
                    view = view[written:]
                    size += written
            if durable:
                await asyncio.to_thread(os.fsync, out.fileno())
        finally:
            await out.close()
        await asyncio.to_thread(os.replace, temporary, target)
        if durable:
            await asyncio.to_thread(fsync_directory, target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    return size
