"""Arrow IPC files (``.arrow``, the file or the stream format): every row of every record batch is a sample.

Read in place: a record batch of a mapped file is a view of its bytes, so only
the rows a reader turns into Python objects cost memory (`BATCH_ROWS` at a
time, a few batches kept). Counting opens each file once through the cache
(an IPC footer does not hold the row counts; the batches' headers do), unless
the manifest already gives its count. The stream format (what Hugging Face
`datasets` writes, ``pa.ipc.new_stream``) has no footer: its batches are found
by reading their messages in order, once, when the file is opened; a stream
must end with its end-of-stream marker (one cut at a batch's end would
otherwise read as a shorter table).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from typing import Any

from datacache.errors import ShardReadError
from datacache.formats._base import (
    Buffer,
    PlanContext,
    SampleFormat,
    Unit,
    UnitPlan,
    UnitReader,
    count_each_shard,
)
from datacache.formats._rows import PythonRows, RowsReader, gather

__all__ = ["FORMAT", "ArrowFormat", "ArrowReader", "ArrowRows"]

BATCH_ROWS = 1024
"""Rows turned into Python objects together."""
MAX_ROWS_PER_BYTE = 1024
"""A null column takes no bytes per row: a count beyond this many rows per stored byte is not believed."""


class ArrowRows:
    """Random access to the rows of one Arrow IPC file or stream, with bounded memory.

    Opening validates every record batch (damage shows at open, not mid-epoch).
    Raises ``pa.ArrowException`` or ``OSError`` for a damaged file.
    """

    def __init__(self, source: Any) -> None:
        import pyarrow as pa

        self._batches = _record_batches(pa.py_buffer(source))
        for batch in self._batches:
            batch.validate(full=True)
        self._starts = [0]
        for batch in self._batches:
            self._starts.append(self._starts[-1] + batch.num_rows)
        self.num_rows = self._starts[-1]
        self._python = PythonRows()
        self._schema = self._batches[0].schema if self._batches else None

    def take(self, indices: Any) -> Any:
        """The rows at ``indices`` (in that order) as one record batch, taken from the mapped batches."""
        import numpy as np

        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.num_rows):
            raise IndexError(f"rows {int(indices.min())}..{int(indices.max())} of {self.num_rows}")
        starts = np.asarray(self._starts, dtype=np.int64)
        batch = np.searchsorted(starts, indices, side="right") - 1
        used, which = np.unique(batch, return_inverse=True)
        slices = [self._batches[b] for b in used.tolist()]
        return gather(slices, which.reshape(-1), indices - starts[batch], self._schema)

    def row(self, index: int) -> dict[str, Any]:
        """Row ``index`` of the file, as a dict of column values."""
        if not 0 <= index < self.num_rows:
            raise IndexError(index)
        batch = bisect.bisect_right(self._starts, index) - 1
        offset = index - self._starts[batch]
        first = offset // BATCH_ROWS * BATCH_ROWS
        rows = self._python.get((batch, first), lambda: self._batches[batch].slice(first, BATCH_ROWS).to_pylist())
        row: dict[str, Any] = rows[offset % BATCH_ROWS]
        return row

    def close(self) -> None:
        """Drop the batches (views of the file's buffer) and the Python rows."""
        self._batches.clear()
        self._python.clear()


_FILE_MAGIC = b"ARROW1"
_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
"""The marker `pa.ipc.new_stream` writes when it is closed: a continuation and a zero length."""


class _TruncatedStream(ValueError):
    pass


def _record_batches(buffer: Any) -> list[Any]:
    """The record batches of an IPC file (by its footer) or an IPC stream (message after message)."""
    import pyarrow as pa

    if buffer[: len(_FILE_MAGIC)].to_pybytes() == _FILE_MAGIC:
        reader = pa.ipc.open_file(buffer)
        return [reader.get_batch(i) for i in range(reader.num_record_batches)]
    if buffer.size < len(_END_OF_STREAM) or buffer[-len(_END_OF_STREAM) :].to_pybytes() != _END_OF_STREAM:
        raise _TruncatedStream("no end-of-stream marker")
    return list(pa.ipc.open_stream(buffer))


def _open(buffer: Any, where: str) -> ArrowRows:
    import pyarrow as pa

    try:
        return ArrowRows(buffer)
    except _TruncatedStream:
        raise ShardReadError(
            f"{where}: an Arrow IPC stream without its end-of-stream marker: truncated, or not Arrow data"
        ) from None
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ShardReadError(f"{where}: not an Arrow IPC file or stream, or a damaged one ({exc})") from None


class ArrowReader(RowsReader):
    """An Arrow IPC file or stream: one sample per row, as a dict of column values."""

    def __init__(self, unit: Unit, where: str, buffer: Buffer) -> None:
        super().__init__(unit, where, buffer, _open(buffer, where), suffix=".arrow", damaged="damaged Arrow data")


class ArrowFormat(SampleFormat):
    """Arrow IPC files and streams, read in place; batch mode gives Arrow record batches, as for Parquet."""

    name = "arrow"
    suffixes = (".arrow",)
    priority = 30
    batch = "arrow"

    def max_samples(self, size: int) -> int:
        return max(size, 1) * MAX_ROWS_PER_BYTE

    async def plan(self, context: PlanContext, *, wait: bool) -> UnitPlan:
        async def count(key: str, size: int) -> int:
            where = f"{context.where}: shard {key!r}"
            rows = _open(await context.read(key, None), where)
            try:
                if rows.num_rows > self.max_samples(size):
                    raise ShardReadError(f"{where}: {rows.num_rows} rows in {size} bytes is not believable")
                return rows.num_rows
            finally:
                rows.close()

        return await count_each_shard(context, count)

    def open_reader(
        self, unit: Unit, where: str, buffers: Mapping[str, Buffer], extra: Mapping[str, Any], *, index: Any = None
    ) -> UnitReader:
        return ArrowReader(unit, where, buffers[unit.keys[0]])


FORMAT = ArrowFormat()
