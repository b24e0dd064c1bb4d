"""A cold epoch as a reader walks it: the plan grows window by window as shard counts become known.

`CountBook` holds the sample counts this process knows, and counts the rest
of the dataset in the background with the other nodes (`ClusterIndex`),
through the stager: each shard is staged once for the cluster (the shared
tier, else the local one) and counted from that copy, which the readers then
use, so a cold epoch reads the origin once per shard.
`ColdPositions` is the reader's plan of a cold epoch (`order.cold`): it has
the attributes of an `PositionTable`, and `ensure` extends it, one window of its
rank's shards at a time, counting a window's shards by opening them (they
are read next anyway). It never places a position that settling could take
back; when a reader gets there before the index is complete, it waits for
the index, settles, and lays out the rest of the epoch at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
import threading
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
from datacache.loaders.order.cold import (
    WINDOW_UNITS,
    Streams,
    lower_bound_length,
    natural_units,
    rank_units,
)
from datacache.loaders.order.layout import Layout, worker_count, worker_spots
from datacache.loaders.plans.counts import complete, read_plan
from datacache.loaders.plans.indexed import Segmented
from datacache.loaders.shardfiles import UnitPlan

from datacache._sync import LoopThread
from datacache.access import ShardAccess
from datacache.config import Settings
from datacache.counting.cluster import ClusterIndex
from datacache.counting.indexfiles import node_plan_path
from datacache.counting.tarscan import count_tar_bytes, count_tar_file, count_tar_samples
from datacache.errors import (
    ChecksumMismatchError,
    DatacacheError,
    ShardReadError,
    StagerClosedError,
    TierAccessError,
)
from datacache.manifest import Shard
from datacache.staging import PRIORITY_PREFETCH, DatasetHandle

__all__ = ["ColdPositions", "CountBook", "Counts"]

logger = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]


class CountBook:
    """Sample counts known in this process (-1: unknown), completed by a background `ClusterIndex.build`."""

    def __init__(
        self, plan: UnitPlan, handle: DatasetHandle, settings: Settings, loop: LoopThread, access: ShardAccess
    ) -> None:
        self._plan = plan
        self._access = access
        self._handle = handle
        self._settings = settings
        self._loop = loop
        self._unit_of = {unit.keys[0]: i for i, unit in enumerate(plan.units)}
        self.counts = np.array(plan.counts, dtype=np.int64)
        self._lock = threading.Lock()
        self._grew = threading.Condition(self._lock)
        self._build: concurrent.futures.Future[Any] | None = None
        self.unreadable: dict[str, str] = {}

    @property
    def complete(self) -> bool:
        return bool((self.counts >= 0).all())

    def start(self) -> None:
        """Count the rest of the dataset in the background (shared with every other node and process)."""
        with self._lock:
            if self._build is not None or self.complete:
                return
            index = ClusterIndex(self._handle.origin, self._handle.manifest, self._settings)
            index.counter = self._count_staged
            build = self._build = self._loop.submit(index.build(on_count=self.note_key))
        # Outside the lock: a build already done runs its callback here, at once, and it takes the lock.
        build.add_done_callback(self._built)

    def _built(self, _: concurrent.futures.Future[Any]) -> None:
        """Wake readers waiting for counts: the index is done (its result is taken by `wait_complete`)."""
        with self._lock:
            self._grew.notify_all()

    async def _count_staged(self, shard: Shard, where: str) -> int:
        """Count a shard from its staged copy: the origin serves it once, for counting and reading alike.

        Staged on the shared tier when there is one (every node's readers copy it from
        there), else on the local tier. A shard a reader here already counted is not read.
        """
        unit = self._unit_of.get(shard.key)
        if unit is not None and self.counts[unit] >= 0:
            return int(self.counts[unit])
        access = self._access
        try:
            location = None
            if self._settings.shared_dir is not None:
                with contextlib.suppress(TierAccessError):  # a tier this user cannot use is read around
                    location = await access.ensure(self._handle, shard.key, tier="shared", priority=PRIORITY_PREFETCH)
            if location is None:  # counted from its verified bytes, before the fsync, where the access can
                location = await access.ensure(self._handle, shard.key, priority=PRIORITY_PREFETCH, early=True)
            if location.buffer is not None:
                return await asyncio.to_thread(count_tar_bytes, location.buffer, shard, where=where)
            if location.path is not None:
                try:
                    return await asyncio.to_thread(count_tar_file, location.path, shard, where=where)
                except FileNotFoundError:
                    # Evicted between the answer and this read (another reader needed the room on a
                    # small tier): no fault of its bytes, which the origin's stream counts as well.
                    pass
            # The tier declined it (full), or it left: count from the origin's stream.
            return await count_tar_samples(self._handle.origin, shard, where=where)
        except (ChecksumMismatchError, DatacacheError, OSError) as exc:
            # A shard is recorded as uncountable (for every node) only for what its bytes are, never
            # because this process is closing: a run that checkpoints and stops mid-index resumes it.
            if isinstance(exc, ShardReadError | StagerClosedError):
                raise
            raise ShardReadError(f"{where}: {exc}") from None

    def note_key(self, key: str, samples: int) -> None:
        unit = self._unit_of.get(key)
        if unit is not None:
            self.note(unit, samples)

    def note(self, unit: int, samples: int) -> None:
        with self._lock:
            self.counts[unit] = samples
            self._grew.notify_all()

    def adopt_saved(self) -> bool:
        """Take every count from the node's saved unit plan, if one is there whole: the counts another
        process of the node made (a DataLoader's workers, at their cold epoch's end). Whether complete now."""
        if self.complete:
            return True
        path = node_plan_path(self._settings.local_dir, self._handle.manifest)
        try:
            saved = read_plan(path, self._handle.manifest)
        except (OSError, ValueError, TypeError):
            return False
        if saved is None or len(saved.units) != len(self._plan.units) or not complete(saved):
            return False
        with self._lock:
            self.counts[:] = saved.counts
            self._grew.notify_all()
        return True

    def note_unreadable(self, unit: int, why: str) -> None:
        """``unit`` could not be read (``on_error="skip"``): it counts 0, and the plan says why."""
        self.unreadable[self._plan.units[unit].keys[0]] = why
        self.note(unit, 0)

    def wait_for_more(self, than: int, timeout: float = 5.0) -> bool:
        """Wait until more than ``than`` samples are known; False if the background index is not running."""
        self.start()
        build = self._build
        with self._grew:
            if build is None or build.done():
                return False

            # The background index notifies each count, and its end; the timeout only bounds a wait on
            # another node.
            def grown() -> bool:
                return build.done() or int(self.counts[self.counts >= 0].sum()) > than

            self._grew.wait_for(grown, timeout=timeout)
        return True

    def known_total(self) -> int:
        with self._lock:
            known = self.counts[self.counts >= 0]
            return int(known.sum())

    def wait_complete(self) -> IntArray:
        """Every count, waiting for the background index if need be."""
        if not self.complete:
            self.start()
            build = self._build
            if build is not None:
                found, report = build.result()
                for key, count in found.items():
                    self.note_key(key, count.samples)
                for key, reason in report.unreadable.items():
                    self.unreadable.setdefault(key, reason)
                    self.note_key(key, 0)
                for unit in np.nonzero(self.counts < 0)[0].tolist():
                    # Uncountable (a truncated or foreign tar): no sample of it is dealt; on_error decides.
                    key = self._plan.units[unit].keys[0]
                    reason = f"dataset {self._handle.id}: shard {key!r}: its samples could not be counted"
                    self.unreadable[key] = report.unreadable.get(key, reason)
                    self.note(unit, 0)
        return self.counts.copy()

    def completed_plan(self) -> UnitPlan:
        counts = self.wait_complete()
        units = self._plan.with_counts(counts)
        return UnitPlan(units, self._plan.extra, {**self._plan.unreadable, **self.unreadable})


class _FirstUse(dict[int, int]):
    """Units not placed yet are first used 'never' (so nothing opens them ahead)."""

    def __missing__(self, key: int) -> int:
        return sys.maxsize


class Counts(Protocol):
    """What a cold epoch's plan needs of the process's sample counts (`CountBook`; -1: unknown)."""

    counts: IntArray

    @property
    def complete(self) -> bool: ...

    def start(self) -> None:
        """Count the rest in the background (the first window is counted)."""
        ...

    def note(self, unit: int, samples: int) -> None: ...

    def note_unreadable(self, unit: int, why: str) -> None: ...

    def known_total(self) -> int: ...

    def wait_for_more(self, than: int, timeout: float = 5.0) -> bool:
        """Wait until more than ``than`` samples are known; False if nothing counts in the background."""
        ...

    def wait_complete(self) -> IntArray:
        """Every count, waiting for them if need be."""
        ...


class ColdPositions(Segmented):
    """One reader's plan of a cold epoch, extended by `ensure` as counts become known; O(shards).

    Parameters
    ----------
    book
        The process's counts.
    layout, seed, epoch, shuffle, drop_last
        As for an indexed epoch.

    It never opens a shard: where the next window holds a unit whose count is unknown,
    `ensure` stops and `uncounted` names those units; the reader opens them (it reads them
    next anyway) and hands each count back with `counted`. A position's sample is computed
    when asked for (`order.cold.natural_units`, then `order.cold.Streams` once settled).
    """

    def __init__(self, book: Counts, *, layout: Layout, seed: int, epoch: int, shuffle: bool, drop_last: bool) -> None:
        super().__init__()
        self._book = book
        self._wanted: tuple[int, ...] = ()
        """The units of the next window whose counts `ensure` waits for (`uncounted`)."""
        self._layout = layout
        self._seed, self._epoch, self._shuffle, self._drop_last = seed, epoch, shuffle, drop_last
        self._units = rank_units(
            len(book.counts), seed=seed, epoch=epoch, shuffle=shuffle, world_size=layout.world_size, rank=layout.rank
        )
        self._bounds = np.zeros(1, dtype=np.int64)
        """Where each counted window of the rank's natural stream starts, and where the last ends."""
        self._placed = 0
        """Spots of the rank's stream laid out so far (this reader's and its siblings')."""
        self._released = 0
        """Windows whose units' release positions are recorded."""
        self._streams: Streams | None = None
        self.final = False
        self.padded = 0
        self.first_use: dict[int, int] = _FirstUse()
        self.last_use: dict[int, int] = {}
        self._releases: dict[int, list[int]] = {}
        self.unit_sequence: tuple[int, ...] = tuple(int(u) for u in self._units)
        self._lock = threading.Lock()

    def uncounted(self) -> tuple[int, ...]:
        """The units whose sample counts the plan needs before it can lay out more positions."""
        with self._lock:
            return tuple(u for u in self._wanted if self._book.counts[u] < 0)

    def counted(self, unit: int, samples: int, why: str | None = None) -> None:
        """``unit`` holds ``samples`` samples; with ``why``, it could not be read and counts 0."""
        if why is not None:
            self._book.note_unreadable(unit, why)
        elif self._book.counts[unit] < 0:
            self._book.note(unit, samples)

    # -- the Positions interface -------------------------------------------------------------

    def __len__(self) -> int:
        return int(worker_count(self._layout, self._placed))

    def columns(self, positions: IntArray) -> tuple[IntArray, IntArray]:
        spots = worker_spots(self._layout, positions)
        if self._streams is not None:
            return self._streams.settled_units(self._layout.rank, spots)
        return natural_units(
            self._book.counts,
            self._units,
            self._bounds,
            spots,
            seed=self._seed,
            epoch=self._epoch,
            rank=self._layout.rank,
            shuffle=self._shuffle,
        )

    def releases_after(self, position: int) -> tuple[int, ...]:
        # A unit a later position reads again (a repeat that evens rank lengths) is released after that one.
        return tuple(u for u in self._releases.get(position, ()) if self.last_use.get(u, -1) <= position)

    def units_from(self, produced: int) -> tuple[int, ...]:
        self.ensure(produced + 1)
        return tuple(u for u in self.unit_sequence if self.last_use.get(u, sys.maxsize) >= produced)

    # -- growing ----------------------------------------------------------------------------

    def ensure(self, length: int) -> int:
        """Lay out positions until there are ``length`` of them or the epoch's end; return how many there are."""
        with self._lock:
            while len(self) < length and not self.final and self._grow():
                pass
            return len(self)

    def _grow(self) -> bool:
        """Lay out more positions; False if a count of the next window is needed first (`uncounted`)."""
        if self._book.complete:
            self._settle()
            return True
        known = int(self._bounds[-1])
        if self._placed >= known:
            window = len(self._bounds) - 1
            units = self._units[window * WINDOW_UNITS : (window + 1) * WINDOW_UNITS]
            if not len(units):
                self._settle()
                return True
            counts = self._book.counts[units]
            self._wanted = tuple(int(u) for u in units[counts < 0])
            if self._wanted:
                return False
            samples = int(counts.sum())
            self._bounds = np.append(self._bounds, known + samples)
            # The first window is counted: now index the rest at the origin's rate, behind the first batch.
            self._book.start()
            known += samples
        # Only spots provably kept by settling: below T for the smallest total the known counts allow.
        bound = lower_bound_length(self._book.known_total(), self._layout.world_size)
        stop = min(known, bound)
        if stop <= self._placed:
            if self._placed < known and (self._book.complete or not self._book.wait_for_more(self._book.known_total())):
                self._settle()
            return True
        self._place(self._placed, stop)
        return True

    def _note(self, start: int, stop: int, units: tuple[int, ...], *, closed: bool) -> None:
        """Spots ``[start, stop)`` read ``units``: first use, and release (``closed``: whole piece)."""
        first = int(worker_count(self._layout, start))
        last = int(worker_count(self._layout, stop)) - 1
        if last < first:
            return
        for unit in units:
            self.first_use.setdefault(unit, first)
            self.last_use[unit] = max(last, self.last_use.get(unit, -1))
        if closed:
            self._releases.setdefault(last, []).extend(units)

    def _place(self, start: int, stop: int) -> None:
        """Lay out the rank's natural spots ``[start, stop)``, recording the windows it completes."""
        units = self._units
        bounds = self._bounds
        for window in range(self._released, len(bounds) - 1):
            lo, hi = int(bounds[window]), int(bounds[window + 1])
            if lo >= stop:
                break
            mine = tuple(
                u
                for u in units[window * WINDOW_UNITS : (window + 1) * WINDOW_UNITS].tolist()
                if self._book.counts[u] > 0
            )
            complete = hi <= stop
            self._note(max(lo, start), min(hi, stop), mine, closed=complete)
            if complete:
                self._released = window + 1
        self._placed = stop

    def _settle(self) -> None:
        """Every count known: lay out the rest of the rank's settled stream (kept, received, repeated)."""
        counts = self._book.wait_complete()
        layout = self._layout
        rank = layout.rank
        streams = Streams(
            counts,
            seed=self._seed,
            epoch=self._epoch,
            shuffle=self._shuffle,
            world_size=layout.world_size,
            drop_last=self._drop_last,
        )
        keep = streams.settled.keep[rank]
        start = min(self._placed, keep)
        for lo, hi, units in streams.window_units(rank, start, keep):
            self._note(lo, hi, units, closed=True)
        offset = keep
        for donor, begin, end in streams.settled.receive[rank]:
            for lo, hi, units in streams.window_units(donor, begin, end):
                self._note(offset + lo - begin, offset + hi - begin, units, closed=True)
            offset += end - begin
        own, length = streams.own(rank), streams.length
        if length > own:
            spots = np.arange(own, length, dtype=np.int64)
            unit, _ = streams.settled_units(rank, spots)
            for spot, one in zip(spots.tolist(), unit.tolist()):
                self._note(spot, spot + 1, (one,), closed=True)
        self.padded = int(worker_count(layout, length) - worker_count(layout, own))
        self._streams = streams
        self._placed = length
        self.final = True
        with self._segment_lock:
            self._segments.clear()
            self._last = (-1, self._last[1])
        placed = [u for u in self.unit_sequence if u in self.first_use]
        ours = set(self.unit_sequence)
        extra = [u for u in self.first_use if u not in ours]
        self.unit_sequence = tuple(placed + sorted(extra, key=self.first_use.__getitem__))
