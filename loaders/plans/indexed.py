"""One reader's share of an indexed epoch, computed a segment at a time: O(shards), never O(samples).

The reader's position ``i`` is a spot of its rank's stream (`order.windows.worker_spots`), which is
a position of the epoch's order (`order.windows.Deal`), whose sample is computed by the order
(`order.windows.Order.ids`), and whose unit and index within it come from per-unit starts. Positions
are computed in segments of `SEGMENT` when first asked for, and a few segments are kept.

What prefetch, opening ahead and closing need is said per *piece* (the reader's part of one
block of its rank's stream), conservatively: a unit is first used at the first piece that may
read it, and closed after the last such piece (`releases_after`); in an epoch of at most
`EXACT_POSITIONS` samples, at its exact first and last read.

`plan_epoch` makes a reader's `IndexedPositions` (`epoch_sequence`: the epoch's global order), and
`node_unit_sequences` every reader's units on the node (the future the stager evicts by).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from datacache.loaders.order.layout import Cursor, Dealing, Layout, reader_name, worker_count, worker_spots
from datacache.loaders.order.windows import (
    ArrayOrder,
    Deal,
    Order,
    WindowedOrder,
    dedupe_ranges,
    remaining,
    unit_starts,
)

__all__ = [
    "SEGMENT",
    "IndexedPositions",
    "Segmented",
    "epoch_sequence",
    "node_epoch_sequences",
    "node_unit_sequences",
    "plan_epoch",
    "rank_unit_sequence",
]

IntArray = npt.NDArray[np.int64]
SEGMENT = 1 << 15
"""Reader positions computed together (and kept, a few segments at a time)."""
_KEEP = 4
EXACT_POSITIONS = 1 << 14
"""An epoch of at most this many samples plans each unit's exact first and last read for every
reader (every position computed: ~0.07 s for 2**14 on this loaded machine, the node's future twice that);
a larger one's are per piece (O(shards)). Per piece, every unit of a
shuffle window is first used at the window's start and held to its end, and every reader of the
node has the same unit order: the node's readers held a whole window each at once, and a local
tier half the dataset kept a share of 0.5 at best (the eviction sweep's optimum fell from 0.82)."""
_NONE = np.zeros(0, dtype=np.int64)


class _UnitMap(Mapping[int, int]):
    """unit -> position, as an array (-1: absent): a dict of a million units would cost ~100 MB."""

    def __init__(self, values: IntArray) -> None:
        self._values = values

    @property
    def array(self) -> IntArray:
        return self._values

    def __getitem__(self, unit: int) -> int:
        if not 0 <= unit < len(self._values) or self._values[unit] < 0:
            raise KeyError(unit)
        return int(self._values[unit])

    def __iter__(self) -> Iterator[int]:
        return iter(np.nonzero(self._values >= 0)[0].tolist())

    def __len__(self) -> int:
        return int((self._values >= 0).sum())


class _Column:
    """``plans.counts.unit_of`` or ``plans.counts.local``: indexable by position, computed a segment at a time."""

    def __init__(self, plan: Segmented, which: int) -> None:
        self._plan = plan
        self._which = which

    def __len__(self) -> int:
        return len(self._plan)

    def __getitem__(self, position: int | slice) -> Any:
        if isinstance(position, slice):
            start, stop, step = position.indices(len(self._plan))
            return self._plan.columns(np.arange(start, stop, step, dtype=np.int64))[self._which]
        segment, at = divmod(int(position), SEGMENT)
        return int(self._plan.segment(segment, at)[self._which][at])


class Segmented:
    """A reader's plan whose positions are computed when asked for, `SEGMENT` at a time, a few kept.

    Subclasses say how many positions there are and compute ``(unit, index in unit)`` for some.
    """

    def __init__(self) -> None:
        self._segments: OrderedDict[int, tuple[IntArray, IntArray]] = OrderedDict()
        self._segment_lock = threading.Lock()
        self._last: tuple[int, tuple[IntArray, IntArray]] = (-1, (_NONE, _NONE))
        self.unit_of = _Column(self, 0)
        self.local = _Column(self, 1)

    def __len__(self) -> int:
        raise NotImplementedError

    def columns(self, positions: IntArray) -> tuple[IntArray, IntArray]:
        """``(unit, index in unit)`` of each of this reader's ``positions``."""
        raise NotImplementedError

    def segment(self, index: int, at: int = 0) -> tuple[IntArray, IntArray]:
        """Positions ``index * SEGMENT`` on, as far as laid out, holding at least offset ``at``."""
        last = self._last  # one attribute read: threads share it without the lock
        if last[0] == index and at < len(last[1][0]):
            return last[1]
        with self._segment_lock:
            found = self._segments.get(index)
            if found is not None and at < len(found[0]):
                self._segments.move_to_end(index)
                self._last = (index, found)
                return found
        start = index * SEGMENT
        # A growing plan (a cold epoch's) lays out more of its last segment later: kept as far as it
        # goes, computed again only when a position past it is asked for.
        computed = self.columns(np.arange(start, min(start + SEGMENT, len(self)), dtype=np.int64))
        with self._segment_lock:
            self._segments[index] = computed
            self._last = (index, computed)
            while len(self._segments) > _KEEP:
                self._segments.popitem(last=False)
        return computed

    def span(self, begin: int, stop: int) -> tuple[IntArray, IntArray]:
        """``(unit, index in unit)`` of positions ``[begin, stop)``, sliced from the kept segments."""
        units: list[IntArray] = []
        local: list[IntArray] = []
        position = begin
        while position < stop:
            index, at = divmod(position, SEGMENT)
            unit_of, offsets = self.segment(index, at)
            end = min(len(unit_of), stop - index * SEGMENT)
            units.append(unit_of[at:end])
            local.append(offsets[at:end])
            position = index * SEGMENT + end
        if len(units) == 1:
            return units[0], local[0]
        return (np.concatenate(units), np.concatenate(local)) if units else (_NONE, _NONE)


def rank_unit_sequence(order: Order, deal: Deal, rank: int, length: int) -> IntArray:
    """The units rank ``rank``'s stream may read, in the order it first may (what the node's future says).

    An array, read-only (every worker of the rank shares it): as a tuple of Python ints, the node's
    future of 1e6 units cost ~36 bytes a unit, twice over (this epoch and the next).
    """
    _, _, start, stop = deal.pieces(rank, length)
    _, units = order.units_of_ranges(start, stop)
    _, units = dedupe_ranges(np.zeros_like(units), units)
    return _frozen(units)


def _frozen(units: IntArray) -> IntArray:
    units = np.ascontiguousarray(units, dtype=np.int64)
    units.flags.writeable = False
    return units


class IndexedPositions(Segmented):
    """What one reader reads of ``order`` (see the module's docstring); the `Positions` interface."""

    def __init__(self, order: Order, counts: IntArray, *, block: int, layout: Layout, drop_last: bool) -> None:
        self._order = order
        self._bounds = unit_starts(np.asarray(counts, dtype=np.int64))
        # An order over these very units says where a position is without numbering it first (`columns`).
        self._same_units = isinstance(order, WindowedOrder) and np.array_equal(order.counts, counts)
        self._layout = layout
        self._deal = Deal(order.total, layout.world_size, block)
        rank_length = self._deal.length(drop_last=drop_last)
        self._rank_length = rank_length
        self._length = int(worker_count(layout, rank_length))
        natural = min(self._deal.natural(layout.rank), rank_length)
        self.padded = self._length - int(worker_count(layout, natural))
        self._last_release = (0, 0)  # (position, at.searchsorted(position)) asked last: `_release_span`
        super().__init__()

    @functools.cached_property
    def _units(self) -> tuple[_UnitMap, _UnitMap, tuple[int, ...], IntArray, IntArray]:
        """First use, release point and order of every unit this reader may read: exact if few positions."""
        if self._order.total <= EXACT_POSITIONS:
            return self._exact_units()
        return self._piece_units()

    def _exact_units(self) -> tuple[_UnitMap, _UnitMap, tuple[int, ...], IntArray, IntArray]:
        """Each unit's first and last read among this reader's positions, computed for every position."""
        units = len(self._bounds) - 1
        first_use = np.full(units, -1, dtype=np.int64)
        release = np.full(units, -1, dtype=np.int64)
        for start in range(0, self._length, SEGMENT):
            unit = self.columns(np.arange(start, min(start + SEGMENT, self._length), dtype=np.int64))[0]
            seen, at = np.unique(unit, return_index=True)
            new = first_use[seen] < 0
            first_use[seen[new]] = start + at[new]
            seen, at = np.unique(unit[::-1], return_index=True)
            release[seen] = start + len(unit) - 1 - at
        used = np.nonzero(first_use >= 0)[0]
        sequence = tuple(used[np.argsort(first_use[used], kind="stable")].tolist())
        by_position = np.argsort(release[used], kind="stable")
        return _UnitMap(first_use), _UnitMap(release), sequence, used[by_position], release[used][by_position]

    def _piece_units(self) -> tuple[_UnitMap, _UnitMap, tuple[int, ...], IntArray, IntArray]:
        """First use, release point and order of every unit this reader may read, per piece."""
        units = len(self._bounds) - 1
        spot_start, spot_stop, start, stop = self._deal.pieces(self._layout.rank, self._rank_length)
        first = worker_count(self._layout, spot_start)
        last = worker_count(self._layout, spot_stop) - 1
        mine = last >= first
        which, unit = self._order.units_of_ranges(start[mine], stop[mine])
        first, last = first[mine][which], last[mine][which]
        first_use = np.full(units, -1, dtype=np.int64)
        release = np.full(units, -1, dtype=np.int64)
        # Pieces are in stream order: a unit's first use is its first piece's start, its release its last's end.
        seen, at = np.unique(unit, return_index=True)
        first_use[seen] = first[at]
        seen, at = np.unique(unit[::-1], return_index=True)
        release[seen] = last[::-1][at]
        _, ordered = dedupe_ranges(np.zeros_like(unit), unit)
        closing = np.nonzero(release >= 0)[0]
        by_position = np.argsort(release[closing], kind="stable")
        sequence = tuple(ordered.tolist())
        return _UnitMap(first_use), _UnitMap(release), sequence, closing[by_position], release[closing][by_position]

    @property
    def first_use(self) -> Mapping[int, int]:
        return self._units[0]

    @property
    def last_use(self) -> Mapping[int, int]:
        return self._units[1]

    @property
    def unit_sequence(self) -> tuple[int, ...]:
        return self._units[2]

    def __len__(self) -> int:
        return self._length

    @property
    def bounds(self) -> IntArray:
        """Each unit's first sample id, and the total: ``unit_of`` and ``local`` make ids with it."""
        return self._bounds

    def columns(self, positions: IntArray) -> tuple[IntArray, IntArray]:
        """``(unit, index in unit)`` of each of this reader's ``positions``."""
        spots = worker_spots(self._layout, positions)
        dealt = self._deal.positions(self._layout.rank, spots)
        if isinstance(self._order, WindowedOrder) and self._same_units:
            return self._order.places(dealt)
        ids = self._order.ids(dealt)
        unit = np.searchsorted(self._bounds, ids, side="right") - 1
        return unit, ids - self._bounds[unit]

    def releases_after(self, position: int) -> tuple[int, ...]:
        """Units no position after ``position`` reads: closed once it is read."""
        return self._releases.get(position, ())

    def releases_between(self, begin: int, stop: int) -> tuple[int, ...]:
        """`releases_after` of every position in ``[begin, stop)``, in position order (a batch's, in one search)."""
        _, _, _, units, at = self._units
        low, high = self._release_span(at, begin), self._release_span(at, stop)
        return tuple(units[low:high].tolist()) if high > low else ()

    def _release_span(self, at: IntArray, position: int) -> int:
        """``at.searchsorted(position)``, from the last answer when batches come in order (a comparison or
        two, ~0.3 us, where ``np.searchsorted`` cost ~6: 8% of batch mode's time holding the GIL)."""
        last_position, index = self._last_release  # one tuple: threads read a pair that belongs together
        if position >= last_position:
            for _ in range(4):
                if index >= len(at) or at[index] >= position:
                    self._last_release = (position, index)
                    return index
                index += 1
        index = int(at.searchsorted(position))
        self._last_release = (position, index)
        return index

    @functools.cached_property
    def _releases(self) -> dict[int, tuple[int, ...]]:
        """Release position -> the units closed there: one entry per unit (asked once per sample, a
        dict lookup, not two binary searches through numpy: ~12% of a cold epoch's batch building)."""
        _, _, _, units, at = self._units
        releases: dict[int, list[int]] = {}
        for unit, position in zip(units.tolist(), at.tolist(), strict=True):
            releases.setdefault(position, []).append(unit)
        return {position: tuple(closed) for position, closed in releases.items()}

    def units_from(self, produced: int) -> tuple[int, ...]:
        """`unit_sequence` less the units no position from ``produced`` on reads."""
        if not produced:
            return self.unit_sequence
        release = self._units[1].array
        return tuple(u for u in self.unit_sequence if release[u] >= produced)


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
) -> dict[str, IntArray]:
    """Every reader's units in order (all ranks, all workers of ``layout``'s job), by `reader_name`.

    This epoch's remaining units, then the next epoch's, so that eviction near the end of
    an epoch keeps what the next one reads first. Every reader computes the same value.
    ``order`` replaces this epoch's global order, as in `plan_epoch`. A rank's workers share
    its sequence (each reads a part of every block of its rank): O(shards), not O(samples).
    """
    seed, shuffle, drop_last = dealing.seed, dealing.shuffle, dealing.drop_last
    now = epoch_sequence(counts, seed=seed, epoch=epoch, shuffle=shuffle, window=window, cursors=cursors, order=order)
    following = epoch_sequence(counts, seed=seed, epoch=epoch + 1, shuffle=shuffle, window=window)
    return _node_epochs((now, following), window, layout, drop_last, counts)


def node_epoch_sequences(
    counts: Sequence[int] | IntArray,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    window: int,
    layout: Layout,
    drop_last: bool,
) -> dict[str, IntArray]:
    """Every reader's units of the whole epoch ``epoch``, by `reader_name` (what follows a cold epoch)."""
    sequence = epoch_sequence(counts, seed=seed, epoch=epoch, shuffle=shuffle, window=window)
    return _node_epochs((sequence,), window, layout, drop_last, counts)


def _node_epochs(
    sequences: tuple[Order, ...], window: int, layout: Layout, drop_last: bool, counts: Sequence[int] | IntArray
) -> dict[str, IntArray]:
    """Each rank's units of ``sequences`` one after another, joined a rank at a time (one array per rank
    alive at once, not every rank's of each epoch and then their joins), shared by the rank's workers."""
    sizes = np.asarray(counts, dtype=np.int64)
    found: dict[str, IntArray] = {}
    for rank in range(layout.world_size):
        parts = [_rank_epoch(sequence, window, layout, rank, drop_last, sizes) for sequence in sequences]
        units = _frozen(parts[0] if len(parts) == 1 else np.concatenate(parts))
        for worker in range(layout.num_workers):
            found[reader_name(rank, worker)] = units
    return found


def _rank_epoch(sequence: Order, window: int, layout: Layout, rank: int, drop_last: bool, sizes: IntArray) -> IntArray:
    if sequence.total <= EXACT_POSITIONS:
        # The rank's order of first reads, exact as its readers' plans are (`EXACT_POSITIONS`), so
        # eviction's steps follow what is read; its workers share it, as they share its stream.
        stream = Layout(layout.world_size, rank, 1, 0, layout.chunk)
        exact = IndexedPositions(sequence, sizes, block=window, layout=stream, drop_last=drop_last).unit_sequence
        return np.asarray(exact, dtype=np.int64)
    deal = Deal(sequence.total, layout.world_size, window)
    return rank_unit_sequence(sequence, deal, rank, deal.length(drop_last=drop_last))
