"""The catalog's rows of this node's readers: where each is, and the shards it holds (its leases).

Eviction never takes a shard a live reader holds, and Belady counts from the readers' positions.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Sequence

from datacache.catalog.database import CatalogDatabase
from datacache.catalog.rows import ReaderRow, leased_shards, owner_alive
from datacache.errors import TierFullError

__all__ = ["ReaderRows"]

logger = logging.getLogger("datacache.catalog.store")


class ReaderRows(CatalogDatabase):
    """The readers' part of `Catalog`."""

    _said_full = False
    """Whether this process warned that its notes go unrecorded on a full disk (once)."""

    async def note_reader(
        self, dataset: str, reader: str, *, owner: str, epoch: int, position: int, holding: Sequence[str]
    ) -> None:
        """Record where ``reader`` is, and replace the shards it holds (leases) with ``holding``.

        On a full disk (another process filled it) nothing is recorded and the reader reads on: an
        eviction may then take a shard it is about to open, which it finds gone and locates again
        (`UnitReaders._open`); one mapped stays whole. A trial's training died of this note.
        """

        def write(c: sqlite3.Connection) -> None:
            with self._transaction(c):
                c.execute(
                    "INSERT INTO readers (dataset, reader, owner, epoch, position, updated) VALUES (?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT(dataset, reader) DO UPDATE SET owner=excluded.owner, epoch=excluded.epoch,"
                    " position=excluded.position, updated=excluded.updated",
                    (dataset, reader, owner, epoch, position, time.time()),
                )
                # Only this owner's: a reader name another process (another uid's) also uses ends nothing of its.
                c.execute("DELETE FROM leases WHERE dataset=? AND reader=? AND owner=?", (dataset, reader, owner))
                c.executemany(
                    "INSERT OR IGNORE INTO leases (dataset, key, reader, owner) VALUES (?, ?, ?, ?)",
                    [(dataset, key, reader, owner) for key in holding],
                )

        try:
            await self._write(write)
        except TierFullError as exc:
            if not self._said_full:
                logger.warning("%s; this node's readers' places and leases are not recorded until it has room", exc)
                self._said_full = True

    async def readers(self, dataset: str) -> list[ReaderRow]:
        """Every reader of the dataset this node has seen, with its last epoch and position.

        Rows outlive their processes on purpose: a reader of the last epoch is a reader
        of this node in the next one too, before it has said so.
        """

        def read(c: sqlite3.Connection) -> list[ReaderRow]:
            rows = c.execute("SELECT reader, epoch, position FROM readers WHERE dataset=?", (dataset,))
            return [ReaderRow(r[0], r[1], r[2]) for r in rows.fetchall()]

        return await self._run(read)

    async def drop_dead_leases(self) -> int:
        """Remove the leases of processes that no longer exist; return how many."""

        def write(c: sqlite3.Connection) -> int:
            with self._transaction(c):
                owners = {row[0] for row in c.execute("SELECT DISTINCT owner FROM leases")}
                dead = [(owner,) for owner in owners if not owner_alive(owner)]
                c.executemany("DELETE FROM leases WHERE owner=?", dead)
                return len(dead)

        return await self._run(write)

    async def leased(self) -> set[tuple[str, str]]:
        """(dataset, key) of every shard a live reader holds."""
        return await self._run(leased_shards)
