"""Reservations: room on the local tier for shards coming in, claimed inside one transaction.

Plain functions of an open connection (the caller holds ``BEGIN IMMEDIATE``), so that one
shard and a batch of thousands are the same code: `reserve_in` claims each in turn, reading
what is held from the ``totals`` the triggers keep (never a sum over the whole table), and
asks the eviction policy for victims only when a shard does not fit.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from datacache.catalog.rows import (
    COLUMNS,
    CatalogEntry,
    Reservation,
    ShardState,
    entry_from_row,
    leased_shards,
    owner_alive,
    state_totals,
)
from datacache.eviction import Candidate
from datacache.sizes import format_bytes

__all__ = ["Claim", "Room", "reserve_in", "trim_in"]

Chooser = Callable[[Candidate, list[Candidate], int], list[Candidate] | None]


@dataclass(frozen=True, slots=True)
class Claim:
    """One shard asking for room: its key, size and the origin version its copy will have."""

    key: str
    size: int
    version: str | None


@dataclass(frozen=True)
class Room:
    """What decides whether a claim fits: the tier's capacity, the device's free bytes, the policy.

    ``reserve_free`` bytes stay free on the device; ``choose`` picks victims (or None: keep
    what is resident and let the claim go to the next tier).
    """

    owner: str
    capacity: int | None
    device_free: Callable[[], int | None]
    reserve_free: int
    choose: Chooser


class _Residents:
    """The shards eviction may take, loaded once per transaction, less those already taken in it."""

    def __init__(self, c: sqlite3.Connection) -> None:
        pinned = {row[0] for row in c.execute("SELECT id FROM datasets WHERE pinned=1")}
        rows = c.execute(f"SELECT {COLUMNS} FROM shards WHERE state=?", (ShardState.RESIDENT.value,)).fetchall()
        leased = leased_shards(c)
        self.entries = {(r[0], r[1]): entry_from_row(r) for r in rows if (r[0], r[1]) not in leased}
        self._pinned = pinned

    def candidates(self, dataset: str, key: str) -> list[Candidate]:
        return [
            Candidate(e.dataset, e.key, e.size, e.last_access, e.dataset in self._pinned)
            for e in self.entries.values()
            if (e.dataset, e.key) != (dataset, key)
        ]

    def take(self, chosen: Sequence[Candidate]) -> list[CatalogEntry]:
        return [self.entries.pop((v.dataset, v.key)) for v in chosen]

    def oldest_first(self) -> list[CatalogEntry]:
        """Those of datasets not pinned, least recently used first."""
        return sorted((e for e in self.entries.values() if e.dataset not in self._pinned), key=lambda e: e.last_access)


def trim_in(c: sqlite3.Connection, capacity: int, owner: str) -> list[CatalogEntry]:
    """Mark ``EVICTING`` the least recently used shards eviction may take until what is held fits ``capacity``.

    For a tier found over its capacity (a process that ran with another capacity, or none, filled
    it; the operator lowered it): no reservation brings it back until one needs room. Pinned
    datasets and shards a live reader holds stay, as in `reserve_in`. The caller holds the
    transaction, deletes the victims' files and then records them evicted.
    """
    totals = state_totals(c)
    excess = totals[ShardState.RESIDENT.value][0] + totals[ShardState.STAGING.value][0] - capacity
    victims: list[CatalogEntry] = []
    for entry in _Residents(c).oldest_first() if excess > 0 else ():
        if excess <= 0:
            break
        victims.append(entry)
        excess -= entry.size
    c.executemany(
        "UPDATE shards SET state=?, owner=? WHERE dataset=? AND key=?",
        [(ShardState.EVICTING.value, owner, v.dataset, v.key) for v in victims],
    )
    return victims


def reserve_in(c: sqlite3.Connection, dataset: str, claims: Sequence[Claim], room: Room) -> list[Reservation]:
    """Claim room for each of ``claims`` in turn; mark the victims ``EVICTING``, insert ``STAGING`` rows.

    One `Reservation` per claim, in order: granted (with the victims to delete first) or
    declined with the reason. The caller holds the transaction.
    """
    residents: _Residents | None = None
    results: list[Reservation] = []
    for claim in claims:
        refusal, own = _existing(c, dataset, claim.key, room.owner)
        if refusal is not None:
            results.append(Reservation(False, reason=refusal))
            continue
        need, short, used, free = _need(c, claim.size, own, room)
        victims: list[CatalogEntry] = []
        if need > 0:
            residents = residents or _Residents(c)
            incoming = Candidate(dataset, claim.key, claim.size, time.time())
            chosen = room.choose(incoming, residents.candidates(dataset, claim.key), need)
            if chosen is None:
                results.append(Reservation(False, reason=_why_full(short, free, used, room)))
                continue
            victims = residents.take(chosen)
            c.executemany(
                "UPDATE shards SET state=?, owner=? WHERE dataset=? AND key=?",
                [(ShardState.EVICTING.value, room.owner, v.dataset, v.key) for v in victims],
            )
        c.execute(
            "INSERT INTO shards (dataset, key, size, version, checksum, state, owner, last_access)"
            " VALUES (?, ?, ?, ?, NULL, ?, ?, ?) ON CONFLICT(dataset, key) DO UPDATE SET size=excluded.size,"
            " version=excluded.version, checksum=NULL, state=excluded.state, owner=excluded.owner,"
            " last_access=excluded.last_access",
            (dataset, claim.key, claim.size, claim.version, ShardState.STAGING.value, room.owner, time.time()),
        )
        if residents is not None:
            residents.entries.pop((dataset, claim.key), None)  # now ours, being re-staged: no victim
        results.append(Reservation(True, victims=tuple(victims)))
    return results


def _existing(c: sqlite3.Connection, dataset: str, key: str, owner: str) -> tuple[str | None, tuple[str, int] | None]:
    """Why a live process's row refuses the claim (None: it does not); and the row's (state, size)."""
    row = c.execute("SELECT state, owner, size FROM shards WHERE dataset=? AND key=?", (dataset, key)).fetchone()
    if row is None:
        return None, None
    if owner_alive(row[1]):
        if row[0] == ShardState.STAGING and row[1] != owner:
            return f"being staged by {row[1]}", None
        if row[0] == ShardState.EVICTING:
            # Its evictor will delete the file and the row: a new copy now would be deleted.
            return f"being evicted by {row[1]}", None
    return None, (row[0], int(row[2]))


def _need(
    c: sqlite3.Connection, size: int, own: tuple[str, int] | None, room: Room
) -> tuple[int, bool, int, int | None]:
    """Bytes to free for ``size`` more; whether the device (not the capacity) is short; bytes held; device free.

    The claim's own row, if any, is replaced by it: its bytes are not counted twice.
    """
    totals = state_totals(c)
    staging = totals[ShardState.STAGING.value][0]
    used = totals[ShardState.RESIDENT.value][0] + staging
    if own is not None and own[0] != ShardState.EVICTING:
        used -= own[1]
    if own is not None and own[0] == ShardState.STAGING:
        staging -= own[1]
    need = used + size - room.capacity if room.capacity is not None else 0
    free = room.device_free()
    device_short = False
    if free is not None:
        # Transfers reserved but not yet written will take their room too: six puts
        # at once must not all find the same free bytes.
        short = size + room.reserve_free - (free - staging)
        device_short = short > max(need, 0)
        need = max(need, short)
    return need, device_short, used, free


def _why_full(device_short: bool, free: int | None, used: int, room: Room) -> str:
    if device_short and free is not None:
        where = (
            f"the local device is nearly full ({format_bytes(free)} free; datacache leaves "
            f"{format_bytes(room.reserve_free)} free for the catalog and the system)"
        )
    else:
        where = f"the local tier is full ({format_bytes(used)} of its {format_bytes(room.capacity or 0)})"
    return f"{where}, and the policy keeps what is resident"
