"""The catalog: what the local tier holds, in SQLite (WAL), shared by every process of a node.

It survives ``kill -9``: each change is one transaction, and `Catalog.reconcile`
repairs what a killed process left (transfers it never finished, evictions it
never completed, files that vanished). Every process on the node uses the same
file; capacity is reserved inside ``BEGIN IMMEDIATE`` transactions, so two
processes cannot both fill the last free gigabyte.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from datacache.eviction import Candidate

__all__ = [
    "Catalog",
    "CatalogEntry",
    "DatasetRecord",
    "ReaderRow",
    "Reservation",
    "ShardState",
    "process_owner",
]

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS datasets (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    policy TEXT NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    snapshot TEXT,
    format TEXT,
    shard_count INTEGER,
    total_bytes INTEGER,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS shards (
    dataset TEXT NOT NULL,
    key TEXT NOT NULL,
    size INTEGER NOT NULL,
    version TEXT,
    checksum TEXT,
    state TEXT NOT NULL,
    owner TEXT,
    last_access REAL NOT NULL,
    staged_at REAL,
    PRIMARY KEY (dataset, key)
);
CREATE INDEX IF NOT EXISTS shards_by_state ON shards (state, last_access);
CREATE TABLE IF NOT EXISTS readers (
    dataset TEXT NOT NULL,
    reader TEXT NOT NULL,
    owner TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    position INTEGER NOT NULL,
    updated REAL NOT NULL,
    PRIMARY KEY (dataset, reader)
);
CREATE TABLE IF NOT EXISTS leases (
    dataset TEXT NOT NULL,
    key TEXT NOT NULL,
    reader TEXT NOT NULL,
    owner TEXT NOT NULL,
    PRIMARY KEY (dataset, key, reader)
);
"""


class ShardState(StrEnum):
    """The life of a shard on the local tier (no row means absent).

    Allowed transitions:

    - absent -> ``STAGING``: a transfer begins; its bytes are reserved against capacity.
    - ``STAGING`` -> ``RESIDENT``: the verified file was renamed into place.
    - ``STAGING`` -> absent: the transfer failed or was cancelled, or its process died.
    - ``RESIDENT`` -> ``EVICTING``: chosen as a victim to make room.
    - ``EVICTING`` -> absent: its file was deleted. Until then no process may reserve it again
      (a live evictor's row refuses `Catalog.reserve`; a dead one's is taken over).
    - ``RESIDENT`` -> absent: its file was found missing or corrupt, or evicted by hand.
    """

    STAGING = "staging"
    RESIDENT = "resident"
    EVICTING = "evicting"


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    """One row of the catalog."""

    dataset: str
    key: str
    size: int
    version: str | None
    checksum: str | None
    state: ShardState
    owner: str | None
    last_access: float


@dataclass(frozen=True, slots=True)
class DatasetRecord:
    """A dataset the node has seen."""

    id: str
    url: str
    policy: str
    pinned: bool
    snapshot: str | None
    format: str | None
    shard_count: int | None
    total_bytes: int | None


