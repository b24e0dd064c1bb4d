"""Table rows (Parquet, Arrow) read many at a time: a batch by one ``take``, samples converted together.

A shuffle window visits the rows of a few files in a permuted order; reading them one at a
time decoded (or converted to Python) a slice of rows per sample. Here the positions a reader
reads next are grouped by unit and each unit's rows are taken from its decoded slices at once:

- **batch mode** (`arrow_batch`): the batch is the units' ``take`` results put in position
  order, an Arrow record batch built without a Python object per row; `ArrowChunks` takes
  `CHUNK_BATCHES` batches' rows at once (one ``take`` and one key column per unit for all of
  them: what a call costs is paid per chunk, not per batch) and cuts the batches from it
  (`ArrowChunks.built`: the iterator hands a built chunk's batches out from a list);
- **per-sample mode**, rows passed as they are (`ready_rows`): the next chunk of positions'
  rows (`chunk_rows`: up to 4,096, about `CHUNK_BYTES` of Arrow data) become dicts together
  (`python_rows`: each column converted at once) and are handed out from a list, counted per chunk;
- **per-sample mode** with a decoder, a transform or a mix (`RowsAhead`): a unit's rows among
  the next `AHEAD` positions become dicts together, kept until their positions are read.

Memory: a chunk of rows as Python objects, or two chunks of Arrow batches (about `CHUNK_BYTES`
each), beside the decoded slices.

Both leave the order, the positions counted and what is skipped exactly as the one-by-one path
(a batch chunk opens the units of its later batches a little earlier).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Container
from typing import Any

import numpy as np
import numpy.typing as npt
from datacache.loaders.plans.indexed import IndexedPositions, Segmented
from datacache.loaders.plans.positions import Positions
from datacache.loaders.runtime import Units

from datacache.errors import ShardReadError
from datacache.formats._rows import RowsReader

__all__ = [
    "AHEAD",
    "CHUNK_BATCHES",
    "CHUNK_ROWS",
    "ArrowChunks",
    "RowsAhead",
    "arrow_batch",
    "chunk_rows",
    "python_rows",
    "ready_rows",
]

IntArray = npt.NDArray[np.int64]
AHEAD = 256
"""Positions per-sample mode (with a decoder, a transform or a mix) looks ahead to convert a unit's rows together."""
CHUNK_ROWS = (64, 4096)
"""The fewest and most rows `ready_rows` converts together (rows passed as they are)."""
CHUNK_BYTES = 8 << 20
"""About how many bytes of Arrow data one chunk of rows converts: big rows come fewer at a time."""
CHUNK_BATCHES = 16
"""Batches batch mode takes together at most (`ArrowChunks`), as long as they hold about `CHUNK_BYTES`."""
Taken = tuple[Any, int, IntArray]
"""A record batch (None: every row skipped), the positions skipped, each row's offset from the first position."""


