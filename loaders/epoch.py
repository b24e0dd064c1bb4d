"""One reader's plan for an epoch: which samples it yields, in what order, from which units.

Pure arithmetic on plain values (numpy, no I/O, no torch): the global order
and the dealing come from `datacache.loaders.order`; this module turns them
into what a reader needs to walk its share, namely each position's unit and
index within that unit, and the order in which units are first and last used
(for prefetch, opening ahead, and closing a unit after its last sample).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
from datacache.loaders.order import (
    Cursor,
    Layout,
    epoch_order,
    equalize,
    rank_positions,
    remaining_sequence,
    worker_positions,
)

__all__ = [
    "EpochPlan",
    "ReadPlan",
    "auto_window",
    "initial_prefetch",
    "node_epoch_sequences",
    "node_unit_sequences",
    "plan_epoch",
    "reader_name",
]

IntArray = npt.NDArray[np.int64]


class ReadPlan(Protocol):
    """What readers need of a plan: an `EpochPlan`, or a cold epoch's plan that grows as it is read."""

    @property
    def unit_of(self) -> IntArray: ...

    @property
    def local(self) -> IntArray: ...

    @property
    def padded(self) -> int: ...

    @property
    def first_use(self) -> Mapping[int, int]: ...

    @property
    def last_use(self) -> Mapping[int, int]: ...

    @property
    def unit_sequence(self) -> tuple[int, ...]: ...

    def __len__(self) -> int: ...

    def units_from(self, produced: int) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class EpochPlan:
    """What one reader (a rank's worker) reads this epoch, position by position."""

    ids: IntArray
    """Global sample ids, in the order this reader yields them."""
    unit_of: IntArray
    """The unit each position reads from."""
    local: IntArray
    """Each position's sample index within its unit."""
    padded: int
    """Positions that repeat another rank's samples to equalise rank lengths."""
    first_use: dict[int, int]
    """Unit -> first position that reads it."""
    last_use: dict[int, int]
    """Unit -> last position that reads it (the unit can be closed after it)."""
    unit_sequence: tuple[int, ...]
    """Units in the order they are first needed."""

    def __len__(self) -> int:
        return len(self.ids)

    def units_from(self, produced: int) -> tuple[int, ...]:
        """`unit_sequence` less the units no position from ``produced`` on reads."""
        if not produced:
            return self.unit_sequence
        upcoming = set(self.unit_of[produced:].tolist())
        return tuple(u for u in self.unit_sequence if u in upcoming)


def plan_epoch(
    counts: Sequence[int] | IntArray,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    window: int,
    cursors: tuple[Cursor, ...],
    layout: Layout,
    drop_last: bool,
    order: IntArray | None = None,
) -> EpochPlan:
    """The reader ``layout``'s plan of epoch ``epoch``, less what ``cursors`` say was consumed.

    ``order`` replaces the epoch's global order (what a cold epoch left, see `coldorder.cold_remaining`).
    """
    if order is None:
        order = epoch_order(counts, seed=seed, epoch=epoch, shuffle=shuffle, window=window)
    sequence = remaining_sequence(order, cursors, window)
    return _deal(sequence, counts, window=window, layout=layout, drop_last=drop_last)


def _deal(
    sequence: IntArray, counts: Sequence[int] | IntArray, *, window: int, layout: Layout, drop_last: bool
) -> EpochPlan:
    """The part of the epoch's remaining ``sequence`` that reader ``layout`` reads."""
    ids, padded = _reader_ids(sequence, window=window, layout=layout, drop_last=drop_last)
    unit_of = _units_of(ids, counts)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    local = ids - starts[unit_of]
    last_use: dict[int, int] = {}
    first_use: dict[int, int] = {}
    for position, unit in enumerate(unit_of.tolist()):
        last_use[unit] = position
        first_use.setdefault(unit, position)
    return EpochPlan(
        ids=ids,
        unit_of=unit_of,
        local=local,
        padded=padded,
        first_use=first_use,
        last_use=last_use,
        unit_sequence=tuple(sorted(first_use, key=first_use.__getitem__)),
    )


