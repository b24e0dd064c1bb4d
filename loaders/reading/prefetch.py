"""Staging ahead of use: what one reader asks the stager for before it reads it, and how far ahead.

`Prefetch` asks for this epoch's next units (as deep as its `PrefetchController` says), then,
near the epoch's end, the next epoch's, one after another (`NextEpochStaging`), and tells the
stager the node's whole future order once (eviction keeps what comes soonest). The depth starts
from what the target needs (units consumed while one unit stages) and doubles whenever the
reader delivers less than its share of the target while waiting on shards. If it still falls
short at the widest depth, one warning names the stage that holds it back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import threading
import time
from collections.abc import Container
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from datacache.errors import DatacacheError
from datacache.staging import PRIORITY_PREFETCH

if TYPE_CHECKING:
    from datacache.loaders.plans.positions import Positions
    from datacache.loaders.runtime import NodeFuture, Runtime

__all__ = ["TRAINING_LOOP", "NextEpochStaging", "Prefetch", "PrefetchController", "initial_prefetch"]

logger = logging.getLogger(__name__)

_INTERVAL = 2.0
_MAX_DEPTH = 64


class PrefetchController:
    """Prefetch depth (in units) for one reader, adapted to its share of a bandwidth target.

    Parameters
    ----------
    fixed
        A depth the user chose; never adapted.
    initial
        The depth to start from when not fixed (the loader passes the units one shuffle window spans).
    target
        This reader's share of the per-rank target, in bytes per second.
    unit_bytes
        The mean size of a unit (shard), in bytes.
    """

    def __init__(
        self, *, fixed: int | None, target: float | None, unit_bytes: float, where: str, initial: int = 2
    ) -> None:
        self._fixed = fixed
        self._target = target
        self._unit_bytes = max(unit_bytes, 1.0)
        self._where = where
        self._depth = fixed if fixed is not None else max(initial, 4 if target else 2)
        self._window_start = time.monotonic()
        self._bytes_at_start = 0.0
        self._wait_at_start = 0.0
        self._short_windows = 0
        self._warned = False
        self.limiting_stage: str | None = None

    @property
    def depth(self) -> int:
        return self._depth

    def due(self) -> bool:
        """Whether enough time passed since the last adaptation to observe again."""
        return self._target is not None and time.monotonic() - self._window_start >= _INTERVAL

    def observe(self, *, delivered: float, waited: float, staging_rate: float, breakdown: dict[str, float]) -> None:
        """Feed the reader's running totals; adapts the depth at most every couple of seconds."""
        now = time.monotonic()
        span = now - self._window_start
        if span < _INTERVAL or self._target is None:
            return
        rate = (delivered - self._bytes_at_start) / span
        wait_share = (waited - self._wait_at_start) / span
        self._window_start, self._bytes_at_start, self._wait_at_start = now, delivered, waited
        if staging_rate > 0 and self._fixed is None:
            # Units consumed at the target rate while one unit stages, plus one in hand.
            needed = math.ceil(self._target * (self._unit_bytes / staging_rate) / self._unit_bytes) + 1
            self._depth = max(self._depth, min(_MAX_DEPTH, needed))
        if rate >= self._target * 0.95:
            self._short_windows = 0
            return
        self._short_windows += 1
        if wait_share > 0.02 and self._fixed is None and self._depth < _MAX_DEPTH:
            self._depth = min(_MAX_DEPTH, self._depth * 2)
            return
        if self._short_windows >= 3:
            self.limiting_stage = _limiting(breakdown)
            if not self._warned:
                self._warned = True
                logger.warning(
                    "%s: delivering %.1f MB/s, under the target of %.1f MB/s at prefetch depth %d; "
                    "the limiting stage is %s",
                    self._where,
                    rate / 1e6,
                    self._target / 1e6,
                    self._depth,
                    self.limiting_stage,
                )


TRAINING_LOOP = "the training loop (its work between batches: datacache waits for it)"
"""The stage named when the time between the consumer's requests is the largest."""


def _limiting(breakdown: dict[str, float]) -> str:
    """The stage where most of the reader's time goes."""
    busy = breakdown.get("total", 0.0)
    stages = {k: v for k, v in breakdown.items() if k != "total"}
    if not stages:
        return "unknown"
    stage, seconds = max(stages.items(), key=lambda item: item[1])
    if busy > 0 and seconds < 0.25 * busy:
        return "the reader's own per-sample work (CPU)"
    return stage


