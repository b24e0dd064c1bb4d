"""One reader's plan for an epoch: which samples it yields, in what order, from which units.

Pure arithmetic on plain values (numpy, no I/O, no torch): the global order
and the dealing come from `datacache.loaders.order.windows`, a reader's share of
them from `datacache.loaders.plans.indexed`, computed a segment at a time; this
module picks the order of an epoch (resumed after earlier layouts) and says
every reader's units in order for the node's future. Nothing here costs more
than the shards do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt
from datacache.loaders.order.layout import Cursor, Dealing, Layout, reader_name
from datacache.loaders.order.windows import ArrayOrder, Deal, Order, WindowedOrder, remaining
from datacache.loaders.plans.counts import save_plan
from datacache.loaders.plans.indexed import EXACT_POSITIONS, IndexedPositions, rank_unit_sequence

if TYPE_CHECKING:
    from datacache.loaders.runtime import Runtime

__all__ = [
    "PositionTable",
    "Positions",
    "auto_window",
    "epoch_sequence",
    "node_epoch_sequences",
    "node_unit_sequences",
    "plan_epoch",
]

IntArray = npt.NDArray[np.int64]


class Column(Protocol):
    """A value per position of a reader's plan (an array, or one computed a segment at a time)."""

    def __getitem__(self, position: int, /) -> Any: ...

    def __len__(self) -> int: ...


class Positions(Protocol):
    """What readers need of a plan: a `IndexedPositions`, an `PositionTable`, or a cold epoch's plan that grows."""

    @property
    def unit_of(self) -> Column: ...

    @property
    def local(self) -> Column: ...

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

    def releases_after(self, position: int) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class PositionTable:
    """A reader's plan as whole arrays, position by position: a mix's (its readers split them by source)."""

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

    def releases_after(self, position: int) -> tuple[int, ...]:
        unit = int(self.unit_of[position])
        return (unit,) if self.last_use.get(unit) == position else ()

    def units_from(self, produced: int) -> tuple[int, ...]:
        """`unit_sequence` less the units no position from ``produced`` on reads."""
        if not produced:
            return self.unit_sequence
        upcoming = set(self.unit_of[produced:].tolist())
        return tuple(u for u in self.unit_sequence if u in upcoming)

    @classmethod
    def of(cls, plan: IndexedPositions) -> PositionTable:
        """``plan`` computed whole (O(the reader's samples))."""
        unit_of, local = plan.columns(np.arange(len(plan), dtype=np.int64))
        last_use: dict[int, int] = {}
        first_use: dict[int, int] = {}
        for position, unit in enumerate(unit_of.tolist()):
            last_use[unit] = position
            first_use.setdefault(unit, position)
        return cls(
            ids=plan.bounds[unit_of] + local,
            unit_of=unit_of,
            local=local,
            padded=plan.padded,
            first_use=first_use,
            last_use=last_use,
            unit_sequence=tuple(sorted(first_use, key=first_use.__getitem__)),
        )


def epoch_sequence(
    counts: Sequence[int] | IntArray,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    window: int,
    cursors: tuple[Cursor, ...] = (),
    order: IntArray | Order | None = None,
) -> Order:
    """Epoch ``epoch``'s order less what ``cursors`` consumed (``order`` replaces the epoch's own)."""
    sizes = np.asarray(counts, dtype=np.int64)
    sequence: Order
    if order is None:
        sequence = WindowedOrder(sizes, seed, epoch, shuffle, window)
    elif isinstance(order, np.ndarray):
        sequence = ArrayOrder(np.asarray(order, dtype=np.int64), sizes)
    else:
        sequence = order
    for cursor in cursors:
        sequence = remaining(sequence, cursor, window)
    return sequence


