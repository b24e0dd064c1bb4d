"""Building what a reader yields: decoded samples, and whole batches in batch mode.

`BatchBuilder` reads the samples of a run of positions from the open units and
packs them as the dataset's format says (`SampleFormat.batch`): raw fields
(tar, files) into reused (shared) memory, array rows (Zarr) stacked into
tensors, table rows (Parquet) into an Arrow record batch, anything decoded
through torch's ``default_collate``. `ReadAhead` keeps reader threads building the next
few batches in order, in the consumer's process, so file reads, hashing and
copies overlap training (they release the GIL).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Container, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from datacache.loaders.decode import Decoder, SampleDecoding
from datacache.loaders.packing import BufferRing, pack_fields
from datacache.loaders.plans.positions import Positions
from datacache.loaders.reading.rows import ArrowChunks, arrow_batch
from datacache.loaders.runtime import Units
from datacache.loaders.shardfiles import UnitReader
from datacache.loaders.stats import Counter

from datacache._logging import FirstFew
from datacache.errors import SampleDecodeError, ShardReadError
from datacache.formats._rows import RowsReader

if TYPE_CHECKING:
    from datacache.loaders.plans.interface import Opening

__all__ = ["LOOKAHEAD", "SKIPPED", "BatchBuilder", "Built", "Decoder", "ReadAhead", "name_sample", "sample_bytes"]

logger = logging.getLogger(__name__)

Built = tuple[Any, int, int]
"""A batch, its payload bytes, its sample count."""
LOOKAHEAD = 6
"""Batches the reader threads build ahead of the consumer; the ring holds two more."""
SKIPPED = object()
"""What `BatchBuilder.decode` returns for a sample its decoder failed on, when bad samples are skipped."""


class BatchBuilder:
    """Reads, decodes and packs the samples of one reader's positions.

    ``opening`` is what the reader's units share with it (`plans.interface.Opening`): its stats row, the
    row's lock, whether bad samples are skipped, whether it runs in the consumer. ``decoding`` and
    ``skips`` are the dataset's, made once per process (`CachedIterableDataset`), not once per epoch;
    the batch layout is the runtime's format's.
    """

    def __init__(
        self,
        units: Units,
        epoch: Positions,
        *,
        decoding: SampleDecoding,
        skips: FirstFew,
        opening: Opening,
        threads: int,
        tally: Callable[[int, int], None] | None = None,
    ) -> None:
        self._units = units
        self._tally = tally
        """Told (position, payload bytes) of every sample put in a batch: a mix counts them per source."""
        self._skip_bad = opening.skip_bad
        self._skips = skips
        self._epoch = epoch
        self._decoding = decoding
        self.raw = decoding.raw
        """Whether samples pass as read (no decoder, no transform)."""
        self._row = opening.row
        self._lock = opening.lock
        self._threads = threads
        self._in_consumer = opening.in_consumer
        self._batch = units.runtime.kind.batch
        self._table_rows = self._batch == "arrow" and self.raw
        """Rows as they are, into a record batch: taken by Arrow per unit (`reading.rows`), never row by row."""
        self._chunks = ArrowChunks(units, epoch) if self._table_rows and ArrowChunks.fits(epoch, tally) else None
        self._ring: BufferRing | None = None

    def build(self, begin: int, size: int) -> Built | None:
        """Read and pack the batch of positions ``[begin, begin + size)``; None if all were skipped.

        Runs on reader threads (file reads, hashing and copies release the GIL)
        or inline. Batch ``n`` is packed into ring slot ``n % slots``: a slot is
        rewritten only after the consumer has taken two later batches.
        """
        stop = min(begin + size, len(self._epoch))
        if self._table_rows:
            if self._chunks is not None:
                taken = self._chunks.batch(begin, stop)
            else:
                taken = arrow_batch(self._units, self._epoch, begin, stop, self._tally)
            if taken is not None:
                return self._taken(*taken)
        raw: list[list[tuple[str, memoryview]]] = []
        decoded: list[Any] = []
        array_rows: list[tuple[UnitReader, int]] = []
        skipped = 0
        for position in range(begin, stop):
            if self._threads and position % 8 == 0:
                # Hand the GIL over now and then: a thread that holds it until the interpreter
                # forces a switch (5 ms) would make the training loop wait that long.
                time.sleep(0)  # sleep-ok: yields the GIL, not a wait
            reader = self._units.reader_at(position)
            if reader is None or not self._gather(position, reader, raw, array_rows, decoded):
                skipped += 1
        if skipped:
            with self._lock:
                self._row[Counter.SKIPPED_SAMPLES] += skipped
        return self._pack(begin // size, raw, array_rows, decoded)

    def cut_later(self, begin: int, size: int, pending: Container[int]) -> bool:
        """Whether the batch at ``begin`` is cut from a chunk built (or being built for ``pending``): inline."""
        return self._chunks is not None and self._chunks.cut_later(begin, min(begin + size, len(self._epoch)), pending)

    def cut_built(self, begin: int, stop: int) -> Built | None:
        """Positions ``[begin, stop)`` as a cut of a chunk of table rows built already, none of them skipped;
        None otherwise (`build` reads them). Counts nothing: the caller counts what it keeps."""
        taken = self._chunks.built(begin, stop) if self._chunks is not None else None
        if taken is None or taken[1] or taken[0] is None or not taken[0].num_rows:
            return None
        return taken[0], taken[0].nbytes, taken[0].num_rows

    def _taken(self, batch: Any, skipped: int, taken: Any) -> Built | None:
        if skipped:
            with self._lock:
                self._row[Counter.SKIPPED_SAMPLES] += skipped
        if batch is None or not batch.num_rows:
            return None
        return batch, batch.nbytes, batch.num_rows

    def _gather(
        self,
        position: int,
        reader: UnitReader,
        raw: list[list[tuple[str, memoryview]]],
        array_rows: list[tuple[UnitReader, int]],
        decoded: list[Any],
    ) -> bool:
        """Put the sample at ``position`` in the list its batch path takes; False if it was skipped."""
        local = int(self._epoch.local[position])
        tally = self._tally
        if self.raw and reader.packable:
            fields = reader.fields(local)
            raw.append(fields)
            if tally is not None:
                tally(position, sum(view.nbytes for name, view in fields if not name.startswith("__")))
        elif self.raw and self._batch == "arrays":
            array_rows.append((reader, local))
            if tally is not None:
                tally(position, sample_bytes(reader.sample(local)))
        else:
            try:
                read = reader.sample(local)
            except ShardReadError as exc:  # a table file's damage shows when read (it opens from its footer)
                if not isinstance(reader, RowsReader) or not self._units.skip_damaged(
                    int(self._epoch.unit_of[position]), exc
                ):
                    raise
                return False
            nbytes = sample_bytes(read) if tally is not None else 0
            sample = self.decode(read, reader, position)
            if sample is SKIPPED:
                return False
            decoded.append(sample)
            if tally is not None:
                tally(position, nbytes)
        return True

    def _pack(
        self,
        slot: int,
        raw: list[list[tuple[str, memoryview]]],
        array_rows: list[tuple[UnitReader, int]],
        decoded: list[Any],
    ) -> Built | None:
        """The batch of what `_gather` collected: packed raw fields, stacked arrays, or collated samples."""
        if raw:
            with self._lock:
                if self._ring is None:
                    slots = LOOKAHEAD + 2 if self._threads else 4
                    self._ring = BufferRing(slots, shared=not self._in_consumer)
            batch = pack_fields(raw, self._ring, slot=slot)
            raw.clear()  # the views pin the mapped shards; drop them before any is unmapped
            nbytes = sum(v.nbytes for k, v in batch.items() if k != "__key__")
            return batch, nbytes, len(batch["__key__"])
        if array_rows:
            batch = _stack_arrays(array_rows)
            return batch, sum(v.nbytes for k, v in batch.items() if k != "__key__"), len(array_rows)
        if decoded:
            return self._collate(decoded)
        return None

    def _collate(self, decoded: list[Any]) -> Built:
        if self._batch == "arrow" and self.raw:
            import pyarrow as pa

            record_batch = pa.RecordBatch.from_pylist(decoded)
            return record_batch, record_batch.nbytes, len(decoded)
        return torch.utils.data.default_collate(decoded), sum(map(_payload_bytes, decoded)), len(decoded)

    def decode(self, sample: dict[str, Any], reader: UnitReader, position: int) -> Any:
        """Apply the dataset's decoder and transform to one sample read from ``reader`` at ``position``.

        Returns `SKIPPED` for a sample either failed on when bad samples are skipped.
        """
        name_sample(sample, reader, self._units.url_at(position))
        if self.raw:
            return sample
        started = time.perf_counter()
        try:
            return self._decoding.apply(sample, reader.where)
        except SampleDecodeError as exc:
            if not self._skip_bad:
                raise
            self._skips.log(logger, "skipping %s", exc)
            return SKIPPED
        finally:
            self._row[Counter.DECODE] += time.perf_counter() - started


class ReadAhead:
    """Reader threads that build the next few batches, in order, ahead of the consumer (a batch cut
    from a chunk of table rows already built is cut in the consumer: a thread's hop costs more)."""

    def __init__(self, builder: BatchBuilder, units: Units, *, threads: int, window: int) -> None:
        self._builder = builder
        self._units = units
        self._threads = threads
        self._window = window
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[int, concurrent.futures.Future[Built | None] | None] = {}
        """Batches scheduled: built on a thread, or None: cut from a chunk in the consumer (`cut_later`)."""

    def take(self, begin: int, size: int, total: int) -> Built | None:
        """The batch starting at ``begin``, scheduling the next ones first."""
        self.schedule(begin, size, total)
        pending = self._pending.pop(begin, None)
        return pending.result() if pending is not None else self._builder.build(begin, size)

    def claim(self, begin: int) -> bool:
        """Whether the batch at ``begin`` may be cut by the caller (no thread builds it); forgets it if so."""
        if self._pending.get(begin) is not None:
            return False
        self._pending.pop(begin, None)
        return True

    def schedule(self, begin: int, size: int, total: int) -> None:
        """Keep the reader threads busy on the next few batches, then open the next window's units."""
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="datacache-reader")
        pool = self.pool
        for _ in range(LOOKAHEAD):
            if begin >= total:
                break
            if begin not in self._pending:
                cut = self._builder.cut_later(begin, size, self._pending)
                self._pending[begin] = None if cut else pool.submit(self._builder.build, begin, size)
            begin += size
        self._units.open_ahead(begin, begin + self._window, pool.submit)

    def drain(self) -> None:
        """Cancel the batches not yet started and wait for those being built."""
        pending, self._pending = self._pending, {}
        futures = [future for future in pending.values() if future is not None]
        for future in futures:
            future.cancel()
        for future in futures:
            if not future.cancelled():
                with contextlib.suppress(Exception):
                    future.result()

    def shutdown(self, *, wait: bool = True) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown(wait=wait, cancel_futures=not wait)


