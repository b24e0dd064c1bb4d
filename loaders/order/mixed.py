"""A mixed epoch's order as a function of position: O(shards + sources), never O(samples).

Pure arithmetic (numpy, no I/O, no torch). A `MixedOrder` is an `order.windows.Order`, so the
dealing, equal rank lengths, resume onto another layout and the node's future of one dataset's
epoch (`plans.positions.plan_epoch`, `plans.indexed.IndexedPositions`) work on a mix unchanged.

**Which source a position reads** (`Interleave`): the epoch's ``E`` positions are cut into
``N`` blocks (about `BLOCK` positions each). Source ``s`` gives ``c_s = N*q_s + r_s`` samples;
the first ``b`` blocks hold exactly

    ``C_s(b) = b*q_s + (b*r_s + o_s) // N``

of them (``o_s`` in ``[0, N)`` drawn from ``(seed, epoch)``), so ``C_s(N) = c_s``: every source's
count in the epoch is exact, and any run of positions holds its share within a block's worth.
Position ``p``'s block is found by bisection near ``p*N/E`` (``|sum_s C_s(b) - b*E/N| <
sources``); inside a block, source ``s``'s ``k`` samples sit at the points ``(i + v_s) / k`` in
order (``v_s`` in ``[0, 1)``), so each block is spread evenly too. Cost: O(sources) per position.

**Which sample** (`SourceDraw`): without replacement, source ``s`` reads its own
`order.windows.WindowedOrder` permutations, one pass each (pass ``k`` seeded by ``(source seed, k)``).
While ``c_s <= n_s`` a pass lasts ``m = ceil(n_s / c_s)`` epochs: epoch ``e`` is epoch
``j = e % m`` of pass ``e // m`` and takes its items ``[j*c_s, (j+1)*c_s)``, the last epoch of a
pass topping up from the pass's start (items read epochs before, so none twice in the epoch). A
pass never straddles an epoch: a fresh permutation that began inside one would hand it, at
random, samples it had just read (issue 34: 59 repeats in one epoch). So no sample repeats within
an epoch and consecutive epochs cover the source before any repeats; ``m*c_s - n_s`` samples of
each pass are read twice in it, a different random set each pass. A source smaller than its
share (``c_s > n_s``) walks the endless stream of passes instead, epoch ``e`` taking items
``[e*c_s, (e+1)*c_s)``: it cycles, and no sample repeats before all of it was read. With
replacement, the draws are spread
over the chunks of this epoch's permutation by the same exact rule (chunk ``k`` of ``K``, each
a window of the permutation), and draw ``j`` is a uniform, keyed pick inside its chunk: each
sample is as likely as any other, samples repeat, and reads stay a few shards at a time.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from datacache.loaders.order.mixcounts import source_seed
from datacache.loaders.order.permute import mix_key
from datacache.loaders.order.windows import WindowedOrder, dedupe_ranges, exclusive_sum

__all__ = ["BLOCK", "Interleave", "MixedOrder", "SourceDraw", "Spread"]

IntArray = npt.NDArray[np.int64]
BLOCK = 64
"""Positions per interleave block: any run of positions holds each source's share within about one."""
_MAX_PARTS = 1 << 30  # keeps b * r_s < 2**60: exact in int64
_EMPTY = np.zeros(0, dtype=np.int64)
_SPREAD_TAG = 0x4D495853  # "MIXS"
_DRAW_TAG = 0x4D495844  # "MIXD"
_KEEP_CYCLES = 8
_RANGES_AT_ONCE = 1 << 15


def _rng(seed: int, epoch: int, tag: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, epoch, tag])


def _bisect(count: Callable[[IntArray], IntArray], targets: IntArray, lo: IntArray, hi: IntArray) -> IntArray:
    """The largest ``b`` in ``[lo, hi]`` with ``count(b) <= target`` (``count`` non-decreasing, true at ``lo``)."""
    lo, hi = lo.copy(), hi.copy()
    while True:
        if not np.any(lo < hi):
            return lo
        mid = (lo + hi + 1) // 2
        ok = count(mid) <= targets
        lo = np.where(ok, mid, lo)
        hi = np.where(ok, hi, mid - 1)