@dataclass(frozen=True, slots=True)
class Reservation:
    """The outcome of asking for room: granted (with victims to delete) or declined."""

    granted: bool
    victims: tuple[CatalogEntry, ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ReaderRow:
    """Where one reader of a dataset on this node is: its epoch and its position in its own sequence."""

    reader: str
    epoch: int
    position: int


def process_owner() -> str:
    """Identify this process for the rows it writes: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _owner_alive(owner: str | None) -> bool:
    if not owner:
        return False
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname():
        return True  # another host's process: cannot tell, assume alive
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def _initialise(connection: sqlite3.Connection) -> None:
    """Switch to WAL and create the tables, however many processes open the file at once.

    Changing the journal mode takes an exclusive lock that SQLite's busy
    handler does not wait for, so first openers can collide: retry briefly.
    """
    for attempt in range(100):
        try:
            if connection.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            connection.executescript(_SCHEMA)
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            time.sleep(min(0.5, 0.005 * (attempt + 1)))
    raise sqlite3.OperationalError("the catalog stayed locked while opening it")


def _leased(c: sqlite3.Connection) -> set[tuple[str, str]]:
    """Shards held by readers whose processes are alive (a dead reader's leases do not count)."""
    rows = c.execute("SELECT dataset, key, owner FROM leases").fetchall()
    alive: dict[str, bool] = {}
    held: set[tuple[str, str]] = set()
    for dataset, key, owner in rows:
        if owner not in alive:
            alive[owner] = _owner_alive(owner)
        if alive[owner]:
            held.add((dataset, key))
    return held


def _entry(row: Sequence[Any]) -> CatalogEntry:
    return CatalogEntry(
        dataset=row[0],
        key=row[1],
        size=row[2],
        version=row[3],
        checksum=row[4],
        state=ShardState(row[5]),
        owner=row[6],
        last_access=row[7],
    )


_COLUMNS = "dataset, key, size, version, checksum, state, owner, last_access"


class Catalog:
    """The SQLite catalog of one local tier.

    Every query runs on one private thread that owns the connection, so the
    event loop never blocks on the database and the connection never crosses
    threads. The object holds only its path when pickled.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._connection: sqlite3.Connection | None = None
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        return {"_path": self._path, "_executor": None, "_connection": None, "_pid": None}

    @property
    def path(self) -> Path:
        return self._path

    # -- plumbing -------------------------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        if self._connection is None:
            self._path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the node's cache: private
            connection = sqlite3.connect(self._path, timeout=60.0, isolation_level=None, check_same_thread=False)
            connection.execute("PRAGMA busy_timeout=60000")
            _initialise(connection)
            self._connection = connection
        return self._connection

    async def _run(self, function: Callable[[sqlite3.Connection], T]) -> T:
        if self._executor is None or self._pid != os.getpid():
            # A forked child must not reuse its parent's thread or connection.
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="datacache-catalog")
            self._connection = None
            self._pid = os.getpid()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: function(self._connect()))

    def run_sync(self, function: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``function`` with a connection, outside any event loop (CLI reports)."""
        connection = sqlite3.connect(self._path, timeout=60.0, isolation_level=None)
        try:
            connection.execute("PRAGMA busy_timeout=60000")
            _initialise(connection)
            return function(connection)
        finally:
            connection.close()

    async def close(self) -> None:
        if self._executor is not None and self._pid == os.getpid():

            def shut(connection: sqlite3.Connection) -> None:
                connection.close()

            if self._connection is not None:
                try:
                    await self._run(shut)
                except RuntimeError:
                    # At interpreter exit the executor refuses work; its thread is idle.
                    self._connection.close()
            self._executor.shutdown(wait=False)
        self._executor = None
        self._connection = None

    @staticmethod
    @contextlib.contextmanager
    def _transaction(connection: sqlite3.Connection) -> Any:
        connection.execute("BEGIN IMMEDIATE")
        try:
            yield connection
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")

    # -- datasets -------------------------------------------------------------------------

    async def record_dataset(
        self,
        dataset_id: str,
        *,
        url: str,
        policy: str,
        pinned: bool,
        snapshot: str | None = None,
        format: str | None = None,
        shard_count: int | None = None,
        total_bytes: int | None = None,
    ) -> None:
        def write(c: sqlite3.Connection) -> None:
            c.execute(
                "INSERT INTO datasets (id, url, policy, pinned, snapshot, format, shard_count, total_bytes, updated)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET url=excluded.url,"
                " policy=excluded.policy, pinned=excluded.pinned, snapshot=coalesce(excluded.snapshot, snapshot),"
                " format=coalesce(excluded.format, format), shard_count=coalesce(excluded.shard_count, shard_count),"
                " total_bytes=coalesce(excluded.total_bytes, total_bytes), updated=excluded.updated",
                (dataset_id, url, policy, int(pinned), snapshot, format, shard_count, total_bytes, time.time()),
            )

        await self._run(write)

    async def set_pinned(self, dataset_id: str, pinned: bool) -> bool:
        def write(c: sqlite3.Connection) -> bool:
            return c.execute("UPDATE datasets SET pinned=? WHERE id=?", (int(pinned), dataset_id)).rowcount > 0

        return await self._run(write)

    async def datasets(self) -> list[DatasetRecord]:
        return await self._run(self.datasets_sync)

    @staticmethod
    def datasets_sync(c: sqlite3.Connection) -> list[DatasetRecord]:
        rows = c.execute(
            "SELECT id, url, policy, pinned, snapshot, format, shard_count, total_bytes FROM datasets ORDER BY id"
        ).fetchall()
        return [DatasetRecord(r[0], r[1], r[2], bool(r[3]), r[4], r[5], r[6], r[7]) for r in rows]

    async def forget_dataset(self, dataset_id: str) -> None:
        def write(c: sqlite3.Connection) -> None:
            c.execute("DELETE FROM datasets WHERE id=?", (dataset_id,))

        await self._run(write)

    # -- shards ---------------------------------------------------------------------------

    async def get(self, dataset: str, key: str) -> CatalogEntry | None:
        def read(c: sqlite3.Connection) -> CatalogEntry | None:
            row = c.execute(f"SELECT {_COLUMNS} FROM shards WHERE dataset=? AND key=?", (dataset, key)).fetchone()
            return _entry(row) if row else None

        return await self._run(read)

    async def entries(self, dataset: str | None = None) -> list[CatalogEntry]:
        def read(c: sqlite3.Connection) -> list[CatalogEntry]:
            return self.entries_sync(c, dataset)

        return await self._run(read)

    @staticmethod
    def entries_sync(c: sqlite3.Connection, dataset: str | None = None) -> list[CatalogEntry]:
        if dataset is None:
            rows = c.execute(f"SELECT {_COLUMNS} FROM shards ORDER BY dataset, key").fetchall()
        else:
            rows = c.execute(f"SELECT {_COLUMNS} FROM shards WHERE dataset=? ORDER BY key", (dataset,)).fetchall()
        return [_entry(row) for row in rows]

    async def touch(self, dataset: str, key: str) -> None:
        def write(c: sqlite3.Connection) -> None:
            c.execute("UPDATE shards SET last_access=? WHERE dataset=? AND key=?", (time.time(), dataset, key))

        await self._run(write)

    async def reserve(
        self,
        dataset: str,
        key: str,
        *,
        size: int,
        version: str | None,
        owner: str,
        capacity: int | None,
        device_free: Callable[[], int | None],
        reserve_free: int,
        choose: Callable[[Candidate, list[Candidate], int], list[Candidate] | None],
    ) -> Reservation:
        """Claim ``size`` bytes for a transfer of ``(dataset, key)``, evicting if needed.

        Inside one ``BEGIN IMMEDIATE`` transaction: count the bytes held and
        reserved, ask ``choose`` for victims when ``size`` does not fit under
        ``capacity`` (or would leave the device with less than ``reserve_free``
        bytes free), mark the victims ``EVICTING`` and insert the ``STAGING`` row.
        The caller deletes the victims' files and then calls `evicted`.
        """

        def write(c: sqlite3.Connection) -> Reservation:
            with self._transaction(c):
                existing = c.execute(
                    "SELECT state, owner FROM shards WHERE dataset=? AND key=?", (dataset, key)
                ).fetchone()
                if existing is not None and _owner_alive(existing[1]):
                    if existing[0] == ShardState.STAGING and existing[1] != owner:
                        return Reservation(False, reason=f"being staged by {existing[1]}")
                    if existing[0] == ShardState.EVICTING:
                        # Its evictor will delete the file and the row: a new copy now would be deleted.
                        return Reservation(False, reason=f"being evicted by {existing[1]}")
                used = c.execute(
                    "SELECT coalesce(sum(size), 0) FROM shards WHERE state != ? AND NOT (dataset=? AND key=?)",
                    (ShardState.EVICTING.value, dataset, key),
                ).fetchone()[0]
                need = 0
                if capacity is not None:
                    need = used + size - capacity
                free = device_free()
                if free is not None:
                    need = max(need, size + reserve_free - free)
                victims: list[CatalogEntry] = []
                if need > 0:
                    pinned = {row[0] for row in c.execute("SELECT id FROM datasets WHERE pinned=1")}
                    rows = c.execute(
                        f"SELECT {_COLUMNS} FROM shards WHERE state=? AND NOT (dataset=? AND key=?)",
                        (ShardState.RESIDENT.value, dataset, key),
                    ).fetchall()
                    leased = _leased(c)
                    residents = {(r[0], r[1]): _entry(r) for r in rows if (r[0], r[1]) not in leased}
                    candidates = [
                        Candidate(e.dataset, e.key, e.size, e.last_access, e.dataset in pinned)
                        for e in residents.values()
                    ]
                    chosen = choose(Candidate(dataset, key, size, time.time()), candidates, need)
                    if chosen is None:
                        return Reservation(False, reason="no room without evicting what the policy keeps")
                    victims = [residents[(v.dataset, v.key)] for v in chosen]
                    c.executemany(
                        "UPDATE shards SET state=?, owner=? WHERE dataset=? AND key=?",
                        [(ShardState.EVICTING.value, owner, v.dataset, v.key) for v in victims],
                    )
                c.execute(
                    "INSERT INTO shards (dataset, key, size, version, checksum, state, owner, last_access)"
                    " VALUES (?, ?, ?, ?, NULL, ?, ?, ?) ON CONFLICT(dataset, key) DO UPDATE SET size=excluded.size,"
                    " version=excluded.version, checksum=NULL, state=excluded.state, owner=excluded.owner,"
                    " last_access=excluded.last_access",
                    (dataset, key, size, version, ShardState.STAGING.value, owner, time.time()),
                )
                return Reservation(True, victims=tuple(victims))

        return await self._run(write)

    async def commit(self, dataset: str, key: str, *, size: int, version: str | None, checksum: str) -> None:
        """``STAGING`` -> ``RESIDENT``: the verified file is in place."""

        def write(c: sqlite3.Connection) -> None:
            now = time.time()
            c.execute(
                "INSERT INTO shards (dataset, key, size, version, checksum, state, owner, last_access, staged_at)"
                " VALUES (?, ?, ?, ?, ?, ?, NULL, ?, ?) ON CONFLICT(dataset, key) DO UPDATE SET size=excluded.size,"
                " version=excluded.version, checksum=excluded.checksum, state=excluded.state, owner=NULL,"
                " last_access=excluded.last_access, staged_at=excluded.staged_at",
                (dataset, key, size, version, checksum, ShardState.RESIDENT.value, now, now),
            )

        await self._run(write)

    async def abandon(self, dataset: str, key: str, owner: str) -> None:
        """``STAGING`` -> absent, if ``owner`` still holds the reservation."""

        def write(c: sqlite3.Connection) -> None:
            c.execute(
                "DELETE FROM shards WHERE dataset=? AND key=? AND state=? AND owner=?",
                (dataset, key, ShardState.STAGING.value, owner),
            )

        await self._run(write)

    async def remove(self, dataset: str, key: str) -> None:
        """Forget a shard whatever its state (its file is gone or not to be trusted)."""

        def write(c: sqlite3.Connection) -> None:
            c.execute("DELETE FROM shards WHERE dataset=? AND key=?", (dataset, key))

        await self._run(write)

    async def evicted(self, victims: Sequence[CatalogEntry]) -> None:
        """``EVICTING`` -> absent for each victim whose file is deleted."""

        def write(c: sqlite3.Connection) -> None:
            c.executemany(
                "DELETE FROM shards WHERE dataset=? AND key=? AND state=?",
                [(v.dataset, v.key, ShardState.EVICTING.value) for v in victims],
            )

        await self._run(write)

    async def mark_evicting(self, dataset: str, keys: Sequence[str] | None, owner: str) -> list[CatalogEntry]:
        """``RESIDENT`` -> ``EVICTING`` for a dataset's shards (all when ``keys`` is None)."""

        def write(c: sqlite3.Connection) -> list[CatalogEntry]:
            with self._transaction(c):
                if keys is None:
                    rows = c.execute(
                        f"SELECT {_COLUMNS} FROM shards WHERE dataset=? AND state=?",
                        (dataset, ShardState.RESIDENT.value),
                    ).fetchall()
                else:
                    rows = []
                    for key in keys:
                        row = c.execute(
                            f"SELECT {_COLUMNS} FROM shards WHERE dataset=? AND key=? AND state=?",
                            (dataset, key, ShardState.RESIDENT.value),
                        ).fetchone()
                        if row:
                            rows.append(row)
                c.executemany(
                    "UPDATE shards SET state=?, owner=? WHERE dataset=? AND key=?",
                    [(ShardState.EVICTING.value, owner, r[0], r[1]) for r in rows],
                )
                return [_entry(r) for r in rows]

        return await self._run(write)

    # -- readers: progress and leases (eviction never takes a shard a live reader holds) -----

    async def note_reader(
        self, dataset: str, reader: str, *, owner: str, epoch: int, position: int, holding: Sequence[str]
    ) -> None:
        """Record where ``reader`` is, and replace the shards it holds (leases) with ``holding``."""

        def write(c: sqlite3.Connection) -> None:
            with self._transaction(c):
                c.execute(
                    "INSERT INTO readers (dataset, reader, owner, epoch, position, updated) VALUES (?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT(dataset, reader) DO UPDATE SET owner=excluded.owner, epoch=excluded.epoch,"
                    " position=excluded.position, updated=excluded.updated",
                    (dataset, reader, owner, epoch, position, time.time()),
                )
                c.execute("DELETE FROM leases WHERE dataset=? AND reader=?", (dataset, reader))
                c.executemany(
                    "INSERT OR IGNORE INTO leases (dataset, key, reader, owner) VALUES (?, ?, ?, ?)",
                    [(dataset, key, reader, owner) for key in holding],
                )

        await self._run(write)

    async def readers(self, dataset: str) -> list[ReaderRow]:
        """Every reader of the dataset this node has seen, with its last epoch and position.

        Rows outlive their processes on purpose: a reader of the last epoch is a reader
        of this node in the next one too, before it has said so.
        """

        def read(c: sqlite3.Connection) -> list[ReaderRow]:
            rows = c.execute("SELECT reader, epoch, position FROM readers WHERE dataset=?", (dataset,))
            return [ReaderRow(r[0], r[1], r[2]) for r in rows.fetchall()]

        return await self._run(read)

    async def leased(self) -> set[tuple[str, str]]:
        """(dataset, key) of every shard a live reader holds."""
        return await self._run(_leased)

    async def usage(self) -> tuple[int, int]:
        """Bytes and shards held or reserved on the local tier."""

        def read(c: sqlite3.Connection) -> tuple[int, int]:
            row = c.execute(
                "SELECT coalesce(sum(size), 0), count(*) FROM shards WHERE state != ?", (ShardState.EVICTING.value,)
            ).fetchone()
            return int(row[0]), int(row[1])

        return await self._run(read)

    async def stale_entries(self) -> list[CatalogEntry]:
        """Rows left ``STAGING`` or ``EVICTING`` by processes that no longer exist."""

        def read(c: sqlite3.Connection) -> list[CatalogEntry]:
            rows = c.execute(
                f"SELECT {_COLUMNS} FROM shards WHERE state IN (?, ?)",
                (ShardState.STAGING.value, ShardState.EVICTING.value),
            ).fetchall()
            return [e for e in map(_entry, rows) if not _owner_alive(e.owner)]

        return await self._run(read)
