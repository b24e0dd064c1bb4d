"""What a sample format gives the rest of datacache: its `SampleFormat` object, its units and readers.

A dataset is read in *units*: a tar shard, a Parquet file, a plain file, or
one row of chunks of a Zarr array. Each unit has a sample count (known before
the epoch starts, so the global order can be dealt exactly) and the shard keys
it needs. A `UnitReader` serves the samples of one unit from bytes that were
checked against the manifest.
"""

from __future__ import annotations

import asyncio
import mmap
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, overload

import numpy as np
import numpy.typing as npt

from datacache.errors import ShardReadError

if TYPE_CHECKING:
    from datacache.config import Settings
    from datacache.manifest import Manifest
    from datacache.manifest.columns import ShardTable
    from datacache.tiers import ByteRange, ObjectInfo, Tier

__all__ = [
    "COUNT_SOURCES",
    "BatchKind",
    "Buffer",
    "BufferReader",
    "Fields",
    "PlanContext",
    "SampleFormat",
    "ShardUnits",
    "Unit",
    "UnitPlan",
    "UnitReader",
    "count_each_shard",
    "one_unit_per_shard",
    "sample_of",
]

Fields = list[tuple[str, memoryview]]
Buffer = mmap.mmap | bytes
BatchKind = Literal["fields", "arrays", "arrow", "collate"]
"""How batch mode builds a batch of a format's raw samples (see `SampleFormat.batch`)."""
COUNT_SOURCES = "count_sources"
"""The plan's ``extra`` entry naming where its tar sample counts came from (sidecar indexes, the cluster's)."""


@dataclass(frozen=True, slots=True)
class Unit:
    """A run of samples read together: one shard, or one row of Zarr chunks."""

    keys: tuple[str, ...]
    count: int
    label: str


class ShardUnits(Sequence[Unit]):
    """One unit per shard of a manifest, in its order, as columns: its keys and a counts array.

    Each `Unit` is made on access (``((key,), count, key)``), so a plan of 1e6 shards costs its
    8 MB of counts, not 1e6 objects of ~200 bytes each (built, saved and read back as JSON).
    """

    def __init__(self, shards: ShardTable, counts: npt.NDArray[np.int64]) -> None:
        if len(counts) != len(shards):
            raise ValueError(f"{len(counts)} counts for {len(shards)} shards")
        counts = np.asarray(counts, dtype=np.int64)
        counts.flags.writeable = False  # the plan's now: shared by every holder of it, written by none
        self.shards = shards
        self.counts = counts

    def __len__(self) -> int:
        return len(self.counts)

    @overload
    def __getitem__(self, index: int) -> Unit: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Unit, ...]: ...
    def __getitem__(self, index: int | slice) -> Unit | tuple[Unit, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        count = int(self.counts[index])  # raises IndexError as a tuple would
        key = self.shards.key(index if index >= 0 else index + len(self))
        return Unit((key,), count, key)

    def __iter__(self) -> Iterator[Unit]:
        for key, count in zip(self.shards.keys(), self.counts.tolist(), strict=True):
            yield Unit((key,), count, key)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardUnits):
            return bool(np.array_equal(self.counts, other.counts)) and list(self.shards.keys()) == list(
                other.shards.keys()
            )
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardUnits({len(self)} shards)"


