"""A mixed epoch behind the `planning.Plan` interface: a thin wrapper of `mixed` and `mixunits`.

The mix's own modules plan it (`mixed.mix_plan`) and open its units by source
(`mixunits.MixedUnitReaders`); this module only adapts them to what
`EpochIterator` asks of every kind of epoch, and tallies what each source
delivered (`stats().sources`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from datacache.loaders.epoch import EpochPlan
from datacache.loaders.mixed import mix_plan
from datacache.loaders.mixunits import MixedUnitReaders
from datacache.loaders.order import Cursor, Layout
from datacache.loaders.planning import Dealing, Opening, Plan
from datacache.loaders.runtime import NodeFuture, Runtime, Units

__all__ = ["MixPlanner", "MixedPlan"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


class _MixTally:
    """Each position's payload, as reader threads note it; added to its source's row once delivered."""

    def __init__(self, length: int) -> None:
        self._noted = np.full(length, -1, dtype=np.int64)
        self.source_at: IntArray = np.zeros(0, dtype=np.int64)
        """Each position's source, once the units are open (`MixedUnitReaders.source_at`)."""

    @property
    def note(self) -> Callable[[int, int], None]:
        return self._note

    def _note(self, position: int, nbytes: int) -> None:
        self._noted[position] = nbytes  # reader threads note distinct positions

    def delivered(self, begin: int, stop: int, rows: FloatArray, lock: threading.Lock) -> None:
        noted = self._noted[begin:stop]
        delivered = noted >= 0
        sources = self.source_at[begin:stop][delivered]
        with lock:
            np.add.at(rows[:, 0], sources, 1)
            np.add.at(rows[:, 1], sources, noted[delivered])


class MixedPlan:
    """A reader's plan of a mixed epoch (`mixed.mix_plan`): whole arrays, every count known."""

    cold = False

    def __init__(self, runtime: Runtime | None, reads: EpochPlan) -> None:
        self._runtime = runtime
        self.reads = reads
        self.sources = _MixTally(len(reads))

    def known(self, length: int) -> int:
        return len(self.reads)

    def readable(self, begin: int, size: int, known: int) -> int:
        return known

    def future(self) -> NodeFuture | None:
        return None  # each source's readers tell the stager their own order (`mixunits`)

    def open_units(self, opening: Opening) -> Units:
        if self._runtime is None:
            raise TypeError("this plan was made from plain values (a test's): it has no units to open")
        units = MixedUnitReaders(self._runtime, self.reads, **opening.arguments())
        self.sources.source_at = units.source_at
        return units


class MixPlanner:
    """The `planning.Planner` of a mix of sources: every source counted when it was opened (`mixed.open_mix`)."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._mix = runtime.mixed()

    def plan(self, layout: Layout, dealing: Dealing, *, epoch: int, cursors: tuple[Cursor, ...]) -> Plan:
        reads = mix_plan(
            self.runtime,
            layout,
            seed=dealing.seed,
            epoch=epoch,
            shuffle=dealing.shuffle,
            drop_last=dealing.drop_last,
            cursors=cursors,
        )
        return MixedPlan(self.runtime, reads)

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
