"""Which shards leave a full tier: LRU, no-thrash, and Belady's rule.

A policy sees the shard that wants in, the shards that could leave, and how
many bytes must be freed. It returns the victims, or ``None`` to decline: the
incoming shard is then not cached on this tier and is read from the next one.

- **lru** evicts the least recently used shards of any dataset.
- **nothrash** never evicts a dataset's own shards to make room for more of it
  (fill once, then serve the rest from the next tier). With a random order
  every epoch and a cache smaller than the data, LRU misses almost always;
  no-thrash hits exactly the resident fraction (CoorDL, VLDB 2021).
- **belady** is used when the future order of reads is known (the loader's
  seeded epoch order): among the dataset's own shards it evicts the one whose
  next use is farthest away, and declines when the incoming shard is itself
  needed later than everything resident.
- **auto** (the default) is belady when the loader has handed over the order,
  no-thrash otherwise.

A new policy is one function of the shape `Order` and its name in `_ORDERS`: the
settings, the CLI's ``--policy`` and the daemon take their names from `POLICIES`.

Shards of *other* datasets are always evicted least recently used first, and
pinned datasets are never evicted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["POLICIES", "Candidate", "choose_victims"]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A shard as eviction sees it."""

    dataset: str
    key: str
    size: int
    last_access: float
    pinned: bool = False


Order = Callable[["Candidate", list["Candidate"], list["Candidate"], Mapping[str, int]], list["Candidate"]]
"""A policy: (incoming, its dataset's evictable shards, other datasets' oldest first, next uses) -> the
shards in the order they may leave; those not listed stay (the incoming shard then may not get in)."""


def _lru(
    incoming: Candidate, own: list[Candidate], others: list[Candidate], uses: Mapping[str, int]
) -> list[Candidate]:
    return sorted(own + others, key=lambda c: c.last_access)


def _nothrash(
    incoming: Candidate, own: list[Candidate], others: list[Candidate], uses: Mapping[str, int]
) -> list[Candidate]:
    return others


def _belady(
    incoming: Candidate, own: list[Candidate], others: list[Candidate], uses: Mapping[str, int]
) -> list[Candidate]:
    incoming_next = uses.get(incoming.key, math.inf)
    later = [c for c in own if uses.get(c.key, math.inf) > incoming_next]
    # Farthest next use first; among equals (never read again, or read at one step), the least
    # recently used, as LRU would.
    later.sort(key=lambda c: (uses.get(c.key, math.inf), -c.last_access), reverse=True)
    return others + later


_ORDERS: dict[str, Order] = {"lru": _lru, "nothrash": _nothrash, "belady": _belady}
POLICIES = ("auto", *_ORDERS)
"""The names a dataset's ``policy`` may take (``auto``: belady with a known future, else nothrash)."""


def choose_victims(
    incoming: Candidate,
    residents: Sequence[Candidate],
    need: int,
    *,
    policy: str,
    next_use: Mapping[str, int] | None = None,
) -> list[Candidate] | None:
    """Return shards whose removal frees at least ``need`` bytes, or ``None`` to bypass this tier.

    Parameters
    ----------
    incoming
        The shard that wants in.
    residents
        The shards that could leave (already-resident, not being written).
    need
        Bytes to free.
    policy
        The incoming dataset's policy: ``lru``, ``nothrash``, ``belady`` or ``auto``.
    next_use
        For belady: the position in the known future order at which each of the
        incoming dataset's shards is next read; absent keys are never read again.
    """
    if need <= 0:
        return []
    if policy == "auto":
        policy = "belady" if next_use else "nothrash"
    if policy not in _ORDERS:
        raise ValueError(f"unknown eviction policy {policy!r}")
    evictable = [c for c in residents if not c.pinned]
    others = sorted((c for c in evictable if c.dataset != incoming.dataset), key=lambda c: c.last_access)
    own = [c for c in evictable if c.dataset == incoming.dataset]
    order = _ORDERS[policy](incoming, own, others, next_use or {})

    victims: list[Candidate] = []
    freed = 0
    for candidate in order:
        if freed >= need:
            break
        victims.append(candidate)
        freed += candidate.size
    if freed < need:
        return None
    return victims
