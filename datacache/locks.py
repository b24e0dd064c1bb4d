"""Cross-process single-flight: one transfer per shard, however many processes ask.

Two kinds of lock, each for the filesystem it lives on:

- `NodeLock` (the local tier): ``flock`` on a lock file. The kernel wakes the
  next waiter when the holder releases, and releases the lock itself when the
  holder dies, so a killed process never leaves a stale lock behind.
- `LeaseLock` (the shared tier, many nodes): an ``O_EXCL`` lock file holding
  its owner and renewed by a heartbeat. ``flock`` over NFS or Lustre is not
  dependable, and no kernel can tell that a process on another node died, so a
  lock whose lease ran out (or whose holder on this node is gone) is taken
  over. Waiting for a holder on another node can only poll the file; the poll
  backs off to a fraction of the lease.

Correctness never rests on these locks: every write is an atomic rename of a
verified file, so two holders at once cost a duplicate transfer, not a torn one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import json
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from datacache.tiers import validate_key

__all__ = ["LeaseLock", "NodeLock", "lock_name"]

logger = logging.getLogger(__name__)

def lock_name(*parts: str) -> str:
    """A lock file's relative path for a dataset's shard key (validated, no escapes)."""
    key = "/".join(parts)
    validate_key(key)
    return key + ".lock"


class NodeLock:
    """An exclusive ``flock`` on ``path``, waited for without polling.

    A blocked wait occupies a thread of ``waiters``, an executor kept apart from
    the default one so that waits never starve the file I/O.
    """

    def __init__(self, path: Path, waiters: concurrent.futures.Executor) -> None:
        self._path = path
        self._waiters = waiters

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        await asyncio.to_thread(self._path.parent.mkdir, parents=True, exist_ok=True)
        while True:
            fd = await self._lock_once()
            if _still_linked(fd, self._path):
                break
            os.close(fd)  # the holder before us removed this file: lock the one there now
        try:
            yield
        finally:
            # Removed while still held, so no lock file stays behind per shard; a waiter that
            # opened this file sees it unlinked once it gets the lock, and tries again.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            os.close(fd)  # releases the flock

    async def _lock_once(self) -> int:
        """Open the lock file and wait for its flock; return the descriptor holding it."""
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            loop = asyncio.get_running_loop()
            waiting = loop.run_in_executor(self._waiters, fcntl.flock, fd, fcntl.LOCK_EX)
            try:
                await asyncio.shield(waiting)
            except asyncio.CancelledError:
                # The thread may still take the lock; closing the fd then releases it.
                waiting.add_done_callback(lambda _: os.close(fd))
                raise
            except BaseException:
                os.close(fd)
                raise
        except BaseException:
            os.close(fd)
            raise
        return fd


def _still_linked(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not unlinked, nor replaced, by a previous holder)."""
    held = os.fstat(fd)
    try:
        current = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino)


class LeaseLock:
    """An ``O_EXCL`` lock file with a lease, renewed while held, taken over when stale."""

    def __init__(self, path: Path, *, lease_seconds: float = 30.0) -> None:
        self._path = path
        self._lease = lease_seconds
        self._token = uuid.uuid4().hex
        self.took_over = False
        """Whether this lock was taken from a dead or expired holder."""

    def _record(self) -> bytes:
        return json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "token": self._token, "since": time.time()}
        ).encode()

    def _try_create(self) -> bool:
        try:
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, self._record())
        finally:
            os.close(fd)
        return True

    def _holder_is_stale(self) -> tuple[bool, Any]:
        try:
            st = os.lstat(self._path)
            raw = self._path.read_bytes()
        except FileNotFoundError:
            return False, None
        try:
            holder = json.loads(raw)
        except ValueError:
            holder = {}
        if not isinstance(holder, dict):
            holder = {}
        if time.time() - st.st_mtime > self._lease:
            return True, holder
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            try:
                os.kill(holder["pid"], 0)
            except ProcessLookupError:
                return True, holder
            except PermissionError:
                pass
        return False, holder

    def _break_stale(self, holder: Any) -> None:
        # Rename first: of several waiters that judged the lock stale, one wins.
        aside = self._path.with_name(f"{self._path.name}.{self._token}.stale")
        try:
            os.rename(self._path, aside)
        except FileNotFoundError:
            return
        try:
            current = json.loads(aside.read_bytes())
        except (OSError, ValueError):
            current = {}
        if isinstance(holder, dict) and isinstance(current, dict) and current.get("token") != holder.get("token"):
            # We moved a fresh lock another waiter had just created: put it back.
            with contextlib.suppress(OSError):
                os.link(aside, self._path)
        with contextlib.suppress(FileNotFoundError):
            aside.unlink()

    def _release(self) -> None:
        try:
            holder = json.loads(self._path.read_bytes())
        except (OSError, ValueError):
            return
        if isinstance(holder, dict) and holder.get("token") == self._token:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self._lease / 3)
            with contextlib.suppress(FileNotFoundError):
                await asyncio.to_thread(os.utime, self._path)

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        await asyncio.to_thread(self._path.parent.mkdir, parents=True, exist_ok=True)
        delay = 0.005
        while not await asyncio.to_thread(self._try_create):
            stale, holder = await asyncio.to_thread(self._holder_is_stale)
            if stale:
                logger.info("taking over stale lock %s from %s", self._path, holder)
                await asyncio.to_thread(self._break_stale, holder)
                self.took_over = True
                continue
            # Another process (maybe on another node) is transferring this shard.
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, max(0.05, self._lease / 10))
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            yield
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
            await asyncio.to_thread(self._release)
