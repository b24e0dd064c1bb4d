"""Parquet files: one sample per row, counted from each file's footer (one ranged read)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from datacache.errors import ShardReadError
from datacache.formats._base import (
    Buffer,
    PlanContext,
    SampleFormat,
    Unit,
    UnitPlan,
    UnitReader,
    count_each_shard,
)
from datacache.formats._rows import RowsReader
from datacache.manifest import PARQUET_MAX_ROWS_PER_BYTE
from datacache.tiers import ByteRange

__all__ = ["FORMAT", "ParquetFormat", "ParquetReader", "parquet_rows"]


class ParquetReader(RowsReader):
    """A Parquet file: one sample per row, as a dict of column values, decoded a batch at a time."""

    def __init__(self, unit: Unit, where: str, buffer: Buffer) -> None:
        import pyarrow as pa

        from datacache.formats._parquet_rows import ParquetRows

        try:
            rows = ParquetRows(buffer)
        except (pa.ArrowException, OSError, ValueError) as exc:  # ValueError: a column name that is not UTF-8
            raise ShardReadError(f"{where}: corrupt Parquet file ({exc})") from None
        super().__init__(unit, where, buffer, rows, suffix=".parquet", damaged="corrupt Parquet data")


async def parquet_rows(context: PlanContext, key: str, size: int) -> int:
    """The rows of one Parquet shard, from its footer; `ShardReadError` for a damaged one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    where = f"{context.where}: shard {key!r}"
    if size < 12:
        raise ShardReadError(f"{where}: too small to be a Parquet file ({size} bytes)")
    tail = await context.read(key, ByteRange(max(0, size - 65536), size))
    if tail[-4:] != b"PAR1":
        raise ShardReadError(f"{where}: not a Parquet file (no PAR1 footer magic)")
    footer = int.from_bytes(tail[-8:-4], "little")
    if footer + 8 > size:
        raise ShardReadError(f"{where}: corrupt Parquet footer length")
    if footer + 8 > len(tail):
        tail = await context.read(key, ByteRange(size - footer - 8, size))
    try:
        metadata = pq.read_metadata(pa.BufferReader(b"PAR1" + tail[-(footer + 8) :]))
    except (pa.ArrowException, OSError) as exc:
        raise ShardReadError(f"{where}: corrupt Parquet footer ({exc})") from None
    rows = int(metadata.num_rows)
    bound = FORMAT.max_samples(size)
    if rows > bound:
        raise ShardReadError(f"{where}: its footer claims {rows} rows in {size} bytes (at most {bound})")
    return rows


class ParquetFormat(SampleFormat):
    """Parquet files, read by row group; batch mode gives Arrow record batches."""

    name = "parquet"
    rechunker = "datacache.shard.columnar:PARQUET"
    suffixes = (".parquet",)
    shard_names = (".pq",)
    priority = 20
    batch = "arrow"

    def max_samples(self, size: int) -> int:
        return max(size, 1) * PARQUET_MAX_ROWS_PER_BYTE

    async def plan(self, context: PlanContext, *, wait: bool) -> UnitPlan:
        return await count_each_shard(context, lambda key, size: parquet_rows(context, key, size))

    def open_reader(
        self, unit: Unit, where: str, buffers: Mapping[str, Buffer], extra: Mapping[str, Any], *, index: Any = None
    ) -> UnitReader:
        return ParquetReader(unit, where, buffers[unit.keys[0]])


FORMAT = ParquetFormat()
