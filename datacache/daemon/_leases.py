"""The bytes each client uid holds leased on the daemon's local tier, bounded while uids share the tier.

A reader's progress leases the shards it holds: eviction never takes them while
the process that made the lease lives. Through the daemon the owner is that
process as the kernel names it (``SO_PEERCRED``), never what the client says.
While more than one uid asks this daemon for room (each by a live process), one
uid may not hold more than its share of the tier: otherwise one user's leases would
push every other user's shards off the node (docs/SECURITY.md, "The daemon"). A uid
alone on the node is not bounded (its readers are the only ones the tier serves,
and a bound there only refused them the shards they read next); when another uid
arrives, what the first holds past its share is let go at once (`LeaseBook.arrive`).
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from datacache.catalog.rows import owner_alive

__all__ = ["Lease", "LeaseBook", "lease_limit", "owner_of"]


def lease_limit(local_dir: Path, capacity: int | None) -> int:
    """What one uid may hold leased while others use the tier: half its capacity (or its device's)."""
    if capacity is None:
        existing = next((p for p in (local_dir, *local_dir.parents) if p.exists()), Path("/"))
        try:
            capacity = shutil.disk_usage(existing).total  # the directory may not exist yet
        except OSError:
            capacity = 0
    return max(capacity // 2, 1)


@dataclass(frozen=True)
class Lease:
    """What one reader (``dataset``, ``reader``, ``owner``) of ``uid`` holds: its shards, nearest first."""

    dataset: str
    reader: str
    owner: str
    uid: int
    epoch: int
    position: int
    keys: tuple[tuple[str, int], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.keys)


@dataclass
class LeaseBook:
    """Leases by (dataset, reader, owner), and the uids (by live process) that asked this daemon for room."""

    limit: int
    held: dict[tuple[str, str, str], Lease] = field(default_factory=dict)
    present: dict[int, set[str]] = field(default_factory=dict)
    """uid -> the processes (``host:pid``) of that uid that asked for room (progress, ensure, prefetch)."""
    told: set[tuple[int, str]] = field(default_factory=set)
    """(uid, dataset) whose readers were told they passed the bound: told once, not per note."""

    def first_refusal(self, uid: int, dataset: str) -> bool:
        """Whether this is the first time ``uid``'s readers of ``dataset`` asked for more than the bound."""
        if (uid, dataset) in self.told:
            return False
        self.told.add((uid, dataset))
        return True

    def _prune(self) -> None:
        """Forget the leases and presence of processes that ended."""
        alive: dict[str, bool] = {}

        def live(owner: str) -> bool:
            if owner not in alive:
                alive[owner] = owner_alive(owner)
            return alive[owner]

        for ident, lease in list(self.held.items()):
            if not live(lease.owner):
                del self.held[ident]
        for uid, owners in list(self.present.items()):
            owners.intersection_update({owner for owner in owners if live(owner)})
            if not owners:
                del self.present[uid]

    def shared(self, uid: int) -> bool:
        """Whether another uid than ``uid`` uses the tier now (then ``uid`` is held to its share)."""
        return any(other != uid for other in self.present)

    def arrive(self, uid: int, owner: str) -> list[Lease]:
        """``owner``, a process of ``uid``, asks for room; the leases to cut back if the tier is now shared.

        A uid that was alone and held more than its share keeps, of each reader's
        shards in turn, the nearest, until its share is full; the daemon writes the
        leases returned (each now holding less) to the catalog.
        """
        self._prune()
        arriving = uid not in self.present
        self.present.setdefault(uid, set()).add(owner)
        if not arriving or len(self.present) < 2:
            return []
        cut: list[Lease] = []
        for other in {lease.uid for lease in self.held.values()} - {uid}:
            cut += self._trim(other)
        return cut

    def _trim(self, uid: int) -> list[Lease]:
        """Cut ``uid``'s leases to the bound: each reader's nearest shard first, round by round."""
        mine = {ident: lease for ident, lease in self.held.items() if lease.uid == uid}
        if sum(lease.nbytes for lease in mine.values()) <= self.limit:
            return []
        kept: dict[tuple[str, str, str], list[tuple[str, int]]] = {ident: [] for ident in mine}
        total, rank, full = 0, 0, False
        while not full and any(rank < len(lease.keys) for lease in mine.values()):
            for ident, lease in mine.items():
                if rank >= len(lease.keys):
                    continue
                key, size = lease.keys[rank]
                if total + size > self.limit:
                    full = True
                    break
                kept[ident].append((key, size))
                total += size
            rank += 1
        cut = []
        for ident, lease in mine.items():
            if len(kept[ident]) < len(lease.keys):
                self.held[ident] = replace(lease, keys=tuple(kept[ident]))
                cut.append(self.held[ident])
        return cut

    def admit(self, lease: Lease, sizes: Sequence[tuple[str, int]]) -> list[str]:
        """The keys of ``sizes`` (in order) that ``lease``'s reader may hold now; records them.

        Unbounded while its uid is alone on the tier; else what fits in its share
        beside its other readers' leases.
        """
        self._prune()
        ident = (lease.dataset, lease.reader, lease.owner)
        bounded = self.shared(lease.uid)
        others = sum(held.nbytes for i, held in self.held.items() if held.uid == lease.uid and i != ident)
        kept: list[tuple[str, int]] = []
        total = 0
        for key, size in sizes:
            if bounded and others + total + size > self.limit:
                break
            kept.append((key, size))
            total += size
        self.held[ident] = replace(lease, keys=tuple(kept))
        return [key for key, _ in kept]


def owner_of(pid: int) -> str:
    """The owner a lease of process ``pid`` of this node is recorded under (as `process_owner` writes it)."""
    return f"{socket.gethostname()}:{pid}"
