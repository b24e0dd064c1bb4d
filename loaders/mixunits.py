"""Opening the units of a mixed epoch: one `UnitReaders` per source, each seeing its part of the plan.

A mixed plan numbers all sources' units one after the other. Each source's
`UnitReaders` (its own handle: its own prefetch, future order and residency in
the stager) gets a `SourcePlan`, the same positions with only that source's
units, numbered as in that source; `MixedUnitReaders` hands each position to
the source it reads from.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from datacache.loaders.epoch import EpochPlan
from datacache.loaders.mixed import Mix
from datacache.loaders.prefetch import PrefetchController
from datacache.loaders.readers import UnitReader
from datacache.loaders.runtime import Runtime
from datacache.loaders.units import UnitReaders

__all__ = ["MixedUnitReaders", "SourcePlan"]

IntArray = npt.NDArray[np.int64]


class SourcePlan:
    """The positions of a mixed plan that read source ``source``, its units numbered as in that source."""

    def __init__(self, plan: EpochPlan, mine: npt.NDArray[np.bool_], offset: int, units: int) -> None:
        self._mine = mine
        self.unit_of: IntArray = plan.unit_of - offset
        self.local: IntArray = plan.local
        self.padded = plan.padded
        self._length = len(plan)
        ours = range(offset, offset + units)
        self.first_use = {u - offset: p for u, p in plan.first_use.items() if u in ours}
        self.last_use = {u - offset: p for u, p in plan.last_use.items() if u in ours}
        self.unit_sequence = tuple(u - offset for u in plan.unit_sequence if u in ours)

    def __len__(self) -> int:
        return self._length

    def releases_after(self, position: int) -> tuple[int, ...]:
        if not self._mine[position]:
            return ()
        unit = int(self.unit_of[position])
        return (unit,) if self.last_use.get(unit) == position else ()

    def units_from(self, produced: int) -> tuple[int, ...]:
        if not produced:
            return self.unit_sequence
        upcoming = set(self.unit_of[produced:][self._mine[produced:]].tolist())
        return tuple(u for u in self.unit_sequence if u in upcoming)


class MixedUnitReaders:
    """The units one reader has open, over every source of a mix (see the module's docstring)."""

    def __init__(
        self,
        runtime: Runtime,
        epoch: EpochPlan,
        *,
        controller: PrefetchController,
        row: npt.NDArray[np.float64],
        lock: threading.Lock,
        skip_bad: bool,
        in_consumer: bool,
    ) -> None:
        mix: Mix = runtime.mixed()
        self.runtime = runtime
        self.source_at: IntArray = mix.source_of_unit[epoch.unit_of] if len(epoch) else np.zeros(0, np.int64)
        self._offsets = mix.unit_offsets
        self.parts: list[UnitReaders] = []
        self._url_of_unit: dict[int, str] = {}
        for source, part in enumerate(mix.parts):
            view = SourcePlan(epoch, self.source_at == source, int(self._offsets[source]), len(part.plan.units))
            readers = UnitReaders(
                part,
                view,
                controller=controller,
                row=row,
                lock=lock,
                skip_bad=skip_bad,
                in_consumer=in_consumer,
            )
            self.parts.append(readers)
            self._url_of_unit.update((id(unit), readers.url) for unit in part.plan.units)

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
        self.parts[int(self.source_at[position])].release_after(position, pool)

    def open_ahead(self, begin: int, horizon: int, submit: Callable[..., object]) -> None:
        for part in self.parts:
            part.open_ahead(begin, horizon, submit)

    def reader_at(self, position: int) -> UnitReader | None:
        return self.parts[int(self.source_at[position])].reader_at(position)

    def reader_for(self, unit: int) -> UnitReader | None:
        source = int(np.searchsorted(self._offsets, unit, side="right") - 1)
        return self.parts[source].reader_for(unit - int(self._offsets[source]))

    def url_of(self, reader: UnitReader) -> str:
        return self._url_of_unit[id(reader.unit)]
