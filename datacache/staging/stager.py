"""The stager: moves shards origin -> shared -> local, once each, verified, atomically.

One `Stager` per process (or one per node, inside ``datacache serve``). It
answers `Stager.ensure` ("make this shard local and tell me where it is"),
takes prefetch lists with priorities, warms whole datasets, and evicts to stay
under capacity. It is a facade over the parts of `datacache.staging`: the job
queue, the local and shared tiers' stagers, the transfer with its memory
budget, residency (what eviction keeps) and recovery; they report through
`Events` and never call back into it. Its verbs come in three layers:
`datacache.staging.runtime` (the parts per event loop, open, close, recovery),
`datacache.staging.verbs` (ensure, prefetch, read, locate) and, here, the warm.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence

from datacache.checksum import hash_file
from datacache.manifest import Shard
from datacache.staging.batch import Turn, WarmBatches, make_room_for, stage_batch
from datacache.staging.shared import evict_shared, shared_copy_matches
from datacache.staging.types import (
    LOCAL,
    DatasetHandle,
    Location,
    WarmReport,
)
from datacache.staging.verbs import StagerVerbs
from datacache.staging.warm import Submit, WarmProgress, WarmSteps, bypass_reason, check_fits, run_warm

__all__ = ["Stager"]

logger = logging.getLogger(__name__)


class Stager(StagerVerbs):
    """Moves shards up the tiers; one per process, or one per node inside the daemon.

    Parameters
    ----------
    settings
        Tiers, capacities, concurrency and limits.
    reconcile
        Repair what killed processes left in the catalog and on disk, once, on
        first use. Loader workers turn this off: their parent already did it.
    inspect
        Only show what the cache holds (``datacache top``): whose it is is not checked.
    """

    async def warm(
        self,
        handle: DatasetHandle,
        shards: Sequence[Shard] | None = None,
        *,
        tier: str = LOCAL,
        verify: bool = False,
        bandwidth: float | None = None,
        progress: Callable[[WarmProgress], None] | None = None,
        submit: Submit | None = None,
    ) -> WarmReport:
        """Stage ``shards`` (default: all) onto ``tier`` and report exactly what is resident.

        With ``verify``, shards already resident are re-hashed, and re-staged if
        they do not match. ``bandwidth`` (bytes/s) paces this warm's transfers;
        ``progress`` hears after each shard. ``submit`` admits each shard's
        transfer (default: this stager's queue; the daemon passes its prefetch gate).
        This is the only warm: the CLI and the daemon adapt it, never re-implement it.

        Some of a dataset's shards (``shards``) that fit the local tier only once the dataset's
        other shards leave there make them leave, least recently used first (`make_room_for`):
        the dataset's policy (no-thrash) would keep those and refuse the ones asked for.
        """
        parts = await self._ready()
        chosen = list(handle.manifest.shards if shards is None else shards)
        check_fits(handle, chosen, tier, self._capacity(tier))
        displaced = await make_room_for(parts.local, handle, chosen) if tier == LOCAL else (0, 0)

        async def admit(shard: Shard, priority: float) -> Location:
            return await self.ensure(handle, shard.key, tier=tier, priority=priority)

        async def check(shard: Shard) -> bool:
            return await self.verify_resident(handle, shard, tier=tier)

        async def batch(shards: Sequence[Shard], turn: Turn) -> list[Location | BaseException]:
            return await stage_batch((await self._ready()).local, handle, shards, turn)

        # In this process onto the local tier: in batches (a tiny shard costs its bytes, not 5 ms).
        async with WarmBatches(batch) as batches:
            steps = WarmSteps(
                submit=submit or (batches.submit if tier == LOCAL else admit),
                residents=lambda shards: self._residents(handle, shards, tier),
                verify=check if verify else None,
                why_not_kept=lambda: bypass_reason(tier, self._capacity(tier)),
                found=(lambda shards: self._found_local(handle, shards)) if tier == LOCAL else None,
            )
            report = await run_warm(
                handle, chosen, tier=tier, events=self._events, steps=steps, bandwidth=bandwidth, progress=progress
            )
        return dataclasses.replace(report, shards_displaced=displaced[0], bytes_displaced=displaced[1])

    def _capacity(self, tier: str) -> int | None:
        target = self.local if tier == LOCAL else self.shared
        return target.capacity if target is not None else None

    async def _found_local(self, handle: DatasetHandle, shards: Sequence[Shard]) -> set[str]:
        """The keys of those of ``shards`` resident on the local tier, in one catalog read (a read of each recorded)."""
        found = await (await self._ready()).local.present(handle, shards)
        for _ in found:
            self._events.hit(LOCAL)
        return found

    async def _residents(self, handle: DatasetHandle, shards: Sequence[Shard], tier: str) -> set[str]:
        if tier == LOCAL:
            parts = await self._ready()
            return await parts.local.resident_keys(handle, shards)
        found: set[str] = set()
        for shard in shards:
            info = await self.shared.stat(handle.tier_key(shard.key)) if self.shared is not None else None
            if info is not None and shared_copy_matches(info, handle.id, shard, self._trusted):
                found.add(shard.key)
        return found

    async def verify_resident(self, handle: DatasetHandle, shard: Shard, *, tier: str = LOCAL) -> bool:
        """Re-hash a resident copy; drop it if wrong. Return whether it was resident and right."""
        if tier == LOCAL:
            entry = await self.catalog.get(handle.id, shard.key)
            if entry is None or entry.state != "resident" or entry.checksum is None:
                return False
            path = self.local.path(handle.tier_key(shard.key))
            expected = entry.checksum
        else:
            if self.shared is None:
                return False
            info = await self.shared.stat(handle.tier_key(shard.key))
            if info is None or not shared_copy_matches(info, handle.id, shard, self._trusted):
                return False
            path = self.shared.path(handle.tier_key(shard.key))
            expected = info.metadata["checksum"]
        actual = await asyncio.to_thread(hash_file, path)
        if actual == expected:
            return True
        await self.report_corrupt(handle, Location(tier, path, shard, expected))
        return False

    async def evict(self, dataset_id: str, keys: Sequence[str] | None = None) -> tuple[int, int]:
        """Remove a dataset's shards (all, or ``keys``) from the local tier; return (shards, bytes)."""
        parts = await self._ready()
        victims = await self.catalog.mark_evicting(dataset_id, keys, self._owner)
        await parts.local.delete_victims(victims)
        return len(victims), sum(v.size for v in victims)

    async def evict_shared(self, dataset_id: str) -> tuple[int, int]:
        """Remove a dataset's shards from the shared tier; return (shards, bytes)."""
        if self.shared is None:
            return 0, 0
        return await evict_shared(self.shared, dataset_id)
