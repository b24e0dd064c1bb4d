"""One reader's pass over its share of an epoch: walks the plan, opens units, builds samples or batches."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from datacache.loaders.batching import SKIPPED, BatchBuilder, ReadAhead, sample_bytes
from datacache.loaders.coldorder import cold_remaining, node_cold_sequences
from datacache.loaders.coldplan import ColdEpochPlan, epoch_plan
from datacache.loaders.epoch import (
    EpochPlan,
    ReadPlan,
    auto_window,
    initial_prefetch,
    node_epoch_sequences,
    node_unit_sequences,
)
from datacache.loaders.mixed import mix_plan
from datacache.loaders.mixunits import MixedUnitReaders
from datacache.loaders.order import Cursor, Layout, reader_name
from datacache.loaders.prefetch import PrefetchController
from datacache.loaders.readers import sample_of
from datacache.loaders.runtime import NodeFuture, Runtime, Units
from datacache.loaders.sharedbytes import SampleRing
from datacache.loaders.stats import Counter, mode_code, publish_reader, reader_figures
from datacache.loaders.units import UnitReaders
from torch.utils.data import get_worker_info

from datacache.errors import ConfigError, ShardReadError

if TYPE_CHECKING:
    from datacache.loaders.dataset import CachedIterableDataset

__all__ = ["ITERATOR_MARK", "EpochIterator"]

logger = logging.getLogger(__name__)

_REPORT_INTERVAL = 1.0  # `datacache top` refreshes every second
"""Seconds between throughput reports to the daemon."""
_READER_THREADS = 2
"""Threads that read and pack batches ahead in the consumer's process (batch mode, no workers)."""
ITERATOR_MARK = "datacache_iterator"
"""Marks an iterator's state inside a StatefulDataLoader's state (see `CachedIterableDataset.load_state_dict`)."""


