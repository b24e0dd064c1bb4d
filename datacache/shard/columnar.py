"""Re-chunking columnar sources: Parquet row groups and Zarr chunks of a target size.

A Parquet dataset written with tiny row groups, or a Zarr array with tiny
chunks, costs one request per piece. ``datacache shard`` rewrites it with
pieces of about ``--chunk-size`` uncompressed bytes: Parquet files of about
``--shard-size`` made of whole input row groups coalesced in order, and a Zarr
array chunked along axis 0 only. Both plans are pure functions of the input
metadata, and each output file (Parquet) or chunk (Zarr) is an independent
unit, so the same resume, verification and engines apply as for tar shards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from datacache.checksum import checksum_of, new_hasher
from datacache.errors import ConfigError, ShardNotFoundError, ShardReadError
from datacache.formats import get_format
from datacache.shard.job import Endpoint, PackIO, ShardJob
from datacache.shard.plan import (
    ParquetPayload,
    RowGroupRef,
    ShardOptions,
    ShardPlan,
    UnitSpec,
    ZarrPayload,
    digest_of,
)
from datacache.shard.rechunk import Rechunker
from datacache.tiers import ObjectInfo

__all__ = [
    "PARQUET",
    "ZARR",
    "ZARR_METADATA",
    "ParquetRechunker",
    "ZarrRechunker",
    "pack_parquet",
    "pack_zarr",
    "plan_parquet",
    "plan_row_groups",
    "plan_zarr",
]

ZARR_METADATA = "zarr.json"
_READ_CHUNK = 8 << 20

logger = logging.getLogger("datacache.shard")


def _filesystem(endpoint: Endpoint) -> tuple[Any, str]:
    import fsspec.core

    fs, root = fsspec.core.url_to_fs(endpoint.url, **dict(endpoint.storage_options))
    return fs, str(root).rstrip("/")


# -- Parquet ------------------------------------------------------------------------------


def plan_row_groups(
    files: Sequence[tuple[ObjectInfo, Sequence[tuple[int, int]]]],
    options: ShardOptions,
    *,
    schema: str,
) -> list[UnitSpec]:
    """Coalesce input row groups, in order, into output row groups and files.

    ``files`` holds each input file with its row groups as (rows, uncompressed
    bytes). An output row group closes once it holds ``chunk_size`` bytes, a
    file once it holds ``shard_size``; input row groups are never split.
    """
    units: list[UnitSpec] = []
    groups: list[tuple[RowGroupRef, ...]] = []
    current: list[RowGroupRef] = []
    current_bytes = 0
    file_bytes = 0

    def close_group() -> None:
        nonlocal current, current_bytes
        if current:
            groups.append(tuple(current))
            current, current_bytes = [], 0

    def close_file() -> None:
        nonlocal groups, file_bytes
        close_group()
        if not groups:
            return
        key = f"{options.prefix}-{len(units):06d}.parquet"
        refs = [ref for group in groups for ref in group]
        described = [[[r.key, r.version, r.index] for r in group] for group in groups]
        units.append(
            UnitSpec(
                key=key,
                kind="parquet",
                digest=digest_of(["parquet", key, schema, described]),
                size=None,
                samples=sum(r.rows for r in refs),
                objects=len(refs),
                input_bytes=sum(r.nbytes for r in refs),
                payload=ParquetPayload(tuple(groups)),
            )
        )
        groups, file_bytes = [], 0

    for info, row_groups in sorted(files, key=lambda f: f[0].key):
        for index, (rows, nbytes) in enumerate(row_groups):
            current.append(RowGroupRef(info.key, info.version, index, rows, nbytes))
            current_bytes += nbytes
            file_bytes += nbytes
            if current_bytes >= options.chunk_size:
                close_group()
                if file_bytes >= options.shard_size:
                    close_file()
    close_file()
    return units


def plan_parquet(source: Endpoint, infos: Sequence[ObjectInfo], options: ShardOptions) -> ShardPlan:
    """Read every input file's footer and plan the re-chunked files (blocking)."""
    import pyarrow.parquet as pq

    fs, root = _filesystem(source)
    files: list[tuple[ObjectInfo, list[tuple[int, int]]]] = []
    schema_text: str | None = None
    first_key = ""
    for info in sorted(infos, key=lambda i: i.key):
        try:
            with fs.open(f"{root}/{info.key}", "rb") as handle:
                parquet = pq.ParquetFile(handle)
                metadata = parquet.metadata
                schema = parquet.schema_arrow
        except OSError as exc:
            raise ShardReadError(
                f"{source.url}/{info.key}: cannot read its Parquet footer ({exc})"
            ) from None
        text = schema.to_string(show_schema_metadata=False)
        if schema_text is None:
            schema_text, first_key = text, info.key
        elif text != schema_text:
            raise ConfigError(
                f"{info.key}: its Parquet schema differs from {first_key}'s; shard them separately"
            )
        row_groups = [
            (metadata.row_group(i).num_rows, metadata.row_group(i).total_byte_size)
            for i in range(metadata.num_row_groups)
        ]
        files.append((info, row_groups))
    units = plan_row_groups(files, options, schema=schema_text or "")
    return ShardPlan(
        kind="parquet",
        source=source.url,
        options=options,
        units=tuple(units),
        objects=sum(u.objects for u in units),
        input_bytes=sum(u.input_bytes for u in units),
    )


