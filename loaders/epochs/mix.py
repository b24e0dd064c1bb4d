"""A mixed epoch behind the `plans.interface.Plan` interface: a thin wrapper of `plans.mixsources`.

The mix's own module plans it (`plans.mixsources.mix_plan`, `mix_futures`); this module only
adapts it to what `EpochIterator` asks of every kind of epoch. Its units are opened by source
by the reader (`reading.mixed.MixedUnitReaders`), which also tallies what each source delivered.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from datacache.loaders.order.layout import Cursor, Layout
from datacache.loaders.plans.indexed import IndexedPositions
from datacache.loaders.plans.interface import Dealing, Plan
from datacache.loaders.plans.mixsources import mix_futures, mix_plan
from datacache.loaders.runtime import NodeFuture, Runtime

__all__ = ["MixPlanner", "MixedPlan"]

FloatArray = npt.NDArray[np.float64]


class MixedPlan:
    """A reader's plan of a mixed epoch (`plans.mixsources.mix_plan`), and each source's node future (`mix_futures`)."""

    cold = False

    def __init__(self, positions: IndexedPositions, futures: tuple[NodeFuture, ...] | None = None) -> None:
        self._futures = futures
        self.positions = positions

    def known(self, length: int) -> int:
        return len(self.positions)

    def readable(self, begin: int, size: int, known: int) -> int:
        return known

    def uncounted(self) -> tuple[int, ...]:
        return ()

    def counted(self, unit: int, samples: int, why: str | None = None) -> None:
        return None  # every source was counted when the mix was opened

    def future(self) -> NodeFuture | None:
        return None  # each source's readers tell the stager their own order (`futures`)

    def futures(self) -> tuple[NodeFuture, ...] | None:
        return self._futures


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
        return MixedPlan(positions, futures)

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
