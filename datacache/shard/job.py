"""What every unit of a ``datacache shard`` run shares: where it reads and writes, and its result;
and what the whole run did (`ShardReport`).

These values cross process boundaries (Dask and Ray tasks), so they hold
configuration only; a worker opens its tiers from an `Endpoint` in its own
process and event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from datacache.errors import ConfigError
from datacache.identity import canonical_origin
from datacache.manifest import MANIFEST_NAME
from datacache.shard.plan import DONE_PREFIX, ShardOptions
from datacache.tiers import Tier, open_origin, redact_url

__all__ = [
    "Endpoint",
    "ObjectCallback",
    "PackIO",
    "ShardJob",
    "ShardReport",
    "UnitResult",
    "check_places",
    "put_bytes",
    "record_key",
]

ObjectCallback = Callable[[int, int], None]
"""Called with (input objects, their bytes) as they are read."""


@dataclass(frozen=True)
class Endpoint:
    """A URL and its storage options: what a worker needs to open a tier in its own process."""

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def open(self, *, writable: bool) -> Tier:
        """Open the tier (in the calling process and event loop)."""
        return open_origin(self.url, storage_options=dict(self.storage_options), writable=writable)


@dataclass(frozen=True)
class PackIO:
    """What one packer reads from and writes to, in this process: one value for every kind of unit."""

    source: Tier
    dest: Tier
    limiter: asyncio.Semaphore  # bounds the source reads in flight
    on_object: ObjectCallback


@dataclass(frozen=True)
class ShardJob:
    """Everything a worker needs besides the unit itself; pickles for Dask and Ray."""

    source: Endpoint
    dest: Endpoint
    options: ShardOptions
    source_format: str = "files"
    """The format the run reads as: its rechunker packs each unit (looked up again in each worker)."""


@dataclass(frozen=True, slots=True)
class UnitResult:
    """A finished unit: what the manifest records, whether this run wrote it, and over what.

    ``replaced``: written over a unit an earlier run recorded with another plan digest (other
    bytes under the same name, which a cache holding the earlier ones must take again).
    """

    key: str
    size: int
    checksum: str
    samples: int
    objects: int
    input_bytes: int
    written: bool
    replaced: bool = False


def record_key(unit_key: str) -> str:
    """Where the record of a finished unit lives, relative to the output root."""
    return f"{DONE_PREFIX}{unit_key}.json"


async def put_bytes(tier: Tier, key: str, data: bytes) -> None:
    """Store a small document atomically."""

    async def body() -> AsyncIterator[bytes]:
        yield data

    await tier.put(key, body())


def check_places(source: Endpoint, dest: Endpoint) -> None:
    """Refuse a DST that is SRC, or inside it (the places as a dataset's identity names them)."""
    src = canonical_origin(source.url, source.storage_options)
    dst = canonical_origin(dest.url, dest.storage_options)
    if src == dst:
        raise ConfigError("SRC and DST are the same place; write the shards somewhere else")
    if dst.startswith(src + "/"):
        # The next run (or the next dataset over SRC) would take the shards for input.
        raise ConfigError(
            f"DST {redact_url(dest.url)} is inside SRC {redact_url(source.url)}; write the shards outside it"
        )


@dataclass(frozen=True)
class ShardReport:
    """What one `shard_dataset` run did."""

    source: str
    dest: str
    kind: str
    units: int
    written: int
    kept: int
    objects: int
    input_bytes: int
    output_bytes: int
    samples: int
    skipped: int
    seconds: float
    plan_digest: str
    results: tuple[UnitResult, ...] = field(repr=False, default=())
    removed: int = 0
    """Shards an earlier run wrote that this run's manifest does not name, removed (with their indexes)."""

    @property
    def rewritten(self) -> int:
        """Shards written over those of an earlier run of another plan: other bytes under the same names."""
        return sum(1 for r in self.results if r.replaced)

    @property
    def changed_earlier_output(self) -> bool:
        """Whether a cache that holds an earlier run's shards now holds some the output no longer has."""
        return bool(self.removed or self.rewritten)

    @property
    def objects_per_second(self) -> float:
        """Input objects read per second of this run (0 when nothing was packed)."""
        read = sum(r.objects for r in self.results if r.written)
        return read / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_second(self) -> float:
        """Input bytes read per second of this run."""
        read = sum(r.input_bytes for r in self.results if r.written)
        return read / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "done",
            "source": self.source,
            "dest": self.dest,
            "format": self.kind,
            "shards": self.units,
            "shards_written": self.written,
            "shards_kept": self.kept,
            "shards_rewritten": self.rewritten,
            "shards_removed": self.removed,
            "objects": self.objects,
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
            "samples": self.samples,
            "skipped_objects": self.skipped,
            "seconds": round(self.seconds, 3),
            "objects_per_s": round(self.objects_per_second, 1),
            "rate_bytes_per_s": round(self.bytes_per_second, 1),
            "plan": self.plan_digest,
            "manifest": MANIFEST_NAME,
        }
