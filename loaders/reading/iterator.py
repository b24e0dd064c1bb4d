"""One reader's pass over its share of an epoch: walks the plan, opens units, builds samples or batches."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from datacache.loaders.decode import SampleDecoding
from datacache.loaders.order.layout import Cursor, Layout
from datacache.loaders.plans.indexed import IndexedPositions
from datacache.loaders.plans.interface import Opening, Plan
from datacache.loaders.reading.batching import SKIPPED, BatchBuilder, ReadAhead, sample_bytes
from datacache.loaders.reading.mixed import MixedUnitReaders
from datacache.loaders.reading.prefetch import TRAINING_LOOP, PrefetchController, initial_prefetch
from datacache.loaders.reading.rows import CHUNK_BATCHES, CHUNK_ROWS, RowsAhead, chunk_rows, ready_rows
from datacache.loaders.reading.units import UnitReaders
from datacache.loaders.runtime import Runtime, Units
from datacache.loaders.shardfiles import UnitReader, sample_of
from datacache.loaders.sharedbytes import SampleRing
from datacache.loaders.stats import Counter, mode_code, publish_reader, reader_figures
from torch.utils.data import get_worker_info

from datacache._logging import FirstFew
from datacache.errors import ConfigError, ShardReadError
from datacache.formats._rows import RowsReader

__all__ = ["ITERATOR_MARK", "EpochIterator", "ReadOptions"]

FloatArray = npt.NDArray[np.float64]

logger = logging.getLogger(__name__)

_REPORT_INTERVAL = 1.0  # `datacache top` refreshes every second
"""Seconds between throughput reports to the daemon."""
_READER_THREADS = 2
"""Threads that read and pack batches ahead in the consumer's process (batch mode, no workers)."""
ITERATOR_MARK = "datacache_iterator"
"""Marks an iterator's state inside a StatefulDataLoader's state (see `CachedIterableDataset.load_state_dict`)."""


@dataclass(frozen=True)
class ReadOptions:
    """What a reader takes of its dataset's configuration (`CachedIterableDataset`'s, the same names),
    made once per dataset and process: every epoch's reader calls the same ``decoding`` and ``skips``."""

    seed: int
    batch_size: int | None
    decoding: SampleDecoding
    """The dataset's decoder, then its transform (`decode.SampleDecoding`)."""
    skips: FirstFew
    """Logs the samples skipped (the first few in full, then a count), over every epoch of the dataset."""
    skip_bad: bool
    """``on_error="skip"``: a corrupt or unreadable shard, or a sample its decoder fails on, is skipped."""
    target_bandwidth: float | None
    prefetch: int | None


