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
        sequences: dict[tuple[str, ...], int] = {}
        self.sequence = {reader: sequences.setdefault(keys, len(sequences)) for reader, keys in order.readers.items()}
        """Reader -> which sequence it reads: the workers of one rank share their rank's."""
        self._last: tuple[tuple[tuple[str, int], ...], dict[str, int]] | None = None

    def next_uses(self, where: Mapping[str, int]) -> dict[str, int]:
        """`next_uses` from the readers' positions ``where``, kept while those positions stay.

        It walks every reader's whole future: one stager asks once per shard it stages, and
        between two reports the positions are the same (a burst of tiny shards staged, each
        paid O(future) again: 1e4 two-sample shards, most of the stager's time). Read-only.
        """
        known = tuple(sorted(where.items()))
        last = self._last
        if last is not None and last[0] == known:
            return last[1]
        found = next_uses(self.positions, where)
        self._last = (known, found)
        return found


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
        the read after it, judged from the waiting reader's place (`_waited_for`).

        ``readers`` are this node's readers as the catalog knows them: one whose last
        report is of the order's epoch is where it said; one last seen in another epoch
        will read this one from its start. Readers of the order never seen on this node
        read on other nodes and count for nothing; with none seen, all read from the start.
        """
        uses = self._orders.get(handle.id)
        # A known order is Belady's even when nothing resident is read again (an empty next_use).
        policy = "belady" if handle.config.policy == "auto" and uses is not None else handle.config.policy
        where: dict[str, int] = {}
        if uses is not None:
            where = {
                row.reader: row.position if row.epoch == uses.epoch else 0
                for row in readers
                if row.reader in uses.positions
            }
            if not where:
                where = dict.fromkeys(uses.positions, 0)

        def choose(incoming: Candidate, residents: list[Candidate], need: int) -> list[Candidate] | None:
            if handle.config.pinned:
                incoming = Candidate(incoming.dataset, incoming.key, incoming.size, incoming.last_access, True)
            # Only when room must be made: a reservation that fits asks nothing of the future.
            next_use = uses.next_uses(where) if uses is not None else None
            uses_now = next_use
            if wanted_now and uses is not None and next_use is not None and next_use.get(incoming.key) == 0:
                # Not for a prefetch at a reader's position: a reader past its epoch's end
                # stands where the next epoch's first shard is read.
                uses_now = _waited_for(uses, where, next_use, incoming.key)
            victims = choose_victims(incoming, residents, need, policy=policy, next_use=uses_now)
            if uses_now is not None and _audit.isEnabledFor(logging.DEBUG):
                _audit.debug("%s", _audited(incoming, residents, victims, uses_now, where))
            return victims

        return choose


def _waited_for(uses: _Uses, where: Mapping[str, int], next_use: Mapping[str, int], key: str) -> dict[str, int]:
    """``next_use`` as it stands for ``key``, a shard a reader waits for (its position reads it now).

    The read under way is served as the bytes arrive (or from the next tier) whatever is
    decided: a copy is worth room only for the reads after it. Counting this one made every
    shard read on demand look the most urgent, so each evicted one read again sooner (one
    reader, few samples per shard: below LRU and no-thrash).

    Those reads are judged from the waiting reader's place, not by steps from every reader's
    report: a reader opens a shuffle window's shards at once (all of an epoch's when its rank
    reads a few samples of every shard) and reports the last one's position, so reports run
    ahead of reads by up to a window, and steps compare badly across readers. Hence:

    - its rank's other workers share its sequence and take batches in turn: one whose report
      is behind reads the shard when it gets where the waiting one is, which is now (counted
      from its report, Belady declined at a window's start the shard three readers opened
      next, for one the waiting reader reads early in the next epoch: 20 samples per shard,
      2 ranks of 2 workers, below LRU);
    - the residents keep their next uses as every reader's reports give them: a rule that kept
      whatever the waiting reader still read this epoch was for readers that opened a whole
      window's shards at its start (the per-window plan before issue 35); with each shard opened
      at its first read it cost 0.03-0.04 below LRU (20 samples per shard, 4 ranks of 2 workers).
    """
    waiting = {r: p for r, p in where.items() if _reads_at(uses.positions[r].get(key, ()), p)}
    lead: dict[int, int] = {}
    for reader, position in waiting.items():
        lead[uses.sequence[reader]] = max(position, lead.get(uses.sequence[reader], position))
    later: int | None = None
    for reader, position in where.items():
        positions = uses.positions[reader].get(key, ())
        # A waiting reader's read at its position is the one under way; a rank-mate counts from the lead.
        at = (bisect.bisect_right if reader in waiting else bisect.bisect_left)(positions, position)
        if at < len(positions):
            steps = max(0, positions[at] - max(position, lead.get(uses.sequence[reader], position)))
            later = steps if later is None else min(later, steps)
    found = dict(next_use)
    if later is None:
        return _without(found, key)
    found[key] = later
    return found


def _reads_at(positions: Sequence[int], position: int) -> bool:
    at = bisect.bisect_left(positions, position)
    return at < len(positions) and positions[at] == position


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