def _write_parquet(spec: UnitSpec, payload: ParquetPayload, source: Endpoint, target: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, root = _filesystem(source)
    with contextlib.ExitStack() as stack:
        readers: dict[str, Any] = {}
        writer: Any = None
        for group in payload.row_groups:
            tables = []
            for ref in group:
                reader = readers.get(ref.key)
                if reader is None:
                    handle = stack.enter_context(fs.open(f"{root}/{ref.key}", "rb"))
                    reader = readers[ref.key] = pq.ParquetFile(handle)
                tables.append(reader.read_row_group(ref.index))
            table = pa.concat_tables(tables)
            if writer is None:
                writer = stack.enter_context(pq.ParquetWriter(target, table.schema))
            writer.write_table(table, row_group_size=max(1, table.num_rows))


async def _file_chunks(path: str) -> AsyncIterator[bytes]:
    """The bytes of the local spool file, read in a thread: a slow disk must not stall the event loop."""
    handle = await asyncio.to_thread(open, path, "rb")
    try:
        while chunk := await asyncio.to_thread(handle.read, _READ_CHUNK):
            yield chunk
    finally:
        await asyncio.to_thread(handle.close)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        Path(path).unlink()


async def pack_parquet(spec: UnitSpec, job: ShardJob, io: PackIO) -> tuple[int, str]:
    """Write one output Parquet file: spooled to a temporary file, then streamed to ``dest``."""
    if not isinstance(spec.payload, ParquetPayload):
        raise TypeError("a parquet unit needs a ParquetPayload")
    payload = spec.payload
    fd, spool = tempfile.mkstemp(prefix="datacache-shard-", suffix=".parquet")
    os.close(fd)
    try:
        async with io.limiter:
            await asyncio.to_thread(_write_parquet, spec, payload, job.source, spool)
        for group in payload.row_groups:
            io.on_object(len(group), sum(ref.nbytes for ref in group))
        hasher = new_hasher()
        size = 0

        async def hashed() -> AsyncIterator[bytes]:
            nonlocal size
            async for chunk in _file_chunks(spool):
                hasher.update(chunk)
                size += len(chunk)
                yield chunk

        await io.dest.put(spec.key, hashed())
        return size, checksum_of(hasher)
    finally:
        await asyncio.to_thread(_remove, spool)


# -- Zarr ---------------------------------------------------------------------------------


def _zarr_store(endpoint: Endpoint, *, read_only: bool) -> Any:
    from zarr.storage import FsspecStore, LocalStore

    fs, root = _filesystem(endpoint)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    if protocol in ("file", "local"):
        return LocalStore(root, read_only=read_only)
    return FsspecStore.from_url(
        endpoint.url, storage_options=dict(endpoint.storage_options), read_only=read_only
    )


def _source_array(source: Endpoint) -> Any:
    """The Zarr array at the root of ``source``; `ConfigError` unless it is one with rows along axis 0."""
    import zarr

    try:
        array = zarr.open_array(store=_zarr_store(source, read_only=True), mode="r")
    except (FileNotFoundError, ValueError, TypeError) as exc:
        raise ConfigError(f"{source.url}: not a Zarr array at its root ({exc})") from None
    if not array.shape or array.shape[0] == 0:
        raise ConfigError(
            f"{source.url}: a Zarr array to re-chunk needs at least one row along axis 0"
        )
    return array


def _rows_per_chunk(row_bytes: int, source_rows: int, length: int, options: ShardOptions) -> int:
    """Rows of an output chunk: about ``chunk_size`` bytes, whole source chunks when more than one."""
    rows = max(1, options.chunk_size // row_bytes)
    if rows >= source_rows:
        rows = rows // source_rows * source_rows  # whole source chunks per output chunk
    return min(rows, length)


def _output_array(array: Any, shape: tuple[int, ...], rows: int) -> tuple[Any, str]:
    """The output array's metadata (``zarr.json``), made in memory: the source's but for its chunks."""
    import zarr
    from zarr.storage import MemoryStore

    kwargs: dict[str, Any] = {}
    if array.metadata.zarr_format == 3:
        kwargs = {
            "compressors": array.compressors,
            "filters": array.filters,
            "serializer": array.serializer,
            "dimension_names": array.metadata.dimension_names,
        }
    memory: dict[str, Any] = {}
    output = zarr.create_array(
        store=MemoryStore(memory),
        shape=shape,
        chunks=(rows, *shape[1:]),
        dtype=array.dtype,
        fill_value=array.fill_value,
        attributes=dict(array.attrs),
        **kwargs,
    )
    return output, memory[ZARR_METADATA].to_bytes().decode()


def plan_zarr(source: Endpoint, infos: Sequence[ObjectInfo], options: ShardOptions) -> ShardPlan:
    """Plan a copy of the Zarr array at ``source`` with chunks of about ``chunk_size`` along axis 0.

    The output's ``zarr.json`` (same shape, dtype, fill value, attributes and,
    for a Zarr v3 source, codecs) is in ``extra["zarr_json"]``; each unit is
    one output chunk. Raises `ConfigError` when the source is not one array.
    """
    array = _source_array(source)
    shape = tuple(int(n) for n in array.shape)
    row_bytes = max(1, math.prod(shape[1:]) * array.dtype.itemsize)
    source_rows = int(array.chunks[0])
    rows = _rows_per_chunk(row_bytes, source_rows, shape[0], options)
    output, metadata = _output_array(array, shape, rows)
    listing = digest_of(sorted([info.key, info.size, info.version] for info in infos))
    units: list[UnitSpec] = []
    for index, start in enumerate(range(0, shape[0], rows)):
        stop = min(start + rows, shape[0])
        key = output.metadata.encode_chunk_key((index,) + (0,) * (len(shape) - 1))
        units.append(
            UnitSpec(
                key=key,
                kind="zarr",
                digest=digest_of(["zarr", key, metadata, listing, start, stop]),
                size=None,
                samples=stop - start,
                objects=math.ceil((stop - start) / source_rows),
                input_bytes=(stop - start) * row_bytes,
                payload=ZarrPayload(start, stop),
            )
        )
    return ShardPlan(
        kind="zarr",
        source=source.url,
        options=options,
        units=tuple(units),
        objects=sum(u.objects for u in units),
        input_bytes=sum(u.input_bytes for u in units),
        extra={
            "zarr_json": metadata,
            "rows_per_chunk": rows,
            "source_chunk_bytes": source_rows * row_bytes,
        },
    )


def _copy_rows(payload: ZarrPayload, job: ShardJob) -> None:
    import zarr

    source = zarr.open_array(store=_zarr_store(job.source, read_only=True), mode="r")
    target = zarr.open_array(store=_zarr_store(job.dest, read_only=False), mode="r+")
    target = target.with_config({"write_empty_chunks": True})
    target[payload.start : payload.stop] = source[payload.start : payload.stop]


async def pack_zarr(spec: UnitSpec, job: ShardJob, io: PackIO) -> tuple[int, str]:
    """Write one output chunk through zarr (atomic per chunk), then checksum what was stored."""
    if not isinstance(spec.payload, ZarrPayload):
        raise TypeError("a zarr unit needs a ZarrPayload")
    async with io.limiter:
        await asyncio.to_thread(_copy_rows, spec.payload, job)
    io.on_object(spec.objects, spec.input_bytes)
    try:
        data = await io.dest.get(spec.key)
    except ShardNotFoundError:
        raise ShardReadError(f"{io.dest.url}/{spec.key}: zarr did not write the chunk") from None
    hasher = new_hasher()
    hasher.update(data)
    return len(data), checksum_of(hasher)


# -- The rechunkers the formats name ------------------------------------------------------


class ParquetRechunker(Rechunker):
    """The ``.parquet`` files of the source re-chunked into files of whole, coalesced row groups."""

    async def plan(
        self, source: Endpoint, infos: Sequence[ObjectInfo], options: ShardOptions, shown: str
    ) -> ShardPlan:
        parquet = get_format("parquet").shard_keys(infos)
        if not parquet:
            raise ConfigError(f"--format parquet: no .parquet files at {shown}")
        if len(parquet) < len(infos):
            logger.warning(
                "%s holds %d .parquet files and %d others; re-chunking the .parquet files only "
                "(--format files packs every file into tar shards)",
                shown,
                len(parquet),
                len(infos) - len(parquet),
            )
        return await asyncio.to_thread(plan_parquet, source, parquet, options)

    async def pack(self, spec: UnitSpec, job: ShardJob, io: PackIO) -> tuple[int, str]:
        return await pack_parquet(spec, job, io)


class ZarrRechunker(Rechunker):
    """The Zarr array at the source's root copied with chunks of about ``--chunk-size`` along axis 0."""

    async def plan(
        self, source: Endpoint, infos: Sequence[ObjectInfo], options: ShardOptions, shown: str
    ) -> ShardPlan:
        return await asyncio.to_thread(plan_zarr, source, infos, options)

    async def pack(self, spec: UnitSpec, job: ShardJob, io: PackIO) -> tuple[int, str]:
        return await pack_zarr(spec, job, io)

    def root_files(self, plan: ShardPlan) -> Mapping[str, bytes]:
        return {ZARR_METADATA: str(plan.extra["zarr_json"]).encode()}


PARQUET = ParquetRechunker()
"""The ``parquet`` format's rechunker (`datacache.formats.parquet` names it)."""
ZARR = ZarrRechunker()
"""The ``zarr`` format's rechunker (`datacache.formats.zarr` names it)."""