def initial_prefetch(total: int, units: int, window: int, concurrency: int) -> int:
    """Units to stage ahead at first.

    Everything the next shuffle window will touch while this one is read, and at
    least enough to keep every transfer slot of the stager busy.
    """
    per_unit = max(1.0, total / max(1, units))
    return min(64, max(int(-(-window // per_unit)) + 2, concurrency))


class Prefetch:
    """What one reader asks the stager for ahead of use (see the module's docstring).

    ``lock`` is the reader's (it guards ``sequence``, ``index`` and the open units). Keys a
    lease note found local (`found_local`) are never asked for: a warm epoch sends none.
    """

    def __init__(
        self,
        runtime: Runtime,
        epoch: Positions,
        controller: PrefetchController,
        future: NodeFuture | None,
        lock: threading.Lock,
    ) -> None:
        self._runtime = runtime
        self._plan = runtime.units
        self._epoch = epoch
        self._controller = controller
        self.future = future
        """The node's future reads (grown by the next epoch's once a cold epoch's counts are known)."""
        self._lock = lock
        self._keys_lock = threading.Lock()  # innermost: never held while calling out
        self.sequence = epoch.unit_sequence
        """The units this reader reads from where it (re)started, in order."""
        self.index = 0
        """Where in ``sequence`` the unit opened last is."""
        self._where: npt.NDArray[np.int64] | None = None
        """Each unit's first place in ``sequence`` (-1: not in it), made when first needed."""
        self._repeats = False
        self._until = 0
        self.told = False
        """Whether the stager was told the future order (then the reader's notes say where it is)."""
        self._unsent: dict[str, None] = {}
        """Prefetches held back until the next note says which of them are local already."""
        self._noted = False
        """Whether a note said where keys are since the held-back prefetches were last sent."""
        self._local: set[str] = set()
        self._next_epoch = NextEpochStaging(runtime)

    @property
    def depth(self) -> int:
        """How many units ahead of the one opened last it asks for."""
        return self._controller.depth

    def restart(self, sequence: tuple[int, ...]) -> None:
        self.sequence, self.index, self._until = sequence, 0, 0
        self._where = None

    def _index_of(self, unit: int) -> int | None:
        """Where ``unit`` is in ``sequence`` at or after ``index``; None if not there (under ``lock``).

        One look-up: a shuffle window opens its units in any order, and walking the sequence
        for each (``tuple.index``) cost O(units) a unit, most of a warm epoch of 1e4 tiny shards.
        """
        if self._where is None:
            sequence = np.asarray(self.sequence, dtype=np.int64)
            units, first = np.unique(sequence, return_index=True)
            where = np.full(int(units[-1]) + 1 if len(units) else 0, -1, dtype=np.int64)
            where[units] = first
            self._where, self._repeats = where, len(units) < len(sequence)
        where = self._where
        found = int(where[unit]) if 0 <= unit < len(where) else -1
        if found >= self.index:
            return found
        if found < 0 or not self._repeats:
            return None
        with contextlib.suppress(ValueError):  # a unit read again later (a repeat that evens rank lengths)
            return self.sequence.index(unit, self.index)
        return None

    def found_local(self, keys: list[str] | None) -> None:
        """Keys a note found local (and leased): no prefetch goes for them. None: forget them all."""
        with self._keys_lock:
            if keys is None:
                self._local.clear()
            else:
                self._noted = True
                self._local.update(keys)

    def _ahead(self) -> tuple[int, ...]:
        """The units to prefetch in order: this epoch's, then (knowing the node's future) the next epoch's.

        The next epoch's only once this epoch's last unit is being opened: earlier, they would
        take room (and, cold, origin reads) that this epoch's units need first.
        """
        if self.future is None or self.index < len(self.sequence) - 1:
            return self.sequence
        return self.sequence + self.future.after(len(self._epoch.unit_sequence))

    def _keys_ahead(self, start: int, until: int, open_units: Container[int]) -> tuple[list[str], list[str]]:
        """The keys of ``_ahead()[start:until]`` not open now: this epoch's, and the next epoch's."""
        ahead, split = self._ahead(), len(self.sequence)

        def keys(units: tuple[int, ...]) -> list[str]:
            return [key for u in units if u not in open_units for key in self._plan.units[u].keys]

        return keys(ahead[start : min(until, split)]), keys(ahead[max(start, split) : until])

    def _not_local(self, keys: list[str]) -> list[str]:
        with self._keys_lock:
            return [key for key in keys if key not in self._local]

    def again(self, open_units: Container[int]) -> None:
        """Ask again for the units prefetched but not opened yet: some found no room when first asked."""
        with self._lock:
            now, later = self._keys_ahead(self.index + 1, self._until, open_units)
            now = [key for key in now if key not in self._unsent]  # not asked yet: the next note says where
        now = self._not_local(now)  # found local (and leased) by a note
        if now:
            self._runtime.submit(self._runtime.access.prefetch(self._runtime.handle, now))
        self._next_epoch.stage(later)

    def advance(self, unit: int, open_units: Container[int]) -> None:
        """``unit`` is being opened: ask for the units after it, as deep as the controller says (under ``lock``)."""
        sequence = self.sequence
        # A unit met before (a thread opening ahead got further) or not in this reader's sequence
        # leaves where it stands unchanged. Walking on would leave the sequence's end, and nothing
        # after it, the next epoch's first units included, would be prefetched.
        found = self._index_of(unit)
        if found is not None:
            self.index = found
        depth = self._controller.depth
        self._grow_future()
        ahead = self._ahead()
        until = min(len(ahead), self.index + 1 + depth)
        if until <= self._until or depth == 0:
            return
        start = max(self._until, self.index + 1)
        keys, later = self._keys_ahead(start, until, open_units)
        # The units this one's first use jumped over (the same shuffle window: their first samples
        # come within a few), first: else each is asked for only when its first sample comes up.
        passed = sequence[self._until : self.index]
        keys = [k for u in passed if u != unit and u not in open_units for k in self._plan.units[u].keys] + keys
        self._until = until
        self._tell_future(sequence)
        if self.future is not None:
            # Sent after the unit's lease: it says where this reader is before its prefetches
            # ask for room, and which of them are local already (a warm epoch sends none).
            self._unsent.update(dict.fromkeys(self._not_local(keys)))
        elif keys:
            self._runtime.submit(self._runtime.access.prefetch(self._runtime.handle, keys))
        self._next_epoch.stage(later)

    def _tell_future(self, sequence: tuple[int, ...]) -> None:
        runtime = self._runtime
        if self.told:
            return
        self.told = True
        if self.future is not None:
            # The whole node's future, the same from every reader: nothing to overwrite.
            runtime.run(runtime.access.set_future_order(runtime.handle, self.future.order(self._plan)))
        else:
            future = [key for u in sequence for key in self._plan.units[u].keys]
            runtime.submit(runtime.access.set_future_order(runtime.handle, future))

    def _grow_future(self) -> None:
        """Append the next epoch's reads to a cold epoch's future as soon as they are known, and say so.

        Until then eviction sees nothing past this epoch: the shards it read first go first,
        and the next epoch would begin with half of them gone.
        """
        future = self.future
        if future is None or future.later is None:
            return
        grown = future.grown()
        if grown is None:
            return
        self.future = grown
        if self.told:
            runtime = self._runtime
            runtime.submit(runtime.access.set_future_order(runtime.handle, grown.order(self._plan)))

    def send(self) -> None:
        """Queue the held-back prefetches that no note found local, once a note has looked.

        Without a note since (a unit an earlier note leased was opened), they wait for the next:
        it locates them with the units it leases, and a warm epoch's are all found local.
        """
        with self._keys_lock:
            if self.future is not None and not self._noted:
                return
            self._noted = False
        with self._lock:
            keys, self._unsent = list(self._unsent), {}
        keys = self._not_local(keys) if keys else keys
        if keys:
            self._runtime.submit(self._runtime.access.prefetch(self._runtime.handle, keys))


class NextEpochStaging:
    """Stages the next epoch's keys one after another, the soonest first, in one task per reader.

    Started together, a later one could take the room the first needs while it is still
    being written (not evictable), and the first would find none. A key found local is
    not asked for again (each ask is a catalog write); one declined for lack of room is,
    when `stage` is called again as room frees.
    """

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._lock = threading.Lock()  # never a lock whose holder waits on the runtime's loop
        self._keys: list[str] = []
        self._task: concurrent.futures.Future[None] | None = None
        self._local: set[str] = set()

    def stage(self, keys: list[str]) -> None:
        """Stage ``keys`` in order: the task running takes the newest list when done with its own."""
        if not keys:
            return
        with self._lock:
            keys = [key for key in keys if key not in self._local]
            if not keys:
                return
            self._keys = keys
            if self._task is None or self._task.done():
                self._task = self._runtime.submit(self._run())

    async def _run(self) -> None:
        access, handle = self._runtime.access, self._runtime.handle
        while True:
            with self._lock:
                keys, self._keys = self._keys, []
            if not keys:
                return
            for key in keys:
                with self._lock:
                    if key in self._local:  # in an older list too, and found local there
                        continue
                try:
                    location = await access.ensure(handle, key, priority=PRIORITY_PREFETCH)
                except (DatacacheError, OSError) as exc:  # met again, and reported, when the shard is opened
                    logger.debug("dataset %s: prefetching %r failed: %s", handle.id, key, exc)
                    continue
                if location.tier == "local":  # declined ones (no room yet) are asked again as room frees
                    with self._lock:
                        self._local.add(key)
