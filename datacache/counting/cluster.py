"""Sample counts of a tar dataset, found or built once per cluster, not once per node.

The order of an epoch is dealt by sample, so readers need every shard's
sample count. They come from, in order:

1. the manifest (``datacache shard`` output records them);
2. the cluster index on the shared tier (what any node already counted);
3. the sidecar indexes beside the shards (`datacache.counting.sidecars`: wids,
   ``sizes.json``, img2dataset, DALI, ``.idx.json``);
4. scanning the shards nobody counted: the headers are read from the
   origin's stream as it arrives (`TarScanner`), at the GET rate, and nothing
   is written to the local tier.

Scanning is divided among every node that needs it: the shards are cut into
batches, a node takes a batch by its lease file on the shared tier (the same
`LeaseLock` the stager uses), writes the batch's counts there atomically, and
moves on; a batch another node holds is left to it, and waited for only at
the end (a lease that runs out is taken over). So the origin serves each
shard once for indexing, however many nodes start at once. Without a shared
tier the node counts alone.

Nothing read from the shared tier is trusted on its own: each count is
checked again when its shard is read (`TarReader`), and a wrong one is
reported naming where it came from.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from datacache.config import Settings
from datacache.counting.indexfiles import (
    IndexFiles,
    backed_counts,
    decide_cold,
    encode_batch,
    index_dir,
    node_plan_path,
    parse_batch,
)
from datacache.counting.sidecars import KnownCount, read_sidecar_counts, wids_index
from datacache.counting.tarscan import count_batch_sync, count_tar_samples
from datacache.dask_ray import map_dask, map_ray
from datacache.errors import DatacacheError, ShardReadError
from datacache.locks import LeaseLock
from datacache.manifest import SIDECAR_CANDIDATES, Manifest, Shard
from datacache.tiers import ObjectInfo, Tier
from datacache.tiers.files import UnsafeFileError, atomic_write

__all__ = [
    "WIDS_INDEX_NAME",
    "ClusterIndex",
    "IndexReport",
    "count_batch_sync",
    "count_tar_samples",
    "decide_cold",
    "index_dataset",
    "index_dir",
    "node_plan_path",
]

logger = logging.getLogger(__name__)

WIDS_INDEX_NAME = "wids-index.json"
"""What `index_dataset` writes beside a writable origin: a wids shard index, which wids and datacache both read."""

_BATCH_MAX = 64
"""Most shards in one lease: small enough that a node that dies loses little work."""


def _listed_candidates(manifest: Manifest) -> list[ObjectInfo] | None:
    """The possible sample indexes the manifest's listing found, None if it did not keep them."""
    recorded = manifest.extra.get(SIDECAR_CANDIDATES)
    if not isinstance(recorded, list):
        return None
    found: list[ObjectInfo] = []
    for entry in recorded:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            return None
        key, size = entry
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return None
        found.append(ObjectInfo(key, size))
    return found


@dataclass
class IndexReport:
    """What one `ClusterIndex.build` did on this node."""

    shards: int = 0
    from_manifest: int = 0
    from_sidecars: int = 0
    from_cluster: int = 0
    scanned: int = 0
    scanned_bytes: int = 0
    seconds: float = 0.0
    sources: dict[str, int] = field(default_factory=dict)
    #: shards whose samples could not be counted (a truncated or foreign tar), with the reason
    unreadable: dict[str, str] = field(default_factory=dict)


