"""Plain files: each object of the listing is one sample, its field named by the file's extension."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from datacache.counting.tarindex import split_key
from datacache.formats._base import (
    Buffer,
    BufferReader,
    Fields,
    PlanContext,
    SampleFormat,
    Unit,
    UnitPlan,
    UnitReader,
    one_unit_per_shard,
)

__all__ = ["FORMAT", "FileReader", "FilesFormat"]


class FileReader(BufferReader):
    """A plain file: one sample, its field named by the file's extension (``data`` if none)."""

    def __init__(self, unit: Unit, where: str, buffer: Buffer) -> None:
        super().__init__(unit, where, buffer)
        split = split_key(unit.keys[0])
        self._key, self._field = split if split is not None else (unit.keys[0], "data")
        self._key_bytes = self._key.encode("utf-8", "surrogateescape")

    def fields(self, index: int) -> Fields:
        if index != 0:
            raise IndexError(index)
        return [("__key__", memoryview(self._key_bytes)), (self._field, self._view)]


class FilesFormat(SampleFormat):
    """A tree of small files: what a listing is when no other format claims it."""

    name = "files"
    rechunker = "datacache.shard.tar:FILES"
    priority = 1000
    batch = "fields"

    def detect(self, keys: Collection[str]) -> bool:
        return True

    def max_samples(self, size: int) -> int:
        return 1

    async def plan(self, context: PlanContext, *, wait: bool) -> UnitPlan:
        return one_unit_per_shard(context.manifest, {s.key: 1 for s in context.manifest.shards}, {})

    def open_reader(
        self, unit: Unit, where: str, buffers: Mapping[str, Buffer], extra: Mapping[str, Any], *, index: Any = None
    ) -> UnitReader:
        return FileReader(unit, where, buffers[unit.keys[0]])


FORMAT = FilesFormat()