@dataclass(frozen=True)
class Spread:
    """``counts[s]`` items over ``parts`` parts: the first ``b`` hold ``b*q_s + (b*r_s + offsets[s]) // parts``."""

    counts: IntArray
    parts: int
    offsets: IntArray

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def before(self, parts: IntArray) -> IntArray:
        """``(len(parts), sources)``: each source's items in the parts before each of ``parts``."""
        b = np.asarray(parts, dtype=np.int64)[:, None]
        q, r = self.counts // self.parts, self.counts % self.parts
        result: IntArray = b * q + (b * r + self.offsets) // self.parts
        return result

    def near(self, items: IntArray) -> tuple[IntArray, IntArray]:
        """Parts at or before, and at or after, the part holding each of ``items``: a few apart, no search."""
        sources, total = len(self.counts), self.total
        if total == 0:  # an empty mix: nothing to locate, every range is the first part
            zero = np.zeros(len(items), dtype=np.int64)
            return zero, zero
        # |items before part b - b*total/parts| < sources: the part is within a few of the proportion.
        scale = self.parts / total
        lo = np.clip(np.floor((items - sources) * scale).astype(np.int64) - 2, 0, self.parts - 1)
        hi = np.clip(np.ceil((items + sources) * scale).astype(np.int64) + 2, 0, self.parts - 1)
        return lo, hi

    def part_of(self, items: IntArray) -> IntArray:
        """The part holding each of ``items`` (numbered across sources, part by part)."""
        items = np.asarray(items, dtype=np.int64)
        if not len(items):
            return _EMPTY
        lo, hi = self.near(items)
        return _bisect(lambda b: self.before(b).sum(axis=1), items, lo, hi)


def _spread(counts: IntArray, parts: int, seed: int, epoch: int, tag: int) -> Spread:
    offsets = _rng(seed, epoch, tag).integers(0, parts, len(counts), dtype=np.int64)
    return Spread(counts, parts, offsets)


