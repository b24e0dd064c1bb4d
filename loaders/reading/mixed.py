"""Opening the units of a mixed epoch: one `UnitReaders` per source, each seeing its part of the plan.

A mixed plan numbers all sources' units one after the other. Each source's
`UnitReaders` (its own handle: its own prefetch, future order and residency in
the stager) gets a `SourcePlan`, the same positions with only that source's
units, numbered as in that source; `MixedUnitReaders` hands each position to
the source it reads from. Nothing here holds a value per sample: the source of a
position comes from the unit the plan computes for it (a segment at a time), and
the units' first and last uses are the plan's, per piece.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
from datacache.loaders.plans.indexed import IndexedPositions, _UnitMap
from datacache.loaders.plans.interface import Opening
from datacache.loaders.plans.mixsources import Mix
from datacache.loaders.reading.units import UnitReaders
from datacache.loaders.runtime import NodeFuture, Runtime
from datacache.loaders.shardfiles import UnitReader

__all__ = ["MixedUnitReaders", "SourcePlan"]

IntArray = npt.NDArray[np.int64]


class _Mapped:
    """A column of the plan (its units) seen through ``table``, or less ``shift``: indexable by position or slice."""

    def __init__(self, column: Any, table: IntArray | None = None, shift: int = 0) -> None:
        self._column = column
        self._table = table
        self._shift = shift

    def __len__(self) -> int:
        return len(self._column)

    def __getitem__(self, position: int | slice) -> Any:
        found = self._column[position]
        if self._table is not None:
            found = self._table[found]
        return found - self._shift if isinstance(position, slice) else int(found) - self._shift


class SourcePlan:
    """The positions of a mixed plan that read source ``source``, its units numbered as in that source."""

    def __init__(self, plan: IndexedPositions, offset: int, units: int) -> None:
        self._plan = plan
        self._offset = offset
        self._units = units
        self.unit_of = _Mapped(plan.unit_of, shift=offset)
        self.local = plan.local
        self.padded = plan.padded

    def __len__(self) -> int:
        return len(self._plan)

    def _ours(self, units: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(u - self._offset for u in units if self._offset <= u < self._offset + self._units)

    def _part(self, found: Mapping[int, int]) -> Mapping[int, int]:
        if isinstance(found, _UnitMap):
            return _UnitMap(found.array[self._offset : self._offset + self._units])
        return {u - self._offset: p for u, p in found.items() if self._offset <= u < self._offset + self._units}

    @functools.cached_property
    def first_use(self) -> Mapping[int, int]:
        return self._part(self._plan.first_use)

    @functools.cached_property
    def last_use(self) -> Mapping[int, int]:
        return self._part(self._plan.last_use)

    @functools.cached_property
    def unit_sequence(self) -> tuple[int, ...]:
        return self._ours(self._plan.unit_sequence)

    def releases_after(self, position: int) -> tuple[int, ...]:
        return self._ours(self._plan.releases_after(position))

    def units_from(self, produced: int) -> tuple[int, ...]:
        return self._ours(self._plan.units_from(produced))


class MixedUnitReaders:
    """The units one reader has open, over every source of a mix (see the module's docstring)."""

    def __init__(
        self, runtime: Runtime, epoch: IndexedPositions, opening: Opening, futures: tuple[NodeFuture, ...] | None = None
    ) -> None:
        mix: Mix = runtime.mixed()
        self.runtime = runtime
        self._plan = epoch
        self._source_of_unit = mix.source_of_unit
        self.source_at = _Mapped(epoch.unit_of, self._source_of_unit)
        """The source each position reads (computed with the plan's segment)."""
        self._offsets = mix.unit_offsets
        self._tallied: dict[int, int] = {}
        self.parts: list[UnitReaders] = []
        for source, part in enumerate(mix.parts):
            view = SourcePlan(epoch, int(self._offsets[source]), len(part.units.units))
            readers = UnitReaders(part, view, opening, futures[source] if futures is not None else None)
            self.parts.append(readers)

    @property
    def skipped_why(self) -> dict[int, str]:
        return {
            int(self._offsets[source]) + unit: why
            for source, part in enumerate(self.parts)
            for unit, why in part.skipped_why.items()
        }

    @property
    def staged_bytes(self) -> float:
        return sum(part.staged_bytes for part in self.parts)

    @property
    def staging_seconds(self) -> float:
        return sum(part.staging_seconds for part in self.parts)

    def restart(self, produced: int) -> None:
        for part in self.parts:
            part.restart(produced)

    def close_all(self) -> None:
        for part in self.parts:
            part.close_all()

    def note_retries(self) -> None:
        self.parts[0].note_retries()  # one process, one count: every part would write the same

    def release_after(self, position: int, pool: concurrent.futures.Executor | None) -> None:
        # A unit is released after the last piece that may read it, whichever source that position reads.
        units = self._plan.releases_after(position)
        for source in sorted({int(self._source_of_unit[unit]) for unit in units}):
            self.parts[source].release_after(position, pool)

    def release_range(self, begin: int, stop: int, pool: concurrent.futures.Executor | None) -> None:
        for position in range(begin, stop):
            self.release_after(position, pool)

    def tally(self, position: int, nbytes: int) -> None:
        """Note the payload of the sample at ``position`` (reader threads note distinct positions)."""
        self._tallied[position] = nbytes

    def count_sources(self, begin: int, stop: int) -> tuple[IntArray, IntArray]:
        """``(source, bytes)`` of the samples noted at ``[begin, stop)``, now delivered (forgotten here)."""
        noted = [
            (position, self._tallied.pop(position)) for position in range(begin, stop) if position in self._tallied
        ]
        if not noted:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        positions, nbytes = (np.asarray(column, dtype=np.int64) for column in zip(*noted, strict=True))
        sources: IntArray = self.source_at[begin:stop][positions - begin]
        return sources, nbytes

    def open_ahead(self, begin: int, horizon: int, submit: Callable[..., object]) -> None:
        for part in self.parts:
            part.open_ahead(begin, horizon, submit)

    def reader_at(self, position: int) -> UnitReader | None:
        return self.parts[int(self.source_at[position])].reader_at(position)

    def reader_for(self, unit: int) -> UnitReader | None:
        source = int(np.searchsorted(self._offsets, unit, side="right") - 1)
        return self.parts[source].reader_for(unit - int(self._offsets[source]))

    def skip_damaged(self, unit: int, error: Exception) -> bool:
        source = int(np.searchsorted(self._offsets, unit, side="right") - 1)
        return self.parts[source].skip_damaged(unit - int(self._offsets[source]), error)

    def url_at(self, position: int) -> str:
        # By the source the position reads, not by the reader's `Unit`: a columnar plan makes a
        # `Unit` each time one is asked for, so no object of it lasts to be looked up by.
        return self.parts[int(self.source_at[position])].url
