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

__all__ = ["EpochPlan", "ReadPlan", "auto_window", "initial_prefetch", "plan_epoch"]

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
    total = len(sequence)
    own = rank_positions(total, layout.world_size, layout.rank, window)
    natural = len(own)
    positions, _ = equalize(own, total, layout.world_size, drop_last=drop_last)
    padded = np.arange(len(positions)) >= natural
    indexes = np.arange(len(positions), dtype=np.int64)
    mine = worker_positions(indexes, layout.num_workers, layout.worker, layout.chunk)
    ids = sequence[positions[mine]]
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    # Units with no samples share a start with the next one; searchsorted picks the last of them.
    unit_of = np.searchsorted(starts, ids, side="right") - 1
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
        padded=int(padded[mine].sum()),
        first_use=first_use,
        last_use=last_use,
        unit_sequence=tuple(sorted(first_use, key=first_use.__getitem__)),
    )


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