class EpochIterator:
    """One reader's pass over its share of an epoch; `Stateful` for torchdata.

    The plan (a `plans.interface.Plan`, whatever kind of epoch it is) says what to read and
    opens its units; `reading.batching.BatchBuilder` turns them into samples or batches.
    This class walks the plan and keeps the reader's counters (``rows``: its stats
    row and its per-source row, in the dataset's shared table).
    """

    def __init__(
        self,
        options: ReadOptions,
        runtime: Runtime,
        plan: Plan,
        layout: Layout,
        epoch: int,
        cursors: tuple[Cursor, ...],
        rows: tuple[FloatArray, FloatArray],
    ) -> None:
        self.options = options
        self.runtime = runtime
        self.layout = layout
        self.epoch = epoch
        self.cursors = cursors
        self.produced = 0
        self._epoch_plan = plan
        self._plan = plan.positions
        self.controller = self._controller()
        self._in_consumer = get_worker_info() is None
        self._row, self._source_row = rows
        self._start_row()
        self._skip_unreadable()
        self._reported_at = time.monotonic()
        self._last_yield = time.perf_counter()
        self._lock = threading.Lock()
        threads = _READER_THREADS if (self._in_consumer and options.batch_size) else 0
        opening = Opening(self.controller, self._row, self._lock, options.skip_bad, self._in_consumer)
        self._units = _open_units(runtime, plan, opening)
        self._mixed = self._units if isinstance(self._units, MixedUnitReaders) else None
        """A mix's units, which tally what each source delivered (`stats().sources`); None: one source."""
        self._note = self._mixed.tally if self._mixed is not None else None
        self._builder = BatchBuilder(
            self._units,
            self._plan,
            decoding=options.decoding,
            skips=options.skips,
            opening=opening,
            threads=threads,
            tally=self._note,
        )
        # Per-sample mode in a DataLoader worker: raw fields leave through shared memory (`sharedbytes`).
        self._ring = SampleRing() if not (self._in_consumer or options.batch_size) else None
        self._rows_ahead: RowsAhead | None = None
        """Table rows read ahead, per sample: made when the first table unit is read (`_next_sample`)."""
        self._ready: list[Any] = []
        """Rows gathered ahead (`rows.ready_rows`), last first."""
        self._ready_after: list[int] | None = None
        """The count produced once each of `_ready` is yielded, last first; None: one more each."""
        self._fast_rows = not options.batch_size and self._builder.raw and self._note is None
        self._chunk = CHUNK_ROWS[0]
        window = runtime.window or 256
        self._ahead = ReadAhead(self._builder, self._units, threads=threads, window=window) if threads else None
        self._skip_to(0)
        self._units.note_retries()
        self._beating = runtime.submit(_heartbeat(weakref.ref(self)))

    def _controller(self) -> PrefetchController:
        """How far ahead this reader stages: from its share of the target bandwidth and the plan's size."""
        options, runtime = self.options, self.runtime
        share = options.target_bandwidth / self.layout.num_workers if options.target_bandwidth else None
        total, units = runtime.units.total, len(runtime.units.units)
        return PrefetchController(
            fixed=options.prefetch,
            initial=initial_prefetch(max(total, units), units, runtime.window or 1, runtime.settings.concurrency),
            target=share,
            unit_bytes=runtime.unit_bytes,
            where=f"{runtime.where} reader {self.layout.worker}",
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
        row[Counter.MODE] = mode_code(self.runtime.mode)

    def _skip_unreadable(self) -> None:
        """Raise, or count as skipped, the shards whose samples the plan could not count."""
        unreadable = self.runtime.units.unreadable
        if not unreadable:
            return
        if not self.options.skip_bad:
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
            "seed": self.options.seed,
            "produced": self.produced,
            "cold": self._epoch_plan.cold,
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
        if self._rows_ahead is not None:
            self._rows_ahead.clear()
        self._ready.clear()
        self._ready_after = None
        self._units.restart(self.produced)

    def _known(self, length: int) -> int:
        """Positions the plan holds, once it holds ``length`` or is complete (a growing plan grows here).

        A plan that needs counts to grow names the units (`Plan.uncounted`): this reader opens them
        (it reads them next) and hands their counts back; the plan itself never opens a shard.
        """
        plan = self._epoch_plan
        known = plan.known(length)
        while known < length and (wanted := plan.uncounted()):
            for unit in wanted:
                reader = self._units.reader_for(unit)  # None: skipped as unreadable, and why is recorded
                plan.counted(unit, reader.samples if reader is not None else 0, self._units.skipped_why.get(unit))
            known = plan.known(length)
        return known

    # -- iteration ------------------------------------------------------------------------

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        ready = self._ready
        if ready:  # rows gathered ahead: counted when gathered, yielded here at a list's cost
            after = self._ready_after
            if after is None:
                self.produced += 1
            else:
                self.produced = after.pop()
            return ready.pop()
        started = time.perf_counter()
        try:
            if self.options.batch_size:
                return self._next_batch(self.options.batch_size)
            return self._next_sample()
        finally:
            if self._in_consumer:
                now = time.perf_counter()
                self._row[Counter.CONSUMER_WAIT] += now - started
                self._row[Counter.CONSUMER_TIME] += now - self._last_yield
                self._last_yield = now

    def _next_sample(self) -> Any:
        while True:
            known = self._known(self.produced + 1)
            if self.produced >= known:
                self._finish()
                raise StopIteration
            position = self.produced
            reader = self._units.reader_at(position)
            if self._fast_rows and isinstance(reader, RowsReader):
                gathered = self._gather_rows(position, known)
                if gathered is not None:
                    if not self._ready:
                        continue  # every position of the chunk was skipped
                    return self.__next__()
            self.produced += 1
            if reader is None:
                self._row[Counter.SKIPPED_SAMPLES] += 1
                continue
            sample = self._read(position, reader, known)
            if sample is None:  # its unit turned out damaged, skipped on request
                self._row[Counter.SKIPPED_SAMPLES] += 1
                continue
            nbytes = sample_bytes(sample)
            self._units.release_after(position, None)
            decoded = self._builder.decode(sample, reader, position)
            if decoded is SKIPPED:
                self._row[Counter.SKIPPED_SAMPLES] += 1
                continue
            self._account(nbytes, 1)
            if self._note is not None:
                self._note(position, nbytes)
                self._delivered(position, position + 1)
            return decoded

    def _read(self, position: int, reader: UnitReader, known: int) -> dict[str, Any] | None:
        """The sample at ``position`` of ``reader``'s unit, as read; None: the unit turned out damaged (skipped)."""
        local = int(self._plan.local[position])
        if self._ring and reader.packable:
            return sample_of(reader.fields(local), self._ring.wrap)
        if not isinstance(reader, RowsReader):  # a shard's sample, not a table row
            sample: dict[str, Any] = reader.sample(local)
            return sample
        if self._rows_ahead is None:  # made for the first table unit read
            self._rows_ahead = RowsAhead(self._plan, self._units)
        return self._rows_ahead.sample(position, local, reader, known)

    def _gather_rows(self, position: int, known: int) -> bool | None:
        """Table rows passed as they are: the next chunk of positions at once (None: not for these units)."""
        stop = min(position + self._chunk, known)
        gathered = ready_rows(self._units, self._plan, position, stop)
        if gathered is None:
            return None
        items, after, skipped, nbytes, arrow_bytes = gathered
        if items:
            self._chunk = chunk_rows(arrow_bytes, len(items))
        if skipped:
            self._row[Counter.SKIPPED_SAMPLES] += skipped
        self._units.release_range(position, stop, None)  # the rows are Python objects now
        if items:
            self._account(nbytes, len(items))
            self._delivered(position, stop)
        else:
            self.produced = stop
        self._ready, self._ready_after = items, after
        return True

    def _next_batch(self, size: int) -> Any:
        while True:
            known = self._known(self.produced + size)
            if self.produced >= known:
                self._finish()
                raise StopIteration
            begin = self.produced
            total = self._epoch_plan.readable(begin, size, known)
            if self._ahead is not None:
                built = self._ahead.take(begin, size, total)
            else:
                built = self._builder.build(begin, size)
            stop = min(begin + size, total)
            self.produced = stop
            pool = self._ahead.pool if self._ahead is not None else None
            self._units.release_range(begin, stop, pool)
            if built is not None:
                batch, nbytes, count = built
                self._account(nbytes, count)
                self._delivered(begin, stop)
                self._cut_ahead(stop, size)
                return batch

    def _cut_ahead(self, begin: int, size: int) -> None:
        """The batches from ``begin`` on that are cuts of a chunk of table rows built already, into `_ready`:
        yielded at a list's cost, counted and their units released now, as per-sample mode's chunks are
        (a batch's scheduling, release and counters cost more CPU than its rows: ~1/3 of batch mode's)."""
        ahead = self._ahead
        if ahead is None:
            return
        batches: list[Any] = []
        stops: list[int] = []
        nbytes, stop = 0, begin
        while len(batches) < CHUNK_BATCHES:
            end = min(stop + size, self._epoch_plan.readable(stop, size, self._known(stop + size)))
            cut = self._builder.cut_built(stop, end) if end > stop else None
            if cut is None or not ahead.claim(stop):
                break
            batches.append(cut[0])
            nbytes += cut[1]
            stop = end
            stops.append(stop)
        if not batches:
            return
        # The next chunk is built on a thread while these are yielded (`take` would ask for it only once due).
        ahead.schedule(stop, size, self._epoch_plan.readable(stop, size, self._known(stop + size)))
        self._units.release_range(begin, stop, ahead.pool)
        self._account(nbytes, stop - begin)
        batches.reverse()
        stops.reverse()
        self._ready, self._ready_after = batches, stops

    # -- counters and reports -------------------------------------------------------------

    def _delivered(self, begin: int, stop: int) -> None:
        """A mix's: add the samples of positions ``[begin, stop)``, now delivered, to their sources' rows."""
        if self._mixed is None:
            return  # one source: its figures are the reader's own
        sources, nbytes = self._mixed.count_sources(begin, stop)
        with self._lock:
            np.add.at(self._source_row[:, 0], sources, 1)
            np.add.at(self._source_row[:, 1], sources, nbytes)

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
                # Time between the loop's requests: a slow step was blamed on the reader's CPU (a trial).
                TRAINING_LOOP: float(row[Counter.CONSUMER_TIME]),
                "total": float(row[Counter.UPDATED] - row[Counter.STARTED]),
            },
        )

    def _report(self) -> None:
        """Tell the daemon (or, embedded, `datacache top`'s report file) what this reader delivered."""
        self.runtime.submit(publish_reader(self.runtime.access, self.runtime.handle, self._figures()))

    def _figures(self) -> dict[str, Any]:
        row = self._row
        row[Counter.MODE] = mode_code(self.runtime.mode)
        layout = self.layout
        return reader_figures(
            row,
            rank=layout.rank,
            world_size=layout.world_size,
            worker=layout.worker,
            num_workers=layout.num_workers,
            epoch=self.epoch,
            target=self.options.target_bandwidth,
            in_consumer=self._in_consumer,
        )

    def _finish(self) -> None:
        self._beating.cancel()
        self._row[Counter.PADDED] = self._plan.padded  # a growing plan knows them once it settled
        self._row[Counter.TOTAL] = len(self._plan)
        self._units.note_retries()
        if self._ahead is not None:
            self._ahead.drain()
            self._ahead.shutdown(wait=True)
        self._units.close_all()
        self._row[Counter.UPDATED] = self._row[Counter.FINISHED] = time.time()
        self._report()  # last: the epoch's final figures, as `stats()` reads them

    def __del__(self) -> None:
        beating = getattr(self, "_beating", None)
        if beating is not None:
            beating.cancel()
        ahead = getattr(self, "_ahead", None)
        if ahead is not None:
            ahead.shutdown(wait=False)


def _open_units(runtime: Runtime, plan: Plan, opening: Opening) -> Units:
    """The units ``plan`` reads, opened as they come: a mix's by source, else the dataset's."""
    positions = plan.positions
    if runtime.mix is not None and isinstance(positions, IndexedPositions):  # a mix is dealt from every count
        return MixedUnitReaders(runtime, positions, opening, plan.futures())
    return UnitReaders(runtime, positions, opening, plan.future())


async def _heartbeat(reader: weakref.ref[EpochIterator]) -> None:
    """Report a reader that delivers nothing too, once an interval: one blocked on a slow origin went silent,
    and `datacache top` then showed none of the transfers it waited for (its figures are a second old)."""
    while True:
        await asyncio.sleep(_REPORT_INTERVAL)
        iterator = reader()
        if iterator is None:
            return  # dropped mid-epoch: nothing to report
        if time.monotonic() - iterator._reported_at >= _REPORT_INTERVAL:
            iterator._reported_at = time.monotonic()
            runtime, figures = iterator.runtime, iterator._figures()
            del iterator  # not held across the await: a dropped iterator is collected
            await publish_reader(runtime.access, runtime.handle, figures)
