"""One reader's plan for an epoch: which samples it yields, in what order, from which units.

Pure arithmetic on plain values (numpy, no I/O, no torch): the global order
and the dealing come from `datacache.loaders.order.windows`, a reader's share of
them from `datacache.loaders.plans.indexed`, computed a segment at a time; this
module picks the order of an epoch (resumed after earlier layouts) and says
every reader's units in order for the node's future. Nothing here costs more
than the shards do.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt
from datacache.loaders.plans.counts import save_plan
from datacache.loaders.plans.indexed import (
    IndexedPositions,
    epoch_sequence,
    node_epoch_sequences,
    node_unit_sequences,
    plan_epoch,
)

if TYPE_CHECKING:
    from datacache.loaders.runtime import Runtime

__all__ = [
    "PositionTable",
    "Positions",
    "auto_window",
    "epoch_sequence",
    "node_epoch_sequences",
    "node_unit_sequences",
    "plan_epoch",
]

IntArray = npt.NDArray[np.int64]


class Column(Protocol):
    """A value per position of a reader's plan (an array, or one computed a segment at a time)."""

    def __getitem__(self, position: int, /) -> Any: ...

    def __len__(self) -> int: ...


class Positions(Protocol):
    """What readers need of a plan: a `IndexedPositions`, an `PositionTable`, or a cold epoch's plan that grows."""

    @property
    def unit_of(self) -> Column: ...

    @property
    def local(self) -> Column: ...

    @property
    def padded(self) -> int: ...

    @property
    def first_use(self) -> Mapping[int, int]: ...

    @property
    def last_use(self) -> Mapping[int, int]: ...

    @property
    def unit_sequence(self) -> tuple[int, ...]: ...

    def __len__(self) -> int: ...

    def units_from(self, produced: int) -> tuple[int, ...]: ...

    def releases_after(self, position: int) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class PositionTable:
    """A reader's plan as whole arrays, position by position: a mix's (its readers split them by source)."""

    ids: IntArray
    """Global sample ids, in the order this reader yields them."""
    unit_of: IntArray
    """The unit each position reads from."""
    local: IntArray
    """Each position's sample index within its unit."""
    padded: int
    """Positions that repeat another rank's samples to equalise rank lengths."""
    first_use: dict[int, int]
    """Unit -> first position that reads it."""
    last_use: dict[int, int]
    """Unit -> last position that reads it (the unit can be closed after it)."""
    unit_sequence: tuple[int, ...]
    """Units in the order they are first needed."""

    def __len__(self) -> int:
        return len(self.ids)

    def releases_after(self, position: int) -> tuple[int, ...]:
        unit = int(self.unit_of[position])
        return (unit,) if self.last_use.get(unit) == position else ()

    def units_from(self, produced: int) -> tuple[int, ...]:
        """`unit_sequence` less the units no position from ``produced`` on reads."""
        if not produced:
            return self.unit_sequence
        upcoming = set(self.unit_of[produced:].tolist())
        return tuple(u for u in self.unit_sequence if u in upcoming)

    @classmethod
    def of(cls, plan: IndexedPositions) -> PositionTable:
        """``plan`` computed whole (O(the reader's samples))."""
        unit_of, local = plan.columns(np.arange(len(plan), dtype=np.int64))
        last_use: dict[int, int] = {}
        first_use: dict[int, int] = {}
        for position, unit in enumerate(unit_of.tolist()):
            last_use[unit] = position
            first_use.setdefault(unit, position)
        return cls(
            ids=plan.bounds[unit_of] + local,
            unit_of=unit_of,
            local=local,
            padded=plan.padded,
            first_use=first_use,
            last_use=last_use,
            unit_sequence=tuple(sorted(first_use, key=first_use.__getitem__)),
        )


def auto_window(total: int, units: int) -> int:
    """Default shuffle window: two shards' worth of samples, within [256, 16384]."""
    per_unit = total / max(1, units)
    return int(min(16384, max(256, round(2 * per_unit))))


def settle_counts(runtime: Runtime, shuffle_buffer: int | None) -> None:
    """Every count known: the complete unit plan (saved for the node) and the default window.

    A dataset's planner and a mix's sources call it (a mix shares its epoch out by the sizes).
    """
    book = runtime.book
    plan = runtime.units
    if book is not None:
        plan = book.completed_plan()
        runtime.run(save_plan(runtime.settings, runtime.handle, plan))
    runtime.counted(plan, runtime.window or shuffle_buffer or auto_window(plan.total, len(plan.units)))
