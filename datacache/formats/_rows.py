"""What the columnar formats (Parquet, Arrow IPC) share: a reader of rows, and the Python rows it keeps.

A format opens its file as a "rows" object (``num_rows``, ``row(index)``, ``close()``);
`RowsReader` serves a sample per row and `PythonRows` bounds the rows turned into Python
objects to a few slices (a shuffle window draws from a few at a time).
"""

from __future__ import annotations

import contextlib
import mmap
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, Protocol

from datacache.errors import ShardReadError
from datacache.formats._base import Buffer, Unit, UnitReader

__all__ = ["PythonRows", "Rows", "RowsReader"]

PYTHON_SLICES = 4
"""Slices of Python rows kept per open file."""


class Rows(Protocol):
    num_rows: int

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

    def close(self) -> None:
        self._rows.close()
        if isinstance(self._buffer, mmap.mmap):
            # Arrow frees its buffers lazily: a mapping still viewed is released with the last view.
            with contextlib.suppress(BufferError):
                self._buffer.close()