def chunk_rows(nbytes: int, rows: int) -> int:
    """Rows for the next chunk, from the last chunk's Arrow bytes and rows."""
    per_row = max(1, nbytes // max(1, rows))
    return int(min(max(CHUNK_BYTES // per_row, CHUNK_ROWS[0]), CHUNK_ROWS[1]))


def _columns(plan: Positions, begin: int, stop: int) -> tuple[IntArray, IntArray]:
    if isinstance(plan, Segmented):
        return plan.span(begin, stop)  # from the segments it keeps: computed once per position
    unit_of: Any = plan.unit_of  # every plan's columns take slices (`Column` promises positions only)
    local_of: Any = plan.local
    units = np.asarray(unit_of[begin:stop], dtype=np.int64)
    local = np.asarray(local_of[begin:stop], dtype=np.int64)
    return units, local


def arrow_batch(
    units: Units, plan: Positions, begin: int, stop: int, tally: Callable[[int, int], None] | None
) -> tuple[Any, int, IntArray] | None:
    """Positions ``[begin, stop)`` as one record batch, the count skipped and each row's offset from ``begin``.

    None if a unit is not table rows (or the units' columns differ): the one-by-one path reads them.

    Units are opened in the order the positions first read them (as one-by-one reads would).
    """
    import pyarrow as pa

    unit_of, local = _columns(plan, begin, stop)
    if len(unit_of) and int(unit_of.min()) == int(unit_of.max()):  # one unit: most batches of a window
        distinct, first, inverse = unit_of[:1], np.zeros(1, dtype=np.int64), np.zeros(len(unit_of), dtype=np.int64)
    else:
        distinct, first, inverse = np.unique(unit_of, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    parts: list[tuple[IntArray, Any]] = []
    skipped = 0
    for which in np.argsort(first, kind="stable").tolist():
        unit = int(distinct[which])
        reader = units.reader_for(unit)
        mine = np.nonzero(inverse == which)[0]
        if reader is None:
            skipped += len(mine)
            continue
        if not isinstance(reader, RowsReader):
            return None
        try:
            parts.append((mine, reader.take(local[mine])))
        except ShardReadError as exc:
            if not units.skip_damaged(unit, exc):
                raise
            skipped += len(mine)
    if not parts:
        return None if not skipped else (None, skipped, np.zeros(0, dtype=np.int64))
    if len({part.schema for _, part in parts}) > 1:
        return None  # sources of other columns: the one-by-one path unites them
    batch = parts[0][1] if len(parts) == 1 else pa.concat_batches([part for _, part in parts])
    taken = np.concatenate([mine for mine, _ in parts])
    if len(parts) > 1:
        batch = batch.take(pa.array(np.argsort(taken, kind="stable")))
        taken.sort()
    if tally is not None:
        for offset, nbytes in zip(taken.tolist(), _payload(batch).tolist(), strict=True):
            tally(begin + offset, nbytes)
    return batch, skipped, taken


class ArrowChunks:
    """Batch mode's record batches cut from chunks of up to `CHUNK_BATCHES` batches taken at once.

    Reader threads (and the consumer, for a batch of a chunk built: `cut_later`) ask for batches
    out of order, so chunks are aligned: the first batch asked for
    is taken alone and its bytes fix the chunk's span (`CHUNK_BYTES`); chunk ``j`` covers
    ``span`` positions from ``origin + j * span``. A batch not inside one chunk, a chunk whose rows
    `arrow_batch` does not take, and a chunk that raised (a damaged file, a failed open: the error
    is raised again by its own batch, as read alone) are read batch by batch. A slice of a chunk
    holds the rows the batch would hold alone, in the same order: the order, the positions
    counted and what is skipped are the per-batch path's (only when a unit is opened moves ahead
    within the chunk). The last two chunks are kept (the threads build at most `reading.batching.LOOKAHEAD`
    batches ahead).
    """

    def __init__(self, units: Units, plan: Positions) -> None:
        self._units = units
        self._plan = plan
        self._lock = threading.Lock()
        self._origin: int | None = None
        self._span = 0
        self._chunks: OrderedDict[int, tuple[int, int, Any, IntArray] | None] = OrderedDict()

    @staticmethod
    def fits(plan: Positions, tally: Callable[[int, int], None] | None) -> bool:
        """Whether ``plan``'s batches can be cut from chunks: a fixed plan, no per-source tally (a mix)."""
        return tally is None and isinstance(plan, IndexedPositions)

    def batch(self, begin: int, stop: int) -> Taken | None:
        """What `arrow_batch` returns for positions ``[begin, stop)`` (with no tally)."""
        if self._origin is None:
            with self._lock:
                if self._origin is None:
                    built = arrow_batch(self._units, self._plan, begin, stop, None)
                    nbytes = built[0].nbytes if built is not None and built[0] is not None else 0
                    batches = min(CHUNK_BATCHES, CHUNK_BYTES // max(1, nbytes)) if nbytes else 1
                    self._span = (stop - begin) * max(1, batches)
                    self._origin = stop  # set last: threads read both without the lock
                    return built
        index = (begin - self._origin) // self._span if self._span > stop - begin else -1
        start = self._origin + index * self._span
        if index < 0 or stop > start + self._span:
            return arrow_batch(self._units, self._plan, begin, stop, None)
        chunk = self._chunk(index, start, min(start + self._span, len(self._plan)))
        if chunk is None or stop > chunk[1]:
            return arrow_batch(self._units, self._plan, begin, stop, None)
        return self._cut(chunk, begin, stop)

    def built(self, begin: int, stop: int) -> Taken | None:
        """`batch` of ``[begin, stop)`` if it is a cut of a chunk built already; None if not (builds nothing)."""
        if self._origin is None or self._span <= stop - begin:
            return None
        index = (begin - self._origin) // self._span
        start = self._origin + index * self._span
        chunk = self._chunks.get(index) if index >= 0 and stop <= start + self._span else None
        return None if chunk is None or stop > chunk[1] else self._cut(chunk, begin, stop)

    @staticmethod
    def _cut(chunk: tuple[int, int, Any, IntArray], begin: int, stop: int) -> Taken:
        start, end, batch, taken = chunk
        if len(taken) == end - start:  # nothing skipped in the chunk: row i is position start + i
            low, high = begin - start, stop - start
        else:
            low, high = int(taken.searchsorted(begin - start)), int(taken.searchsorted(stop - start))
        skipped = (stop - begin) - (high - low)
        if batch is None or high == low:
            return None, skipped, np.zeros(0, dtype=np.int64)
        return batch.slice(low, high - low), skipped, taken[low:high] - (begin - start)

    def cut_later(self, begin: int, stop: int, pending: Container[int]) -> bool:
        """Whether `batch` of ``[begin, stop)`` will be a cut of a chunk built already, or being built for
        the batch at the chunk's start in ``pending``: a cut costs microseconds, less than a thread's hop."""
        if self._origin is None or self._span <= stop - begin:
            return False
        index = (begin - self._origin) // self._span
        start = self._origin + index * self._span
        if index < 0 or stop > start + self._span:
            return False
        return index in self._chunks or (start != begin and start in pending)

    def _chunk(self, index: int, start: int, stop: int) -> tuple[int, int, Any, IntArray] | None:
        if index in self._chunks:  # built: cut without waiting for a thread building the next one
            with contextlib.suppress(KeyError):  # dropped in between: built again below
                return self._chunks[index]
        with self._lock:
            if index in self._chunks:
                return self._chunks[index]
            try:
                built = arrow_batch(self._units, self._plan, start, stop, None)
            except Exception:  # raised again where the batch holding its position is read alone
                built = None
            chunk = None if built is None else (start, stop, built[0], built[2])
            self._chunks[index] = chunk
            while len(self._chunks) > 2:
                self._chunks.popitem(last=False)
            return chunk


def ready_rows(
    units: Units, plan: Positions, begin: int, stop: int
) -> tuple[list[Any], list[int] | None, int, int, int] | None:
    """Per-sample mode's rows of ``[begin, stop)``, converted together (`arrow_batch`, then `python_rows`).

    Returns ``(rows, after, skipped, payload bytes, Arrow bytes)``: ``rows`` last first; ``after``
    (last first too) the positions consumed once each row is delivered (the last one consumes up
    to ``stop``, skipped positions included), or None when no position was skipped: then each row
    consumes one more position than the row before (no pair per row: per-sample mode yields
    millions of rows a second, and a tuple each, with the collections it sets off, cost ~15%).
    None as `arrow_batch`.
    """
    built = arrow_batch(units, plan, begin, stop, None)
    if built is None:
        return None
    batch, skipped, taken = built
    if batch is None or not batch.num_rows:
        return [], None, skipped, 0, 0
    rows = python_rows(batch)
    rows.reverse()
    after: list[int] | None = None
    if len(rows) != stop - begin:
        consumed = taken + begin + 1
        consumed[-1] = stop
        after = consumed[::-1].tolist()
    return rows, after, skipped, int(_payload(batch).sum()), int(batch.nbytes)


def python_rows(batch: Any) -> list[dict[str, Any]]:
    """``batch.to_pylist()``, ~20% faster for up to four columns: each column turned into Python
    objects at once, the dicts built by a display (what per-sample mode spends most of its time on)."""
    names = batch.schema.names
    if len(set(names)) != len(names) or not 1 <= len(names) <= 4:
        rows: list[dict[str, Any]] = batch.to_pylist()
        return rows
    columns = [column.to_pylist() for column in batch.columns]
    if len(names) == 1:
        (n0,) = names
        return [{n0: a} for a in columns[0]]
    if len(names) == 2:
        n0, n1 = names
        return [{n0: a, n1: b} for a, b in zip(*columns, strict=True)]
    if len(names) == 3:
        n0, n1, n2 = names
        return [{n0: a, n1: b, n2: c} for a, b, c in zip(*columns, strict=True)]
    n0, n1, n2, n3 = names
    return [{n0: a, n1: b, n2: c, n3: d} for a, b, c, d in zip(*columns, strict=True)]


def _payload(batch: Any) -> IntArray:
    """Each row's payload bytes as `reading.batching.sample_bytes` counts a row dict's: its binary values."""
    import pyarrow as pa
    import pyarrow.compute as pc

    total = np.zeros(batch.num_rows, dtype=np.int64)
    for name, column in zip(batch.schema.names, batch.columns, strict=True):
        if name.startswith("__") or not (pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type)):
            continue
        total += np.asarray(pc.fill_null(pc.binary_length(column), 0), dtype=np.int64)
    return total


class RowsAhead:
    """Per-sample reads of table rows, a unit's rows among the next `AHEAD` positions converted together."""

    def __init__(self, plan: Positions, units: Units) -> None:
        self._plan = plan
        self._units = units
        self._rows: dict[int, dict[str, Any]] = {}

    def sample(self, position: int, local: int, reader: Any, known: int) -> dict[str, Any] | None:
        """The sample at ``position`` (``local`` in ``reader``'s unit); ``known``: positions laid out.

        None: the unit turned out damaged and is skipped (``on_error="skip"``).
        """
        found = self._rows.pop(position, None)
        if found is not None:
            return found
        if not isinstance(reader, RowsReader):
            sample: dict[str, Any] = reader.sample(local)
            return sample
        stop = max(position + 1, min(position + AHEAD, known))
        unit_of, locals_ = _columns(self._plan, position, stop)
        mine = np.nonzero(unit_of == unit_of[0])[0]
        positions = [position + offset for offset in mine.tolist()]
        fresh = [i for i, at in enumerate(positions) if at not in self._rows]
        try:
            rows = reader.rows(locals_[mine[fresh]])
        except ShardReadError as exc:
            if not self._units.skip_damaged(int(unit_of[0]), exc):
                raise
            return None
        for i, row in zip(fresh, rows, strict=True):
            self._rows[positions[i]] = row
        return self._rows.pop(position)

    def clear(self) -> None:
        """Forget the rows read ahead (the reader restarts at another position)."""
        self._rows.clear()
