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
  (`order.produced_from_consumed`) holds.
- **Resume** (on any world size) waits for the complete index, computes from
  the cursor exactly which samples the old layout consumed, and deals the
  rest as an indexed epoch would (`cold_remaining`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from datacache.loaders.order import Cursor, Layout, worker_positions

__all__ = [
    "WINDOW_UNITS",
    "Settlement",
    "cold_remaining",
    "final_stream",
    "lower_bound_length",
    "natural_stream",
    "node_cold_sequences",
    "rank_units",
    "settle",
    "window_ids",
    "window_order",
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
) -> dict[str, tuple[int, ...]]:
    """Every reader's shards in a cold epoch (all ranks, all workers of ``layout``'s job), by reader name.

    A rank's workers take chunks of its stream, which walks its shards two at a time:
    each of them reads the rank's shards in the rank's order. Every reader computes the
    same value, as for an indexed epoch (`epoch.node_unit_sequences`); the samples a rank
    takes from another's shards once the lengths are settled are left out (a few at the end).
    """
    found: dict[str, tuple[int, ...]] = {}
    for rank in range(layout.world_size):
        mine = tuple(
            rank_units(units, seed=seed, epoch=epoch, shuffle=shuffle, world_size=layout.world_size, rank=rank).tolist()
        )
        for worker in range(layout.num_workers):
            found[f"{rank}.{worker}"] = mine
    return found


def window_order(
    counts: Sequence[int] | IntArray, *, seed: int, epoch: int, rank: int, index: int, shuffle: bool
) -> IntArray:
    """The order of one window's samples, as indexes into its units' samples laid end to end."""
    total = int(np.sum(counts)) if len(counts) else 0
    if not shuffle or total < 2:
        return np.arange(total, dtype=np.int64)
    order: IntArray = _rng(seed, epoch, rank, index, len(counts)).permutation(total).astype(np.int64)
    return order


def window_ids(
    units: Sequence[int] | IntArray,
    counts: Sequence[int] | IntArray,
    starts: Sequence[int] | IntArray,
    *,
    seed: int,
    epoch: int,
    rank: int,
    index: int,
    shuffle: bool,
) -> IntArray:
    """Sample ids of one window: the samples of ``units`` (with their ``counts`` and first ids), shuffled."""
    pieces = [np.arange(int(s), int(s) + int(c), dtype=np.int64) for s, c in zip(starts, counts)]
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    order = window_order(counts, seed=seed, epoch=epoch, rank=rank, index=index, shuffle=shuffle)
    result: IntArray = ids[order]
    return result


def natural_stream(counts: IntArray, *, seed: int, epoch: int, shuffle: bool, world_size: int, rank: int) -> IntArray:
    """A rank's whole natural stream (every count known): its windows, one after another."""
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    units = rank_units(len(counts), seed=seed, epoch=epoch, shuffle=shuffle, world_size=world_size, rank=rank)
    windows = [
        window_ids(
            units[i : i + WINDOW_UNITS],
            counts[units[i : i + WINDOW_UNITS]],
            starts[units[i : i + WINDOW_UNITS]],
            seed=seed,
            epoch=epoch,
            rank=rank,
            index=i // WINDOW_UNITS,
            shuffle=shuffle,
        )
        for i in range(0, len(units), WINDOW_UNITS)
    ]
    return np.concatenate(windows) if windows else np.zeros(0, dtype=np.int64)


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
    """A rank's settled stream (every count known), and how many of its positions are repeats."""
    naturals = [
        natural_stream(counts, seed=seed, epoch=epoch, shuffle=shuffle, world_size=world_size, rank=r)
        for r in range(world_size)
    ]
    settled = settle([len(s) for s in naturals], drop_last=drop_last)
    own = naturals[rank][: settled.keep[rank]]
    parts = [own, *(naturals[donor][start:stop] for donor, start, stop in settled.receive[rank])]
    stream = np.concatenate(parts)
    repeats = settled.repeats[rank]
    if repeats:
        source = stream if len(stream) else np.concatenate(naturals)
        stream = np.concatenate((stream, np.resize(source, repeats)))
    return stream.astype(np.int64), repeats


def cold_remaining(
    counts: IntArray, cursor: Cursor, *, seed: int, epoch: int, shuffle: bool, drop_last: bool
) -> IntArray:
    """What a cold epoch read by ``cursor``'s layout left: every sample it did not consume, in its ranks' order."""
    consumed = np.zeros(int(counts.sum()), dtype=np.bool_)
    left: list[IntArray] = []
    for rank in range(cursor.world_size):
        stream, _ = final_stream(
            counts,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            world_size=cursor.world_size,
            rank=rank,
            drop_last=drop_last,
        )
        taken = np.zeros(len(stream), dtype=np.bool_)
        indexes = np.arange(len(stream), dtype=np.int64)
        for worker in range(cursor.num_workers):
            mine = worker_positions(indexes, cursor.num_workers, worker, cursor.chunk)
            taken[mine[: cursor.produced[worker]]] = True
        consumed[stream[taken]] = True
        left.append(stream[~taken])
    # Each sample once, in the order the old ranks would have read it (a repeat of a consumed
    # sample, or a second copy, is dropped: the new layout pads by its own rule).
    merged = np.concatenate(left) if left else np.zeros(0, dtype=np.int64)
    _, first = np.unique(merged, return_index=True)
    merged = merged[np.sort(first)]
    result: IntArray = merged[~consumed[merged]]
    return result
