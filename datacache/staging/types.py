"""The stager's small value types: handles, locations, events, counters, reports, jobs."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from datacache.catalog import process_owner
from datacache.staging._future import FutureOrder

if TYPE_CHECKING:
    from datacache.staging.batch import Turn
from datacache.config import DatasetConfig
from datacache.manifest import Manifest, Shard
from datacache.tiers import Tier

__all__ = [
    "LOCAL",
    "ORIGIN",
    "PRIORITY_PREFETCH",
    "PRIORITY_URGENT",
    "SHARED",
    "TIERS",
    "WANTED_NOW",
    "WARMING",
    "DatasetHandle",
    "FutureOrder",
    "Job",
    "Location",
    "ReaderProgress",
    "StagerStats",
    "StagingEvent",
    "WarmReport",
]

PRIORITY_URGENT = 0.0
"""A reader is blocked on this shard."""
PRIORITY_PREFETCH = 1.0
"""Prefetches start here; later positions in the read order get larger numbers."""


def _never() -> bool:
    return False


WANTED_NOW: ContextVar[Callable[[], bool]] = ContextVar("datacache_wanted_now", default=_never)
"""Whether a reader is blocked on the transfer this task runs, asked at each chunk (a reader may
join a prefetch in flight). Set by the job queue in each job's task; under a bandwidth limit a
transfer wanted now takes the whole rate until its bytes are in (`Transfer`)."""

WARMING: ContextVar[bool] = ContextVar("datacache_warming", default=False)
"""Whether this task stages for a warm-up (`datacache warm`), which says what it did not keep in its
own summary: the per-shard notices a reading run gets are not said again (`LocalStager.bypass`)."""

LOCAL, SHARED, ORIGIN = "local", "shared", "origin"
TIERS = (LOCAL, SHARED)
"""The tiers a shard can be staged onto."""


@dataclass(frozen=True)
class DatasetHandle:
    """An opened dataset: its configuration, the manifest snapshot it reads, and its origin."""

    config: DatasetConfig
    manifest: Manifest
    origin: Tier

    @property
    def id(self) -> str:
        return self.config.id

    def tier_key(self, shard_key: str) -> str:
        """The key of one of this dataset's shards in the shared and local tiers."""
        return f"{self.id}/{shard_key}"


@dataclass(frozen=True, slots=True)
class Location:
    """Where a shard can be read now.

    ``tier`` is ``"local"`` or ``"shared"`` (then ``path`` is a file to open) or
    ``"origin"`` (the shard was not cached: read it with `Stager.read`).
    ``checksum`` is what its bytes must hash to, when known. ``buffer``, when set,
    holds the shard's bytes, verified in this process while its local copy is still
    being made durable (``Stager.ensure(..., early=True)``); read them instead of ``path``.
    """

    tier: str
    path: Path | None
    shard: Shard
    checksum: str | None
    buffer: bytes | memoryview | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class StagingEvent:
    """Something the stager did; listeners (progress bars, metrics) receive these."""

    kind: str  # "hit", "started", "staged", "bytes", "failed", "evicted", "bypass", "retry"
    dataset: str
    key: str
    tier: str = ""
    source: str = ""
    size: int = 0
    seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True, slots=True)
class StagerStats:
    """Counters of one stager since it started."""

    bytes_from_origin: int = 0
    bytes_from_shared: int = 0
    bytes_to_shared: int = 0
    bytes_to_local: int = 0
    shards_staged: int = 0
    shards_to_shared: int = 0
    hits: Mapping[str, int] = field(default_factory=dict)
    misses: int = 0
    bypassed: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    checksum_failures: int = 0
    failures: int = 0
    retries: int = 0
    queue_depth: int = 0
    in_flight: int = 0
    shared_scans: int = 0
    """Walks of the whole shared tier to learn its usage (once, then one per refresh interval)."""


@dataclass(frozen=True)
class WarmReport:
    """The outcome of `Stager.warm`: honest about every shard asked for."""

    dataset: str
    tier: str
    shards_requested: int
    shards_resident: int
    bytes_requested: int
    bytes_transferred: int
    shards_transferred: int
    shards_verified: int
    seconds: float
    failures: tuple[tuple[str, str], ...] = ()
    bytes_resident: int = 0
    """Bytes of the requested shards resident at the end (``bytes_requested`` when complete)."""
    shards_displaced: int = 0
    """The dataset's shards not asked for that were evicted to make room for those asked for."""
    bytes_displaced: int = 0

    @property
    def complete(self) -> bool:
        """Every requested shard is resident (and verified, when asked)."""
        return self.shards_resident == self.shards_requested and not self.failures

    @property
    def rate(self) -> float:
        """Bytes transferred per second."""
        return self.bytes_transferred / self.seconds if self.seconds > 0 else 0.0


@dataclass(eq=False)
class Job:
    """One queued transfer of one shard onto one tier; every caller asking for it awaits ``future``."""

    handle: DatasetHandle
    shard: Shard
    tier: str
    priority: float
    future: asyncio.Future[Location]
    started: bool = False
    early: asyncio.Future[Location] | None = None
    """Set once the shard's bytes are verified in memory, before its copy is durable (local tier only)."""
    after: Turn | None = None
    """Its warm's place (`staging.batch.Turn`): room is reserved after the warm's shard before it reserved."""


@dataclass(frozen=True)
class ReaderProgress:
    """Where one reader is: its position in its `FutureOrder` sequence, and the shards it holds.

    Held shards (open, or about to be opened) are leased: eviction never
    takes them while ``owner`` (``host:pid``) lives.
    """

    reader: str
    epoch: int
    position: int
    holding: tuple[str, ...] = ()
    owner: str = field(default_factory=process_owner)

    def to_json(self) -> dict[str, Any]:
        return {
            "reader": self.reader,
            "epoch": self.epoch,
            "position": self.position,
            "holding": list(self.holding),
            "owner": self.owner,
        }

    @classmethod
    def from_json(cls, data: object) -> ReaderProgress:
        """Parse `to_json`'s form; raise ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("reader progress must be an object")
        reader, owner, holding = data.get("reader"), data.get("owner"), data.get("holding", [])
        numbers = [data.get("epoch"), data.get("position")]
        if not isinstance(reader, str) or not isinstance(owner, str):
            raise ValueError("reader progress needs a reader name and an owner")
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers):
            raise ValueError("reader progress needs a non-negative epoch and position")
        if not isinstance(holding, list) or not all(isinstance(key, str) for key in holding):
            raise ValueError("reader progress's holding must be a list of shard keys")
        return cls(reader, int(numbers[0]), int(numbers[1]), tuple(holding), owner)  # type: ignore[arg-type]
