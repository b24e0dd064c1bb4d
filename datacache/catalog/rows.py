"""The catalog's rows: its schema, the value types read from it, and who owns a row.

Plain data and the SQL that creates it, so that `datacache.catalog.store`
holds only the transactions.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "CATALOG_ROOM",
    "COLUMNS",
    "SQLITE_FULL",
    "SQLITE_IOERR",
    "CatalogEntry",
    "DatasetRecord",
    "ReaderRow",
    "Reservation",
    "ShardState",
    "entry_from_row",
    "initialise",
    "leased_shards",
    "owner_alive",
    "process_owner",
    "state_totals",
]

CATALOG_ROOM = 512 << 10
"""Bytes every reservation leaves free on the local device for the catalog, its WAL and small files."""
SQLITE_FULL = 13
SQLITE_IOERR = 10
"""sqlite3's primary code of a failed read or write (its extended codes add a reason above the low byte)."""

SCHEMA = """
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

# Bytes and shards by state, kept by triggers in the writing transaction itself (so every
# writer, of any version, keeps them): a reservation reads two rows instead of summing the
# whole table, which made each reservation O(shards) and a warm of 1e5 shards O(shards^2).
TOTALS = (
    "CREATE TABLE totals (state TEXT PRIMARY KEY, bytes INTEGER NOT NULL, shards INTEGER NOT NULL)",
    "INSERT INTO totals (state, bytes, shards) VALUES ('staging', 0, 0), ('resident', 0, 0), ('evicting', 0, 0)",
    "UPDATE totals SET bytes = (SELECT coalesce(sum(size), 0) FROM shards WHERE shards.state = totals.state),"
    " shards = (SELECT count(*) FROM shards WHERE shards.state = totals.state)",
    "CREATE TRIGGER totals_insert AFTER INSERT ON shards BEGIN"
    " UPDATE totals SET bytes = bytes + new.size, shards = shards + 1 WHERE state = new.state; END",
    "CREATE TRIGGER totals_delete AFTER DELETE ON shards BEGIN"
    " UPDATE totals SET bytes = bytes - old.size, shards = shards - 1 WHERE state = old.state; END",
    "CREATE TRIGGER totals_update AFTER UPDATE OF size, state ON shards BEGIN"
    " UPDATE totals SET bytes = bytes - old.size, shards = shards - 1 WHERE state = old.state;"
    " UPDATE totals SET bytes = bytes + new.size, shards = shards + 1 WHERE state = new.state; END",
)


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


def owner_alive(owner: str | None) -> bool:
    if not owner:
        return False
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname():
        return True  # another host's process: cannot tell, assume alive
    if not pid.isdigit() or int(pid) <= 0:
        return False  # names no process of this host ("host:notapid"): holds nothing
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def initialise(connection: sqlite3.Connection) -> None:
    """Switch to WAL and create the tables, however many processes open the file at once.

    Changing the journal mode takes an exclusive lock that SQLite's busy
    handler does not wait for, so first openers can collide: retry briefly.
    """
    for attempt in range(100):
        try:
            if connection.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                connection.execute("PRAGMA journal_mode=WAL")
            connection.execute("PRAGMA synchronous=NORMAL")
            # Keep the WAL small (checkpoint every 64 pages, truncated to half the room): its room
            # is what reservations leave free on the device (`CATALOG_ROOM`), not 4 MB by default.
            connection.execute("PRAGMA wal_autocheckpoint=64")
            connection.execute(f"PRAGMA journal_size_limit={CATALOG_ROOM // 2}")
            connection.executescript(SCHEMA)
            _add_totals(connection)
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            time.sleep(min(0.5, 0.005 * (attempt + 1)))
    raise sqlite3.OperationalError("the catalog stayed locked while opening it")


def _add_totals(connection: sqlite3.Connection) -> None:
    """Create `TOTALS` once, counted from the rows already there, in the transaction that adds its triggers."""
    present = "SELECT count(*) FROM sqlite_master WHERE type='trigger' AND name='totals_update'"
    if connection.execute(present).fetchone()[0]:
        return
    connection.execute("BEGIN IMMEDIATE")
    try:
        if not connection.execute(present).fetchone()[0]:  # another opener may have made it meanwhile
            connection.execute("DROP TABLE IF EXISTS totals")
            for statement in TOTALS:
                connection.execute(statement)
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")


def state_totals(c: sqlite3.Connection) -> dict[str, tuple[int, int]]:
    """(bytes, shards) by state, from `TOTALS` (no scan of the shards)."""
    return {row[0]: (int(row[1]), int(row[2])) for row in c.execute("SELECT state, bytes, shards FROM totals")}


def leased_shards(c: sqlite3.Connection) -> set[tuple[str, str]]:
    """Shards held by readers whose processes are alive (a dead reader's leases do not count)."""
    rows = c.execute("SELECT dataset, key, owner FROM leases").fetchall()
    alive: dict[str, bool] = {}
    held: set[tuple[str, str]] = set()
    for dataset, key, owner in rows:
        if owner not in alive:
            alive[owner] = owner_alive(owner)
        if alive[owner]:
            held.add((dataset, key))
    return held


def entry_from_row(row: Sequence[Any]) -> CatalogEntry:
    state = _STATES.get(row[5]) or ShardState(row[5])  # the enum's own call: 1 us a row, 1e5 rows a warm
    return CatalogEntry(row[0], row[1], row[2], row[3], row[4], state, row[6], row[7])


_STATES = {state.value: state for state in ShardState}


COLUMNS = "dataset, key, size, version, checksum, state, owner, last_access"


KEYS_AT_ONCE = 500
"""Keys in one ``IN (...)``: under the 999 parameters of SQLite's oldest limit."""


def entries_of(c: sqlite3.Connection, dataset: str, keys: Sequence[str]) -> dict[str, CatalogEntry]:
    """The rows of ``keys`` that exist, by key: a statement per `KEYS_AT_ONCE` (one per key was most of a
    warm of 1e5 resident shards)."""
    found: dict[str, CatalogEntry] = {}
    for start in range(0, len(keys), KEYS_AT_ONCE):
        chunk = keys[start : start + KEYS_AT_ONCE]
        marks = ",".join("?" * len(chunk))  # placeholders only: never a value in the text
        query = f"SELECT {COLUMNS} FROM shards WHERE dataset=? AND key IN ({marks})"  # noqa: S608
        for row in c.execute(query, (dataset, *chunk)):
            found[row[1]] = entry_from_row(row)
    return found


def write_reads(c: sqlite3.Connection, pending: dict[tuple[str, str], float]) -> None:
    """Record the reads ``pending`` holds, by (dataset, key): those of one moment (`Catalog.touch_many`'s)
    in a statement per `KEYS_AT_ONCE`, not one per key."""
    keys_at: dict[tuple[float, str], list[str]] = {}
    for (dataset, key), when in pending.items():
        keys_at.setdefault((when, dataset), []).append(key)
    for (when, dataset), keys in keys_at.items():
        for start in range(0, len(keys), KEYS_AT_ONCE):
            chunk = keys[start : start + KEYS_AT_ONCE]
            marks = ",".join("?" * len(chunk))
            c.execute(
                f"UPDATE shards SET last_access=max(last_access, ?) WHERE dataset=? AND key IN ({marks})",  # noqa: S608
                (when, dataset, *chunk),
            )


def resident_versions_of(c: sqlite3.Connection, dataset: str, keys: Sequence[str]) -> dict[str, str | None]:
    """The version of each of ``keys`` resident, by key: a warm's look-up, in one read.

    Keys that are most of the dataset's rows (a warm of a whole dataset) are found in one pass over
    them: a statement per `KEYS_AT_ONCE` keys, and a `CatalogEntry` a row, were ~1 s of a warm of
    1e5 resident shards. A few keys of a big dataset are asked for by key.
    """
    state = ShardState.RESIDENT.value
    (rows,) = c.execute("SELECT count(*) FROM shards WHERE dataset=?", (dataset,)).fetchone()
    if len(keys) * 4 >= rows:
        wanted = set(keys)
        scan = c.execute("SELECT key, version FROM shards WHERE dataset=? AND state=?", (dataset, state))
        return {key: version for key, version in scan if key in wanted}
    found: dict[str, str | None] = {}
    for start in range(0, len(keys), KEYS_AT_ONCE):
        chunk = keys[start : start + KEYS_AT_ONCE]
        marks = ",".join("?" * len(chunk))  # placeholders only: never a value in the text
        query = f"SELECT key, version FROM shards WHERE dataset=? AND state=? AND key IN ({marks})"  # noqa: S608
        found.update(c.execute(query, (dataset, state, *chunk)))
    return found
