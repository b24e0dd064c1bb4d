"""A mixed epoch behind the `plans.interface.Plan` interface: a thin wrapper of `plans.mixsources` and `reading.mixed`.

The mix's own modules plan it (`plans.mixsources.mix_plan`) and open its units by source
(`reading.mixed.MixedUnitReaders`); this module only adapts them to what
`EpochIterator` asks of every kind of epoch, and tallies what each source
delivered (`stats().sources`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from datacache.loaders.order.layout import Cursor, Layout
from datacache.loaders.plans.indexed import IndexedPositions
from datacache.loaders.plans.interface import Dealing, Opening, Plan
from datacache.loaders.plans.mixsources import mix_futures, mix_plan
from datacache.loaders.reading.mixed import MixedUnitReaders
from datacache.loaders.runtime import NodeFuture, Runtime, Units

__all__ = ["MixPlanner", "MixedPlan"]

FloatArray = npt.NDArray[np.float64]


class _MixTally:
    """What each source delivered, counted by the mix's readers (`MixedUnitReaders.tally`), per segment."""

    def __init__(self) -> None:
        self.units: MixedUnitReaders | None = None
        """The readers that know each position's source, once the units are open."""

    @property
    def note(self) -> Callable[[int, int], None] | None:
        return self.units.tally if self.units is not None else None

    def delivered(self, begin: int, stop: int, rows: FloatArray, lock: threading.Lock) -> None:
        if self.units is None:
            return
        sources, nbytes = self.units.count_sources(begin, stop)
        with lock:
            np.add.at(rows[:, 0], sources, 1)
            np.add.at(rows[:, 1], sources, nbytes)


class MixedPlan:
    """A reader's plan of a mixed epoch (`plans.mixsources.mix_plan`), and each source's node future (`mix_futures`)."""

    cold = False

    def __init__(
        self, runtime: Runtime | None, positions: IndexedPositions, futures: tuple[NodeFuture, ...] | None = None
    ) -> None:
        self._runtime = runtime
        self._futures = futures
        self.positions = positions
        self.sources = _MixTally()

    def known(self, length: int) -> int:
        return len(self.positions)

    def readable(self, begin: int, size: int, known: int) -> int:
        return known

    def future(self) -> NodeFuture | None:
        return None  # each source's readers tell the stager their own order (`reading.mixed`)

    def open_units(self, opening: Opening) -> Units:
        if self._runtime is None:
            raise TypeError("this plan was made from plain values (a test's): it has no units to open")
        units = MixedUnitReaders(self._runtime, self.positions, futures=self._futures, **opening.arguments())
        self.sources.units = units
        return units


class MixPlanner:
    """The `interface.Planner` of a mix of sources: every source counted when it was opened (`mixsources.open_mix`)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._mix = runtime.mixed()

    def plan(self, layout: Layout, dealing: Dealing, *, epoch: int, cursors: tuple[Cursor, ...]) -> Plan:
        seed, shuffle, drop_last = dealing.seed, dealing.shuffle, dealing.drop_last
        positions = mix_plan(
            self.runtime, layout, seed=seed, epoch=epoch, shuffle=shuffle, drop_last=drop_last, cursors=cursors
        )
        futures = mix_futures(
            self.runtime, layout, seed=seed, epoch=epoch, shuffle=shuffle, drop_last=drop_last, cursors=cursors
        )
        return MixedPlan(self.runtime, positions, futures)

    def complete(self) -> None:
        return None  # every source's counts were awaited when the mix was opened

    def total(self) -> int:
        return self._mix.total

    def empty(self) -> bool:
        return self._mix.total == 0

    def cold(self, dealing: Dealing, epoch: int) -> bool:
        return False

    def identity(self) -> tuple[str, str]:
        return self._mix.identity()

    def state_fields(self) -> dict[str, object]:
        return {"mix": self._mix.counts.tolist(), "replacement": self._mix.replacement}
