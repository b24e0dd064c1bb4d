"""Rows of a Parquet file, decoded a batch at a time: memory follows the batch, not the file.

A Parquet file of 44 KB can hold millions of rows (a constant column encodes
to almost nothing); turned into Python objects all at once it took 1.5 GB.
Here a file is decoded by row group and batch of `BATCH_ROWS` rows: a few
Arrow batches and one batch of Python rows are kept, and a batch that was
dropped is decoded again when asked for (reads go mostly forward: the shuffle
window covers a few thousand neighbouring rows).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from datacache.formats._rows import PythonRows

__all__ = ["BATCH_ROWS", "ParquetRows"]

BATCH_ROWS = 1024
"""Rows decoded (and turned into Python objects) together."""
_ARROW_CACHE_BYTES = 64 << 20
"""Decoded Arrow batches kept for re-use, at most."""


class ParquetRows:
    """Random access to the rows of one Parquet file, with bounded memory.

    Opening decodes and validates every batch once (damage shows at open, not
    mid-epoch) and keeps them up to `_ARROW_CACHE_BYTES`. Raises
    ``pa.ArrowException``, ``OSError`` or ``ValueError`` for a damaged file.
    """

    def __init__(self, source: Any) -> None:
        self._file = pq.ParquetFile(pa.BufferReader(source))
        metadata = self._file.metadata
        counts = [metadata.row_group(group).num_rows for group in range(metadata.num_row_groups)]
        self.num_rows = int(metadata.num_rows)
        self._starts = [sum(counts[:group]) for group in range(len(counts))]
        self._arrow: OrderedDict[tuple[int, int], pa.RecordBatch] = OrderedDict()
        self._arrow_bytes = 0
        self._python = PythonRows()
        self._stream: Iterator[pa.RecordBatch] | None = None
        self._position = (-1, 0)  # (row group, index of the batch the stream yields next)
        # Where each batch of each row group starts (Arrow decides the batch lengths).
        self._batch_starts: list[list[int]] = []
        for group in range(len(counts)):
            starts: list[int] = []
            at = 0
            for decoded in self._file.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], use_threads=False):
                decoded.validate(full=True)  # a string that is not UTF-8 fails here, not in a reader's hands
                self._keep((group, len(starts)), decoded)
                starts.append(at)
                at += decoded.num_rows
            if at != counts[group]:
                raise ValueError(f"row group {group} decodes to {at} rows, its footer says {counts[group]}")
            self._batch_starts.append(starts)

    def row(self, index: int) -> dict[str, Any]:
        """Row ``index`` of the file, as a dict of column values."""
        if not 0 <= index < self.num_rows:
            raise IndexError(index)
        group = bisect.bisect_right(self._starts, index) - 1
        offset = index - self._starts[group]
        starts = self._batch_starts[group]
        batch = bisect.bisect_right(starts, offset) - 1
        rows = self._python.get((group, batch), lambda: self._batch(group, batch).to_pylist())
        at = offset - starts[batch]
        if at >= len(rows):  # damaged data that decodes differently the second time
            raise ValueError(f"row group {group} batch {batch} decodes to {len(rows)} rows, fewer than at open")
        row: dict[str, Any] = rows[at]
        return row

    def _batch(self, group: int, batch: int) -> pa.RecordBatch:
        found = self._arrow.get((group, batch))
        if found is not None:
            self._arrow.move_to_end((group, batch))
            return found
        if self._stream is None or self._position[0] != group or self._position[1] > batch:
            self._stream = self._file.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], use_threads=False)
            self._position = (group, 0)
        while True:
            decoded = next(self._stream, None)
            if decoded is None:  # a damaged file whose metadata promises more than its data holds
                raise ValueError(f"row group {group} holds fewer batches than its metadata says")
            at = self._position[1]
            self._position = (group, at + 1)
            if at == batch:
                self._keep((group, batch), decoded)
                return decoded

    def _keep(self, key: tuple[int, int], decoded: pa.RecordBatch) -> None:
        self._arrow[key] = decoded
        self._arrow_bytes += decoded.nbytes
        while self._arrow_bytes > _ARROW_CACHE_BYTES and len(self._arrow) > 1:
            _, dropped = self._arrow.popitem(last=False)
            self._arrow_bytes -= dropped.nbytes

    def close(self) -> None:
        """Drop every decoded batch and the stream (they may hold views of the file's buffer)."""
        self._arrow.clear()
        self._python.clear()
        self._stream = None
        self._file.close()
