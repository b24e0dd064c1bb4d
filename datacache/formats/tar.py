"""WebDataset tar shards: a sample is a run of members sharing a key (``0001.jpg``, ``0001.cls``).

Counts come from `datacache.counting.cluster.ClusterIndex`: the cluster's index on the
shared tier, the sidecar indexes beside the shards (wids, open_clip,
img2dataset, DALI), and, for shards nobody indexed, a streaming scan of their
headers that the nodes divide among themselves. A cold epoch starts before
they are all known.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from datacache.counting.cluster import ClusterIndex
from datacache.counting.sidecars import KnownCount
from datacache.counting.spantable import SpanTable
from datacache.counting.tarindex import SampleSpan, group_samples, scan_tar
from datacache.errors import ShardReadError
from datacache.formats._base import (
    COUNT_SOURCES,
    Buffer,
    BufferReader,
    Fields,
    PlanContext,
    SampleFormat,
    Unit,
    UnitPlan,
    UnitReader,
)
from datacache.manifest import SIDECAR_CANDIDATES, TAR_BLOCK
from datacache.tiers import ObjectInfo

__all__ = ["FORMAT", "TarFormat", "TarReader"]

logger = logging.getLogger(__name__)


class TarReader(BufferReader):
    """A WebDataset tar shard: samples are runs of members sharing a key."""

    def __init__(
        self,
        unit: Unit,
        where: str,
        buffer: Buffer,
        spans: Sequence[SampleSpan] | None = None,
        sources: Sequence[str] = (),
    ) -> None:
        super().__init__(unit, where, buffer)
        try:
            if spans is None:
                try:
                    spans = group_samples(scan_tar(self._view, where=where))
                except ValueError as exc:
                    if isinstance(exc, ShardReadError):
                        raise
                    raise ShardReadError(f"{where}: {exc}") from None
            table = SpanTable.from_spans(spans, shard_size=len(self._view))
            if unit.count >= 0 and len(table) != unit.count:  # a negative count: not known yet (a cold epoch)
                said = f" ({', '.join(sources)})" if sources else ""
                raise ShardReadError(
                    f"{where}: holds {len(table)} samples, its sample index{said} says {unit.count}: "
                    "the index is wrong; fix or delete it, then run `datacache index URL --rescan`"
                )
        except BaseException:
            # The caller unmaps the buffer; an export left in a frame the traceback keeps would forbid it.
            self._view.release()
            raise
        self.spans: SpanTable = table
        self._keys = [memoryview(table.key(i).encode("utf-8", "surrogateescape")) for i in range(len(table))]

    @property
    def samples(self) -> int:
        return len(self.spans)

    @property
    def index(self) -> SpanTable:
        return self.spans

    def fields(self, index: int) -> Fields:
        fields: Fields = [("__key__", self._keys[index])]
        fields += self.spans.views(index, self._view)
        return fields


class TarFormat(SampleFormat):
    """WebDataset-style tar shards, read in place; their scanned index is kept per node."""

    name = "tar"
    suffixes = (".tar",)
    shard_names = (".tar.gz", ".tgz")
    priority = 10
    batch = "fields"
    keeps_index = True
    indexed = True

    def max_samples(self, size: int) -> int:
        return size // TAR_BLOCK

    def manifest_extra(self, infos: Sequence[ObjectInfo]) -> dict[str, Any]:
        found = [[info.key, info.size] for info in infos if info.key.endswith((".json", ".idx"))]
        return {SIDECAR_CANDIDATES: found}

    async def plan(self, context: PlanContext, *, wait: bool) -> UnitPlan:
        manifest = context.manifest
        index = ClusterIndex(context.origin, manifest, context.settings)
        if not wait:
            found = await index.known()
            if len(found) < len(manifest.shards):
                # A cold epoch starts now; the counts are completed in the background (`coldplan`).
                units = tuple(
                    Unit((s.key,), found[s.key].samples if s.key in found else -1, s.key) for s in manifest.shards
                )
                return UnitPlan(units, _sources(found))
        found, report = await index.build()
        if report.scanned:
            logger.info(
                "%s: scanned %d tar shards (%d bytes) in %.1fs for their sample counts; "
                "other nodes shared the work (`datacache index` does it ahead of time)",
                context.where,
                report.scanned,
                report.scanned_bytes,
                report.seconds,
            )
        uncounted = "its samples could not be counted"
        keys = manifest.table.keys()
        uncountable = {
            key: report.unreadable.get(key, f"{context.where}: shard {key!r}: {uncounted}")
            for key in keys
            if key not in found
        }
        units = tuple(Unit((s.key,), found[s.key].samples if s.key in found else 0, s.key) for s in manifest.shards)
        return UnitPlan(units, _sources(found), uncountable)

    def open_reader(
        self, unit: Unit, where: str, buffers: Mapping[str, Buffer], extra: Mapping[str, Any], *, index: Any = None
    ) -> UnitReader:
        return TarReader(unit, where, buffers[unit.keys[0]], index, tuple(extra.get(COUNT_SOURCES, ())))


def _sources(found: Mapping[str, KnownCount]) -> dict[str, Any]:
    sources = sorted({count.source for count in found.values() if count.source != "scanned"})
    return {COUNT_SOURCES: sources} if sources else {}


FORMAT = TarFormat()
