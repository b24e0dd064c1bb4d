"""What the columnar formats (Parquet, Arrow IPC) share: a reader of rows, and the Python rows it keeps.

A format opens its file as a "rows" object (``num_rows``, ``take(indices)``, ``row(index)``,
``close()``); `RowsReader` serves a sample per row, or many rows at once: as one Arrow record
batch (`RowsReader.take`, batch mode: no Python object per row) or as a list of dicts converted
together (`RowsReader.rows`, what per-sample mode gathers a shuffle window's rows with).
`PythonRows` bounds the rows `row` turns into Python objects to a few slices (map-style reads).
"""

from __future__ import annotations

import contextlib
import mmap
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from datacache.errors import ShardReadError
from datacache.formats._base import Buffer, Unit, UnitReader

__all__ = ["PythonRows", "Rows", "RowsReader", "gather"]

IntArray = npt.NDArray[np.int64]

PYTHON_SLICES = 4
"""Slices of Python rows kept per open file."""


class Rows(Protocol):
    num_rows: int

    def take(self, indices: IntArray) -> Any:
        """The rows at ``indices``, in that order, as one ``pa.RecordBatch`` of the file's columns."""
        ...

    def row(self, index: int) -> dict[str, Any]: ...

    def close(self) -> None: ...


class PythonRows:
    """The last few slices of rows turned into Python objects, by slice key (least recently used goes)."""

    def __init__(self, slices: int = PYTHON_SLICES) -> None:
        self._slices = slices
        self._kept: OrderedDict[Hashable, list[dict[str, Any]]] = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        rows = self._kept.get(key)
        if rows is None:
            rows = self._kept[key] = make()
            while len(self._kept) > self._slices:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        return rows

    def clear(self) -> None:
        self._kept.clear()


def gather(slices: list[Any], which: IntArray, at: IntArray, schema: Any) -> Any:
    """One record batch of row ``at[i]`` of ``slices[which[i]]`` for each ``i``, in that order.

    Few rows from many slices: each slice gives its rows, then one ``take`` puts them in order
    (what is copied is the rows asked for); many rows: the slices are joined and taken from once.
    """
    import pyarrow as pa

    if not len(which):
        return pa.RecordBatch.from_pylist([], schema=schema)
    if len(slices) == 1:
        return slices[0].take(pa.array(at))
    lengths = np.asarray([piece.num_rows for piece in slices], dtype=np.int64)
    if int(lengths.sum()) <= 4 * len(which):
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        return pa.concat_batches(slices).take(pa.array(offsets[which] + at))
    ordering = np.argsort(which, kind="stable")
    bounds = np.searchsorted(which[ordering], np.arange(len(slices) + 1))
    parts = [slices[s].take(pa.array(at[ordering[bounds[s] : bounds[s + 1]]])) for s in range(len(slices))]
    back = np.empty_like(ordering)
    back[ordering] = np.arange(len(ordering))
    return pa.concat_batches(parts).take(pa.array(back))


class RowsReader(UnitReader):
    """One file of rows: one sample per row, as a dict of column values, keyed ``<stem>/<row>``."""

    def __init__(self, unit: Unit, where: str, buffer: Buffer, rows: Rows, *, suffix: str, damaged: str) -> None:
        super().__init__(unit, where)
        if rows.num_rows != unit.count:
            rows.close()
            raise ShardReadError(f"{where}: holds {rows.num_rows} rows, it was counted {unit.count}")
        import pyarrow as pa

        self._rows, self._buffer, self._damaged = rows, buffer, damaged
        self._stem = unit.keys[0].removesuffix(suffix)
        self._errors = (pa.ArrowException, OSError, ValueError)  # resolved once, not per row

    @property
    def packable(self) -> bool:
        return False

    def sample(self, index: int) -> dict[str, Any]:
        try:
            row = self._rows.row(index)
        except self._errors as exc:
            raise ShardReadError(f"{self.where}: {self._damaged} at row {index} ({exc})") from None
        row.setdefault("__key__", f"{self._stem}/{index}")  # cached with its slice: set once
        return row

    def take(self, indices: IntArray) -> Any:
        """Rows ``indices`` as one Arrow record batch: the file's columns and ``__key__``, nothing per row in Python."""
        import pyarrow as pa
        import pyarrow.compute as pc

        indices = np.asarray(indices, dtype=np.int64)
        try:
            batch = self._rows.take(indices)
        except (*self._errors, IndexError) as exc:
            raise ShardReadError(f"{self.where}: {self._damaged} in rows {_span(indices)} ({exc})") from None
        # The row numbers as text, the stem put before each (replace_slice: ~3x binary_join's speed)
        keys = pc.binary_replace_slice(pc.cast(pa.array(indices), pa.string()), 0, 0, f"{self._stem}/")
        return batch.append_column("__key__", keys)

    def rows(self, indices: IntArray) -> list[dict[str, Any]]:
        """Rows ``indices`` as dicts (with ``__key__``), converted to Python together, not one at a time."""
        rows: list[dict[str, Any]] = self.take(indices).to_pylist()
        return rows

    def close(self) -> None:
        self._rows.close()
        if isinstance(self._buffer, mmap.mmap):
            # Arrow frees its buffers lazily: a mapping still viewed is released with the last view.
            with contextlib.suppress(BufferError):
                self._buffer.close()


def _span(indices: IntArray) -> str:
    return f"{int(indices.min())}..{int(indices.max())}" if len(indices) else "(none)"
