"""Packing a tar unit: a WebDataset-style shard streamed to the output, never held whole.

The shard is produced as a stream of chunks (headers computed from the plan,
member data fetched by a bounded set of concurrent GETs, prefetched in order
within a byte budget) and handed to the output tier's atomic `put` (a
multipart upload on S3), followed by its index (``<shard>.idx.json``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Sequence

from datacache.checksum import checksum_of, new_hasher
from datacache.counting.tarindex import INDEX_SUFFIX, index_to_json
from datacache.errors import DatacacheError, OriginChangedError
from datacache.shard.job import Endpoint, PackIO, ShardJob, put_bytes
from datacache.shard.plan import (
    ShardOptions,
    ShardPlan,
    TarMemberPlan,
    TarPayload,
    UnitSpec,
    plan_tar,
    tar_header,
)
from datacache.shard.rechunk import Rechunker
from datacache.tiers import ObjectInfo, Tier

__all__ = ["FILES", "FilesRechunker", "pack_tar"]

_FLUSH = 1 << 20
_STREAM_OVER = 8 << 20
_END_OF_ARCHIVE = b"\x00" * 1024


async def _tar_chunks(payload: TarPayload, options: ShardOptions, io: PackIO) -> AsyncIterator[bytes]:
    """Yield the bytes of the tar shard ``spec`` describes, in chunks of about 1 MiB."""
    source, limiter, on_object = io.source, io.limiter, io.on_object
    members = payload.members
    window: deque[tuple[TarMemberPlan, asyncio.Task[bytes] | None]] = deque()
    window_count = max(8, 2 * options.concurrency)
    in_flight = 0
    position = 0

    async def fetch(key: str, member: TarMemberPlan) -> bytes:
        async with limiter:
            data: bytes = await source.get(key, version=member.version)
        if len(data) != member.size:
            raise OriginChangedError(
                f"{source.url}/{key}: {len(data)} bytes, listed with {member.size}; "
                "rerun to plan again"
            )
        return data

    def refill() -> None:
        nonlocal in_flight, position
        while position < len(members) and len(window) < window_count:
            member = members[position]
            task: asyncio.Task[bytes] | None = None
            if member.source is not None and member.size <= _STREAM_OVER:
                if window and in_flight + member.size > options.memory:
                    return
                task = asyncio.create_task(fetch(member.source, member))
                in_flight += member.size
            window.append((member, task))
            position += 1

    out = bytearray()
    try:
        while window or position < len(members):
            refill()
            member, task = window.popleft()
            out += tar_header(member.name, member.size)
            if member.inline is not None:
                out += member.inline
            elif task is not None:
                data = await task
                in_flight -= member.size
                on_object(1, member.size)
                if len(data) >= _FLUSH:
                    yield bytes(out)
                    out.clear()
                    yield data
                else:
                    out += data
            elif member.source is not None:
                if out:
                    yield bytes(out)
                    out.clear()
                streamed = 0
                async for chunk in source.stream(
                    member.source, chunk_size=_STREAM_OVER, version=member.version
                ):
                    streamed += len(chunk)
                    yield chunk
                if streamed != member.size:
                    raise OriginChangedError(
                        f"{source.url}/{member.source}: {streamed} bytes, listed with "
                        f"{member.size}; rerun to plan again"
                    )
                on_object(1, member.size)
            remainder = member.size % 512
            if remainder:
                out += b"\x00" * (512 - remainder)
            if len(out) >= _FLUSH:
                yield bytes(out)
                out.clear()
        out += _END_OF_ARCHIVE
        yield bytes(out)
    finally:
        for _, pending in window:
            if pending is not None:
                pending.cancel()
        leftovers = [pending for _, pending in window if pending is not None]
        if leftovers:
            await asyncio.gather(*leftovers, return_exceptions=True)


async def pack_tar(spec: UnitSpec, job: ShardJob, io: PackIO) -> tuple[int, str]:
    """Stream the tar shard ``spec`` plans into ``dest``, then its index; return (size, checksum)."""
    if not isinstance(spec.payload, TarPayload):
        raise TypeError("a tar unit needs a TarPayload")
    payload = spec.payload
    hasher = new_hasher()
    written = 0

    async def hashed() -> AsyncIterator[bytes]:
        nonlocal written
        async for chunk in _tar_chunks(payload, job.options, io):
            hasher.update(chunk)
            written += len(chunk)
            yield chunk

    await io.dest.put(spec.key, hashed())
    if written != spec.size:
        raise DatacacheError(
            f"shard {spec.key}: wrote {written} bytes, planned {spec.size} (a bug)"
        )
    await put_bytes(io.dest, spec.key + INDEX_SUFFIX, index_to_json(payload.spans, shard_size=written))
    return written, checksum_of(hasher)


class FilesRechunker(Rechunker):
    """Every object of the source, grouped into samples, packed into WebDataset tar shards."""

    async def plan(
        self, source: Endpoint, infos: Sequence[ObjectInfo], options: ShardOptions, shown: str
    ) -> ShardPlan:
        return plan_tar(infos, options, source=shown)

    async def pack(self, spec: UnitSpec, job: ShardJob, io: PackIO) -> tuple[int, str]:
        return await pack_tar(spec, job, io)

    async def kept(self, spec: UnitSpec, dest: Tier, size: int) -> None:
        # A shard kept from a run killed between the shard and its index: the index is rebuilt from the plan.
        if isinstance(spec.payload, TarPayload) and await dest.stat(spec.key + INDEX_SUFFIX) is None:
            await put_bytes(dest, spec.key + INDEX_SUFFIX, index_to_json(spec.payload.spans, shard_size=size))


FILES = FilesRechunker()
"""The ``files`` format's rechunker (`datacache.formats.files` names it)."""
