"""The catalog's transactions: datasets, shards, reservations, readers and leases."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from datacache.catalog.readers import ReaderRows
from datacache.catalog.room import Claim, Room, reserve_in, trim_in
from datacache.catalog.rows import (
    COLUMNS,
    CatalogEntry,
    DatasetRecord,
    Reservation,
    ShardState,
    entries_of,
    entry_from_row,
    owner_alive,
    resident_versions_of,
    write_reads,
)
from datacache.errors import TierFullError
from datacache.eviction import Candidate

__all__ = ["Catalog", "CatalogWrites"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

TOUCH_BATCH = 64
"""Pending accesses that make `Catalog.touch` write them all, in one transaction."""

TOUCH_SECONDS = 5.0
"""Age of the oldest pending access that makes `Catalog.touch` write them all."""


_COMMIT = (
    "INSERT INTO shards (dataset, key, size, version, checksum, state, owner, last_access, staged_at)"
    " VALUES (?, ?, ?, ?, ?, ?, NULL, ?, ?) ON CONFLICT(dataset, key) DO UPDATE SET size=excluded.size,"
    " version=excluded.version, checksum=excluded.checksum, state=excluded.state, owner=NULL,"
    " last_access=excluded.last_access, staged_at=excluded.staged_at"
)
"""``STAGING`` -> ``RESIDENT`` (or absent -> ``RESIDENT``, for an adopted file)."""


@dataclass(frozen=True)
class CatalogWrites:
    """What this process's catalog wrote so far: write transactions, and the longest one took, waits included.

    ``runs``: every query job, reads and writes (``runs - writes`` are its reads).
    """

    writes: int
    longest_wait: float
    touches: int
    runs: int = 0


class Catalog(ReaderRows):
    """The SQLite catalog of one local tier: its transactions, run where `CatalogDatabase` runs them.

    The object holds only its path when pickled.
    """

    def _reset_counts(self) -> None:
        super()._reset_counts()
        # Accesses not yet written (last_access by shard), oldest first; and how many were written.
        self._touches: dict[tuple[str, str], float] = {}
        self._touched = 0
        self._said_full = False

    def writes(self) -> CatalogWrites:
        """Write transactions this process made so far, the longest one's duration, and the shard reads it saw."""
        return CatalogWrites(self._writes, self._longest_write, self._touched, self._runs)

    async def close(self) -> None:
        if self._executor is not None and self._pid == os.getpid():
            try:
                await self.flush_touches()
            except RuntimeError:
                # At interpreter exit the executor refuses work; its thread is idle: write here.
                if self._connection is not None and self._touches:
                    with contextlib.suppress(sqlite3.OperationalError), self._transaction(self._connection):
                        write_reads(self._connection, self._touches)
                    self._touches = {}
            except (sqlite3.OperationalError, TierFullError) as exc:
                logger.debug("catalog %s: %d reads not recorded: %s", self._path, len(self._touches), exc)
            if self._writes:
                logger.debug(
                    "catalog %s: %d write transactions, the longest %.3f s; %d reads recorded",
                    self._path, self._writes, self._longest_write, self._touched,
                )

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
        def same(c: sqlite3.Connection) -> bool:
            row = c.execute(
                "SELECT url, policy, pinned, snapshot, format, shard_count, total_bytes FROM datasets WHERE id=?",
                (dataset_id,),
            ).fetchone()
            if row is None:
                return False
            given = (url, policy, int(pinned), snapshot, format, shard_count, total_bytes)
            # A None leaves the recorded value (coalesce below): it is no change.
            return all(new is None or new == old for new, old in zip(given, row, strict=True))

        # Every process (each DataLoader worker, each epoch) opens its datasets: almost always
        # the row is there already, and a read takes no lock that other processes wait for.
        if await self._run(same):
            return

        def write(c: sqlite3.Connection) -> None:
            c.execute(
                "INSERT INTO datasets (id, url, policy, pinned, snapshot, format, shard_count, total_bytes, updated)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET url=excluded.url,"
                " policy=excluded.policy, pinned=excluded.pinned, snapshot=coalesce(excluded.snapshot, snapshot),"
                " format=coalesce(excluded.format, format), shard_count=coalesce(excluded.shard_count, shard_count),"
                " total_bytes=coalesce(excluded.total_bytes, total_bytes), updated=excluded.updated",
                (dataset_id, url, policy, int(pinned), snapshot, format, shard_count, total_bytes, time.time()),
            )

        await self._write(write)

    async def set_pinned(self, dataset_id: str, pinned: bool) -> bool:
        def write(c: sqlite3.Connection) -> bool:
            return c.execute("UPDATE datasets SET pinned=? WHERE id=?", (int(pinned), dataset_id)).rowcount > 0

        return await self._write(write)

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

        await self._write(write)

    # -- shards ---------------------------------------------------------------------------

    async def get(self, dataset: str, key: str) -> CatalogEntry | None:
        def read(c: sqlite3.Connection) -> CatalogEntry | None:
            row = c.execute(f"SELECT {COLUMNS} FROM shards WHERE dataset=? AND key=?", (dataset, key)).fetchone()
            return entry_from_row(row) if row else None

        return await self._run(read)

    async def entries(self, dataset: str | None = None) -> list[CatalogEntry]:
        await self.flush_touches()

        def read(c: sqlite3.Connection) -> list[CatalogEntry]:
            return self.entries_sync(c, dataset)

        return await self._run(read)

    @staticmethod
    def entries_sync(c: sqlite3.Connection, dataset: str | None = None) -> list[CatalogEntry]:
        if dataset is None:
            rows = c.execute(f"SELECT {COLUMNS} FROM shards ORDER BY dataset, key").fetchall()
        else:
            rows = c.execute(f"SELECT {COLUMNS} FROM shards WHERE dataset=? ORDER BY key", (dataset,)).fetchall()
        return [entry_from_row(row) for row in rows]

    async def touch(self, dataset: str, key: str) -> None:
        """Record a read of the shard (its ``last_access``, for LRU eviction).

        Kept in memory and written with the others in one transaction: when `TOUCH_BATCH`
        are pending or the oldest is `TOUCH_SECONDS` old, before this process reserves room
        (its eviction sees its own reads), and at close. A write per shard read was the
        read path's main use of the database's single write lock, which every reader of
        the node shares. Other processes see these reads up to a few seconds late.
        """
        now = time.time()
        self._touched += 1
        self._touches.pop((dataset, key), None)
        self._touches[(dataset, key)] = now
        oldest = next(iter(self._touches.values()))
        if len(self._touches) >= TOUCH_BATCH or now - oldest >= TOUCH_SECONDS:
            try:
                await self.flush_touches()
            except (sqlite3.OperationalError, TierFullError) as exc:
                # Busy for the whole busy timeout, or its disk full: the reads stay pending for the
                # next flush; a reader never fails for its bookkeeping.
                logger.debug("catalog %s: reads not recorded yet: %s", self._path, exc)

    async def touch_many(self, dataset: str, keys: Sequence[str]) -> None:
        """`touch` each of ``keys``, written in one transaction (if any)."""
        if not keys:
            return
        now = time.time()
        self._touched += len(keys)
        for key in keys:
            self._touches.pop((dataset, key), None)
            self._touches[(dataset, key)] = now
        try:
            await self.flush_touches()
        except (sqlite3.OperationalError, TierFullError) as exc:
            logger.debug("catalog %s: reads not recorded yet: %s", self._path, exc)

    async def flush_touches(self) -> None:
        """Write the pending reads of `touch` now."""
        if not self._touches:
            return
        pending = self._touches
        self._touches = {}

        def write(c: sqlite3.Connection) -> None:
            with self._transaction(c):  # one commit for them all: alone, each UPDATE was its own
                write_reads(c, pending)

        try:
            await self._write(write)
        except BaseException:
            for shard, when in pending.items():
                self._touches.setdefault(shard, when)
            raise

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
        room = Room(owner, capacity, device_free, reserve_free, choose)
        return (await self.reserve_many(dataset, [Claim(key, size, version)], room))[0]

    async def reserve_many(self, dataset: str, claims: Sequence[Claim], room: Room) -> list[Reservation]:
        """`reserve` for each of ``claims`` in turn, in one transaction: one `Reservation` each, in order."""
        reads, self._touches = self._touches, {}

        def write(c: sqlite3.Connection) -> list[Reservation]:
            with self._transaction(c):
                write_reads(c, reads)  # this process's reads first: its eviction must see them
                return reserve_in(c, dataset, claims, room)

        try:
            return await self._write(write)
        except BaseException:
            for shard, when in reads.items():
                self._touches.setdefault(shard, when)
            raise

    async def trim(self, capacity: int, owner: str) -> list[CatalogEntry]:
        """Mark ``EVICTING`` what must leave for the tier to fit ``capacity`` (delete them, then `evicted`)."""
        return await self._write_transaction(lambda c: trim_in(c, capacity, owner))

    async def commit_many(self, dataset: str, staged: Sequence[tuple[str, int, str | None, str]]) -> None:
        """`commit` for each ``(key, size, version, checksum)``, in one transaction: their files are in place."""
        if not staged:
            return

        def write(c: sqlite3.Connection) -> None:
            now = time.time()
            with self._transaction(c):
                c.executemany(
                    _COMMIT,
                    [
                        (dataset, key, size, version, checksum, ShardState.RESIDENT.value, now, now)
                        for key, size, version, checksum in staged
                    ],
                )

        await self._write(write)

    async def abandon_many(self, dataset: str, keys: Sequence[str], owner: str) -> None:
        """`abandon` for each of ``keys``, in one transaction."""
        if not keys:
            return

        def write(c: sqlite3.Connection) -> None:
            with self._transaction(c):
                c.executemany(
                    "DELETE FROM shards WHERE dataset=? AND key=? AND state=? AND owner=?",
                    [(dataset, key, ShardState.STAGING.value, owner) for key in keys],
                )

        await self._write(write)

    async def get_many(self, dataset: str, keys: Sequence[str]) -> dict[str, CatalogEntry]:
        """The rows of ``keys`` that exist, by key (one read)."""

        def read(c: sqlite3.Connection) -> dict[str, CatalogEntry]:
            return entries_of(c, dataset, keys)

        return await self._run(read)

    async def resident_versions(self, dataset: str, keys: Sequence[str]) -> dict[str, str | None]:
        """The version of each of ``keys`` resident, by key (one read: `resident_versions_of`)."""
        return await self._run(lambda c: resident_versions_of(c, dataset, keys))

    async def remove_many(self, shards: Sequence[tuple[str, str]]) -> None:
        """`remove` each ``(dataset, key)``, in one transaction."""
        if not shards:
            return

        def write(c: sqlite3.Connection) -> None:
            with self._transaction(c):
                c.executemany("DELETE FROM shards WHERE dataset=? AND key=?", list(shards))

        await self._write(write)

    async def commit(self, dataset: str, key: str, *, size: int, version: str | None, checksum: str) -> None:
        """``STAGING`` -> ``RESIDENT``: the verified file is in place."""

        def write(c: sqlite3.Connection) -> None:
            now = time.time()
            c.execute(_COMMIT, (dataset, key, size, version, checksum, ShardState.RESIDENT.value, now, now))

        await self._write(write)

    async def abandon(self, dataset: str, key: str, owner: str) -> None:
        """``STAGING`` -> absent, if ``owner`` still holds the reservation."""

        def write(c: sqlite3.Connection) -> None:
            c.execute(
                "DELETE FROM shards WHERE dataset=? AND key=? AND state=? AND owner=?",
                (dataset, key, ShardState.STAGING.value, owner),
            )

        await self._write(write)

    async def remove(self, dataset: str, key: str) -> None:
        """Forget a shard whatever its state (its file is gone or not to be trusted)."""

        def write(c: sqlite3.Connection) -> None:
            c.execute("DELETE FROM shards WHERE dataset=? AND key=?", (dataset, key))

        await self._write(write)

    async def evicted(self, victims: Sequence[CatalogEntry]) -> None:
        """``EVICTING`` -> absent for each victim whose file is deleted."""

        def write(c: sqlite3.Connection) -> None:
            c.executemany(
                "DELETE FROM shards WHERE dataset=? AND key=? AND state=?",
                [(v.dataset, v.key, ShardState.EVICTING.value) for v in victims],
            )

        await self._write(write)

    async def mark_evicting(self, dataset: str, keys: Sequence[str] | None, owner: str) -> list[CatalogEntry]:
        """``RESIDENT`` -> ``EVICTING`` for a dataset's shards (all when ``keys`` is None)."""

        def write(c: sqlite3.Connection) -> list[CatalogEntry]:
            with self._transaction(c):
                if keys is None:
                    rows = c.execute(
                        f"SELECT {COLUMNS} FROM shards WHERE dataset=? AND state=?",
                        (dataset, ShardState.RESIDENT.value),
                    ).fetchall()
                else:
                    rows = []
                    for key in keys:
                        row = c.execute(
                            f"SELECT {COLUMNS} FROM shards WHERE dataset=? AND key=? AND state=?",
                            (dataset, key, ShardState.RESIDENT.value),
                        ).fetchone()
                        if row:
                            rows.append(row)
                c.executemany(
                    "UPDATE shards SET state=?, owner=? WHERE dataset=? AND key=?",
                    [(ShardState.EVICTING.value, owner, r[0], r[1]) for r in rows],
                )
                return [entry_from_row(r) for r in rows]

        return await self._write(write)

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
                f"SELECT {COLUMNS} FROM shards WHERE state IN (?, ?)",
                (ShardState.STAGING.value, ShardState.EVICTING.value),
            ).fetchall()
            return [e for e in map(entry_from_row, rows) if not owner_alive(e.owner)]

        return await self._run(read)

    async def sizes(self) -> list[tuple[str, str, int, str]]:
        """Each row's (dataset, key, size, state), as plain tuples: recovery's comparison with the files."""
        return await self._run(lambda c: c.execute("SELECT dataset, key, size, state FROM shards").fetchall())
