"""The first epoch of a dataset whose sample counts are not all known yet: whole shards dealt.

Pure arithmetic (numpy, no I/O). An indexed epoch deals a global sample
order, which needs every shard's count before the first sample. A *cold*
epoch needs only the counts of the shards a reader is about to read:

- **Shards are dealt whole.** The shards are shuffled by ``(seed, epoch)``
  and dealt round robin to the ranks (rank ``r`` gets shards ``r, r+R, ...``
  of that order). A rank's *natural stream* is its shards' samples, window by
  window: each window is `WINDOW_UNITS` consecutive shards of its list, whose
  samples are shuffled together by ``(seed, epoch, rank, window)``. A window
  needs only its own shards' counts, so the first batch waits for two shards.
- **Settling equal lengths.** Ranks' natural streams differ in length. Once
  every count is known (the cluster indexes in the background meanwhile),
  every rank keeps the first ``T`` samples of its stream, ``T = ceil(N / R)``
  (``floor`` with ``drop_last``); the samples past ``T`` on longer ranks are
  handed, in rank order, to the ranks short of ``T``, which read them after
  their own; a rank still short repeats its first samples (fewer than ``R``
  repeats in all, as in an indexed epoch). A reader produces position ``p``
  of its rank's stream before the index is complete only when ``p`` is
  provably below ``T`` (``p < T`` for the smallest ``N`` the known counts
  allow), so nothing is ever produced that settling would take back.
- **Workers** take chunks of the rank's final stream round robin, exactly as
  in an indexed epoch, so batches per rank are equal and resume arithmetic
  (`order.layout.produced_from_consumed`) holds.
- **Resume** (on any world size) waits for the complete index, computes from
  the cursor exactly which samples the old layout consumed, and deals the
  rest as an indexed epoch would (`cold_remaining`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from datacache.loaders.order.layout import Cursor, Layout, consumed_spots, reader_name, worker_ends
from datacache.loaders.order.permute import mix_key, permute
from datacache.loaders.order.windows import dedupe_ranges, exclusive_sum

__all__ = [
    "WINDOW_UNITS",
    "ColdRemainder",
    "Settlement",
    "Streams",
    "cold_remaining",
    "final_stream",
    "lower_bound_length",
    "natural_stream",
    "natural_units",
    "node_cold_sequences",
    "rank_units",
    "settle",
    "window_bounds",
]

IntArray = npt.NDArray[np.int64]
WINDOW_UNITS = 2
"""Shards whose samples one window of a cold epoch shuffles together."""
_TAG = 0x434F4C44  # "COLD": keeps these streams apart from the indexed epochs' ones


def _rng(seed: int, *parts: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, *parts, _TAG])


def rank_units(units: int, *, seed: int, epoch: int, shuffle: bool, world_size: int, rank: int) -> IntArray:
    """The units (shards) rank ``rank`` reads in a cold epoch, in order."""
    order = _rng(seed, epoch).permutation(units).astype(np.int64) if shuffle else np.arange(units, dtype=np.int64)
    mine: IntArray = order[rank::world_size]
    return mine


def node_cold_sequences(
    units: int, *, seed: int, epoch: int, shuffle: bool, layout: Layout
) -> dict[str, IntArray]:
    """Every reader's shards in a cold epoch (all ranks, all workers of ``layout``'s job), by reader name.

    A rank's workers take chunks of its stream, which walks its shards two at a time:
    each of them reads the rank's shards in the rank's order. Every reader computes the
    same value, as for an indexed epoch (`plans.positions.node_unit_sequences`); the samples a rank
    takes from another's shards once the lengths are settled are left out (a few at the end).
    """
    found: dict[str, IntArray] = {}
    for rank in range(layout.world_size):
        mine = np.asarray(
            rank_units(units, seed=seed, epoch=epoch, shuffle=shuffle, world_size=layout.world_size, rank=rank),
            dtype=np.int64,
        )
        mine.flags.writeable = False  # the rank's workers share it
        for worker in range(layout.num_workers):
            found[reader_name(rank, worker)] = mine
    return found


def window_bounds(counts: IntArray, units: IntArray) -> IntArray:
    """Where each window of a rank's natural stream starts (and the stream's length, last): its units' counts known."""
    per = np.asarray(counts, dtype=np.int64)[units]
    padded = np.zeros(-(-len(per) // WINDOW_UNITS) * WINDOW_UNITS, dtype=np.int64)
    padded[: len(per)] = per
    return exclusive_sum(padded.reshape(-1, WINDOW_UNITS).sum(axis=1))


def natural_units(
    counts: IntArray,
    units: IntArray,
    bounds: IntArray,
    spots: IntArray,
    *,
    seed: int,
    epoch: int,
    rank: int,
    shuffle: bool,
) -> tuple[IntArray, IntArray]:
    """``(unit, index in unit)`` at ``spots`` of rank ``rank``'s natural stream (its ``units``, windows ``bounds``).

    A window's samples (its units' samples laid end to end) are permuted by a keyed bijection of
    ``(seed, epoch, rank, window)``: nothing is stored per sample.
    """
    spots = np.asarray(spots, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    window = np.searchsorted(bounds, spots, side="right") - 1
    offset = spots - bounds[window]
    if shuffle and len(spots):
        size = bounds[window + 1] - bounds[window]
        offset = permute(offset, size, mix_key(seed, epoch, rank, window, _TAG))
    unit = np.full(len(spots), -1, dtype=np.int64)
    local = offset.copy()
    for slot in range(WINDOW_UNITS):
        index = window * WINDOW_UNITS + slot
        present = index < len(units)
        here = units[np.where(present, index, 0)] if len(units) else np.zeros(len(spots), dtype=np.int64)
        size = np.where(present, counts[here], 0)
        open_ = unit < 0
        found = open_ & (local < size)
        unit = np.where(found, here, unit)
        local = np.where(open_ & ~found, local - size, local)
    return unit, local


class Streams:
    """Every rank's natural and settled stream of a cold epoch, computed per spot (every count known).

    O(shards) to build; a spot's sample costs a few integer operations.
    """

    def __init__(
        self, counts: IntArray, *, seed: int, epoch: int, shuffle: bool, world_size: int, drop_last: bool
    ) -> None:
        self.counts = np.asarray(counts, dtype=np.int64)
        self.seed, self.epoch, self.shuffle = seed, epoch, shuffle
        self.units = [
            rank_units(len(counts), seed=seed, epoch=epoch, shuffle=shuffle, world_size=world_size, rank=r)
            for r in range(world_size)
        ]
        self.bounds = [window_bounds(self.counts, units) for units in self.units]
        self.naturals = np.asarray([int(b[-1]) for b in self.bounds], dtype=np.int64)
        self.settled = settle(self.naturals.tolist(), drop_last=drop_last)
        self._received = [
            (
                np.asarray([d for d, _, _ in got], dtype=np.int64),
                np.asarray([a for _, a, _ in got], dtype=np.int64),
                exclusive_sum([b - a for _, a, b in got]),
            )
            for got in self.settled.receive
        ]

    @property
    def length(self) -> int:
        return self.settled.length

    def own(self, rank: int) -> int:
        """Spots of rank ``rank``'s settled stream that are not repeats."""
        return self.settled.keep[rank] + int(self._received[rank][2][-1])

    def natural(self, rank: int, spots: IntArray) -> tuple[IntArray, IntArray]:
        return natural_units(
            self.counts,
            self.units[rank],
            self.bounds[rank],
            spots,
            seed=self.seed,
            epoch=self.epoch,
            rank=rank,
            shuffle=self.shuffle,
        )

    def sources(self, rank: int, spots: IntArray) -> tuple[IntArray, IntArray]:
        """``(rank, natural spot)`` that spots ``spots`` of rank ``rank``'s settled stream read."""
        spots = np.asarray(spots, dtype=np.int64)
        keep = self.settled.keep[rank]
        donors, firsts, sums = self._received[rank]
        own = self.own(rank)
        if not own:
            # No stream of its own to repeat: the first samples of every natural stream, in rank order.
            everything = exclusive_sum(self.naturals)
            spot = spots % max(1, int(everything[-1]))
            source = np.searchsorted(everything, spot, side="right") - 1
            return source, spot - everything[source]
        spots = np.where(spots >= own, (spots - own) % own, spots)
        if not len(donors):
            return np.full(len(spots), rank, dtype=np.int64), spots
        received = spots >= keep
        index = np.clip(np.searchsorted(sums, spots - keep, side="right") - 1, 0, len(donors) - 1)
        source = np.where(received, donors[index], rank)
        natural = np.where(received, firsts[index] + spots - keep - sums[index], spots)
        return source, natural

    def settled_units(self, rank: int, spots: IntArray) -> tuple[IntArray, IntArray]:
        """``(unit, index in unit)`` at ``spots`` of rank ``rank``'s settled stream."""
        source, natural = self.sources(rank, spots)
        unit = np.zeros(len(natural), dtype=np.int64)
        local = np.zeros(len(natural), dtype=np.int64)
        for donor in np.unique(source).tolist():
            mine = source == donor
            unit[mine], local[mine] = self.natural(int(donor), natural[mine])
        return unit, local

    def ids(self, rank: int, spots: IntArray) -> IntArray:
        unit, local = self.settled_units(rank, spots)
        result: IntArray = exclusive_sum(self.counts)[unit] + local
        return result

    def holder(self, rank: int, natural: int) -> tuple[int, int]:
        """``(rank, spot)`` of the settled stream that reads rank ``rank``'s natural spot ``natural`` (-1: none)."""
        if natural < self.settled.keep[rank]:
            return rank, natural
        for reader, got in enumerate(self.settled.receive):
            offset = self.settled.keep[reader]
            for donor, start, stop in got:
                if donor == rank and start <= natural < stop:
                    return reader, offset + natural - start
                offset += stop - start
        return -1, -1

    def spot_units(self, rank: int, start: int, stop: int) -> list[int]:
        """The units spots ``[start, stop)`` of rank ``rank``'s settled stream may read, in order."""
        found: list[int] = []
        keep = self.settled.keep[rank]
        for _, _, units in self.window_units(rank, start, min(stop, keep)):
            found.extend(units)
        offset = keep
        for donor, first, last in self.settled.receive[rank]:
            lo, hi = max(start, offset), min(stop, offset + last - first)
            if hi > lo:
                for _, _, units in self.window_units(donor, first + lo - offset, first + hi - offset):
                    found.extend(units)
            offset += last - first
        if stop > offset:
            unit, _ = self.settled_units(rank, np.arange(max(start, offset), stop, dtype=np.int64))
            found.extend(unit.tolist())
        return list(dict.fromkeys(found))

    def window_units(self, rank: int, start: int, stop: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """Pieces ``(spot start, spot stop, units)`` of rank ``rank``'s natural spots ``[start, stop)``."""
        bounds, units = self.bounds[rank], self.units[rank]
        pieces = []
        first = int(np.searchsorted(bounds, start, side="right") - 1)
        for window in range(max(first, 0), len(bounds) - 1):
            lo, hi = max(start, int(bounds[window])), min(stop, int(bounds[window + 1]))
            if lo >= stop:
                break
            if hi > lo:
                mine = units[window * WINDOW_UNITS : (window + 1) * WINDOW_UNITS]
                pieces.append((lo, hi, tuple(u for u in mine.tolist() if self.counts[u] > 0)))
        return pieces


def natural_stream(counts: IntArray, *, seed: int, epoch: int, shuffle: bool, world_size: int, rank: int) -> IntArray:
    """A rank's whole natural stream as sample ids (every count known): O(its samples), for resume and tests."""
    streams = Streams(counts, seed=seed, epoch=epoch, shuffle=shuffle, world_size=world_size, drop_last=True)
    unit, local = streams.natural(rank, np.arange(int(streams.naturals[rank]), dtype=np.int64))
    result: IntArray = exclusive_sum(streams.counts)[unit] + local
    return result


def lower_bound_length(known_total: int, world_size: int) -> int:
    """The smallest settled length ``T`` possible when ``known_total`` samples are known to exist.

    With ``drop_last`` or without, ``T >= floor(N / R) >= floor(known / R)``.
    """
    return known_total // world_size


@dataclass(frozen=True, slots=True)
class Settlement:
    """Equal rank lengths: every rank's length, what each keeps, receives and repeats."""

    length: int
    keep: tuple[int, ...]
    """Samples of its own natural stream each rank keeps."""
    receive: tuple[tuple[tuple[int, int, int], ...], ...]
    """Per rank: (donor rank, start, stop) slices of donors' natural streams it reads after its own."""
    repeats: tuple[int, ...]
    """Per rank: its first samples repeated at the end (``drop_last=False`` only)."""


def settle(lengths: Sequence[int], *, drop_last: bool) -> Settlement:
    """Make the ranks' streams equal (see the module docstring): donors' tails go to short ranks in rank order."""
    world = len(lengths)
    total = sum(lengths)
    length = total // world if drop_last else -(-total // world)
    keep = tuple(min(n, length) for n in lengths)
    excess = [(rank, length, n) for rank, n in enumerate(lengths) if n > length]
    receive: list[tuple[tuple[int, int, int], ...]] = []
    repeats: list[int] = []
    for rank in range(world):
        need = length - keep[rank]
        got: list[tuple[int, int, int]] = []
        while need and excess:
            donor, start, stop = excess[0]
            take = min(need, stop - start)
            got.append((donor, start, start + take))
            need -= take
            if start + take == stop:
                excess.pop(0)
            else:
                excess[0] = (donor, start + take, stop)
        receive.append(tuple(got))
        repeats.append(need)
    return Settlement(length, keep, tuple(receive), tuple(repeats))


def final_stream(
    counts: IntArray, *, seed: int, epoch: int, shuffle: bool, world_size: int, rank: int, drop_last: bool
) -> tuple[IntArray, int]:
    """A rank's settled stream as sample ids (every count known), and how many of its positions are repeats."""
    streams = Streams(counts, seed=seed, epoch=epoch, shuffle=shuffle, world_size=world_size, drop_last=drop_last)
    return streams.ids(rank, np.arange(streams.length, dtype=np.int64)), streams.settled.repeats[rank]


def cold_remaining(
    counts: IntArray, cursor: Cursor, *, seed: int, epoch: int, shuffle: bool, drop_last: bool
) -> ColdRemainder:
    """What a cold epoch read by ``cursor``'s layout left: every sample it did not consume, in its ranks' order.

    Each sample once: a repeat (the settled streams' padding) is left out, and so is a sample a
    consumed repeat already delivered. A layout consumed the same spots of every rank's settled
    stream: all below the slowest worker's end, some below the fastest's; so what is left is, per
    rank, a few spots listed one by one and a tail, at a cost of ranks x the workers' spread.
    """
    streams = Streams(
        counts, seed=seed, epoch=epoch, shuffle=shuffle, world_size=cursor.world_size, drop_last=drop_last
    )
    ends = worker_ends(cursor)
    low, high = min(int(ends.min()), streams.length), min(int(ends.max()), streams.length)
    band = np.arange(low, high, dtype=np.int64)
    taken = band[consumed_spots(cursor, band)]
    left = np.setdiff1d(band, taken, assume_unique=True)
    excluded: dict[int, set[int]] = {}
    for rank in range(cursor.world_size):
        own = streams.own(rank)
        repeats = np.arange(own, min(low, streams.length), dtype=np.int64)
        for spot in np.concatenate((repeats, taken[taken >= own])).tolist():
            source, natural = streams.sources(rank, np.asarray([spot], dtype=np.int64))
            holder, at = streams.holder(int(source[0]), int(natural[0]))
            excluded.setdefault(holder, set()).add(at)
    pieces: list[tuple[int, int, int]] = []
    for rank in range(cursor.world_size):
        own = streams.own(rank)
        gone = excluded.get(rank, set())
        cuts = sorted(s for s in gone if high <= s < own)  # the tail is split around them
        begin = high
        for spot in [s for s in left[left < own].tolist() if s not in gone]:
            _append(pieces, rank, spot, spot + 1)
        for cut in cuts:
            _append(pieces, rank, begin, cut)
            begin = cut + 1
        _append(pieces, rank, begin, own)
    return ColdRemainder(streams, pieces)


def _append(pieces: list[tuple[int, int, int]], rank: int, start: int, stop: int) -> None:
    if stop <= start:
        return
    if pieces and pieces[-1][0] == rank and pieces[-1][2] == start:
        pieces[-1] = (rank, pieces[-1][1], stop)
    else:
        pieces.append((rank, start, stop))


class ColdRemainder:
    """An `Order`: what a cold epoch left, as runs of its ranks' settled streams, in rank order."""

    def __init__(self, streams: Streams, pieces: list[tuple[int, int, int]]) -> None:
        self._streams = streams
        self._rank = np.asarray([p[0] for p in pieces], dtype=np.int64)
        self._start = np.asarray([p[1] for p in pieces], dtype=np.int64)
        self._sums = exclusive_sum([p[2] - p[1] for p in pieces])

    @property
    def total(self) -> int:
        return int(self._sums[-1])

    def _locate(self, positions: IntArray) -> tuple[IntArray, IntArray]:
        piece = np.searchsorted(self._sums, positions, side="right") - 1
        return self._rank[piece], self._start[piece] + positions - self._sums[piece]

    def ids(self, positions: IntArray) -> IntArray:
        ranks, spots = self._locate(np.asarray(positions, dtype=np.int64))
        result = np.zeros(len(spots), dtype=np.int64)
        for rank in np.unique(ranks).tolist():
            mine = ranks == rank
            result[mine] = self._streams.ids(int(rank), spots[mine])
        return result

    def units_of_ranges(self, starts: IntArray, stops: IntArray) -> tuple[IntArray, IntArray]:
        which: list[int] = []
        units: list[int] = []
        for index, (start, stop) in enumerate(zip(np.asarray(starts).tolist(), np.asarray(stops).tolist())):
            if stop <= start:
                continue
            first = int(np.searchsorted(self._sums, start, side="right") - 1)
            last = int(np.searchsorted(self._sums, stop - 1, side="right") - 1)
            for piece in range(first, last + 1):
                base = int(self._sums[piece])
                lo = int(self._start[piece]) + max(start, base) - base
                hi = int(self._start[piece]) + min(stop, int(self._sums[piece + 1])) - base
                for unit in self._streams.spot_units(int(self._rank[piece]), lo, hi):
                    which.append(index)
                    units.append(unit)
        found = np.asarray(which, dtype=np.int64), np.asarray(units, dtype=np.int64)
        return dedupe_ranges(*found)