def plan_epoch(
    counts: Sequence[int] | IntArray,
    *,
    dealing: Dealing,
    epoch: int,
    window: int,
    cursors: tuple[Cursor, ...],
    layout: Layout,
    order: IntArray | Order | None = None,
) -> IndexedPositions:
    """The reader ``layout``'s plan of epoch ``epoch``, less what ``cursors`` say was consumed.

    ``order`` replaces the epoch's global order (what a cold epoch left, see `order.cold.cold_remaining`).
    """
    seed, shuffle = dealing.seed, dealing.shuffle
    sequence = epoch_sequence(
        counts, seed=seed, epoch=epoch, shuffle=shuffle, window=window, cursors=cursors, order=order
    )
    counts = np.asarray(counts, dtype=np.int64)
    return IndexedPositions(sequence, counts, block=window, layout=layout, drop_last=dealing.drop_last)


def node_unit_sequences(
    counts: Sequence[int] | IntArray,
    *,
    dealing: Dealing,
    epoch: int,
    window: int,
    cursors: tuple[Cursor, ...],
    layout: Layout,
    order: IntArray | Order | None = None,
) -> dict[str, tuple[int, ...]]:
    """Every reader's units in order (all ranks, all workers of ``layout``'s job), by `reader_name`.

    This epoch's remaining units, then the next epoch's, so that eviction near the end of
    an epoch keeps what the next one reads first. Every reader computes the same value.
    ``order`` replaces this epoch's global order, as in `plan_epoch`. A rank's workers share
    its sequence (each reads a part of every block of its rank): O(shards), not O(samples).
    """
    seed, shuffle, drop_last = dealing.seed, dealing.shuffle, dealing.drop_last
    now = _node_epoch(
        epoch_sequence(counts, seed=seed, epoch=epoch, shuffle=shuffle, window=window, cursors=cursors, order=order),
        window,
        layout,
        drop_last,
        counts,
    )
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
    sequence = epoch_sequence(counts, seed=seed, epoch=epoch, shuffle=shuffle, window=window)
    return _node_epoch(sequence, window, layout, drop_last, counts)


def _node_epoch(
    sequence: Order, window: int, layout: Layout, drop_last: bool, counts: Sequence[int] | IntArray
) -> dict[str, tuple[int, ...]]:
    found: dict[str, tuple[int, ...]] = {}
    if sequence.total <= EXACT_POSITIONS:
        # Each rank's order of first reads, exact as its readers' plans are (`EXACT_POSITIONS`), so
        # eviction's steps follow what is read; its workers share it, as they share its stream.
        sizes = np.asarray(counts, dtype=np.int64)
        for rank in range(layout.world_size):
            stream = Layout(layout.world_size, rank, 1, 0, layout.chunk)
            units = IndexedPositions(sequence, sizes, block=window, layout=stream, drop_last=drop_last).unit_sequence
            for worker in range(layout.num_workers):
                found[reader_name(rank, worker)] = units
        return found
    deal = Deal(sequence.total, layout.world_size, window)
    length = deal.length(drop_last=drop_last)
    for rank in range(layout.world_size):
        units = rank_unit_sequence(sequence, deal, rank, length)
        for worker in range(layout.num_workers):
            found[reader_name(rank, worker)] = units
    return found


def auto_window(total: int, units: int) -> int:
    """Default shuffle window: two shards' worth of samples, within [256, 16384]."""
    per_unit = total / max(1, units)
    return int(min(16384, max(256, round(2 * per_unit))))


def settle_counts(runtime: Runtime, shuffle_buffer: int | None) -> None:
    """Every count known: the complete unit plan (saved for the node) and the default window.

    A dataset's planner and a mix's sources call it (a mix shares its epoch out by the sizes).
    """
    book = runtime.book
    plan = runtime.units
    if book is not None:
        plan = book.completed_plan()
        runtime.loop.run(save_plan(runtime.settings, runtime.handle, plan))
    runtime.counted(plan, runtime.window or shuffle_buffer or auto_window(plan.total, len(plan.units)))
