"""What an `EpochIterator` needs of an epoch's plan, whatever kind of epoch it is.

Three kinds of epoch are read: an *indexed* one (every sample count known:
`epochs.dataset.IndexedPlan`), a dataset's *first* one while its counts still
arrive (whole shards dealt, the plan growing as they are counted:
`epochs.dataset.ColdPlan`), and a *mixed* one over several sources
(`epochs.mix.MixedPlan`). Each is an object with the `Plan` interface, made by
its dataset's `Planner` (`epochs.dataset.DatasetPlanner`, `epochs.mix.MixPlanner`);
the iterator talks only to these two, never asks which kind it reads.

`loaders.testing.PlanTests` is the contract every kind passes: every sample
once across ranks and workers, equal rank lengths, resume on another layout.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt
from datacache.loaders.order.layout import Cursor, Dealing, Layout
from datacache.loaders.plans.positions import Positions
from datacache.loaders.runtime import NodeFuture

if TYPE_CHECKING:
    from datacache.loaders.reading.prefetch import PrefetchController

__all__ = ["Dealing", "Opening", "Plan", "Planner"]

FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Opening:
    """What the units a reader opens share with it (`reading.units.UnitReaders`, `reading.batching.BatchBuilder`).

    Its prefetch controller, stats row and the lock that guards it, whether a bad unit is skipped,
    and whether the reader runs in the training process.
    """

    controller: PrefetchController
    row: FloatArray
    lock: threading.Lock
    skip_bad: bool
    in_consumer: bool


class Plan(Protocol):
    """One reader's plan of one epoch, whatever its kind."""

    @property
    def positions(self) -> Positions:
        """Each position's unit and index in it; the unit sequence, first use and release (prefetch, closing)."""
        ...

    @property
    def cold(self) -> bool:
        """Whether a cursor saved in this epoch says so: resume then deals what the cold dealing left."""
        ...

    def known(self, length: int) -> int:
        """Positions laid out once ``length`` of them are, or as many as the counts known allow.

        A plan whose counts are still arriving grows here; the others are whole from the start.
        A plan never opens a shard: where it stops short for want of a count, `uncounted` says
        which units the reader should open and count (`counted`).
        """
        ...

    def uncounted(self) -> tuple[int, ...]:
        """The units whose sample counts the plan needs to lay out more positions (none: it needs none)."""
        ...

    def counted(self, unit: int, samples: int, why: str | None = None) -> None:
        """Hand the plan ``unit``'s count, found by opening it; ``why``: it could not be read (counts 0)."""
        ...

    def readable(self, begin: int, size: int, known: int) -> int:
        """Where reading ahead from ``begin`` in batches of ``size`` may stop, ``known`` positions laid out.

        A plan still growing lets readers ahead only over whole batches laid out.
        """
        ...

    def future(self) -> NodeFuture | None:
        """Every reader's units on this node, in order (eviction keeps what comes soonest); None: not known."""
        ...

    def futures(self) -> tuple[NodeFuture, ...] | None:
        """A mix's: each source's node future (its readers tell the stager their own order); else None."""
        ...


class Planner(Protocol):
    """A dataset's epochs: makes each reader's `Plan`, and says what a saved state records of it.

    The switch from "some counts unknown" to "every count known" happens here (`complete`), and
    only here: a planner is the one thing that changes its runtime's unit plan and window.
    """

    def plan(self, layout: Layout, dealing: Dealing, *, epoch: int, cursors: tuple[Cursor, ...]) -> Plan:
        """Reader ``layout``'s plan of epoch ``epoch``, less what ``cursors`` say was consumed."""
        ...

    def complete(self) -> None:
        """Wait for every sample count; from then on every epoch is indexed."""
        ...

    def total(self) -> int:
        """Samples in one epoch, across all ranks (waits for every count)."""
        ...

    def empty(self) -> bool:
        """Whether an epoch is known to hold no sample (without waiting for counts)."""
        ...

    def cold(self, dealing: Dealing, epoch: int) -> bool:
        """Whether epoch ``epoch``, read from its start, is dealt before every count is known."""
        ...

    def identity(self) -> tuple[str, str]:
        """``(dataset id, manifest snapshot)`` a saved state names: a resume needs the same."""
        ...

    def state_fields(self) -> dict[str, object]:
        """What else a saved state records of this dataset's epochs, to be found equal on resume."""
        ...