def _batch_size(shards: int, concurrency: int) -> int:
    return max(1, min(_BATCH_MAX, shards // max(1, 4 * concurrency)))


class ClusterIndex:
    """The sample counts of one dataset snapshot, shared by every node through the shared tier.

    Parameters
    ----------
    origin
        The dataset's origin, streamed for scanning.
    manifest
        The snapshot to count.
    settings
        ``shared_dir`` (where counts and leases live; without it the node counts
        alone, in memory), ``concurrency`` (shards scanned at once) and
        ``lease_seconds``.
    """

    def __init__(self, origin: Tier, manifest: Manifest, settings: Settings) -> None:
        self.origin = origin
        self.manifest = manifest
        self.settings = settings
        # Without a shared tier the node is the cluster: its processes share the work the same way.
        self.files = IndexFiles(settings, manifest)
        self.directory = self.files.path
        self._where = f"dataset {manifest.dataset}"
        self.engine: tuple[str, str | None, str, Mapping[str, Any]] | None = None
        """(``dask`` or ``ray``, scheduler address, origin URL, storage options): scan on that engine."""
        self.ignore_sidecars = False
        """Count every shard not in the manifest by scanning it (`datacache index --rescan`)."""
        self.counter: Callable[[Shard, str], Awaitable[int]] | None = None
        """Counts one shard (``where`` names it in errors); default: stream it from the origin.

        A loader counts through its stager instead (`coldplan.CountBook`): the shard is
        staged once for the cluster and counted from that copy, which its readers use too.
        """

    def forget(self) -> None:
        """Remove what the cluster index holds for this snapshot (a count in it was found wrong)."""
        for name in self.files.names():
            if name.endswith(".json"):
                self.files.unlink(name)

    async def _count(self, shard: Shard, where: str) -> int:
        if self.counter is not None:
            return await self.counter(shard, where)
        return await count_tar_samples(self.origin, shard, where=where)

    def _batch_path(self, number: int) -> Path:
        return self.directory / f"batch-{number:06d}.json"

    def _read_done(self) -> dict[str, KnownCount]:
        found: dict[str, KnownCount] = {}
        for name in self.files.names():
            if not (name.startswith(("batch-", "sidecars")) and name.endswith(".json")):
                continue
            path = self.directory / name
            try:
                raw = self.files.read_trusted(name)
                if raw is None:
                    continue
                counts = parse_batch(raw, str(path))
            except (OSError, ShardReadError, UnsafeFileError) as exc:
                logger.warning("ignoring a damaged cluster index file: %s", exc)
                continue
            found.update(backed_counts(self.manifest, counts, path)[0])
        return found

    async def _write(self, path: Path, counts: Mapping[str, KnownCount]) -> None:
        encoded = encode_batch(counts)

        async def body() -> AsyncIterator[bytes]:
            yield encoded

        await atomic_write(self.files.place(path.name), body(), durable=False, file_mode=self.files.file_mode)

    async def known(self) -> dict[str, KnownCount]:
        """Counts known without scanning: manifest, cluster index, then sidecars (read once per cluster)."""
        table = self.manifest.table
        known = np.nonzero(table.samples >= 0)[0]
        counts = (KnownCount(n, "manifest") for n in table.samples[known].tolist())
        found = dict(zip(table.keys_at(known), counts, strict=True))
        if len(found) == len(table):
            return found
        for key, count in (await asyncio.to_thread(self._read_done)).items():
            found.setdefault(key, count)
        if len(found) == len(self.manifest.shards) or self._sidecars_done() or self.ignore_sidecars:
            return found
        sidecars = await self._sidecars()
        for key, count in sidecars.items():
            found.setdefault(key, count)
        return found

    def _sidecars_done(self) -> bool:
        return self.files.exists("sidecars.json")

    async def _sidecars(self) -> dict[str, KnownCount]:
        """Read the sidecar indexes once per cluster, keeping what they say in the cluster index."""
        path = self.directory / "sidecars.json"
        lock = self.files.place("sidecars.lock")
        async with LeaseLock(lock, lease_seconds=self.settings.lease_seconds).hold():
            if await asyncio.to_thread(self.files.exists, path.name):
                return {k: v for k, v in (await asyncio.to_thread(self._read_done)).items()}
            counts = await self._read_sidecars()
            await self._write(path, counts)
            return counts

    async def _read_sidecars(self) -> dict[str, KnownCount]:
        listing = _listed_candidates(self.manifest)
        if listing is None:  # a manifest taken before it kept them: list again
            listing = [info async for info in self.origin.list()]
        return await read_sidecar_counts(self.origin, self.manifest, listing, concurrency=4 * self.settings.concurrency)

    async def build(
        self, *, only: Iterable[str] | None = None, on_count: Callable[[str, int], None] | None = None
    ) -> tuple[dict[str, KnownCount], IndexReport]:
        """Every shard's count (or those in ``only``): known ones, then the rest scanned with the other nodes."""
        started = time.monotonic()
        report = IndexReport(shards=len(self.manifest.shards))
        found = await self.known()
        for count in found.values():
            label = count.source.split(" ", 1)[0] if not count.source.startswith("cluster") else "cluster"
            report.sources[label] = report.sources.get(label, 0) + 1
        report.from_manifest = sum(1 for c in found.values() if c.source == "manifest")
        report.from_cluster = sum(1 for c in found.values() if c.source.startswith("cluster index"))
        report.from_sidecars = len(found) - report.from_manifest - report.from_cluster
        wanted = set(only) if only is not None else None
        table = self.manifest.table
        keys = table.keys()  # the key column: a `Shard` made only for a shard still to count
        missing = [table[i] for i, key in enumerate(keys) if key not in found and (wanted is None or key in wanted)]
        if missing and self.engine is not None:
            found.update(await self._scan_on_engine(missing, found, report))
        elif missing:
            scanned = await self._scan_shared(missing, found, report, on_count)
            found.update(scanned)
        report.seconds = time.monotonic() - started
        return found, report

    def _batches(self, missing: Sequence[Shard]) -> list[tuple[int, list[Shard]]]:
        """The batches holding a missing shard; cut over the whole manifest, so every node cuts the same ones."""
        everything = list(self.manifest.shards)
        size = _batch_size(len(everything), self.settings.concurrency)
        missing_keys = {s.key for s in missing}
        return [
            (number, everything[start : start + size])
            for number, start in enumerate(range(0, len(everything), size))
            if any(s.key in missing_keys for s in everything[start : start + size])
        ]

    async def _scan_on_engine(
        self, missing: Sequence[Shard], found: Mapping[str, KnownCount], report: IndexReport
    ) -> dict[str, KnownCount]:
        """Count on Dask or Ray, one task per batch; the engine, not leases, divides the work."""
        engine, scheduler, url, options = self.engine or ("", None, "", {})
        batches = self._batches(missing)
        calls = [
            (number, url, dict(options), [(s.key, s.size, s.version) for s in batch if s.key not in found], self._where)
            for number, batch in batches
        ]
        done: list[tuple[int, dict[str, int | str]]] = []
        workers = max(1, self.settings.concurrency)
        if engine == "dask":
            names = [f"datacache-index-{self.manifest.snapshot}-{number}" for number, _ in batches]
            runner = functools.partial(map_dask, names=names)
        else:
            runner = functools.partial(map_ray)
        await asyncio.to_thread(
            runner, count_batch_sync, calls, scheduler=scheduler, workers=workers, on_result=done.append
        )
        results: dict[str, KnownCount] = {}
        by_number = dict(batches)
        for number, counts in done:
            counted = {s.key: found[s.key] for s in by_number[number] if s.key in found}
            for key, value in counts.items():
                if isinstance(value, str):
                    report.unreadable[key] = value
                    continue
                counted[key] = KnownCount(value, "scanned")
                report.scanned += 1
                report.scanned_bytes += self.manifest.shard(key).size
            await self._write(self._batch_path(number), counted)
            results.update(counted)
        return results

    async def _scan_shared(
        self,
        missing: Sequence[Shard],
        found: Mapping[str, KnownCount],
        report: IndexReport,
        on_count: Callable[[str, int], None] | None,
    ) -> dict[str, KnownCount]:
        batches = self._batches(missing)
        if not batches:
            return {}
        logger.info(
            "%s: counting the samples of %d tar shards (%d batches; other nodes take their share)",
            self._where,
            len(missing),
            len(batches),
        )
        # Nodes start at different batches, so that they rarely ask for the same lease.
        offset = zlib.crc32(f"{socket.gethostname()}:{os.getpid()}".encode()) % len(batches)
        queue = batches[offset:] + batches[:offset]
        results: dict[str, KnownCount] = {}
        deferred: list[tuple[int, list[Shard]]] = []

        async def worker(wait: bool) -> None:
            source = deferred if wait else queue
            while source:
                number, batch = source.pop(0)
                counted = await self._take_batch(number, batch, found, report, wait=wait, on_count=on_count)
                if counted is None:
                    deferred.append((number, batch))
                else:
                    results.update(counted)

        workers = max(1, self.settings.concurrency)
        await asyncio.gather(*(worker(False) for _ in range(workers)))
        await asyncio.gather(*(worker(True) for _ in range(workers)))
        return results

    async def _take_batch(
        self,
        number: int,
        batch: Sequence[Shard],
        found: Mapping[str, KnownCount],
        report: IndexReport,
        *,
        wait: bool,
        on_count: Callable[[str, int], None] | None,
    ) -> dict[str, KnownCount] | None:
        """Count one batch under its lease; None if another node holds it and ``wait`` is false."""
        path = self._batch_path(number)
        lock_path = path.with_suffix(".lock")
        done = await asyncio.to_thread(self._load_batch, path)
        if done is not None and _whole(done, batch):
            return _told(done, on_count)
        if not wait and await asyncio.to_thread(self._held_by_another, lock_path.name):
            return None
        lock = self.files.place(lock_path.name)
        async with LeaseLock(lock, lease_seconds=self.settings.lease_seconds).hold():
            done = await asyncio.to_thread(self._load_batch, path)
            if done is not None and _whole(done, batch):
                return _told(done, on_count)
            # A batch file without some of its shards: their counts failed (a read that came back
            # wrong once, or a bad shard). Counted again, not taken as done: one failed read must
            # not make a shard uncountable for the whole cluster; a bad shard fails again, here.
            counted = await self._count_batch(batch, {**found, **(done or {})}, report, on_count)
            await self._write(path, counted)
            return counted

    def _held_by_another(self, lock_name: str) -> bool:
        """Whether a live lease on ``lock_name`` exists (a stale one is taken over by whoever asks next)."""
        age = self.files.age(lock_name)
        return age is not None and age <= self.settings.lease_seconds

    def _load_batch(self, path: Path) -> dict[str, KnownCount] | None:
        try:
            raw = self.files.read_trusted(path.name)
            if raw is None:
                return None
            counts = parse_batch(raw, str(path))
        except (OSError, ShardReadError, UnsafeFileError) as exc:
            logger.warning("counting again: %s", exc)
            return None
        backed, ours = backed_counts(self.manifest, counts, path)
        if len(backed) < ours:
            return None  # a count its bytes cannot back: the batch is counted again
        return backed

    async def _count_batch(
        self,
        batch: Sequence[Shard],
        found: Mapping[str, KnownCount],
        report: IndexReport,
        on_count: Callable[[str, int], None] | None,
    ) -> dict[str, KnownCount]:
        counted: dict[str, KnownCount] = {}
        for shard in batch:
            if shard.key in found:
                # Kept in the batch file too, so the file alone says the whole batch is done.
                counted[shard.key] = found[shard.key]
                continue
            try:
                samples = await self._count(shard, f"{self._where}: shard {shard.key!r}")
            except ShardReadError as exc:
                # Left out of the batch (every node finds it uncounted), not raised: whether a bad
                # shard is skipped or fatal is each reader's on_error.
                report.unreadable[shard.key] = str(exc)
                continue
            report.scanned += 1
            report.scanned_bytes += shard.size
            counted[shard.key] = KnownCount(samples, "scanned")
            if on_count is not None:
                on_count(shard.key, samples)
        return counted


def _whole(done: Mapping[str, KnownCount], batch: Sequence[Shard]) -> bool:
    return all(shard.key in done for shard in batch)


def _told(
    counted: dict[str, KnownCount], on_count: Callable[[str, int], None] | None
) -> dict[str, KnownCount]:
    """``counted`` (a batch another process counted), each count told to ``on_count`` as if counted here:
    a reader waiting for counts hears of them now, not when the whole index is done."""
    if on_count is not None:
        for key, count in counted.items():
            on_count(key, count.samples)
    return counted


@dataclass
class IndexOutcome:
    """What `index_dataset` did: the counts, how they were found, and where the index was kept."""

    counts: dict[str, KnownCount]
    report: IndexReport
    shared: Path
    """The cluster index (on the shared tier; without one, the node's own)."""
    beside_origin: str | None
    not_beside_origin: str | None = None


async def index_dataset(
    origin: Tier,
    writable_origin: Tier | None,
    manifest: Manifest,
    settings: Settings,
    *,
    rescan: bool = False,
    engine: tuple[str, str | None, str, Mapping[str, Any]] | None = None,
) -> IndexOutcome:
    """Count every shard of ``manifest`` once per cluster and keep the counts for every later reader.

    The counts go to the cluster index on the shared tier (when there is
    one) and, as a wids shard index named `WIDS_INDEX_NAME`, beside the
    shards when ``writable_origin`` accepts a write. ``rescan`` forgets what
    the cluster index and the sidecars said and scans every shard again (after
    a wrong count was reported).
    """
    index = ClusterIndex(origin, manifest, settings)
    index.engine = engine
    if rescan:
        await asyncio.to_thread(index.forget)
        index.ignore_sidecars = True
    found, report = await index.build()
    if len(found) != len(manifest.shards):
        missing = len(manifest.shards) - len(found)
        raise ShardReadError(f"dataset {manifest.dataset}: {missing} shards could not be counted")
    outcome = IndexOutcome(found, report, index.directory, None)
    if writable_origin is None:
        outcome.not_beside_origin = "the origin is read-only"
        return outcome
    document = wids_index(manifest, {key: count.samples for key, count in found.items()}, name=manifest.dataset)

    async def body() -> AsyncIterator[bytes]:
        yield document

    try:
        await writable_origin.put(WIDS_INDEX_NAME, body())
    except (OSError, DatacacheError) as exc:
        outcome.not_beside_origin = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    else:
        outcome.beside_origin = f"{origin.url.rstrip('/')}/{WIDS_INDEX_NAME}"
    return outcome
