"""Packing one planned unit: stream it to the output, record it, or keep a verified copy.

A unit's bytes are never held whole: a tar shard is produced as a stream of
chunks (headers computed from the plan, member data fetched by a bounded set
of concurrent GETs, prefetched in order within a byte budget) and handed to
the output tier's atomic `put` (a multipart upload on S3). Once the unit and
its index are stored, a small record (size, checksum, plan digest) is written
under ``.datacache-shard-done/``: the commit point a rerun trusts, after
re-reading the unit and checking its checksum.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from datacache._shard_plan import (
    DONE_PREFIX,
    ShardOptions,
    TarMemberPlan,
    TarPayload,
    UnitSpec,
    tar_header,
)
from datacache.checksum import checksum_of, new_hasher
from datacache.errors import DatacacheError, OriginChangedError, ShardNotFoundError
from datacache.tarindex import INDEX_SUFFIX, index_to_json
from datacache.tiers import Tier, open_origin

__all__ = [
    "Endpoint",
    "ObjectCallback",
    "ShardJob",
    "UnitResult",
    "ensure_unit",
    "put_bytes",
    "record_key",
    "run_unit_sync",
]

logger = logging.getLogger("datacache.shard")

ObjectCallback = Callable[[int, int], None]
"""Called with (input objects, their bytes) as they are read."""

_FLUSH = 1 << 20
_STREAM_OVER = 8 << 20
_END_OF_ARCHIVE = b"\x00" * 1024


@dataclass(frozen=True)
class Endpoint:
    """A URL and its storage options: what a worker needs to open a tier in its own process."""

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def open(self, *, writable: bool) -> Tier:
        """Open the tier (in the calling process and event loop)."""
        return open_origin(self.url, storage_options=dict(self.storage_options), writable=writable)


@dataclass(frozen=True)
class ShardJob:
    """Everything a worker needs besides the unit itself; pickles for Dask and Ray."""

    source: Endpoint
    dest: Endpoint
    options: ShardOptions


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


async def _hash_object(tier: Tier, key: str) -> tuple[int, str]:
    hasher = new_hasher()
    size = 0
    async for chunk in tier.stream(key):
        hasher.update(chunk)
        size += len(chunk)
    return size, checksum_of(hasher)


async def _kept(spec: UnitSpec, dest: Tier) -> UnitResult | None:
    """Return the unit as recorded if its record matches the plan and its bytes verify."""
    try:
        raw = await dest.get(record_key(spec.key))
        record = json.loads(raw)
    except ShardNotFoundError:
        return None
    except ValueError:
        logger.warning("shard %s: unreadable record, packing it again", spec.key)
        return None
    if not isinstance(record, dict) or record.get("digest") != spec.digest:
        logger.info("shard %s: planned differently last time, packing it again", spec.key)
        return None
    size, checksum = record.get("size"), record.get("checksum")
    if not isinstance(size, int) or not isinstance(checksum, str):
        return None
    info = await dest.stat(spec.key)
    if info is None or info.size != size or (spec.size is not None and spec.size != size):
        logger.warning("shard %s: missing or of the wrong size, packing it again", spec.key)
        return None
    found_size, found = await _hash_object(dest, spec.key)
    if found_size != size or found != checksum:
        logger.warning(
            "shard %s: checksum mismatch (%s, recorded %s), packing it again",
            spec.key,
            found,
            checksum,
        )
        return None
    if isinstance(spec.payload, TarPayload) and await dest.stat(spec.key + INDEX_SUFFIX) is None:
        await put_bytes(
            dest, spec.key + INDEX_SUFFIX, index_to_json(spec.payload.spans, shard_size=size)
        )
    return UnitResult(
        spec.key, size, checksum, spec.samples, spec.objects, spec.input_bytes, written=False
    )


async def _tar_chunks(
    payload: TarPayload,
    *,
    source: Tier,
    options: ShardOptions,
    limiter: asyncio.Semaphore,
    on_object: ObjectCallback,
) -> AsyncIterator[bytes]:
    """Yield the bytes of the tar shard ``spec`` describes, in chunks of about 1 MiB."""
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


async def _pack_tar(
    spec: UnitSpec,
    job: ShardJob,
    *,
    source: Tier,
    dest: Tier,
    limiter: asyncio.Semaphore,
    on_object: ObjectCallback,
) -> tuple[int, str]:
    if not isinstance(spec.payload, TarPayload):
        raise TypeError("a tar unit needs a TarPayload")
    payload = spec.payload
    hasher = new_hasher()
    written = 0

    async def hashed() -> AsyncIterator[bytes]:
        nonlocal written
        async for chunk in _tar_chunks(
            payload, source=source, options=job.options, limiter=limiter, on_object=on_object
        ):
            hasher.update(chunk)
            written += len(chunk)
            yield chunk

    await dest.put(spec.key, hashed())
    if written != spec.size:
        raise DatacacheError(
            f"shard {spec.key}: wrote {written} bytes, planned {spec.size} (a bug)"
        )
    await put_bytes(dest, spec.key + INDEX_SUFFIX, index_to_json(payload.spans, shard_size=written))
    return written, checksum_of(hasher)


Packer = Callable[..., Awaitable[tuple[int, str]]]


def _packer(kind: str) -> Packer:
    if kind == "tar":
        return _pack_tar
    from datacache import _shard_columnar

    if kind == "parquet":
        return _shard_columnar.pack_parquet
    if kind == "zarr":
        return _shard_columnar.pack_zarr
    raise ValueError(f"unknown unit kind {kind!r}")


async def ensure_unit(
    spec: UnitSpec,
    job: ShardJob,
    source: Tier,
    dest: Tier,
    *,
    has_record: bool,
    limiter: asyncio.Semaphore | None = None,
    on_object: ObjectCallback | None = None,
) -> UnitResult:
    """Make sure ``spec`` is stored and recorded at ``dest``; return what the manifest needs.

    A unit with a record from an earlier run (``has_record``) is kept when
    its record carries the same plan digest and its bytes match the recorded
    size and checksum; anything else is packed again (atomically replacing
    what was there).
    """
    if has_record:
        kept = await _kept(spec, dest)
        if kept is not None:
            return kept
    size, checksum = await _packer(spec.kind)(
        spec,
        job,
        source=source,
        dest=dest,
        limiter=limiter or asyncio.Semaphore(job.options.concurrency),
        on_object=on_object or _ignore,
    )
    record = {
        "key": spec.key,
        "digest": spec.digest,
        "size": size,
        "checksum": checksum,
        "samples": spec.samples,
    }
    await put_bytes(dest, record_key(spec.key), json.dumps(record, sort_keys=True).encode())
    logger.debug("shard %s: %d bytes, %d samples, %s", spec.key, size, spec.samples, checksum)
    return UnitResult(
        spec.key, size, checksum, spec.samples, spec.objects, spec.input_bytes, written=True
    )


def _ignore(objects: int, nbytes: int) -> None:
    return None


async def _run_alone(spec: UnitSpec, has_record: bool, job: ShardJob) -> UnitResult:
    source = job.source.open(writable=False)
    dest = job.dest.open(writable=True)
    try:
        return await ensure_unit(spec, job, source, dest, has_record=has_record)
    finally:
        await source.close()
        await dest.close()


def run_unit_sync(spec: UnitSpec, has_record: bool, job: ShardJob) -> UnitResult:
    """Ensure one unit from synchronous code (a Dask or Ray task), on an event loop of its own."""
    return asyncio.run(_run_alone(spec, has_record, job))
