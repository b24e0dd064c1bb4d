"""The catalog: what the local tier holds, in SQLite (WAL), shared by every process of a node.

It survives ``kill -9``: each change is one transaction, and `Catalog.reconcile`
repairs what a killed process left (transfers it never finished, evictions it
never completed, files that vanished). Every process on the node uses the same
file; capacity is reserved inside ``BEGIN IMMEDIATE`` transactions, so two
processes cannot both fill the last free gigabyte.
"""

from __future__ import annotations

from datacache.catalog.room import Claim, Room
from datacache.catalog.rows import (
    CATALOG_ROOM,
    CatalogEntry,
    DatasetRecord,
    ReaderRow,
    Reservation,
    ShardState,
    process_owner,
)
from datacache.catalog.store import Catalog

__all__ = [
    "CATALOG_ROOM",
    "Catalog",
    "CatalogEntry",
    "Claim",
    "DatasetRecord",
    "ReaderRow",
    "Reservation",
    "Room",
    "ShardState",
    "process_owner",
]
