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


class _Window:
    """Member data fetched ahead, in order: up to ``2 * concurrency`` members, ``memory`` bytes in flight.

    Members over ``_STREAM_OVER`` bytes are not fetched ahead: they are streamed when their turn comes.
    """

    def __init__(self, members: tuple[TarMemberPlan, ...], options: ShardOptions, io: PackIO) -> None:
        self._members = members
        self._memory = options.memory
        self._count = max(8, 2 * options.concurrency)
        self._io = io
        self._window: deque[tuple[TarMemberPlan, asyncio.Task[bytes] | None]] = deque()
        self._in_flight = 0
        self._position = 0

    def more(self) -> bool:
        return bool(self._window) or self._position < len(self._members)

    def next(self) -> tuple[TarMemberPlan, asyncio.Task[bytes] | None]:
        """The next member, and the task fetching its data if it was fetched ahead."""
        self._refill()
        return self._window.popleft()

    async def take(self, member: TarMemberPlan, task: asyncio.Task[bytes]) -> bytes:
        """The data of a member fetched ahead, counted as read."""
        data = await task
        self._in_flight -= member.size
        self._io.on_object(1, member.size)
        return data

    async def close(self) -> None:
        """Cancel the fetches still in the window (an error or a cancelled put)."""
        pending = [task for _, task in self._window if task is not None]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def _refill(self) -> None:
        while self._position < len(self._members) and len(self._window) < self._count:
            member = self._members[self._position]
            task: asyncio.Task[bytes] | None = None
            if member.source is not None and member.size <= _STREAM_OVER:
                if self._window and self._in_flight + member.size > self._memory:
                    return
                task = asyncio.create_task(self._fetch(member.source, member))
                self._in_flight += member.size
            self._window.append((member, task))
            self._position += 1

    async def _fetch(self, key: str, member: TarMemberPlan) -> bytes:
        source = self._io.source
        async with self._io.limiter:
            data: bytes = await source.get(key, version=member.version)
        if len(data) != member.size:
            raise OriginChangedError(
                f"{source.url}/{key}: {len(data)} bytes, listed with {member.size}; "
                "rerun to plan again"
            )
        return data


async def _streamed(member: TarMemberPlan, key: str, io: PackIO) -> AsyncIterator[bytes]:
    """The data of a large member, streamed from the source and checked against its listed size."""
    streamed = 0
    async for chunk in io.source.stream(key, chunk_size=_STREAM_OVER, version=member.version):
        streamed += len(chunk)
        yield chunk
    if streamed != member.size:
        raise OriginChangedError(
            f"{io.source.url}/{key}: {streamed} bytes, listed with {member.size}; rerun to plan again"
        )
    io.on_object(1, member.size)


async def _tar_chunks(payload: TarPayload, options: ShardOptions, io: PackIO) -> AsyncIterator[bytes]:
    """Yield the bytes of the tar shard ``spec`` describes, in chunks of about 1 MiB."""
    window = _Window(payload.members, options, io)
    out = bytearray()
    try:
        while window.more():
            member, task = window.next()
            out += tar_header(member.name, member.size)
            if member.inline is not None:
                out += member.inline
            elif task is not None:
                data = await window.take(member, task)
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
                async for chunk in _streamed(member, member.source, io):
                    yield chunk
            remainder = member.size % 512
            if remainder:
                out += b"\x00" * (512 - remainder)
            if len(out) >= _FLUSH:
                yield bytes(out)
                out.clear()
        out += _END_OF_ARCHIVE
        yield bytes(out)
    finally:
        await window.close()


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
