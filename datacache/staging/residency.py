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
from typing import Any

import numpy as np
import numpy.typing as npt

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
    """One `FutureOrder`, indexed: per distinct sequence, its (key index, position) pairs, sorted.

    Each pair is one int64, ``key * length + position``, so one `np.searchsorted` finds the next
    read of a key at or after a position: 8 bytes a read, where a dict of key -> positions per
    reader was ~280 bytes a shard at 1e6 shards. Readers that read equal sequences (a rank's
    workers) share one, and are rank-mates to `_waited_for`.
    """

    def __init__(self, order: FutureOrder) -> None:
        self.order = order
        self.epoch = order.epoch
        self.readers = order.reads.keys()
        self.sequence: dict[str, int] = {}
        """Reader -> which sequence it reads: the workers of one rank share their rank's."""
        self._reads: list[npt.NDArray[np.integer[Any]]] = []
        """Each distinct sequence, as the order holds it (no copy)."""
        self._pairs: list[npt.NDArray[np.int64]] = []
        self._lengths: list[int] = []
        by_id: dict[int, int] = {}
        for reader, reads in order.reads.items():
            if id(reads) not in by_id:
                by_id[id(reads)] = self._sequence_of(reads)
            self.sequence[reader] = by_id[id(reads)]
        self._index: dict[str, int] = {}
        """Key -> its index in the order's key column (-1: not in it), for the keys asked about."""
        self._last: tuple[tuple[tuple[str, int], ...], dict[str, int | None]] | None = None

    def _sequence_of(self, reads: npt.NDArray[np.integer[Any]]) -> int:
        for at, known in enumerate(self._reads):
            if len(known) == len(reads) and np.array_equal(known, reads):
                return at
        length = len(reads)
        pairs = reads.astype(np.int64)
        pairs *= length
        pairs += np.arange(length, dtype=np.int64)
        pairs.sort()
        self._reads.append(reads)
        self._pairs.append(pairs)
        self._lengths.append(length)
        return len(self._pairs) - 1

    def positions_of(self, keys: Iterable[str]) -> npt.NDArray[np.int64]:
        """Each key's index in the order's key column, -1 for one not in it (looked up once each)."""
        index = self._index
        asked = list(keys)
        unknown = list(dict.fromkeys(key for key in asked if key not in index))
        if unknown:
            # All at once: a binary search each (~50 us a key) stalled the first choice among 1e5 residents ~5 s.
            index.update(zip(unknown, self.order.keys.positions(unknown).tolist(), strict=True))
        return np.fromiter((index[key] for key in asked), dtype=np.int64, count=len(asked))

    def after(
        self, reader: str, keys: npt.NDArray[np.int64], position: int, *, strictly: bool = False
    ) -> npt.NDArray[np.int64]:
        """Where ``reader`` next reads each of ``keys`` (column indices) at or after ``position``
        (after it, if ``strictly``); `_NEVER` where it reads it no more or the key is not in the order."""
        never = np.full(len(keys), _NEVER, dtype=np.int64)
        sequence = self.sequence.get(reader)
        if sequence is None:
            return never
        pairs, length = self._pairs[sequence], self._lengths[sequence]
        if not length or position >= length or (strictly and position >= length - 1):
            return never
        start = max(position, 0)
        known = keys >= 0
        targets = keys[known] * length + start
        at = np.searchsorted(pairs, targets, side="right" if strictly and position >= 0 else "left")
        inside = at < len(pairs)
        hit = np.full(len(targets), -1, dtype=np.int64)
        hit[inside] = pairs[at[inside]]
        same = inside & (hit // length == keys[known])
        found = np.where(same, hit % length, _NEVER)
        never[known] = found
        return never

    def next_uses(self, where: Mapping[str, int], keys: Iterable[str]) -> dict[str, int]:
        """`next_uses` of ``keys`` from the readers' positions ``where``, each kept while those positions stay.

        Only the keys asked about (the residents and the incoming shard), never the whole future:
        one stager asks once per shard it stages, and between two reports the positions are the
        same (a burst of tiny shards staged). Read-only.
        """
        asked = list(dict.fromkeys(keys))
        known = tuple(sorted(where.items()))
        if self._last is None or self._last[0] != known:
            if len(self._index) > max(_KEYS_KEPT, 4 * len(asked)):
                self._index = {}  # the residents of long ago: looked up again if asked again
            self._last = (known, {})
        found = self._last[1]
        missing = [key for key in asked if key not in found]
        if missing:
            indices = self.positions_of(missing)
            best = np.full(len(missing), _NEVER, dtype=np.int64)
            for reader, position in where.items():
                then = self.after(reader, indices, position)
                np.minimum(best, np.where(then == _NEVER, _NEVER, then - position), out=best)
            for key, steps in zip(missing, best.tolist(), strict=True):
                found[key] = None if steps == _NEVER else steps
        return {key: value for key in asked if (value := found[key]) is not None}


_NEVER = np.iinfo(np.int64).max
_KEYS_KEPT = 4096
"""Keys whose column index `_Uses` remembers, at least: beyond that, at most four times those asked about."""


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
    """Whether ``known`` is ``order``, or ``order`` with more reads after it (the next epoch's), reader by reader."""
    return known.begins(order)


class Residency:
    """The future reads per dataset (for Belady), and the victim chooser per dataset."""

    def __init__(self) -> None:
        self._orders: dict[str, _Uses] = {}

    def set_future_order(self, dataset_id: str, keys: Iterable[str] | FutureOrder) -> None:
        """Record the node's future reads of ``dataset_id``: a `FutureOrder`, or one plain sequence of keys."""
        order = keys if isinstance(keys, FutureOrder) else FutureOrder(0, {_ANONYMOUS: tuple(keys)})
        known = self._orders.get(dataset_id)
        if known is not None and _extends(known.order, order):
            # A reader that does not know the next epoch yet (a cold one's counts): keep the longer.
            # The same order again (each reader hands it over): kept, not indexed again.
            return
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
                if row.reader in uses.readers
            }
            if not where:
                where = dict.fromkeys(uses.readers, 0)

        def choose(incoming: Candidate, residents: list[Candidate], need: int) -> list[Candidate] | None:
            if handle.config.pinned:
                incoming = Candidate(incoming.dataset, incoming.key, incoming.size, incoming.last_access, True)
            # Only when room must be made: a reservation that fits asks nothing of the future.
            asked = (incoming.key, *(c.key for c in residents))
            next_use = uses.next_uses(where, asked) if uses is not None else None
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
    at = uses.positions_of((key,))
    waiting = {r: p for r, p in where.items() if int(uses.after(r, at, p)[0]) == p}
    lead: dict[int, int] = {}
    for reader, position in waiting.items():
        lead[uses.sequence[reader]] = max(position, lead.get(uses.sequence[reader], position))
    later: int | None = None
    for reader, position in where.items():
        # A waiting reader's read at its position is the one under way; a rank-mate counts from the lead.
        found = int(uses.after(reader, at, position, strictly=reader in waiting)[0])
        if found != _NEVER:
            steps = max(0, found - max(position, lead.get(uses.sequence[reader], position)))
            later = steps if later is None else min(later, steps)
    found_uses = dict(next_use)
    if later is None:
        return _without(found_uses, key)
    found_uses[key] = later
    return found_uses


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
