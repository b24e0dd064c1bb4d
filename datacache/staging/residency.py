"""What each tier keeps: the node's future reads and the eviction choice they drive.

Belady's rule needs, for every resident shard, how soon it is read next. The
loader hands over the whole node's future (`FutureOrder`: every reader's
sequence, identical from every reader) and each reader's progress goes to the
catalog, shared by the node's processes. A shard's next use is then the
fewest steps any live reader has to go, from where it is, to reach it.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from datacache.catalog import ReaderRow
from datacache.eviction import Candidate, choose_victims
from datacache.staging.types import DatasetHandle, FutureOrder

__all__ = ["Chooser", "Residency", "next_uses"]

_audit = logging.getLogger(__name__ + ".audit")
"""Each eviction choice Belady makes, at DEBUG (off unless a benchmark or a person turns it on)."""

Chooser = Callable[[Candidate, list[Candidate], int], "list[Candidate] | None"]
"""Given the incoming shard, the residents and the bytes needed: the victims, or None to decline."""

_ANONYMOUS = ""
"""The one reader of an order handed over as a plain list of keys."""


class _Uses:
    """One `FutureOrder`, indexed: reader -> shard key -> the positions that read it, ascending."""

    def __init__(self, order: FutureOrder) -> None:
        self.order = order
        self.epoch = order.epoch
        self.positions: dict[str, dict[str, list[int]]] = {}
        for reader, keys in order.readers.items():
            index: dict[str, list[int]] = {}
            for position, key in enumerate(keys):
                index.setdefault(key, []).append(position)
            self.positions[reader] = index


def next_uses(uses: Mapping[str, Mapping[str, Sequence[int]]], where: Mapping[str, int]) -> dict[str, int]:
    """Steps until each shard is read next by any reader, from the readers' positions in ``where``.

    Readers absent from ``where`` are not reading on this node: they count for nothing.
    A shard no reader reaches again is absent from the result (never read again).
    """
    found: dict[str, int] = {}
    for reader, position in where.items():
        for key, positions in uses.get(reader, {}).items():
            at = bisect.bisect_left(positions, position)
            if at < len(positions):
                steps = positions[at] - position
                if steps < found.get(key, steps + 1):
                    found[key] = steps
    return found


def _extends(known: FutureOrder, order: FutureOrder) -> bool:
    """Whether ``known`` is ``order`` with more reads after it (the next epoch's), reader by reader."""
    if known.epoch != order.epoch or known == order:
        return False
    return all(known.readers.get(name, ())[: len(keys)] == keys for name, keys in order.readers.items())


class Residency:
    """The future reads per dataset (for Belady), and the victim chooser per dataset."""

    def __init__(self) -> None:
        self._orders: dict[str, _Uses] = {}

    def set_future_order(self, dataset_id: str, keys: Iterable[str] | FutureOrder) -> None:
        """Record the node's future reads of ``dataset_id``: a `FutureOrder`, or one plain sequence of keys."""
        order = keys if isinstance(keys, FutureOrder) else FutureOrder(0, {_ANONYMOUS: tuple(keys)})
        known = self._orders.get(dataset_id)
        if known is not None and _extends(known.order, order):
            return  # a reader that does not know the next epoch yet (a cold one's counts): keep the longer
        self._orders[dataset_id] = _Uses(order)

    def knows(self, dataset_id: str) -> bool:
        """Whether a future order was handed over for the dataset."""
        return dataset_id in self._orders

    def chooser(self, handle: DatasetHandle, readers: Sequence[ReaderRow] = (), *, wanted_now: bool = False) -> Chooser:
        """The eviction choice for a shard of ``handle`` coming in, by the dataset's policy.

        ``wanted_now``: a reader is blocked on the incoming shard (not a prefetch). That read
        is served as the bytes arrive whatever is chosen here, so Belady weighs the shard by
        the read after it.

        ``readers`` are this node's readers as the catalog knows them: one whose last
        report is of the order's epoch is where it said; one last seen in another epoch
        will read this one from its start. Readers of the order never seen on this node
        read on other nodes and count for nothing; with none seen, all read from the start.
        """
        uses = self._orders.get(handle.id)
        # A known order is Belady's even when nothing resident is read again (an empty next_use).
        policy = "belady" if handle.config.policy == "auto" and uses is not None else handle.config.policy
        next_use: dict[str, int] | None = None
        where: dict[str, int] = {}
        if uses is not None:
            where = {
                row.reader: row.position if row.epoch == uses.epoch else 0
                for row in readers
                if row.reader in uses.positions
            }
            if not where:
                where = dict.fromkeys(uses.positions, 0)
            next_use = next_uses(uses.positions, where)

        def choose(incoming: Candidate, residents: list[Candidate], need: int) -> list[Candidate] | None:
            if handle.config.pinned:
                incoming = Candidate(incoming.dataset, incoming.key, incoming.size, incoming.last_access, True)
            uses_now = next_use
            if wanted_now and uses is not None and next_use is not None and next_use.get(incoming.key) == 0:
                # A reader waits for the incoming shard: that read is served as it arrives (or
                # from the next tier), whatever is decided here. A copy is worth room only for
                # the read after it. Counting this one made every shard read on demand look the
                # most urgent, so each evicted one read again sooner (few samples per shard:
                # below LRU and no-thrash). Not for a prefetch at a reader's position: a reader
                # past its epoch's end stands where the next epoch's first shard is read.
                later = _next_use_of(uses.positions, where, incoming.key)
                uses_now = {**next_use, incoming.key: later} if later is not None else _without(next_use, incoming.key)
            victims = choose_victims(incoming, residents, need, policy=policy, next_use=uses_now)
            if uses_now is not None and _audit.isEnabledFor(logging.DEBUG):
                _audit.debug("%s", _audited(incoming, residents, victims, uses_now, where))
            return victims

        return choose


def _next_use_of(uses: Mapping[str, Mapping[str, Sequence[int]]], where: Mapping[str, int], key: str) -> int | None:
    """Steps until ``key`` is read after the readers' current positions (reads at them excluded); None: never."""
    found: int | None = None
    for reader, position in where.items():
        positions = uses.get(reader, {}).get(key, ())
        at = bisect.bisect_right(positions, position)
        if at < len(positions) and (found is None or positions[at] - position < found):
            found = positions[at] - position
    return found


def _without(uses: Mapping[str, int], key: str) -> dict[str, int]:
    return {k: v for k, v in uses.items() if k != key}


def _audited(
    incoming: Candidate,
    residents: Sequence[Candidate],
    victims: Sequence[Candidate] | None,
    next_use: Mapping[str, int],
    where: Mapping[str, int],
) -> str:
    """One eviction choice as a JSON line: each shard's next use (null: never), the readers' positions.

    What `benchmarks/bigger.py --audit` reads to check the rule: a victim is never needed
    sooner than the shard it makes room for, and the farthest residents go first.
    """
    farthest = max((next_use.get(c.key, math.inf) for c in residents), default=math.inf)
    return json.dumps(
        {
            "incoming": incoming.key,
            "incoming_next": next_use.get(incoming.key),
            "victims": None if victims is None else [[v.key, next_use.get(v.key)] for v in victims],
            "farthest": None if farthest == math.inf else farthest,
            "candidates": len(residents),
            "where": dict(where),
        }
    )