@dataclass(frozen=True)
class UnitPlan:
    """A dataset's units in manifest order, with where each unit's samples start."""

    units: Sequence[Unit]
    """A tuple of `Unit`, or `ShardUnits` (one per shard, as columns)."""
    extra: Mapping[str, Any]
    unreadable: Mapping[str, str] = field(default_factory=dict)
    """Shard key -> why its samples could not be counted; its unit holds no samples."""

    @property
    def counts(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        if isinstance(self.units, ShardUnits):
            return self.units.counts
        return np.fromiter((unit.count for unit in self.units), dtype=np.int64, count=len(self.units))

    @property
    def total(self) -> int:
        if isinstance(self.units, ShardUnits):
            return int(self.units.counts.sum())
        return sum(unit.count for unit in self.units)

    def with_counts(self, counts: Sequence[int] | npt.NDArray[np.int64]) -> tuple[Unit, ...] | ShardUnits:
        """These units with ``counts`` as their sample counts, in the same form (columns stay columns)."""
        if isinstance(self.units, ShardUnits):
            return ShardUnits(self.units.shards, np.asarray(counts, dtype=np.int64))
        return tuple(Unit(u.keys, int(n), u.label) for u, n in zip(self.units, counts, strict=True))

    def to_json(self) -> dict[str, Any]:
        return {
            "units": [[list(u.keys), u.count, u.label] for u in self.units],
            "extra": dict(self.extra),
            "unreadable": dict(self.unreadable),
        }

    @classmethod
    def from_json(cls, data: Any) -> UnitPlan:
        if not isinstance(data, dict) or not isinstance(data.get("units"), list):
            raise ValueError("not a unit plan")
        units = []
        for entry in data["units"]:
            keys, count, label = entry
            units.append(Unit(tuple(str(k) for k in keys), int(count), str(label)))
        unreadable = {str(k): str(v) for k, v in dict(data.get("unreadable") or {}).items()}
        return cls(tuple(units), dict(data.get("extra") or {}), unreadable)


def one_unit_per_shard(manifest: Manifest, counts: Mapping[str, int], unreadable: Mapping[str, str]) -> UnitPlan:
    """The plan of a format whose every shard is one unit (all but Zarr)."""
    table = manifest.table
    keys = table.keys()  # the manifest's key column, one string at a time
    found = np.fromiter((counts[key] for key in keys), dtype=np.int64, count=len(table))
    return UnitPlan(ShardUnits(table, found), {}, dict(unreadable))


def sample_of(fields: Fields, payload: Callable[[memoryview], bytes] = bytes) -> dict[str, Any]:
    """Raw fields as a sample dict: ``__key__`` decoded, each other field's bytes made by ``payload``."""
    sample: dict[str, Any] = {}
    for name, view in fields:
        sample[name] = payload(view) if name != "__key__" else view.tobytes().decode("utf-8", "surrogateescape")
    return sample


class UnitReader:
    """Serves the samples of one unit. Subclasses implement one format each."""

    def __init__(self, unit: Unit, where: str) -> None:
        self.unit = unit
        self.where = where

    def fields(self, index: int) -> Fields:
        """The raw fields of sample ``index`` as (name, bytes view) pairs; ``__key__`` first."""
        raise NotImplementedError

    def sample(self, index: int) -> dict[str, Any]:
        """Sample ``index`` as a dict: ``__key__`` and one entry per field."""
        return sample_of(self.fields(index))

    @property
    def packable(self) -> bool:
        """Whether `fields` gives raw bytes that batches can pack without decoding."""
        return True

    @property
    def samples(self) -> int:
        """How many samples the unit holds (a cold epoch asks a reader of a unit its plan could not count)."""
        if self.unit.count < 0:
            raise NotImplementedError(f"{self.where}: this format cannot count a unit by opening it")
        return self.unit.count

    @property
    def index(self) -> Any:
        """What opening found out about the unit that is worth keeping for the next opening (None: nothing)."""
        return None

    def close(self) -> None:
        """Release the buffer (unmap the file)."""


@dataclass(frozen=True)
class PlanContext:
    """What a format may use to count its samples: the snapshot, its origin, and reads through the cache."""

    manifest: Manifest
    origin: Tier
    settings: Settings
    read: Callable[[str, ByteRange | None], Awaitable[bytes]]
    """A shard's bytes (or a range of them) from the fastest tier holding it, verified."""

    @property
    def where(self) -> str:
        return f"dataset {self.manifest.dataset}"


class SampleFormat:
    """One sample format. Subclass it, set `name`, and give `plan` and `open_reader`.

    The class attributes are what the rest of datacache asks a format; the
    defaults suit a format whose shards are files named by a suffix, one unit
    each, read into samples that batch mode collates.
    """

    name: ClassVar[str] = ""
    suffixes: ClassVar[tuple[str, ...]] = ()
    """The names of its shard files end so (``()``: every object of the listing is one)."""
    shard_names: ClassVar[tuple[str, ...]] = ()
    """Other endings a URL in a list of shard files may have and still be taken as one shard file."""
    priority: ClassVar[int] = 100
    """Detection order, lowest first (Zarr 0, tar 10, Parquet 20, plain files last)."""
    batch: ClassVar[BatchKind] = "collate"
    """Batch mode's raw batches: ``fields`` packed bytes (readers say `UnitReader.packable`), ``arrays``
    rows stacked into tensors, ``arrow`` an Arrow record batch, ``collate`` torch's ``default_collate``."""
    keeps_index: ClassVar[bool] = False
    """Whether a reader's `UnitReader.index` is kept per node and handed to the next `open_reader`."""
    indexed: ClassVar[bool] = False
    """Whether ``datacache index`` counts its samples ahead of time (tar: counting means scanning)."""
    rechunker: ClassVar[str | None] = None
    """Where ``datacache shard`` finds how to re-chunk it: the import string (``"module:OBJECT"``) of a
    `datacache.shard.Rechunker`; a name, not an import, so formats stay below the shard package."""

    def detect(self, keys: Collection[str]) -> bool:
        """Whether a listing of ``keys`` holds this format's shards."""
        return bool(self.suffixes) and any(key.endswith(self.suffixes) for key in keys)

    def shard_keys(self, infos: Sequence[ObjectInfo]) -> list[ObjectInfo]:
        """The listed objects that are its shards."""
        if not self.suffixes:
            return list(infos)
        return [info for info in infos if info.key.endswith(self.suffixes)]

    def names_a_shard(self, name: str) -> bool:
        """Whether a URL ending in ``name`` names one of its shard files (for a list of shard URLs)."""
        endings = self.suffixes + self.shard_names
        return bool(endings) and name.lower().endswith(endings)

    def max_samples(self, size: int) -> int | None:
        """The most samples ``size`` bytes can hold (None: no bound from the bytes alone).

        A declared count above it is not backed by bytes: trusting it would let a
        small file make every reader allocate for billions of samples.
        """
        return None

    def manifest_extra(self, infos: Sequence[ObjectInfo]) -> dict[str, Any]:
        """What a new manifest keeps from the whole listing for later (tar: the sidecar index candidates)."""
        return {}

    async def plan(self, context: PlanContext, *, wait: bool) -> UnitPlan:
        """The units of ``context.manifest`` and their sample counts.

        With ``wait=False`` a format may leave counts it does not know yet as -1
        (a cold epoch completes them); the others count everything now.
        """
        raise NotImplementedError

    def open_reader(
        self, unit: Unit, where: str, buffers: Mapping[str, Buffer], extra: Mapping[str, Any], *, index: Any = None
    ) -> UnitReader:
        """A reader of ``unit`` over the verified bytes of its shards (``index``: a kept `UnitReader.index`)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<format {self.name}>"


class BufferReader(UnitReader):
    """A reader over one shard's buffer, which it releases (unmaps) when closed."""

    def __init__(self, unit: Unit, where: str, buffer: Buffer) -> None:
        super().__init__(unit, where)
        self._buffer = buffer
        self._view = memoryview(buffer)

    def close(self) -> None:
        self._view.release()
        if isinstance(self._buffer, mmap.mmap):
            self._buffer.close()


async def count_each_shard(context: PlanContext, count: Callable[[str, int], Awaitable[int]]) -> UnitPlan:
    """One unit per shard, the counts the manifest lacks found by ``count(key, size)`` a few at a time.

    A shard ``count`` fails on (`ShardReadError`) is recorded, not raised: whether
    to skip it is each reader's ``on_error``.
    """
    manifest = context.manifest
    table = manifest.table
    counts = np.array(table.samples, dtype=np.int64)  # -1 where the manifest does not know it
    unreadable: dict[str, str] = {}
    gate = asyncio.Semaphore(context.settings.concurrency)

    async def one(key: str, size: int) -> tuple[str, int | ShardReadError]:
        async with gate:
            try:
                return key, await count(key, size)
            except ShardReadError as exc:
                return key, exc

    unknown = np.nonzero(counts < 0)[0].tolist()
    sizes = table.sizes
    found = await asyncio.gather(*(one(table.key(i), int(sizes[i])) for i in unknown))
    for index, (key, counted) in zip(unknown, found, strict=True):
        if isinstance(counted, ShardReadError):
            unreadable[key] = str(counted)
            counts[index] = 0
        else:
            counts[index] = counted
    return UnitPlan(ShardUnits(table, counts), {}, unreadable)