def name_sample(sample: dict[str, Any], reader: UnitReader, url: str) -> None:
    """Give ``sample`` (read from ``reader``) the ``__url__`` of its shard, where it has one (a tar shard's,
    a plain file's). ``url``: the one its unit's keys are relative to, credentials redacted (samples travel
    to logs and files); a mix's readers know each unit's own source's.
    """
    if reader.packable:
        sample["__url__"] = f"{url.rstrip('/')}/{reader.unit.keys[0]}"


def _payload_bytes(sample: Any) -> int:
    return sample_bytes(sample) if isinstance(sample, Mapping) else 0


def sample_bytes(sample: Mapping[str, Any]) -> int:
    """Bytes of payload in a sample dict (bytes, arrays, tensors)."""
    total = 0
    for key, value in sample.items():
        if key.startswith("__"):
            continue
        if isinstance(value, bytes | bytearray | memoryview):
            total += len(value)
        elif hasattr(value, "nbytes"):
            total += int(value.nbytes)
    return total


def _stack_arrays(rows: list[tuple[UnitReader, int]]) -> dict[str, Any]:
    batch: dict[str, Any] = {"__key__": []}
    columns: dict[str, list[Any]] = {}
    for reader, index in rows:
        sample = reader.sample(index)
        batch["__key__"].append(sample["__key__"])
        for name, value in sample.items():
            if name != "__key__":
                columns.setdefault(name, []).append(value)
    for name, values in columns.items():
        batch[name] = torch.from_numpy(np.stack(values))
    return batch
