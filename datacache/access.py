"""How readers reach shards: the `ShardAccess` protocol, and `open_access` to get one.

A reader (the loader, ``datacache warm``) needs a handful of verbs: open a
dataset, ensure a shard is local, prefetch, read from wherever a shard is,
report a corrupt copy. In-process, the `Stager` answers them; on a node that
runs ``datacache serve``, a client of the daemon does, so that every process
of the node shares one cache and one transfer per shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from datacache.config import DatasetConfig, Settings
from datacache.stager import PRIORITY_PREFETCH, PRIORITY_URGENT, DatasetHandle, Location, Stager
from datacache.tiers import ByteRange

__all__ = ["ShardAccess", "open_access"]


class ShardAccess(Protocol):
    """What a reader asks of the cache. `Stager` implements it in-process."""

    @property
    def mode(self) -> str:
        """``"embedded"`` (an in-process stager) or ``"daemon"``."""
        ...

    async def open(self, dataset: DatasetConfig | str, *, refresh: bool = False) -> DatasetHandle:
        """The dataset's handle, with the manifest snapshot to read."""
        ...

    async def ensure(
        self, handle: DatasetHandle, key: str, *, tier: str = "local", priority: float = PRIORITY_URGENT
    ) -> Location:
        """Make a shard resident (on the local tier by default) and say where it is."""
        ...

    async def prefetch(
        self, handle: DatasetHandle, keys: Sequence[str], *, priority: float = PRIORITY_PREFETCH
    ) -> None:
        """Queue shards for staging, the first ones soonest."""
        ...

    async def set_future_order(self, handle: DatasetHandle, keys: Iterable[str]) -> None:
        """The order in which shards will be read next (for Belady eviction)."""
        ...

    async def locate(self, handle: DatasetHandle, key: str) -> Location:
        """Where a shard can be read now, moving nothing."""
        ...

    async def read(self, handle: DatasetHandle, key: str, byte_range: ByteRange | None = None) -> bytes:
        """A shard's bytes (or a range) from the fastest tier holding it."""
        ...

    async def report_corrupt(self, handle: DatasetHandle, location: Location) -> None:
        """A reader found a copy's bytes wrong: drop it so it is staged again."""
        ...

    async def close(self) -> None:
        """Release what this access holds."""
        ...


async def open_access(settings: Settings, *, reconcile: bool = True) -> ShardAccess:
    """Return the way this process should reach shards (an in-process `Stager` for now)."""
    return Stager(settings, reconcile=reconcile)
