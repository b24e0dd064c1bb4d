"""An epoch's global order as a function of position, dealt to ranks, and what a resumed layout left.

Pure arithmetic (numpy, no I/O, no torch), and nothing here holds an array with one entry per
sample of the dataset:

- **`WindowedOrder`**: the shards are shuffled by ``(seed, epoch)`` and their samples laid end
  to end; the samples inside each window of ``window`` consecutive positions are permuted by a
  keyed bijection (`order.permute`) seeded by ``(seed, epoch, window index)``. Position ``p``'s sample
  is computed when asked for, from per-shard arrays only.
- **`Deal`**: ranks read blocks of ``window`` positions round robin (rank ``r`` reads blocks
  ``r, r+R, ...``); the last partial round is dealt one position at a time; a short rank repeats
  its first positions (``drop_last=False``) or a long one drops its last (``drop_last=True``).
  Workers take chunks of their rank's stream round robin. All of it is a closed form per
  position.
- **`RemainingOrder`**: what an earlier layout (a `Cursor`) did not consume, in order. What a
  layout consumed is a common prefix of every rank's stream plus a band as wide as the workers'
  spread; so the remainder is a short explicit list followed by a contiguous tail of the order
  it came from, at a cost of ranks x (window + band), not of samples.
- **`ArrayOrder`**: an order given as an array (what a cold epoch left). A mix of sources is an
  `Order` of its own, computed per position too (`order.mixed.MixedOrder`).

Every order also says, conservatively, which shards a range of its positions may read
(`units_of_ranges`): the node's future, prefetch and closing work from that, per window.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from datacache.loaders.order.layout import Cursor, consumed_spots, worker_ends
from datacache.loaders.order.permute import mix_key, permute_windows

__all__ = [
    "ArrayOrder",
    "Deal",
    "Order",
    "RemainingOrder",
    "WindowedOrder",
    "dedupe_ranges",
    "epoch_order",
    "exclusive_sum",
    "read_only",
    "remaining",
    "unit_starts",
]

IntArray = npt.NDArray[np.int64]
_EMPTY = np.zeros(0, dtype=np.int64)
_ORDER_TAG = 0x44435348  # "DCSH": the shard permutation's stream


def exclusive_sum(counts: Sequence[int] | IntArray) -> IntArray:
    """``[0, c0, c0+c1, ...]`` with one more entry than ``counts``: where each one starts, and the total."""
    sums = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(np.asarray(counts, dtype=np.int64), out=sums[1:])
    return sums


_SHARED_STARTS: dict[int, tuple[weakref.ref[IntArray], IntArray]] = {}
_SHARED_LOCK = threading.Lock()


def unit_starts(counts: IntArray) -> IntArray:
    """`exclusive_sum` of ``counts``, read-only, and made once per read-only ``counts`` array.

    A reader's plan, its epoch's order and the next epoch's (the node's future) each need the
    counts' running sum: 8 MB a copy at 1e6 shards. A read-only array cannot change under the
    shared sum (its writer would have to unfreeze it), so one sum serves every holder while the
    array lives; a writable one gets a fresh sum each time.
    """
    if counts.flags.writeable:
        return _read_only(exclusive_sum(counts))
    with _SHARED_LOCK:
        held = _SHARED_STARTS.get(id(counts))
        if held is not None and held[0]() is counts:
            return held[1]
    sums = _read_only(exclusive_sum(counts))
    key = id(counts)
    ref = weakref.ref(counts, functools.partial(_forget, key))
    with _SHARED_LOCK:
        _SHARED_STARTS[key] = (ref, sums)
    return sums


def _forget(key: int, ref: weakref.ref[IntArray]) -> None:
    """Drop the sum of a ``counts`` array that died (``ref``'s), not a newer one's under its reused id.

    No lock: a weakref's callback runs wherever the collector runs, inside `unit_starts`'s own ``with
    _SHARED_LOCK`` too, and took the lock its own thread held (a test process hung there for 20 minutes).
    The dictionary's single operations are atomic; a newer entry dropped by a race costs one sum again.
    """
    held = _SHARED_STARTS.get(key)
    if held is not None and held[0] is ref:
        _SHARED_STARTS.pop(key, None)


def read_only(values: Sequence[int] | IntArray) -> IntArray:
    """``values`` as an int64 array no one writes through (a view when already one): `unit_starts` shares its sum."""
    array = np.asarray(values, dtype=np.int64)
    if not array.flags.writeable:
        return array
    return _read_only(array.view())


def _read_only(array: IntArray) -> IntArray:
    array.flags.writeable = False
    return array


def _shard_permutation(seed: int, epoch: int, shards: int) -> npt.NDArray[Any]:
    """``Generator.permutation(shards)``'s values (it shuffles an arange), held as int32 where they fit: 4 MB at 1e6."""
    rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, epoch, _ORDER_TAG])
    perm: npt.NDArray[Any] = np.arange(shards, dtype=np.int32 if shards < 2**31 else np.int64)
    rng.shuffle(perm)
    return perm


