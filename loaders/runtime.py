"""What one process holds for a dataset (`Runtime`), the node's future reads (`NodeFuture`), and the
protocol of the units a plan reads (`Units`)."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from datacache.loaders.openunits import OpenUnits
from datacache.loaders.shardfiles import SpanCache, UnitPlan, UnitReader
from datacache.tiers import redact_url

from datacache._sync import LoopThread
from datacache.access import ShardAccess
from datacache.catalog import process_owner
from datacache.config import Settings
from datacache.errors import ConfigError
from datacache.formats import SampleFormat, get_format
from datacache.staging import DatasetHandle, FutureOrder

if TYPE_CHECKING:
    from datacache.loaders.plans.cold import CountBook
    from datacache.loaders.plans.mixsources import Mix

__all__ = ["NodeFuture", "Runtime", "Units"]


@dataclass
class Runtime:
    """What one process opened for a dataset; never pickled."""

    pid: int
    loop: LoopThread
    settings: Settings
    access: ShardAccess
    handle: DatasetHandle
    units: UnitPlan
    """The dataset's units and their sample counts (some -1 while a first epoch counts them)."""
    window: int
    closed: bool = False
    spans: SpanCache = field(default_factory=SpanCache)
    """Tar indexes scanned on this node: later epochs and workers reuse them instead of scanning again."""
    book: CountBook | None = None
    """The sample counts this process knows, while some are unknown (given when made; see `counted`)."""
    opened: OpenUnits = field(default_factory=OpenUnits)
    """Units open in this process, shared by its readers (`OpenUnits`)."""
    mix: Mix | None = None
    """The sources of a dataset of several (or of one with an epoch size), given when made: None otherwise."""
    kind: SampleFormat = field(init=False)
    """The dataset's format (`formats.get_format`), which opens a unit's reader."""
    where: str = field(init=False)
    """``dataset <id>``, as messages name it."""
    url: str = field(init=False)
    """The URL (credentials redacted: samples travel to logs and files) the shard keys are relative to."""
    owner: str = field(init=False)
    """This process as the stager's leases name it (``host:pid``)."""
    unit_bytes: float = field(init=False)
    """The mean size of a unit, in bytes (a reader's prefetch depth follows from it)."""

    def __post_init__(self) -> None:
        # Found once per process, not once per reader or note.
        self.kind = get_format(self.handle.manifest.format.value)
        self.where = f"dataset {self.handle.id}"
        self.url = redact_url(self.handle.config.url).rstrip("/")
        self.owner = process_owner()
        self.unit_bytes = self.handle.manifest.total_bytes / max(1, len(self.units.units))

    def counted(self, units: UnitPlan, window: int) -> None:
        """Every sample count is known: ``units`` holds them, ``window`` is the default shuffle window.

        Called by `epochs.dataset.DatasetPlanner.complete` only: the one switch from counts unknown to known.
        """
        self.units, self.window, self.book = units, window, None

    def mixed(self) -> Mix:
        """The mix this runtime reads (a mixed dataset's)."""
        if self.mix is None:
            raise ConfigError(f"dataset {self.handle.id} is not a mix of sources")
        return self.mix

    def close(self) -> None:
        if self.pid != os.getpid() or self.closed:
            return
        self.closed = True
        try:
            self.loop.run(self.access.close(), timeout=30)
        finally:
            self.loop.close()


@dataclass(frozen=True)
class NodeFuture:
    """The node's future reads (every reader's units, from `positions.node_unit_sequences`) and this reader's name."""

    reader: str
    epoch: int
    units: Mapping[str, tuple[int, ...]]
    later: Callable[[], Mapping[str, tuple[int, ...]] | None] | None = None
    """A cold epoch's: the next epoch's units by reader, once its sample counts are all known (else None)."""
    split: int | None = None
    """Where this reader's units of the next epoch begin, once `grown` appended them."""

    def grown(self) -> NodeFuture | None:
        """This future and the next epoch's reads after it, when `later` can say them now (else None)."""
        more = self.later() if self.later is not None else None
        if more is None:
            return None
        units = {name: (*self.units.get(name, ()), *more.get(name, ())) for name in {*self.units, *more}}
        return NodeFuture(self.reader, self.epoch, units, split=len(self.units.get(self.reader, ())))

    def order(self, plan: UnitPlan) -> FutureOrder:
        """The same future in shard keys, as the stager takes it."""
        return FutureOrder(
            self.epoch,
            {name: tuple(key for u in units for key in plan.units[u].keys) for name, units in self.units.items()},
        )

    def after(self, units_this_epoch: int) -> tuple[int, ...]:
        """This reader's units of the next epoch: its sequence past the ``units_this_epoch`` of this one."""
        return self.units.get(self.reader, ())[units_this_epoch if self.split is None else self.split :]

    def key_positions(self, plan: UnitPlan) -> dict[int, int]:
        """Unit -> the position of its first key in this reader's sequence (this epoch's part)."""
        found: dict[int, int] = {}
        position = 0
        for unit in self.units.get(self.reader, ()):
            found.setdefault(unit, position)
            position += len(plan.units[unit].keys)
        return found


class Units(Protocol):
    """What walking a plan needs of the units it reads: `UnitReaders`, or `reading.mixed.MixedUnitReaders`."""

    runtime: Runtime

    @property
    def skipped_why(self) -> dict[int, str]: ...

    @property
    def staged_bytes(self) -> float: ...

    @property
    def staging_seconds(self) -> float: ...

    def restart(self, produced: int) -> None: ...

    def close_all(self) -> None: ...

    def note_retries(self) -> None: ...

    def release_after(self, position: int, pool: concurrent.futures.Executor | None) -> None: ...

    def release_range(self, begin: int, stop: int, pool: concurrent.futures.Executor | None) -> None:
        """`release_after` of every position in ``[begin, stop)`` (a batch's)."""
        ...

    def open_ahead(self, begin: int, horizon: int, submit: Callable[..., object]) -> None: ...

    def reader_at(self, position: int) -> UnitReader | None: ...

    def reader_for(self, unit: int) -> UnitReader | None: ...

    def skip_damaged(self, unit: int, error: Exception) -> bool:
        """``unit`` failed mid-read (damage its opening could not see): True if it is skipped from now on."""
        ...

    def url_of(self, reader: UnitReader) -> str: ...
