"""The catalog's SQLite connection: one private thread per process, and SQLite's rules for it.

Every query runs on one thread that owns the connection, so the event loop never blocks on
the database and the connection never crosses threads; no connection is open across a fork
(below); write transactions are ``BEGIN IMMEDIATE``.

SQLite's rule for fork() is that no connection may be carried across it, and the reason is not
only the connection: SQLite keeps each file's lock state per process, so a child forked while its
parent's connection was inside a write transaction believes that transaction's locks are still
held in its own process, and every connection it opens waits on them until the busy timeout
("database is locked" after 60 s in a DataLoader worker, issue 24's item 12). So a fork waits
for the query in progress, every connection is closed before the fork, and each process reopens
its own on its next query.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import sqlite3
import stat as stat_module
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from datacache.catalog.rows import SQLITE_FULL, SQLITE_IOERR, initialise
from datacache.errors import TierFullError
from datacache.tiers.local import make_local_file

logger = logging.getLogger(__name__)

__all__ = ["CatalogDatabase", "private_database"]

T = TypeVar("T")

_GATE = threading.Lock()
"""Held from just before a fork to just after it: no query starts meanwhile."""
_LIVE: weakref.WeakSet[CatalogDatabase] = weakref.WeakSet()
_HELD: list[threading.Lock] = []


def _before_fork() -> None:
    _GATE.acquire()
    for database in list(_LIVE):
        database._busy.acquire()  # the query in progress, if any, ends first
        _HELD.append(database._busy)
        database._close_for_fork()


def _after_fork() -> None:
    # In the child too: its copies of these locks are held, by a thread that no longer exists.
    for lock in _HELD:
        lock.release()
    _HELD.clear()
    _GATE.release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)


def private_database(path: Path) -> None:
    """Make the catalog 0600 whatever the umask, before SQLite opens it; tighten one this user left looser.

    SQLite creates its ``-wal`` and ``-shm`` files with the database file's mode, so
    a database made 0600 here keeps its side files 0600 too; side files an older
    version left looser are tightened as well. The catalog names every dataset's
    URL, keys and checksums: nobody else's to read.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
    for side in ("-wal", "-shm", "-journal"):
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(f"{path}{side}", follow_symlinks=False)
            if stat_module.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
                os.chmod(f"{path}{side}", 0o600)  # a regular file of this user's, just checked

ROOM_BYTES = 1 << 20
"""Held allocated beside the catalog (``<catalog>.room``) while the disk has room, and given back
when it has none: another process that fills the disk leaves the catalog no page for its
write-ahead log, nor for the ``-shm`` index a new connection makes, and every reader of the node
failed on its next write or open (a trial: training died of a progress note). 1 MiB holds the
index (32 KiB) and the log up to its checkpoint (`wal_autocheckpoint`, 64 pages) a few times over."""


def _keep_room(path: Path) -> None:
    """Allocate `ROOM_BYTES` at ``path`` if it is not and the disk has plenty (a stat when it is)."""
    with contextlib.suppress(OSError):
        found = os.statvfs(path.parent)
        if found.f_bavail * found.f_frsize < 8 * ROOM_BYTES:  # a disk nearly full already: not now
            return
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and stat_module.S_ISREG(st.st_mode) and st.st_size < ROOM_BYTES:
                os.posix_fallocate(fd, 0, ROOM_BYTES)
        finally:
            os.close(fd)


