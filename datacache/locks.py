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
import functools
import json
import logging
import os
import random
import socket
import stat as stat_module
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datacache.tiers import validate_key
from datacache.tiers.files import Place, UnsafeFileError, open_dir_async, read_bounded_at, server_now
from datacache.tiers.local import make_local_dirs

__all__ = ["LeaseLock", "NodeLock", "lock_name", "release_node_locks", "try_node_locks"]

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
        await asyncio.to_thread(make_local_dirs, self._path.parent)
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
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
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


def try_node_locks(paths: Sequence[Path]) -> dict[Path, int]:
    """Take each `NodeLock` of ``paths`` that is free now, without waiting; the descriptors holding them.

    Blocking (run it in a thread): a batch's locks in one job, a few system calls each.
    Those held elsewhere are left out; their holder is staging them (wait for them with
    `NodeLock.hold`). Release with `release_node_locks`.
    """
    held: dict[Path, int] = {}
    made: set[Path] = set()
    try:
        for path in paths:
            if path.parent not in made:
                make_local_dirs(path.parent)
                made.add(path.parent)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if _still_linked(fd, path):
                held[path] = fd
            else:
                os.close(fd)  # its holder just finished and removed it: a later `hold` takes it
    except BaseException:
        release_node_locks(held)
        raise
    return held


