"""The bytes each client uid holds leased on the daemon's local tier, bounded.

A reader's progress leases the shards it holds: eviction never takes them while
the process that made the lease lives. Through the daemon the owner is that
process as the kernel names it (``SO_PEERCRED``), never what the client says, and
one uid may not hold more than its share of the tier: otherwise one user's
leases would push every other user's shards off the node (docs/SECURITY.md,
"The daemon").
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from datacache.catalog.rows import owner_alive

__all__ = ["LeaseBook", "lease_limit", "owner_of"]


def lease_limit(local_dir: Path, capacity: int | None) -> int:
    """What one uid may hold leased: half the local tier's capacity (or of its device, if unbounded)."""
    if capacity is None:
        existing = next((p for p in (local_dir, *local_dir.parents) if p.exists()), Path("/"))
        try:
            capacity = shutil.disk_usage(existing).total  # the directory may not exist yet
        except OSError:
            capacity = 0
    return max(capacity // 2, 1)


@dataclass
class LeaseBook:
    """Leased bytes by (dataset, reader, owner): the uid and owner (``host:pid``) that hold them."""

    limit: int
    held: dict[tuple[str, str, str], tuple[int, str, int]] = field(default_factory=dict)
    told: set[tuple[int, str]] = field(default_factory=set)
    """(uid, dataset) whose readers were told they passed the bound: told once, not per note."""

    def first_refusal(self, uid: int, dataset: str) -> bool:
        """Whether this is the first time ``uid``'s readers of ``dataset`` asked for more than the bound."""
        if (uid, dataset) in self.told:
            return False
        self.told.add((uid, dataset))
        return True

    def admit(self, uid: int, owner: str, dataset: str, reader: str, sizes: Sequence[tuple[str, int]]) -> list[str]:
        """The keys of ``sizes`` (in order) that ``uid`` may lease now; the rest would pass its bound."""
        for ident, (_, who, _) in list(self.held.items()):
            if not owner_alive(who):
                del self.held[ident]
        mine = (dataset, reader, owner)
        others = sum(size for ident, (u, _, size) in self.held.items() if u == uid and ident != mine)
        kept: list[str] = []
        total = 0
        for key, size in sizes:
            if others + total + size > self.limit:
                break
            kept.append(key)
            total += size
        self.held[mine] = (uid, owner, total)
        return kept


def owner_of(pid: int) -> str:
    """The owner a lease of process ``pid`` of this node is recorded under (as `process_owner` writes it)."""
    return f"{socket.gethostname()}:{pid}"
