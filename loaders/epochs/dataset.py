"""The epochs of one dataset: a first epoch while its sample counts arrive, indexed epochs after.

`DatasetPlanner` makes each reader's `plans.interface.Plan`: a `ColdPlan` (whole shards
dealt, `plans.cold.ColdPositions` growing as the reader counts the shards it
opens) while some count is unknown and the cluster decided to read the epoch
cold, else an `IndexedPlan` (`plans.indexed.IndexedPositions`), resumed after cursors of
either kind. It is the one place where the runtime's counts go from unknown to
known (`complete`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
from datacache.loaders.order.cold import ColdRemainder, cold_remaining, node_cold_sequences
from datacache.loaders.order.layout import Cursor, Layout, reader_name
from datacache.loaders.order.windows import read_only
from datacache.loaders.plans.cold import ColdPositions, CountBook, Counts
from datacache.loaders.plans.counts import complete, load_or_build_plan
from datacache.loaders.plans.indexed import IndexedPositions
from datacache.loaders.plans.interface import Dealing, Plan
from datacache.loaders.plans.positions import (
    auto_window,
    epoch_sequence,
    node_epoch_sequences,
    node_unit_sequences,
    plan_epoch,
    settle_counts,
)
from datacache.loaders.runtime import NodeFuture, Runtime, SpanCache

from datacache._sync import LoopThread
from datacache.access import ShardAccess
from datacache.config import Settings
from datacache.counting.cluster import decide_cold
from datacache.staging import DatasetHandle

__all__ = ["ColdPlan", "DatasetPlanner", "IndexedPlan", "cold_plan", "indexed_plan", "open_dataset"]

IntArray = npt.NDArray[np.int64]


class IndexedPlan:
    """An epoch dealt from every sample count (`plans.indexed.IndexedPositions`): whole from the start."""

    cold = False

    def __init__(self, positions: IndexedPositions, future: NodeFuture | None) -> None:
        self.positions = positions
        self._future = future

    def known(self, length: int) -> int:
        return len(self.positions)

    def readable(self, begin: int, size: int, known: int) -> int:
        return known

    def uncounted(self) -> tuple[int, ...]:
        return ()

    def counted(self, unit: int, samples: int, why: str | None = None) -> None:
        return None  # every count was known when the plan was made

    def future(self) -> NodeFuture | None:
        return self._future

    def futures(self) -> tuple[NodeFuture, ...] | None:
        return None


class ColdPlan:
    """A first epoch read while its counts arrive (`plans.cold.ColdPositions`): it grows as it is read."""

    cold = True

    def __init__(
        self,
        planner: DatasetPlanner | None,
        positions: ColdPositions,
        future: NodeFuture | None,
        epoch: tuple[Dealing, int] | None = None,
    ) -> None:
        self._planner = planner
        self.positions = positions
        self._future = future
        self._epoch = epoch
        """This epoch's dealing and number: once its counts are all known, the next epoch's is decided ahead."""
        self._saved = False

    def known(self, length: int) -> int:
        known = self.positions.ensure(length)
        if self.positions.final and self._planner is not None and not self._saved:
            # The node's later readers, and this training process's len(), start from these counts.
            self._saved = self._planner.keep_counts()
            if self._saved and self._epoch is not None:
                self._planner.decide_ahead(self._epoch[0], self._epoch[1] + 1)
        return known

    def readable(self, begin: int, size: int, known: int) -> int:
        if self.positions.final:
            return known
        return begin + (known - begin) // size * size  # read ahead only whole batches laid out

    def uncounted(self) -> tuple[int, ...]:
        return self.positions.uncounted()

    def counted(self, unit: int, samples: int, why: str | None = None) -> None:
        self.positions.counted(unit, samples, why)

    def future(self) -> NodeFuture | None:
        return self._future

    def futures(self) -> tuple[NodeFuture, ...] | None:
        return None


def open_dataset(
    loop: LoopThread, access: ShardAccess, settings: Settings, handle: DatasetHandle, *, shuffle_buffer: int | None
) -> Runtime:
    """The runtime of one dataset: its unit plan, and its counts (a `CountBook`) while some are unknown."""
    plan = loop.run(load_or_build_plan(access, handle, settings, wait=False))
    spans = SpanCache(directory=settings.local_dir / "indexes" / "spans" / handle.id)
    known = complete(plan)
    # Without every count the default window waits for them (`DatasetPlanner.complete`).
    window = shuffle_buffer or (auto_window(plan.total, len(plan.units)) if known else 0)
    book = None if known else CountBook(plan, handle, settings, loop, access)
    return Runtime(os.getpid(), loop, settings, access, handle, plan, window, spans=spans, book=book)


class DatasetPlanner:
    """The `plans.interface.Planner` of one dataset (see the module's docstring)."""

    def __init__(self, runtime: Runtime, shuffle_buffer: int | None) -> None:
        self.runtime = runtime
        self._shuffle_buffer = shuffle_buffer
        self._decided: dict[tuple[int, int], concurrent.futures.Future[bool]] = {}
        """(seed, epoch) -> whether the cluster deals it cold (`cold`): read once per epoch by this process."""

    def complete(self) -> None:
        """Every count known: the complete unit plan (saved for the node) and the default window."""
        if self.runtime.book is not None:  # else settled already (a cold epoch's end, or counts all known)
            settle_counts(self.runtime, self._shuffle_buffer)

    def keep_counts(self) -> bool:
        """At a cold epoch's end, once every count is known: the complete unit plan saved for the node,
        and this process's runtime switched to it (the next epoch plans from it at once)."""
        book = self.runtime.book
        if book is None or not book.complete:
            return False
        self.complete()
        return True

    def total(self) -> int:
        self.complete()
        return self.runtime.units.total

    def empty(self) -> bool:
        return self.runtime.book is None and self.runtime.units.total == 0

    def cold(self, dealing: Dealing, epoch: int) -> bool:
        """Whether this epoch is dealt cold (see `counting.cluster.decide_cold`: every process agrees).

        Read once per epoch by this process, and ahead of it where `decide_ahead` could: the record
        is written once and never changes, so reading it again would find the same answer.
        """
        decided = self._decided.get((dealing.seed, epoch))
        if decided is None:
            runtime = self.runtime
            decided = concurrent.futures.Future()
            incomplete = runtime.book is not None and not runtime.book.complete
            manifest = runtime.handle.manifest
            decided.set_result(decide_cold(runtime.settings, manifest, seed=dealing.seed, epoch=epoch, cold=incomplete))
            self._decided[dealing.seed, epoch] = decided
        return decided.result()

    def decide_ahead(self, dealing: Dealing, epoch: int) -> None:
        """Read (or make) the cluster's record of ``epoch`` on a thread now, while this process knows every count:
        the answer it would find at that epoch's start (counts, once known, stay known), read off the consumer's
        thread, and not at the epoch boundary, where the training loop waits for it."""
        runtime = self.runtime
        if (dealing.seed, epoch) in self._decided or (runtime.book is not None and not runtime.book.complete):
            return
        manifest, settings = runtime.handle.manifest, runtime.settings
        reading = asyncio.to_thread(decide_cold, settings, manifest, seed=dealing.seed, epoch=epoch, cold=False)
        self._decided[dealing.seed, epoch] = runtime.submit(reading)

    def identity(self) -> tuple[str, str]:
        manifest = self.runtime.handle.manifest
        return manifest.dataset, manifest.snapshot

    def state_fields(self) -> dict[str, object]:
        return {}

    def plan(self, layout: Layout, dealing: Dealing, *, epoch: int, cursors: tuple[Cursor, ...]) -> Plan:
        runtime = self.runtime
        if not cursors and self.cold(dealing, epoch):
            book = runtime.book or CountBook(
                runtime.units, runtime.handle, runtime.settings, runtime.loop, runtime.access
            )
            return cold_plan(book, layout, dealing, epoch=epoch, planner=self)
        self.complete()
        counts, window = runtime.units.counts, runtime.window
        self.decide_ahead(dealing, epoch + 1)
        return indexed_plan(counts, layout, dealing, epoch=epoch, cursors=cursors, window=window)

    def after_cold(self, layout: Layout, dealing: Dealing, epoch: int) -> Mapping[str, IntArray] | None:
        """Every reader's units of the epoch after a cold one, once every count is known (else None)."""
        runtime = self.runtime
        book = runtime.book
        if book is not None and not book.complete:
            return None
        counts = runtime.units.counts if book is None else book.counts.copy()
        window = runtime.window or self._shuffle_buffer or auto_window(int(counts.sum()), len(counts))
        return node_epoch_sequences(
            counts,
            seed=dealing.seed,
            epoch=epoch,
            shuffle=dealing.shuffle,
            window=window,
            layout=layout,
            drop_last=dealing.drop_last,
        )


def cold_plan(
    book: Counts, layout: Layout, dealing: Dealing, *, epoch: int, planner: DatasetPlanner | None = None
) -> ColdPlan:
    """Reader ``layout``'s plan of cold epoch ``epoch``, counted through ``book``, and the node's future."""
    seed, shuffle = dealing.seed, dealing.shuffle
    positions = ColdPositions(book, layout=layout, seed=seed, epoch=epoch, shuffle=shuffle, drop_last=dealing.drop_last)
    units = node_cold_sequences(len(book.counts), seed=seed, epoch=epoch, shuffle=shuffle, layout=layout)
    later = (lambda: planner.after_cold(layout, dealing, epoch + 1)) if planner is not None else None
    future = NodeFuture(reader_name(layout.rank, layout.worker), epoch, units, later=later)
    return ColdPlan(planner, positions, future, (dealing, epoch))


def indexed_plan(
    counts: IntArray,
    layout: Layout,
    dealing: Dealing,
    *,
    epoch: int,
    cursors: tuple[Cursor, ...],
    window: int,
) -> IndexedPlan:
    """Reader ``layout``'s indexed plan of epoch ``epoch`` after ``cursors`` (a cold one's first), and its future."""
    seed, shuffle, drop_last = dealing.seed, dealing.shuffle, dealing.drop_last
    counts = read_only(counts)  # the plan, this epoch's order and the next's share one running sum of it
    order: ColdRemainder | None = None
    if cursors and cursors[0].cold:
        order = cold_remaining(counts, cursors[0], seed=seed, epoch=epoch, shuffle=shuffle, drop_last=drop_last)
        cursors = cursors[1:]
    # The epoch's order once, for the reader and the node's future (each copy of 1e6 units' costs ~24 MB).
    sequence = epoch_sequence(
        counts, seed=seed, epoch=epoch, shuffle=shuffle, window=window, cursors=cursors, order=order
    )
    positions = plan_epoch(
        counts, dealing=dealing, epoch=epoch, window=window, cursors=(), layout=layout, order=sequence
    )
    units = node_unit_sequences(
        counts, dealing=dealing, epoch=epoch, window=window, cursors=(), layout=layout, order=sequence
    )
    return IndexedPlan(positions, NodeFuture(reader_name(layout.rank, layout.worker), epoch, units))