@dataclass(frozen=True)
class Interleave:
    """Which source each position of a mixed epoch reads (see the module's docstring)."""

    counts: IntArray
    seed: int
    epoch: int
    spread: Spread = field(init=False)
    phases: npt.NDArray[np.float64] = field(init=False)

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.int64)
        object.__setattr__(self, "counts", counts)
        parts = int(min(_MAX_PARTS, max(1, -(-int(counts.sum()) // BLOCK))))
        object.__setattr__(self, "spread", _spread(counts, parts, self.seed, self.epoch, _SPREAD_TAG))
        object.__setattr__(self, "phases", _rng(self.seed, self.epoch, _SPREAD_TAG + 1).random(len(counts)))

    def locate(self, positions: IntArray) -> tuple[IntArray, IntArray]:
        """``(source, index in the source's share)`` of each of ``positions``."""
        positions = np.asarray(positions, dtype=np.int64)
        if not len(positions):
            return _EMPTY, _EMPTY
        sources = len(self.counts)
        blocks, inverse = np.unique(self.spread.part_of(positions), return_inverse=True)
        before = self.spread.before(blocks)
        sizes = (self.spread.before(blocks + 1) - before).ravel()  # block-major, then source
        entry = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
        nth = np.arange(len(entry), dtype=np.int64) - exclusive_sum(sizes)[:-1][entry]
        source = entry % sources
        points = (nth + self.phases[source]) / sizes[entry]
        ranked = np.lexsort((source, points, entry // sources))
        block_starts = exclusive_sum(sizes.reshape(len(blocks), sources).sum(axis=1))
        offset = positions - before.sum(axis=1)[inverse]
        picked = ranked[block_starts[inverse] + offset]
        return source[picked], before[inverse, source[picked]] + nth[picked]

    def index_ranges(self, starts: IntArray, stops: IntArray) -> tuple[IntArray, IntArray]:
        """``(lo, hi)``, each ``(ranges, sources)``: indexes of each source ``[start, stop)`` may read.

        A superset by a few blocks each side (`Spread.near`, no search): what a range may read, for the
        node's future and for when a unit is first and last used, at the cost of a few arithmetic passes.
        """
        first, _ = self.spread.near(np.asarray(starts, dtype=np.int64))
        _, last = self.spread.near(np.asarray(stops, dtype=np.int64) - 1)
        return self.spread.before(first), self.spread.before(last + 1)


@dataclass(frozen=True)
class SourceDraw:
    """The ``count`` samples one source gives epoch ``epoch`` of a mix, by index (see the module's docstring)."""

    unit_counts: IntArray
    seed: int
    """The source's own (`order.mixcounts.source_seed`)."""
    epoch: int
    count: int
    shuffle: bool
    window: int
    replacement: bool
    _orders: dict[int, WindowedOrder] = field(default_factory=dict, init=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit_counts", np.asarray(self.unit_counts, dtype=np.int64))

    @property
    def size(self) -> int:
        return int(self.unit_counts.sum())

    def _order(self, cycle: int) -> WindowedOrder:
        with self._lock:
            found = self._orders.get(cycle)
            if found is None:
                if len(self._orders) >= _KEEP_CYCLES:
                    self._orders.clear()
                found = WindowedOrder(self.unit_counts, self.seed, cycle, self.shuffle, self.window)
                self._orders[cycle] = found
            return found

    @functools.cached_property
    def _pass(self) -> tuple[int, int] | None:
        """Without replacement and ``count <= size``: this epoch's pass and its first item in it; else None."""
        if self.replacement or not 0 < self.count <= self.size:
            return None
        epochs = -(-self.size // self.count)
        return self.epoch // epochs, self.epoch % epochs * self.count

    @functools.cached_property
    def _chunks(self) -> tuple[int, Spread]:
        """With replacement: the chunk width, and the draws spread over the chunks of the permutation."""
        width = max(1, self.window, -(-self.size // _MAX_PARTS))
        parts = max(1, -(-self.size // width))
        return width, _spread(np.asarray([self.count], dtype=np.int64), parts, self.seed, self.epoch, _DRAW_TAG)

    def ids(self, indexes: IntArray) -> IntArray:
        """The sample id (numbered in the source, unit by unit) of each draw of ``indexes``."""
        indexes = np.asarray(indexes, dtype=np.int64)
        result = np.empty(len(indexes), dtype=np.int64)
        if not len(indexes):
            return result
        size = self.size
        if self.replacement:
            width, spread = self._chunks
            chunk = spread.part_of(indexes)
            room = np.minimum(width, size - chunk * width)
            pick = (mix_key(self.seed, self.epoch, _DRAW_TAG, indexes) % room.astype(np.uint64)).astype(np.int64)
            return self._order(self.epoch).ids(chunk * width + pick)
        if self._pass is not None:
            cycle, start = self._pass
            at = start + indexes
            return self._order(cycle).ids(np.where(at >= size, at - size, at))
        stream = self.epoch * self.count + indexes
        cycles, at = stream // size, stream % size
        for cycle in np.unique(cycles).tolist():
            mine = cycles == cycle
            result[mine] = self._order(cycle).ids(at[mine])
        return result

    def units_of_ranges(self, starts: IntArray, stops: IntArray) -> tuple[IntArray, IntArray]:
        """``(range, unit)`` pairs as `order.windows.Order.units_of_ranges` says them, for draws ``[start, stop)``."""
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        size, ranges = self.size, np.arange(len(starts), dtype=np.int64)
        if self.replacement:
            width, spread = self._chunks
            begin = spread.part_of(starts) * width
            end = np.minimum(size, (spread.part_of(stops - 1) + 1) * width)
            return self._order(self.epoch).units_of_ranges(begin, end)
        if self._pass is not None:
            return self._pass_units(starts, stops)
        first, last = self.epoch * self.count + starts, self.epoch * self.count + stops
        lo, hi = first // size, (last - 1) // size
        # Each range: the rest of its first cycle, one whole cycle for any in between, the start of its last.
        zero, whole, after = np.zeros_like(lo), np.full_like(lo, size), lo + 1
        pieces = [
            (ranges, lo, first - lo * size, np.minimum(last, after * size) - lo * size, 0),
            (ranges, after, zero, whole, 1),
            (ranges, hi, zero, last - hi * size, 2),
        ]
        keep = [np.ones(len(lo), dtype=bool), hi - lo >= 2, hi > lo]
        found: list[tuple[IntArray, IntArray, IntArray]] = []
        for (which, cycle, begin, end, phase), wanted in zip(pieces, keep, strict=True):
            for number in np.unique(cycle[wanted]).tolist():
                mine = wanted & (cycle == number)
                index, units = self._order(number).units_of_ranges(begin[mine], end[mine])
                found.append((which[mine][index], units, np.full(len(units), phase, dtype=np.int64)))
        if len(found) == 1:
            return found[0][0], found[0][1]  # every range in one cycle: grouped and distinct already
        return _grouped(found)

    def _pass_units(self, starts: IntArray, stops: IntArray) -> tuple[IntArray, IntArray]:
        """`units_of_ranges` within this epoch's pass: each range to the pass's end, then its top-up from its start."""
        if self._pass is None:
            raise TypeError("only an epoch read within one pass has a pass's units")
        cycle, start = self._pass
        size, order = self.size, self._order(cycle)
        first, last = start + starts, start + stops
        ranges = np.arange(len(starts), dtype=np.int64)
        found: list[tuple[IntArray, IntArray, IntArray]] = []
        for phase, (begin, end) in enumerate(
            [(first, np.minimum(last, size)), (np.maximum(first - size, 0), last - size)]
        ):
            wanted = np.nonzero(end > begin)[0]
            index, units = order.units_of_ranges(begin[wanted], end[wanted])
            found.append((ranges[wanted][index], units, np.full(len(units), phase, dtype=np.int64)))
        return _grouped(found)


def _grouped(found: list[tuple[IntArray, IntArray, IntArray]]) -> tuple[IntArray, IntArray]:
    """``(range, unit)`` pairs from ``(range, unit, phase)`` parts: by range, then phase, first occurrences kept."""
    if not found:
        return _EMPTY, _EMPTY
    which, units, phase = (np.concatenate([part[i] for part in found]) for i in range(3))
    ordering = np.lexsort((phase, which))
    return dedupe_ranges(which[ordering], units[ordering])


@dataclass(frozen=True)
class MixedOrder:
    """A mixed epoch's order: flat sample ids (source ``s``'s offset by the sizes before it), per position."""

    interleave: Interleave
    draws: tuple[SourceDraw, ...]

    @classmethod
    def of(
        cls,
        unit_counts: Sequence[IntArray],
        counts: Sequence[int] | IntArray,
        *,
        seed: int,
        epoch: int,
        shuffle: bool,
        windows: Sequence[int],
        replacement: bool,
    ) -> MixedOrder:
        """Epoch ``epoch`` of sources of ``unit_counts`` giving ``counts`` samples each."""
        counts = np.asarray(counts, dtype=np.int64)
        draws = tuple(
            SourceDraw(units, source_seed(seed, s), epoch, int(counts[s]), shuffle, windows[s], replacement)
            for s, units in enumerate(unit_counts)
        )
        return cls(Interleave(counts, seed, epoch), draws)

    @property
    def total(self) -> int:
        return self.interleave.spread.total

    @functools.cached_property
    def _offsets(self) -> tuple[IntArray, IntArray]:
        """Each source's first flat sample id and first flat unit."""
        samples = exclusive_sum([draw.size for draw in self.draws])
        units = exclusive_sum([len(draw.unit_counts) for draw in self.draws])
        return samples, units

    def sources(self, positions: IntArray) -> IntArray:
        """The source each of ``positions`` reads."""
        return self.interleave.locate(positions)[0]

    def ids(self, positions: IntArray) -> IntArray:
        source, index = self.interleave.locate(np.asarray(positions, dtype=np.int64))
        samples, _ = self._offsets
        result = np.empty(len(source), dtype=np.int64)
        for s, draw in enumerate(self.draws):
            mine = source == s
            if mine.any():
                result[mine] = draw.ids(index[mine]) + samples[s]
        return result

    def units_of_ranges(self, starts: IntArray, stops: IntArray) -> tuple[IntArray, IntArray]:
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        if len(starts) <= _RANGES_AT_ONCE:
            return self._units_of_ranges(starts, stops)
        # A whole epoch's pieces (the node's future): a batch at a time, so temporaries stay small.
        found: list[tuple[IntArray, IntArray, IntArray]] = []
        for begin in range(0, len(starts), _RANGES_AT_ONCE):
            end = begin + _RANGES_AT_ONCE
            which, units = self._units_of_ranges(starts[begin:end], stops[begin:end])
            found.append((which + begin, units, np.zeros(len(units), dtype=np.int64)))
        which, units, _ = (np.concatenate([part[i] for part in found]) for i in range(3))
        return which, units

    def _units_of_ranges(self, starts: IntArray, stops: IntArray) -> tuple[IntArray, IntArray]:
        kept = np.nonzero(stops > starts)[0].astype(np.int64)
        lo, hi = self.interleave.index_ranges(starts[kept], stops[kept])
        _, unit_offsets = self._offsets
        found: list[tuple[IntArray, IntArray]] = []
        for s, draw in enumerate(self.draws):
            some = np.nonzero(hi[:, s] > lo[:, s])[0]
            if len(some):
                which, units = draw.units_of_ranges(lo[some, s], hi[some, s])
                found.append((kept[some][which], units + unit_offsets[s]))
        if not found:
            return _EMPTY, _EMPTY
        # Sources' units are distinct: grouping by range (sources in order within one) is all that is left.
        which, units = (np.concatenate([part[i] for part in found]) for i in range(2))
        ordering = np.argsort(which, kind="stable")
        return which[ordering], units[ordering]