def _reader_ids(sequence: IntArray, *, window: int, layout: Layout, drop_last: bool) -> tuple[IntArray, int]:
    """The sample ids reader ``layout`` yields, in order, and how many of them are padding."""
    total = len(sequence)
    own = rank_positions(total, layout.world_size, layout.rank, window)
    natural = len(own)
    positions, _ = equalize(own, total, layout.world_size, drop_last=drop_last)
    padded = np.arange(len(positions)) >= natural
    indexes = np.arange(len(positions), dtype=np.int64)
    mine = worker_positions(indexes, layout.num_workers, layout.worker, layout.chunk)
    return sequence[positions[mine]], int(padded[mine].sum())


def _units_of(ids: IntArray, counts: Sequence[int] | IntArray) -> IntArray:
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    # Units with no samples share a start with the next one; searchsorted picks the last of them.
    units: IntArray = np.searchsorted(starts, ids, side="right") - 1
    return units


def reader_name(layout: Layout) -> str:
    """How a reader is named in the node's future order: ``"rank.worker"``."""
    return f"{layout.rank}.{layout.worker}"


def node_unit_sequences(
    counts: Sequence[int] | IntArray,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    window: int,
    cursors: tuple[Cursor, ...],
    layout: Layout,
    drop_last: bool,
    order: IntArray | None = None,
) -> dict[str, tuple[int, ...]]:
    """Every reader's units in order (all ranks, all workers of ``layout``'s job), by `reader_name`.

    This epoch's remaining units, then the next epoch's, so that eviction near the end of
    an epoch keeps what the next one reads first. Every reader computes the same value.
    ``order`` replaces this epoch's global order, as in `plan_epoch`.
    """
    if order is None:
        order = epoch_order(counts, seed=seed, epoch=epoch, shuffle=shuffle, window=window)
    now = _node_epoch(counts, remaining_sequence(order, cursors, window), window, layout, drop_last)
    following = node_epoch_sequences(
        counts, seed=seed, epoch=epoch + 1, shuffle=shuffle, window=window, layout=layout, drop_last=drop_last
    )
    return {name: (*now.get(name, ()), *following.get(name, ())) for name in {*now, *following}}


def node_epoch_sequences(
    counts: Sequence[int] | IntArray,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    window: int,
    layout: Layout,
    drop_last: bool,
) -> dict[str, tuple[int, ...]]:
    """Every reader's units of the whole epoch ``epoch``, by `reader_name` (what follows a cold epoch)."""
    order = epoch_order(counts, seed=seed, epoch=epoch, shuffle=shuffle, window=window)
    return _node_epoch(counts, remaining_sequence(order, (), window), window, layout, drop_last)


def _node_epoch(
    counts: Sequence[int] | IntArray, sequence: IntArray, window: int, layout: Layout, drop_last: bool
) -> dict[str, tuple[int, ...]]:
    found: dict[str, tuple[int, ...]] = {}
    for rank in range(layout.world_size):
        for worker in range(layout.num_workers):
            reader = Layout(layout.world_size, rank, layout.num_workers, worker, layout.chunk)
            ids, _ = _reader_ids(sequence, window=window, layout=reader, drop_last=drop_last)
            unit_of = _units_of(ids, counts)
            _, first = np.unique(unit_of, return_index=True)
            found[reader_name(reader)] = tuple(unit_of[np.sort(first)].tolist())
    return found


def auto_window(total: int, units: int) -> int:
    """Default shuffle window: two shards' worth of samples, within [256, 16384]."""
    per_unit = total / max(1, units)
    return int(min(16384, max(256, round(2 * per_unit))))


def initial_prefetch(total: int, units: int, window: int, concurrency: int) -> int:
    """Units to stage ahead at first.

    Everything the next shuffle window will touch while this one is read, and at
    least enough to keep every transfer slot of the stager busy.
    """
    per_unit = max(1.0, total / max(1, units))
    return min(64, max(int(-(-window // per_unit)) + 2, concurrency))