class EpochIterator:
    """One reader's pass over its share of an epoch; `Stateful` for torchdata.

    The plan (`epoch.plan_epoch`) says what to read; `units.UnitReaders` opens
    it; `batching.BatchBuilder` turns it into samples or batches. This class
    walks the plan and keeps the reader's counters.
    """

    def __init__(
        self,
        dataset: CachedIterableDataset,
        runtime: Runtime,
        layout: Layout,
        epoch: int,
        cursors: tuple[Cursor, ...],
    ) -> None:
        self.dataset = dataset
        self.runtime = runtime
        self.layout = layout
        self.epoch = epoch
        self.cursors = cursors
        self.produced = 0
        self._plan: ReadPlan
        common: dict[str, Any] = {
            "seed": dataset.seed,
            "epoch": epoch,
            "shuffle": dataset.shuffle,
            "drop_last": dataset.drop_last,
            "cursors": cursors,
        }
        mixed: EpochPlan | None = None
        if runtime.mix is not None:
            self._plan = mixed = mix_plan(runtime, layout, **common)
        else:
            self._plan = epoch_plan(runtime, layout, shuffle_buffer=dataset.shuffle_buffer, **common)
        plan = runtime.plan
        share = dataset.target_bandwidth / layout.num_workers if dataset.target_bandwidth else None
        self.controller = PrefetchController(
            fixed=dataset.prefetch,
            initial=initial_prefetch(
                max(plan.total, len(plan.units)), len(plan.units), runtime.window or 1, runtime.settings.concurrency
            ),
            target=share,
            unit_bytes=runtime.handle.manifest.total_bytes / max(1, len(plan.units)),
            where=f"dataset {runtime.handle.id} reader {layout.worker}",
        )
        self._in_consumer = get_worker_info() is None
        self._row = dataset._table.row(layout.worker).numpy()
        self._source_row = dataset._table.source_row(layout.worker).numpy()
        self._start_row()
        self._skip_unreadable()
        self._reported_at = time.monotonic()
        self._last_yield = time.perf_counter()
        self._lock = threading.Lock()
        threads = _READER_THREADS if (self._in_consumer and dataset.batch_size) else 0
        self._units: Units
        self._mixed: MixedUnitReaders | None = None
        self._tallied = np.zeros(0, dtype=np.int64)
        readers: dict[str, Any] = {
            "controller": self.controller,
            "row": self._row,
            "lock": self._lock,
            "skip_bad": dataset.on_error == "skip",
            "in_consumer": self._in_consumer,
        }
        if mixed is not None:
            self._units = self._mixed = MixedUnitReaders(runtime, mixed, **readers)
            self._tallied = np.full(len(self._plan), -1, dtype=np.int64)
        else:
            units = UnitReaders(runtime, self._plan, future=self._node_future(), **readers)
            if isinstance(self._plan, ColdEpochPlan):
                self._plan.count_with(units)  # a cold epoch counts the shards it reads as it opens them
            self._units = units
        self._builder = BatchBuilder(
            self._units,
            self._plan,
            decode=dataset.decode,
            transform=dataset.transform,
            row=self._row,
            lock=self._lock,
            threads=threads,
            in_consumer=self._in_consumer,
            skip_bad=dataset.on_error == "skip",
            tally=self._tally if self._mixed is not None else None,
        )
        # Per-sample mode in a DataLoader worker: raw fields leave through shared memory (`sharedbytes`).
        self._ring = SampleRing() if not (self._in_consumer or dataset.batch_size) else None
        window = runtime.window or 256
        self._ahead = ReadAhead(self._builder, self._units, threads=threads, window=window) if threads else None
        self._skip_to(0)
        self._units.note_retries()

    def _node_future(self) -> NodeFuture:
        """Every reader's units (all ranks, all workers), so the stager sees the node's whole future.

        A cold epoch's readers read whole shards in their rank's order (`coldorder.node_cold_sequences`);
        a resumed one reads what the cold epoch left (`coldorder.cold_remaining`), as its plan does.
        """
        dataset, runtime = self.dataset, self.runtime
        if isinstance(self._plan, ColdEpochPlan):
            units = node_cold_sequences(
                len(runtime.plan.units),
                seed=dataset.seed,
                epoch=self.epoch,
                shuffle=dataset.shuffle,
                layout=self.layout,
            )
            name = reader_name(self.layout.rank, self.layout.worker)
            return NodeFuture(name, self.epoch, units, later=self._next_epoch_units)
        cursors, order = self.cursors, None
        if cursors and cursors[0].cold:
            order = cold_remaining(
                runtime.plan.counts,
                cursors[0],
                seed=dataset.seed,
                epoch=self.epoch,
                shuffle=dataset.shuffle,
                drop_last=dataset.drop_last,
            )
            cursors = cursors[1:]
        units = node_unit_sequences(
            runtime.plan.counts,
            seed=dataset.seed,
            epoch=self.epoch,
            shuffle=dataset.shuffle,
            window=runtime.window,
            cursors=cursors,
            layout=self.layout,
            drop_last=dataset.drop_last,
            order=order,
        )
        return NodeFuture(reader_name(self.layout.rank, self.layout.worker), self.epoch, units)

    def _next_epoch_units(self) -> Mapping[str, tuple[int, ...]] | None:
        """Every reader's units of the epoch after this cold one, once the cold epoch's counts are all known."""
        runtime, dataset = self.runtime, self.dataset
        book = runtime.book
        if book is not None and not book.complete:
            return None
        counts = runtime.plan.counts if book is None else book.counts.copy()
        window = runtime.window or dataset.shuffle_buffer or auto_window(int(counts.sum()), len(counts))
        return node_epoch_sequences(
            counts,
            seed=dataset.seed,
            epoch=self.epoch + 1,
            shuffle=dataset.shuffle,
            window=window,
            layout=self.layout,
            drop_last=dataset.drop_last,
        )

    def _start_row(self) -> None:
        row = self._row
        row[:] = 0
        self._source_row[:] = 0
        now = time.time()
        row[Counter.ACTIVE] = 1
        row[Counter.STARTED] = now
        row[Counter.UPDATED] = now
        row[Counter.NUM_WORKERS] = self.layout.num_workers
        row[Counter.PADDED] = self._plan.padded
        row[Counter.TOTAL] = len(self._plan)
        row[Counter.MODE] = mode_code(self.runtime.access.mode)

    def _skip_unreadable(self) -> None:
        """Raise, or count as skipped, the shards whose samples the plan could not count."""
        unreadable = self.runtime.plan.unreadable
        if not unreadable:
            return
        if self.dataset.on_error != "skip":
            raise ShardReadError(unreadable[min(unreadable)])
        if self.layout.worker == 0:
            for key in sorted(unreadable):
                logger.warning("skipping %s", unreadable[key])
            self._row[Counter.SKIPPED_SHARDS] += len(unreadable)

    # -- Stateful ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            ITERATOR_MARK: 1,
            "epoch": self.epoch,
            "seed": self.dataset.seed,
            "produced": self.produced,
            "cold": isinstance(self._plan, ColdEpochPlan),
            "cursors": [c.to_json() for c in self.cursors],
            "layout": {
                "world_size": self.layout.world_size,
                "rank": self.layout.rank,
                "num_workers": self.layout.num_workers,
                "worker": self.layout.worker,
                "chunk": self.layout.chunk,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        layout = state.get("layout", {})
        same = (
            int(state.get("epoch", -1)) == self.epoch
            and [Cursor.from_json(c) for c in state.get("cursors", [])] == list(self.cursors)
            and layout.get("world_size") == self.layout.world_size
            and layout.get("rank") == self.layout.rank
            and layout.get("num_workers") == self.layout.num_workers
            and layout.get("worker") == self.layout.worker
            and layout.get("chunk") == self.layout.chunk
        )
        if not same:
            raise ConfigError(
                "this iterator state was saved with another layout or epoch; "
                "resume through CachedIterableDataset.load_state_dict(loader.state_dict()) instead"
            )
        self._skip_to(int(state["produced"]))

    def _skip_to(self, produced: int) -> None:
        if self._ahead is not None:
            self._ahead.drain()
        self.produced = min(produced, self._known(produced))
        self._units.restart(self.produced)

    def _known(self, length: int) -> int:
        """Positions the plan holds, once it holds ``length`` or is complete (a cold plan grows here)."""
        if isinstance(self._plan, ColdEpochPlan):
            return self._plan.ensure(length)
        return len(self._plan)

    # -- iteration ------------------------------------------------------------------------

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        started = time.perf_counter()
        try:
            if self.dataset.batch_size:
                return self._next_batch(self.dataset.batch_size)
            return self._next_sample()
        finally:
            if self._in_consumer:
                now = time.perf_counter()
                self._row[Counter.CONSUMER_WAIT] += now - started
                self._row[Counter.CONSUMER_TIME] += now - self._last_yield
                self._last_yield = now

    def _next_sample(self) -> Any:
        while True:
            if self.produced >= self._known(self.produced + 1):
                self._finish()
                raise StopIteration
            position = self.produced
            reader = self._units.reader_at(position)
            self.produced += 1
            if reader is None:
                self._row[Counter.SKIPPED_SAMPLES] += 1
                continue
            local = int(self._plan.local[position])
            ring = self._ring
            sample = sample_of(reader.fields(local), ring.wrap) if ring and reader.packable else reader.sample(local)
            nbytes = sample_bytes(sample)
            self._units.release_after(position, None)
            decoded = self._builder.decode(sample, reader)
            if decoded is SKIPPED:
                self._row[Counter.SKIPPED_SAMPLES] += 1
                continue
            self._account(nbytes, 1)
            if self._mixed is not None:
                self._tally(position, nbytes)
                self._count_sources(position, position + 1)
            return decoded

    def _next_batch(self, size: int) -> Any:
        while True:
            known = self._known(self.produced + size)
            if self.produced >= known:
                self._finish()
                raise StopIteration
            begin = self.produced
            total = known
            if isinstance(self._plan, ColdEpochPlan) and not self._plan.final:
                total = begin + (known - begin) // size * size  # read ahead only whole batches laid out
            if self._ahead is not None:
                built = self._ahead.take(begin, size, total)
            else:
                built = self._builder.build(begin, size)
            stop = min(begin + size, total)
            self.produced = stop
            pool = self._ahead.pool if self._ahead is not None else None
            for position in range(begin, stop):
                self._units.release_after(position, pool)
            if built is not None:
                batch, nbytes, count = built
                self._account(nbytes, count)
                if self._mixed is not None:
                    self._count_sources(begin, stop)
                return batch

    # -- counters and reports -------------------------------------------------------------

    def _tally(self, position: int, nbytes: int) -> None:
        """Note the payload of the sample at ``position`` (reader threads note distinct positions)."""
        self._tallied[position] = nbytes

    def _count_sources(self, begin: int, stop: int) -> None:
        """Add the samples of positions ``[begin, stop)`` now delivered to their sources' counts."""
        if self._mixed is None:
            return
        noted = self._tallied[begin:stop]
        delivered = noted >= 0
        sources = self._mixed.source_at[begin:stop][delivered]
        with self._lock:
            np.add.at(self._source_row[:, 0], sources, 1)
            np.add.at(self._source_row[:, 1], sources, noted[delivered])

    def _account(self, nbytes: int, samples: int) -> None:
        with self._lock:
            self._account_locked(nbytes, samples)

    def _account_locked(self, nbytes: int, samples: int) -> None:
        row = self._row
        row[Counter.SAMPLES] += samples
        row[Counter.BYTES] += nbytes
        row[Counter.UPDATED] = time.time()
        row[Counter.DEPTH] = self.controller.depth
        now = time.monotonic()
        if now - self._reported_at >= _REPORT_INTERVAL:
            self._reported_at = now
            self._report()
        if not self.controller.due():
            return
        units = self._units
        self.controller.observe(
            delivered=float(row[Counter.BYTES]),
            waited=float(row[Counter.WAIT]),
            staging_rate=units.staged_bytes / units.staging_seconds if units.staging_seconds else 0.0,
            breakdown={
                "origin": float(row[Counter.WAIT_ORIGIN]),
                "shared tier": float(row[Counter.WAIT_SHARED]),
                "local disk": float(row[Counter.READ]),
                "decode": float(row[Counter.DECODE]),
                "total": float(row[Counter.UPDATED] - row[Counter.STARTED]),
            },
        )

    def _report(self) -> None:
        """Tell the daemon (or, embedded, `datacache top`'s report file) what this reader delivered."""
        access = self.runtime.access
        row = self._row
        row[Counter.MODE] = mode_code(access.mode)
        layout = self.layout
        figures = reader_figures(
            row,
            rank=layout.rank,
            world_size=layout.world_size,
            worker=layout.worker,
            num_workers=layout.num_workers,
            epoch=self.epoch,
            target=self.dataset.target_bandwidth,
            in_consumer=self._in_consumer,
        )
        self.runtime.loop.submit(publish_reader(access, self.runtime.handle, figures))

    def _finish(self) -> None:
        self._row[Counter.PADDED] = self._plan.padded  # a cold plan knows them once it settled
        self._row[Counter.TOTAL] = len(self._plan)
        self._units.note_retries()
        if self._ahead is not None:
            self._ahead.drain()
            self._ahead.shutdown(wait=True)
        self._units.close_all()
        self._row[Counter.UPDATED] = time.time()
        self._report()  # last: the epoch's final figures, as `stats()` reads them

    def __del__(self) -> None:
        ahead = getattr(self, "_ahead", None)
        if ahead is not None:
            ahead.shutdown(wait=False)