def _give_room(path: Path) -> bool:
    """Free the room kept at ``path``; whether there was any (this user's regular file, not empty)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not stat_module.S_ISREG(st.st_mode) or not st.st_blocks:
            return False
        os.ftruncate(fd, 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class CatalogDatabase:
    """Where a catalog's queries run: this process's connection, on its own thread."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._connection: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self._reset_counts()
        self._busy = threading.Lock()
        _LIVE.add(self)

    def _reset_counts(self) -> None:
        self._writes = 0
        self._longest_write = 0.0
        self._runs = 0  # every query job, reads and writes: what a test counts reads by

    def __getstate__(self) -> dict[str, Any]:
        return {"_path": self._path, "_executor": None, "_connection": None, "_pid": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_counts()
        self._busy = threading.Lock()
        _LIVE.add(self)

    @property
    def path(self) -> Path:
        return self._path

    # -- plumbing -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _querying(self) -> Any:
        """Held while a query runs, so that a fork waits for it (see the module's note)."""
        with _GATE:
            self._busy.acquire()
        try:
            yield
        finally:
            self._busy.release()

    def _close_for_fork(self) -> None:
        # Idle (its lock is held by the fork): closing from the forking thread is safe.
        if self._connection is not None:
            with contextlib.suppress(sqlite3.Error):
                self._connection.close()
            self._connection = None

    def _call(self, function: Callable[[sqlite3.Connection], T]) -> T:
        with self._querying():
            return function(self._connect())

    def _connect(self) -> sqlite3.Connection:
        if self._connection is None:
            make_local_file(self._path)  # private (with its -wal and -shm), whatever the umask
            private_database(self._path)  # side files an older version left looser: tightened
            connection = sqlite3.connect(self._path, timeout=60.0, isolation_level=None, check_same_thread=False)
            try:
                connection.execute("PRAGMA busy_timeout=60000")
                initialise(connection)
            except BaseException:
                connection.close()
                raise
            self._connection = connection
            _keep_room(self._room)
        return self._connection

    @property
    def _room(self) -> Path:
        return self._path.with_name(self._path.name + ".room")

    async def _write(self, function: Callable[[sqlite3.Connection], T]) -> T:
        """`_run` for a write, counted and timed (its wait for the database's write lock included)."""
        started = time.monotonic()
        try:
            return await self._run(function)
        finally:
            self._writes += 1
            self._longest_write = max(self._longest_write, time.monotonic() - started)

    async def _write_transaction(self, function: Callable[[sqlite3.Connection], T]) -> T:
        """`_write` of ``function`` inside one ``BEGIN IMMEDIATE`` transaction."""

        def run(c: sqlite3.Connection) -> T:
            with self._transaction(c):
                return function(c)

        return await self._write(run)

    async def _run(self, function: Callable[[sqlite3.Connection], T]) -> T:
        if self._executor is None or self._pid != os.getpid():
            # A forked child must not reuse its parent's thread, nor its counts (it has no connection).
            if self._pid != os.getpid():
                self._reset_counts()
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="datacache-catalog")
            self._connection = None
            self._pid = os.getpid()
        self._runs += 1
        loop = asyncio.get_running_loop()
        for attempt in range(2):
            try:
                return await loop.run_in_executor(self._executor, self._call, function)
            except sqlite3.OperationalError as exc:
                code = getattr(exc, "sqlite_errorcode", None)
                # Reservations leave the catalog room (`CATALOG_ROOM`); something else filled the disk. A
                # write-ahead log or its index that cannot grow says "disk I/O error" (SQLITE_IOERR_*).
                io_error = code is not None and code & 0xFF == SQLITE_IOERR
                if code != SQLITE_FULL and not (io_error and self._device_full()):
                    raise
                if attempt == 0 and await asyncio.to_thread(_give_room, self._room):
                    logger.warning("the disk of the catalog %s is full: it takes the room kept for it", self._path)
                    continue
                raise TierFullError(f"the catalog {self._path} cannot grow: no space left on its device") from exc
        raise AssertionError("unreachable")

    def _device_full(self) -> bool:
        try:
            found = os.statvfs(self._path.parent)
        except OSError:
            return False
        return found.f_bavail * found.f_frsize < 1 << 20

    def run_sync(self, function: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``function`` with a connection, outside any event loop (CLI reports)."""
        with self._querying():
            make_local_file(self._path)
            private_database(self._path)
            connection = sqlite3.connect(self._path, timeout=60.0, isolation_level=None)
            try:
                connection.execute("PRAGMA busy_timeout=60000")
                initialise(connection)
                return function(connection)
            finally:
                connection.close()

    @staticmethod
    @contextlib.contextmanager
    def _transaction(connection: sqlite3.Connection) -> Any:
        connection.execute("BEGIN IMMEDIATE")
        try:
            yield connection
            connection.execute("COMMIT")
        except BaseException:
            # A COMMIT that failed too (a full disk) leaves the transaction, and the node's write
            # lock, held by this connection until it is rolled back.
            if connection.in_transaction:
                connection.execute("ROLLBACK")
            raise