class Order(Protocol):
    """A sequence of sample ids (numbered shard by shard in manifest order), computed per position."""

    @property
    def total(self) -> int: ...

    def ids(self, positions: IntArray) -> IntArray:
        """The sample id at each of ``positions``."""
        ...

    def units_of_ranges(self, starts: IntArray, stops: IntArray) -> tuple[IntArray, IntArray]:
        """``(range index, unit)`` pairs, grouped by range in order: every unit positions ``[start, stop)`` may read.

        A superset is allowed (a unit whose window overlaps the range); units of no samples never appear.
        """
        ...


def dedupe_ranges(which: IntArray, units: IntArray) -> tuple[IntArray, IntArray]:
    """``(which, units)`` without a repeated pair, first occurrences kept in order."""
    if not len(units):
        return which, units
    key = which * (int(units.max()) + 1) + units
    _, first = np.unique(key, return_index=True)
    first.sort()
    return which[first], units[first]


def _expand(lo: IntArray, hi: IntArray) -> tuple[IntArray, IntArray]:
    """For each ``i``, the integers ``lo[i] .. hi[i]`` (inclusive): ``(i repeated, integer)``."""
    lengths = np.maximum(hi - lo + 1, 0)
    which = np.repeat(np.arange(len(lo), dtype=np.int64), lengths)
    offsets = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(exclusive_sum(lengths)[:-1], lengths)
    return which, lo[which] + offsets