def release_node_locks(held: Mapping[Path, int]) -> None:
    """Release locks `try_node_locks` took (removing their files first, as `NodeLock.hold` does)."""
    for path, fd in held.items():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def _still_linked(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (not unlinked, nor replaced, by a previous holder)."""
    held = os.fstat(fd)
    try:
        current = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino)


LOCK_LIMIT = 64 << 10
"""The largest lock file read: a holder's record is ~150 bytes; a planted one may be anything."""


@dataclass(frozen=True, slots=True)
class _Seen:
    """A lock file as a waiter saw it: which file, and its heartbeat."""

    device: int
    inode: int
    mtime_ns: int


def _discard(dir_fd: int, name: str) -> None:
    """Remove ``name``, a file or (planted where a lock goes) an empty directory; leave what cannot be removed."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except IsADirectoryError:
        try:
            os.rmdir(name, dir_fd=dir_fd)
        except OSError as exc:
            logger.warning("could not remove %s planted where a lock goes: %s", name, exc)
    except FileNotFoundError:
        pass


def _died_here(holder: dict[str, Any]) -> bool:
    """Whether ``holder`` (a lock's record) names a process of this host that no longer exists."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return False
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        pass
    return False


class LeaseLock:
    """An ``O_EXCL`` lock file with a lease, renewed while held, taken over when stale.

    Staleness never compares this node's clock with the file server's: the age
    of the holder's heartbeat is measured against the server's own clock (the
    mtime of a file created there just now), and a waiter also times, on its
    own monotonic clock, how long the holder's file has gone without a
    heartbeat. A lock dated in the future, or one no heartbeat touched for a
    lease, is stale; so is any lock held for more than ``max_hold`` seconds of
    the waiter's watch, however it is kept alive (a hostile heartbeat cannot hang
    a warm). The lock directory is opened once and every step acts inside it
    (`Place`): a swapped directory or a planted link, FIFO or huge file cannot
    make a waiter touch or read anything outside it.
    """

    def __init__(
        self, place: Place | Path, *, lease_seconds: float = 30.0, max_hold: float | None = None
    ) -> None:
        self._place = place if isinstance(place, Place) else Place.of(place)
        self._lease = lease_seconds
        self._max_hold = max_hold if max_hold is not None else 20 * lease_seconds
        self._token = uuid.uuid4().hex
        self._mine: int | None = None  # our lock file while we hold it: the heartbeat touches it, not a path
        self._seen: _Seen | None = None
        self._seen_at = 0.0  # when (monotonic) the holder's file last changed, as watched from here
        self._holder_since: tuple[int, int] | None = None
        self._holder_seen_at = 0.0
        self.took_over = False
        """Whether this lock was taken from a dead or expired holder."""
        self.holder_died_here = False
        """Whether the holder taken over was a process on this host that is gone (its partial files are garbage)."""

    @property
    def _name(self) -> str:
        return self._place.name

    def _record(self) -> bytes:
        return json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "token": self._token, "since": time.time()}
        ).encode()

    def _try_create(self, dir_fd: int) -> bool:
        try:
            fd = os.open(
                self._name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd
            )
        except FileExistsError:
            return False
        try:
            os.fchmod(fd, 0o640)  # the group may read who holds it
            os.write(fd, self._record())
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._name, dir_fd=dir_fd)
            raise
        self._mine = fd
        return True

    def _holder_is_stale(self, dir_fd: int) -> tuple[bool, Any]:
        try:
            st = os.stat(self._name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False, None
        seen = _Seen(st.st_dev, st.st_ino, st.st_mtime_ns)
        if not stat_module.S_ISREG(st.st_mode):
            return True, seen  # a link, FIFO or directory planted as a lock: nobody holds it
        holder: Any = {}
        try:
            holder = json.loads(read_bounded_at(dir_fd, self._name, LOCK_LIMIT))
        except UnsafeFileError:
            return True, seen  # larger than any holder's record: not a lock
        except (OSError, ValueError):
            pass  # unreadable, or being written this instant: its heartbeat decides
        if not isinstance(holder, dict):
            holder = {}
        self.holder_died_here = _died_here(holder)
        if self.holder_died_here:
            return True, seen
        now = time.monotonic()
        if seen != self._seen:
            self._seen, self._seen_at = seen, now
        if (st.st_dev, st.st_ino) != self._holder_since:
            self._holder_since, self._holder_seen_at = (st.st_dev, st.st_ino), now
        age = server_now(dir_fd) - st.st_mtime
        if age > self._lease or age < -self._lease:
            return True, seen  # no heartbeat for a lease, or dated in the future by no live heartbeat
        if now - self._seen_at > self._lease:
            return True, seen  # watched for a lease: no heartbeat came
        if now - self._holder_seen_at > self._max_hold:
            logger.warning("lock %s held over %.0fs by %s; taking it over", self._place.path, self._max_hold, holder)
            return True, seen
        return False, seen

    def _remove_if(self, dir_fd: int, expected: Callable[[os.stat_result], bool]) -> bool:
        """Remove the lock file if it is the one ``expected`` says; return whether it was.

        Rename first, then look: of several processes acting on the same lock, one
        moves it, and a file that turns out not to be the expected one (a fresh lock
        another waiter just created) is put back. Checking, then unlinking by name,
        could remove a lock created in between.
        """
        aside = f"{self._name}.{self._token}.stale"
        try:
            os.rename(self._name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        try:
            matches = expected(os.stat(aside, dir_fd=dir_fd, follow_symlinks=False))
            if not matches:
                with contextlib.suppress(OSError):
                    os.link(aside, self._name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            return matches
        finally:
            _discard(dir_fd, aside)

    def _break_stale(self, dir_fd: int, *, seen: _Seen) -> None:
        self._remove_if(dir_fd, lambda st: (st.st_dev, st.st_ino) == (seen.device, seen.inode))
        self._seen = self._holder_since = None

    def _release(self, dir_fd: int) -> None:
        mine, self._mine = self._mine, None
        if mine is None:
            return
        try:
            own = os.fstat(mine)
            self._remove_if(dir_fd, lambda st: (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino))
        finally:
            os.close(mine)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self._lease / 3)
            mine = self._mine
            if mine is not None:
                # The file we created, by descriptor: if our lease was taken over meanwhile,
                # the new holder's file is not touched. No time given: the server's clock sets it.
                touch = asyncio.get_running_loop().run_in_executor(None, os.utime, mine)
                try:
                    await asyncio.shield(touch)
                except asyncio.CancelledError:
                    await asyncio.wait([touch])  # the release closes the file: not before this touch ends
                    raise

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        directory = await open_dir_async(self._place, create=True)
        try:
            delay = 0.005
            while not await directory.run(self._try_create):
                stale, seen = await directory.run(self._holder_is_stale)
                if stale:
                    logger.info("taking over stale lock %s", self._place.path)
                    await directory.run(functools.partial(self._break_stale, seen=seen))
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
                await directory.run(self._release)
        finally:
            directory.close()
