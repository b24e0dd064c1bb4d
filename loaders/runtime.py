"""What one process holds for a dataset (`Runtime`): the units open in it (`OpenUnits`), the tar indexes
scanned on the node (`SpanCache`); the node's future reads (`NodeFuture`), this process's rank
(`rank_and_world`), and the protocol of the units a plan reads (`Units`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import numpy.typing as npt
import torch
from datacache.loaders.shardfiles import ShardUnits, UnitPlan, UnitReader
from datacache.tiers import redact_url

from datacache._sync import LoopThread
from datacache.access import FailoverAccess, ShardAccess
from datacache.catalog import process_owner
from datacache.config import Settings
from datacache.counting.spantable import SpanTable
from datacache.counting.tarindex import SampleSpan
from datacache.errors import ConfigError, ShardReadError
from datacache.formats import SampleFormat, get_format
from datacache.staging import DatasetHandle, FutureOrder

if TYPE_CHECKING:
    from datacache.loaders.plans.cold import CountBook
    from datacache.loaders.plans.mixsources import Mix

T = TypeVar("T")
__all__ = ["KEEP_RELEASED", "NodeFuture", "OpenUnits", "Runtime", "SpanCache", "Units", "rank_and_world"]


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: torch.distributed's, else ``RANK`` and ``WORLD_SIZE``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError("RANK and WORLD_SIZE must be integers") from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is not within WORLD_SIZE={world}")
    return rank, world


KEEP_RELEASED = 8
"""Units no reader holds that stay open for the next reader, while several read in one process (`OpenUnits`)."""


class OpenUnits:
    """Units open in one process, shared by its readers of one dataset.

    `dataloader.DataLoader` reads as N workers would, in one process: each of them
    reads from most shards, and would otherwise map, verify and index each shard up
    to N times. While ``keep`` is set, a unit no reader holds stays open until
    ``keep`` later ones are released (the next worker to read it takes it as it is);
    otherwise it is closed at once, as with one reader. A unit held by a reader that
    never finished (its iterator abandoned) goes with that reader.
    """

    def __init__(self) -> None:
        self.keep = 0
        self._lock = threading.Lock()
        self._open: weakref.WeakValueDictionary[int, UnitReader] = weakref.WeakValueDictionary()
        self._users: dict[int, int] = {}
        """id() of each open reader -> how many readers hold it."""
        self._idle: OrderedDict[int, UnitReader] = OrderedDict()
        """Released units kept open, by unit, the oldest first."""
        self._opening: dict[int, threading.Lock] = {}
        self._tiers: dict[int, str] = {}
        """id() of each open reader -> the tier its opener found the unit on."""

    def acquire(self, unit: int, opener: Callable[[], UnitReader]) -> UnitReader:
        """The open reader of ``unit``, or ``opener()`` if none is."""
        with self.gate(unit) as waited:
            found = self.get(unit, waited=waited)
            if found is not None:
                return found[0]
            reader = opener()
            self.add(unit, reader, "local")
            return reader

    @contextlib.contextmanager
    def gate(self, unit: int) -> Iterator[bool]:
        """Held while ``unit`` is looked up and, if need be, opened: one opening per unit at a time.

        Yields whether another reader held it first (then `get` most likely finds what it opened).
        """
        with self._lock:
            gate = self._opening.setdefault(unit, threading.Lock())
        waited = not gate.acquire(blocking=False)
        if waited:
            gate.acquire()
        try:
            yield waited
        finally:
            gate.release()

    def get(self, unit: int, *, waited: bool) -> tuple[UnitReader, str] | None:
        """``unit``'s open reader, taken by one more reader, and the tier this one counts it as; None: not open.

        The tier is where this reader would have found the unit had it opened it itself, as a
        worker process would (its hit): the opener's tier when it ``waited`` for that opening,
        "local" when the unit was open already.
        """
        with self._lock:
            reader = self._idle.pop(unit, None) or self._open.get(unit)
            if reader is None or id(reader) not in self._users:
                return None
            self._users[id(reader)] += 1
            return reader, (self._tiers.get(id(reader), "local") if waited else "local")

    def add(self, unit: int, reader: UnitReader, tier: str) -> None:
        """``reader`` of ``unit`` was just opened (under `gate`), from ``tier``: held by one reader."""
        with self._lock:
            self._open[unit] = reader
            self._users[id(reader)] = 1
            self._tiers[id(reader)] = tier
            weakref.finalize(reader, self._forget, id(reader))

    def _forget(self, ident: int) -> None:
        with self._lock:
            self._users.pop(ident, None)
            self._tiers.pop(ident, None)

    def release(self, unit: int, reader: UnitReader) -> list[UnitReader]:
        """One reader is done with ``reader`` (of ``unit``); returns the units to close now."""
        with self._lock:
            left = self._users.get(id(reader), 1) - 1
            self._users[id(reader)] = left
            if left > 0:
                return []
            self._idle[unit] = reader
            closing = []
            while len(self._idle) > self.keep:
                _, oldest = self._idle.popitem(last=False)
                self._users.pop(id(oldest), None)
                closing.append(oldest)
            return closing

    def close_idle(self) -> list[UnitReader]:
        """Every released unit still open (the dataset is done with this process's readers)."""
        with self._lock:
            closing = list(self._idle.values())
            for reader in closing:
                self._users.pop(id(reader), None)
            self._idle.clear()
            return closing


SPAN_FILE_MIN_BYTES = 16 * 1024
"""Shards smaller than this keep their scanned index in memory only (`SpanCache`)."""


class SpanCache:
    """Tar shard indexes already scanned, so a shard is scanned once per node, not once per epoch and worker.

    Scanning a tar's headers in Python costs ~20-40 us per sample, as much as
    reading the sample. Keyed by what identifies the verified bytes (key,
    size, checksum or version). Held in memory (bounded by samples) and, when
    ``directory`` is given, in small files there, so that new worker processes
    and later runs on the node reuse them.
    """

    def __init__(self, max_samples: int = 1 << 19, directory: Path | None = None) -> None:
        self._entries: OrderedDict[tuple[str, int, str | None], SpanTable] = OrderedDict()
        self._samples = 0
        self._max = max_samples
        self._lock = threading.Lock()
        self._directory = directory

    def _file(self, key: tuple[str, int, str | None]) -> Path | None:
        if self._directory is None or key[1] < SPAN_FILE_MIN_BYTES:
            return None  # a tiny shard's headers are scanned faster than its index file is read
        name = hashlib.sha256(json.dumps(list(key)).encode()).hexdigest()[:40]
        return self._directory / f"{name}.spans"

    def get(self, key: tuple[str, int, str | None]) -> SpanTable | None:
        with self._lock:
            spans = self._entries.get(key)
            if spans is not None:
                self._entries.move_to_end(key)
                return spans
        path = self._file(key)
        if path is None:
            return None
        try:
            loaded = SpanTable.from_bytes(path.read_bytes(), where=str(path))
        except (OSError, ShardReadError):
            return None
        if loaded.shard_size != key[1]:
            return None
        self._remember(key, loaded)
        return loaded

    def put(self, key: tuple[str, int, str | None], spans: Sequence[SampleSpan]) -> None:
        spans = SpanTable.from_spans(spans, shard_size=key[1])
        self._remember(key, spans)
        path = self._file(key)
        if path is None:
            return
        try:
            if path.exists():  # may raise: a daemon's private folder another user's reader cannot enter
                return
            for directory in reversed([path.parent, *path.parent.parents][:3]):  # indexes/spans/<id>: private
                with contextlib.suppress(FileExistsError):
                    directory.mkdir(mode=0o700)
            temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            out = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(out, "wb") as handle:
                handle.write(spans.to_bytes())
            os.replace(temporary, path)
        except OSError:
            pass  # an index we could not keep is scanned again next time

    def _remember(self, key: tuple[str, int, str | None], spans: SpanTable) -> None:
        if len(spans) > self._max:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = spans
            self._samples += len(spans)
            while self._samples > self._max:
                _, dropped = self._entries.popitem(last=False)
                self._samples -= len(dropped)


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
    _mode: str | None = field(init=False)
    _event_loop: asyncio.AbstractEventLoop = field(init=False)

    def __post_init__(self) -> None:
        # Found once per process, not once per reader or note.
        self.kind = get_format(self.handle.manifest.format.value)
        self.where = f"dataset {self.handle.id}"
        self.url = redact_url(self.handle.config.url).rstrip("/")
        self.owner = process_owner()
        self.unit_bytes = self.handle.manifest.total_bytes / max(1, len(self.units.units))
        # Only a daemon's client changes mode (to its fallback and back): any other access is asked once.
        self._mode = None if isinstance(self.access, FailoverAccess) else self.access.mode
        self._event_loop = self.loop.loop  # this process's: a Runtime is never pickled, and `pid` is checked

    @property
    def mode(self) -> str:
        """How this process reaches the cache, as the stats say it (`ShardAccess.mode`)."""
        if self._mode is not None:
            return self._mode
        access = self.access
        return access.mode_of(self.handle.id) if isinstance(access, FailoverAccess) else access.mode

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on this process's event loop (`_sync.LoopThread`) and return its result."""
        return self.submit(coroutine).result()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coroutine`` on this process's event loop; a future for its result."""
        # Once closed, its LoopThread starts a loop again for what a late reader still sends (as it did).
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop.loop if self.closed else self._event_loop)

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
    """The node's future reads (every reader's units, from `positions.node_unit_sequences`) and this reader's name.

    Each reader's units are an int64 array, shared by a rank's workers: 1e6 units as tuples of
    Python ints cost ~76 MB more a process than as arrays (`benchmarks._manifest_scale`).
    """

    reader: str
    epoch: int
    units: Mapping[str, npt.NDArray[np.int64]]
    later: Callable[[], Mapping[str, npt.NDArray[np.int64]] | None] | None = None
    """A cold epoch's: the next epoch's units by reader, once its sample counts are all known (else None)."""
    split: int | None = None
    """Where this reader's units of the next epoch begin, once `grown` appended them."""

    def grown(self) -> NodeFuture | None:
        """This future and the next epoch's reads after it, when `later` can say them now (else None)."""
        more = self.later() if self.later is not None else None
        if more is None:
            return None
        units = {
            name: np.concatenate((self._of(self.units, name), self._of(more, name))) for name in {*self.units, *more}
        }
        return NodeFuture(self.reader, self.epoch, units, split=len(self._of(self.units, self.reader)))

    @staticmethod
    def _of(units: Mapping[str, npt.NDArray[np.int64]], name: str) -> npt.NDArray[np.int64]:
        found = units.get(name)
        return np.zeros(0, dtype=np.int64) if found is None else found

    def order(self, plan: UnitPlan) -> FutureOrder:
        """The same future as the stager takes it: for a plan of one unit per shard, the units arrays
        themselves, indices into the manifest's key column (no key decoded, no array copied: 1e6 shards'
        keys as tuples of strings, and the stager's dict of them, were ~600 MB at rank 3 of 8)."""
        if isinstance(plan.units, ShardUnits):
            return FutureOrder.of_indices(self.epoch, plan.units.shards, self.units)
        made: dict[int, tuple[str, ...]] = {}
        keys: dict[str, tuple[str, ...]] = {}
        for name, units in self.units.items():
            if id(units) not in made:
                made[id(units)] = tuple(key for u in units.tolist() for key in plan.units[u].keys)
            keys[name] = made[id(units)]
        return FutureOrder(self.epoch, keys)

    def after(self, units_this_epoch: int) -> tuple[int, ...]:
        """This reader's units of the next epoch: its sequence past the ``units_this_epoch`` of this one."""
        mine = self._of(self.units, self.reader)
        return tuple(mine[units_this_epoch if self.split is None else self.split :].tolist())

    def key_positions(self, plan: UnitPlan) -> KeyPositions:
        """Unit -> the position of its first key in this reader's sequence (this epoch's part)."""
        mine = self._of(self.units, self.reader)
        if isinstance(plan.units, ShardUnits):  # one key a unit: its position is its index
            starts = np.arange(len(mine), dtype=np.int64)
        else:
            lengths = np.fromiter((len(plan.units[u].keys) for u in mine.tolist()), dtype=np.int64, count=len(mine))
            starts = np.cumsum(lengths) - lengths
        units, first = np.unique(mine, return_index=True)
        return KeyPositions(units, starts[first])


class KeyPositions(Mapping[int, int]):
    """Unit -> the position of its first key in a reader's sequence, as two sorted arrays.

    A dict of this reader's units (2.5e5 at 1e6 shards, rank 3 of 8) was ~24 MB of Python ints and
    entries in each reader; looked up once per unit opened.
    """

    def __init__(self, units: npt.NDArray[np.int64], positions: npt.NDArray[np.int64]) -> None:
        self._units, self._positions = units, positions

    def __getitem__(self, unit: int) -> int:
        at = int(np.searchsorted(self._units, unit))
        if at < len(self._units) and int(self._units[at]) == unit:
            return int(self._positions[at])
        raise KeyError(unit)

    def __len__(self) -> int:
        return len(self._units)

    def __iter__(self) -> Iterator[int]:
        return iter(self._units.tolist())


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

    def url_at(self, position: int) -> str:
        """The URL (credentials redacted) the keys of the unit ``position`` reads are relative to."""
        ...
