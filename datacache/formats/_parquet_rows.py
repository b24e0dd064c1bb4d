"""Rows of a Parquet file, decoded a slice at a time: memory follows the slices in use, not the file.

A Parquet file of 44 KB can hold millions of rows (a constant column encodes
to almost nothing); turned into Python objects all at once it took 1.5 GB.
Here a file is opened from its footer alone (no batch is decoded at open, so
opening costs the same at 1e3 rows and 1e7) and decoded by row group and slice
of about `SLICE_BYTES` when a row of the slice is first asked for. Decoded slices
are kept up to `_ARROW_CACHE_BYTES`: a shuffle window covers a few thousand
neighbouring rows, so each slice is decoded once per window, and a window's rows
are gathered from the decoded slices by Arrow's ``take`` (`take`), never one by
one. Each slice is validated when it is decoded: damage shows as a named error
on the first read of the slice, never as a wrong value.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.parquet as pq

from datacache.formats._rows import PythonRows, gather

__all__ = ["BATCH_ROWS", "ParquetRows"]

BATCH_ROWS = 1024
"""Rows turned into Python objects together by `ParquetRows.row` (map-style reads)."""
SLICE_BYTES = 4 << 20
"""About how many bytes of a row group are decoded together (by its footer's uncompressed size)."""
_SLICE_ROWS = (64, 1 << 20)
"""The fewest and most rows decoded together: small rows decode a whole row group at a time."""
_ARROW_CACHE_BYTES = 64 << 20
"""Decoded Arrow slices kept for re-use, at most: a shuffle window's rows times their decoded size."""

IntArray = npt.NDArray[np.int64]


class ParquetRows:
    """Random access to the rows of one Parquet file, with bounded memory.

    Opening reads the footer only. Raises ``pa.ArrowException``, ``OSError`` or
    ``ValueError`` for a damaged file (at open for a damaged footer, at the first
    read of a slice for damaged data).
    """

    def __init__(self, source: Any) -> None:
        self._file = pq.ParquetFile(pa.BufferReader(source))
        metadata = self._file.metadata
        counts = np.asarray([metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)], dtype=np.int64)
        if (counts < 0).any():
            raise ValueError("a row group with a negative row count")
        self.num_rows = int(metadata.num_rows)
        self._starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=self._starts[1:])
        if int(self._starts[-1]) != self.num_rows:
            raise ValueError(f"the row groups hold {int(self._starts[-1])} rows, the footer says {self.num_rows}")
        self._counts = counts
        self._slice_rows = np.asarray([_slice_rows(metadata.row_group(g)) for g in range(len(counts))], dtype=np.int64)
        self._arrow: OrderedDict[tuple[int, int], pa.RecordBatch] = OrderedDict()
        self._arrow_bytes = 0
        self._python = PythonRows()
        self._stream: Iterator[pa.RecordBatch] | None = None
        self._position = (-1, 0)  # (row group, index of the slice the stream yields next)
        self._schema = self._file.schema_arrow
        self._lock = threading.Lock()  # reader threads share a file: one decodes at a time

    def _where(self, indices: IntArray) -> tuple[IntArray, IntArray, IntArray]:
        """(row group, slice in it, row in the slice) of each of ``indices``."""
        if len(indices) > 1:
            low, high = np.searchsorted(self._starts, [indices.min(), indices.max()], side="right") - 1
            size = int(self._slice_rows[low])
            if low == high and not size & (size - 1):  # one row group (most windows' rows), slices of 2**k rows
                offset = indices - self._starts[low]
                shift = size.bit_length() - 1
                return np.full(len(indices), low, dtype=np.int64), offset >> shift, offset & (size - 1)
        group = np.searchsorted(self._starts, indices, side="right") - 1
        offset = indices - self._starts[group]
        rows = self._slice_rows[group]
        return group, offset // rows, offset % rows

    def take(self, indices: IntArray) -> pa.RecordBatch:
        """The rows at ``indices`` (in that order) as one record batch of the file's columns."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= self.num_rows):
            raise IndexError(f"rows {int(indices.min())}..{int(indices.max())} of {self.num_rows}")
        group, piece, at = self._where(indices)
        keys = group * (int(piece.max(initial=0)) + 1) + piece
        if not len(keys) or int(keys.min()) == int(keys.max()):  # one slice (a window inside a row group)
            first, inverse = np.zeros(min(1, len(keys)), dtype=np.int64), np.zeros(len(keys), dtype=np.int64)
        else:
            _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        slices = [self._slice(int(group[i]), int(piece[i])) for i in first.tolist()]
        return gather(slices, inverse.reshape(-1), at, self._schema)

    def row(self, index: int) -> dict[str, Any]:
        """Row ``index`` of the file, as a dict of column values (map-style reads: a slice's rows kept)."""
        if not 0 <= index < self.num_rows:
            raise IndexError(index)
        group, piece, at = (int(v[0]) for v in self._where(np.asarray([index], dtype=np.int64)))
        part, at = divmod(at, BATCH_ROWS)
        rows = self._python.get(
            (group, piece, part), lambda: self._slice(group, piece).slice(part * BATCH_ROWS, BATCH_ROWS).to_pylist()
        )
        row: dict[str, Any] = rows[at]
        return row

    def _slice(self, group: int, piece: int) -> pa.RecordBatch:
        found = self._arrow.get((group, piece))
        if found is not None:
            self._arrow.move_to_end((group, piece))
            return found
        with self._lock:
            found = self._arrow.get((group, piece))
            return found if found is not None else self._decode(group, piece)

    def _decode(self, group: int, piece: int) -> pa.RecordBatch:
        """Decode forward through ``group`` up to slice ``piece``, keeping every slice on the way."""
        rows = int(self._slice_rows[group])
        if self._stream is None or self._position[0] != group or self._position[1] > piece:
            self._stream = self._file.iter_batches(batch_size=rows, row_groups=[group], use_threads=False)
            self._position = (group, 0)
        while True:
            decoded = next(self._stream, None)
            at = self._position[1]
            expected = min(rows, int(self._counts[group]) - at * rows)
            if decoded is None or decoded.num_rows != expected:  # metadata that promises other data
                self._stream = None
                raise ValueError(f"row group {group} slice {at} does not decode to the {expected} rows its footer says")
            decoded.validate(full=True)  # a string that is not UTF-8 fails here, not in a reader's hands
            self._position = (group, at + 1)
            self._keep((group, at), decoded)
            if at == piece:
                return decoded

    def _keep(self, key: tuple[int, int], decoded: pa.RecordBatch) -> None:
        self._arrow[key] = decoded
        self._arrow_bytes += decoded.nbytes
        while self._arrow_bytes > _ARROW_CACHE_BYTES and len(self._arrow) > 1:
            _, dropped = self._arrow.popitem(last=False)
            self._arrow_bytes -= dropped.nbytes

    def close(self) -> None:
        """Drop every decoded slice and the stream (they may hold views of the file's buffer)."""
        with self._lock:
            self._arrow.clear()
            self._python.clear()
            self._stream = None
            self._file.close()


def _slice_rows(group: Any) -> int:
    """Rows of row group ``group`` (its metadata) decoded together: about `SLICE_BYTES`, a power of two."""
    per_row = max(1.0, group.total_byte_size / max(1, group.num_rows))
    rows = 1 << max(0, int(np.log2(SLICE_BYTES / per_row)))
    return int(min(max(rows, _SLICE_ROWS[0]), _SLICE_ROWS[1]))
