"""What every unit of a ``datacache shard`` run shares: where it reads and writes, and its result.

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
from datacache.shard.plan import DONE_PREFIX, ShardOptions
from datacache.tiers import Tier, open_origin, redact_url

__all__ = [
    "Endpoint",
    "ObjectCallback",
    "PackIO",
    "ShardJob",
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
    """A finished unit: what the manifest records, and whether this run wrote it."""

    key: str
    size: int
    checksum: str
    samples: int
    objects: int
    input_bytes: int
    written: bool


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