@dataclass(frozen=True)
class WindowedOrder:
    """Shards shuffled, then samples permuted within windows (see the module's docstring)."""

    counts: IntArray
    seed: int
    epoch: int
    shuffle: bool
    window: int

    def __post_init__(self) -> None:
        counts = np.asarray(self.counts, dtype=np.int64)
        object.__setattr__(self, "counts", counts)
        perm: npt.NDArray[Any]
        if self.shuffle:
            perm = _shard_permutation(self.seed, self.epoch, len(counts))
            laid = exclusive_sum(counts[perm])
        else:
            perm = np.arange(len(counts), dtype=np.int32 if len(counts) < 2**31 else np.int64)
            laid = unit_starts(counts)
        object.__setattr__(self, "_perm", perm)
        object.__setattr__(self, "_starts", unit_starts(counts))
        object.__setattr__(self, "_laid", laid)

    @property
    def total(self) -> int:
        return int(self._starts[-1])  # type: ignore[attr-defined]

    @property
    def _permuted(self) -> bool:
        return self.shuffle and self.window > 1

    def ids(self, positions: IntArray) -> IntArray:
        positions = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            return positions.copy()
        unit, local = self.places(positions)
        starts: IntArray = self._starts  # type: ignore[attr-defined]
        result: IntArray = starts[unit] + local
        return result

    def places(self, positions: IntArray) -> tuple[IntArray, IntArray]:
        """``(unit, index in unit)`` of the sample at each of ``positions``: what `ids` numbers, before numbering.

        A reader's plan wants these, not ids: from the shuffled layout they come with one search over
        the units' places; from ids, a second search over the units' starts, ~15% of batch mode's time.
        """
        positions = np.asarray(positions, dtype=np.int64)
        starts: IntArray = self._starts  # type: ignore[attr-defined]
        if not self.shuffle:
            unit = np.searchsorted(starts, positions, side="right") - 1
            return unit, positions - starts[unit]
        laid: IntArray = self._laid  # type: ignore[attr-defined]
        perm: IntArray = self._perm  # type: ignore[attr-defined]
        pre = positions
        if self._permuted:
            window = positions // self.window
            base = window * self.window
            size = np.minimum(self.window, self.total - base)
            pre = base + permute_windows(positions - base, window, size, self._key)
        if len(pre):
            # A reader's run of positions lies mostly inside one unit (a window of a large file): two
            # searches for its ends, not one for each position.
            low, high = np.searchsorted(laid, [pre.min(), pre.max()], side="right") - 1
            if low == high:
                return np.full(len(pre), perm[low], dtype=np.int64), pre - laid[low]
        slot = np.searchsorted(laid, pre, side="right") - 1
        return perm[slot].astype(np.int64, copy=False), pre - laid[slot]

    def _key(self, window: IntArray) -> npt.NDArray[np.uint64]:
        return mix_key(self.seed, self.epoch, window)

    def units_of_ranges(self, starts: IntArray, stops: IntArray) -> tuple[IntArray, IntArray]:
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        keep = stops > starts
        if self._permuted:
            starts = starts // self.window * self.window
            stops = np.minimum(self.total, -(-stops // self.window) * self.window)
        laid: IntArray = self._laid  # type: ignore[attr-defined]
        perm: IntArray = self._perm  # type: ignore[attr-defined]
        lo = np.searchsorted(laid, starts, side="right") - 1
        hi = np.searchsorted(laid, stops - 1, side="right") - 1
        hi = np.where(keep, hi, lo - 1)
        which, slots = _expand(lo, hi)
        units = perm[slots].astype(np.int64)
        nonempty = self.counts[units] > 0
        return which[nonempty], units[nonempty]


@dataclass(frozen=True)
class ArrayOrder:
    """An order given as an array of sample ids (what a cold epoch left)."""

    order: IntArray
    counts: IntArray

    @property
    def total(self) -> int:
        return len(self.order)

    def ids(self, positions: IntArray) -> IntArray:
        result: IntArray = self.order[np.asarray(positions, dtype=np.int64)]
        return result

    def units_of_ranges(self, starts: IntArray, stops: IntArray) -> tuple[IntArray, IntArray]:
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        which, positions = _expand(starts, stops - 1)
        units = np.searchsorted(unit_starts(self.counts), self.order[positions], side="right") - 1
        return dedupe_ranges(which, units.astype(np.int64))


@dataclass(frozen=True)
class RemainingOrder:
    """``base`` less a consumed part: positions ``explicit`` of it, then ``tail..base.total`` in order."""

    base: Order
    explicit: IntArray
    tail: int

    @property
    def total(self) -> int:
        return len(self.explicit) + self.base.total - self.tail

    def _base_positions(self, positions: IntArray) -> IntArray:
        positions = np.asarray(positions, dtype=np.int64)
        head = len(self.explicit)
        inside = positions < head
        picked = self.explicit[np.where(inside, positions, 0)] if head else np.zeros_like(positions)
        result: IntArray = np.where(inside, picked, self.tail + positions - head)
        return result

    def ids(self, positions: IntArray) -> IntArray:
        return self.base.ids(self._base_positions(positions))

    def units_of_ranges(self, starts: IntArray, stops: IntArray) -> tuple[IntArray, IntArray]:
        starts, stops = np.asarray(starts, dtype=np.int64), np.asarray(stops, dtype=np.int64)
        head = len(self.explicit)
        parts_which: list[IntArray] = []
        parts_units: list[IntArray] = []
        parts_phase: list[IntArray] = []
        inside = np.nonzero(starts < np.minimum(stops, head))[0]
        for index in inside.tolist():
            stop = min(int(stops[index]), head)
            spots = self.explicit[int(starts[index]) : stop]
            # One range per explicit position: exact, and the explicit part is short by construction.
            _, units = self.base.units_of_ranges(spots, spots + 1)
            parts_which.append(np.full(len(units), index, dtype=np.int64))
            parts_units.append(units)
            parts_phase.append(np.zeros(len(units), dtype=np.int64))
        later = stops > head
        if later.any():
            ranges = np.nonzero(later)[0].astype(np.int64)
            begin = self.tail + np.maximum(starts[ranges], head) - head
            end = self.tail + stops[ranges] - head
            which, units = self.base.units_of_ranges(begin, end)
            parts_which.append(ranges[which])
            parts_units.append(units)
            parts_phase.append(np.ones(len(units), dtype=np.int64))
        if not parts_units:
            return _EMPTY, _EMPTY
        which, units, phase = (np.concatenate(p) for p in (parts_which, parts_units, parts_phase))
        ordering = np.lexsort((phase, which))
        return dedupe_ranges(which[ordering], units[ordering])


@dataclass(frozen=True)
class Deal:
    """Positions ``[0, total)`` dealt to ``world`` ranks in blocks of ``block`` (see the module's docstring)."""

    total: int
    world: int
    block: int

    @property
    def rounds(self) -> int:
        """Full rounds (every rank one block)."""
        return self.total // (self.world * self.block)

    @property
    def head(self) -> int:
        return self.rounds * self.world * self.block

    def natural(self, rank: int) -> int:
        """Positions rank ``rank`` reads before lengths are made equal."""
        tail = max(0, -(-(self.total - self.head - rank) // self.world))
        return self.rounds * self.block + tail

    def length(self, *, drop_last: bool) -> int:
        """Every rank's length once made equal."""
        return self.total // self.world if drop_last else -(-self.total // self.world)

    def positions(self, rank: int, spots: IntArray) -> IntArray:
        """The positions of the order that spots ``spots`` of rank ``rank``'s equalised stream read."""
        spots = np.asarray(spots, dtype=np.int64)
        natural = self.natural(rank)
        if len(spots) and int(spots.max()) >= natural:
            # Repeats: np.resize of the rank's own positions (or of the first ones, for a rank with none).
            extra = spots - natural
            if natural:
                spots = np.where(spots >= natural, extra % natural, spots)
            else:
                return extra % max(1, min(self.total, self.length(drop_last=False)))
        full = self.rounds * self.block
        if self.world == 1:
            return spots  # one rank reads every block in order (its head is ``full``): the identity
        blocks = rank + self.world * (spots // self.block)
        result: IntArray = np.where(
            spots < full, blocks * self.block + spots % self.block, self.head + rank + self.world * (spots - full)
        )
        return result

    def pieces(self, rank: int, length: int) -> tuple[IntArray, IntArray, IntArray, IntArray]:
        """The rank's stream up to ``length`` as pieces: ``(spot start, spot stop, position start, position stop)``.

        One piece per block; the last partial round is one piece covering its positions
        conservatively; repeats are one piece per repeated position.
        """
        full = min(self.rounds * self.block, length)
        count = -(-full // self.block)
        spot_start = np.arange(count, dtype=np.int64) * self.block
        spot_stop: IntArray = np.minimum(spot_start + self.block, full).astype(np.int64)
        position_start = (rank + self.world * np.arange(count, dtype=np.int64)) * self.block
        position_stop: IntArray = position_start + (spot_stop - spot_start)
        pieces: list[tuple[IntArray, ...]] = [(spot_start, spot_stop, position_start, position_stop)]
        natural = self.natural(rank)
        stop = min(natural, length)
        if stop > full:
            one = np.asarray([full]), np.asarray([stop])
            pieces.append((*one, np.asarray([self.head]), np.asarray([self.total])))
        if length > natural:
            spots = np.arange(max(natural, full), length, dtype=np.int64)
            where = self.positions(rank, spots)
            pieces.append((spots, spots + 1, where, where + 1))
        joined = [np.concatenate([piece[i] for piece in pieces]).astype(np.int64) for i in range(4)]
        return joined[0], joined[1], joined[2], joined[3]


def epoch_order(counts: Sequence[int] | IntArray, *, seed: int, epoch: int, shuffle: bool, window: int) -> IntArray:
    """Every sample id of ``counts`` in `WindowedOrder`'s order, as one array: O(samples), for small orders."""
    order = WindowedOrder(np.asarray(counts, dtype=np.int64), seed, epoch, shuffle, window)
    return order.ids(np.arange(order.total, dtype=np.int64))


def remaining(order: Order, cursor: Cursor, block: int) -> RemainingOrder:
    """What ``cursor``'s layout did not consume of ``order`` dealt in blocks of ``block``, in order.

    A rank's consumed spots are every spot below the smallest worker's end, and some of those
    below the largest's: the same on every rank. So the consumed positions are a prefix of whole
    rounds plus, per rank, a span of about a block and the workers' spread, listed explicitly.
    """
    deal = Deal(order.total, cursor.world_size, block)
    ends = worker_ends(cursor)
    low, high = int(ends.min()), int(ends.max())
    full_blocks = min(low, deal.rounds * block) // block
    prefix = full_blocks * deal.world * block
    consumed: list[IntArray] = []
    for rank in range(deal.world):
        natural = deal.natural(rank)
        spots = np.arange(full_blocks * block, min(high, natural), dtype=np.int64)
        if not len(spots):
            continue
        taken = spots[consumed_spots(cursor, spots)]
        consumed.append(deal.positions(rank, taken))
    gone = np.unique(np.concatenate(consumed)) if consumed else _EMPTY
    tail = int(gone[-1]) + 1 if len(gone) else prefix
    tail = max(tail, prefix)
    explicit = np.setdiff1d(np.arange(prefix, tail, dtype=np.int64), gone, assume_unique=True)
    return RemainingOrder(order, explicit, tail)
