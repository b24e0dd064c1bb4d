"""One transfer: a shard's bytes from a source tier into a destination tier, verified, in bounded memory.

Each shard streams in parts (concurrent ranged GETs from object storage)
through a memory budget shared by every transfer of the stager, is hashed on
the way, and becomes visible only by the destination's atomic put once its
size and checksum are right.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence

from datacache._rate import TokenBucket
from datacache.checksum import checksum_of, new_hasher
from datacache.config import Settings
from datacache.errors import ChecksumMismatchError
from datacache.manifest import Shard
from datacache.staging.events import Events
from datacache.staging.types import ORIGIN, WANTED_NOW, DatasetHandle, StagingEvent
from datacache.tiers import ByteRange, Hasher, Landing, ObjectInfo, ObjectTier, Tier

__all__ = ["Transfer"]

logger = logging.getLogger(__name__)


class Transfer:
    """Copies shards between tiers within one memory budget and bandwidth limit; bound to the running loop."""

    def __init__(self, settings: Settings, events: Events) -> None:
        self._part_size = settings.part_size
        self._memory = asyncio.Semaphore(max(1, settings.memory_budget // settings.part_size))
        self._throttle = TokenBucket(settings.bandwidth_limit) if settings.bandwidth_limit else None
        self._events = events
        # Whole shards kept for early serving share the budget with the parts in flight: at
        # most one budget's worth across the transfers that may run at once.
        self.keep_limit = settings.memory_budget // max(1, settings.concurrency)
        self._buffers = _Buffers(idle=max(1, settings.concurrency))
        self._wanted: set[object] = set()
        """Transfers a reader is blocked on, moving bytes under the bandwidth limit now."""
        self._none_wanted = asyncio.Event()
        self._none_wanted.set()
        self._turn = asyncio.Lock()
        self._starved = 0
        """Wanted transfers waiting for memory: the held-back parts hold it, so they go on meanwhile."""

    async def copy(
        self,
        handle: DatasetHandle,
        shard: Shard,
        source: Tier,
        source_key: str,
        destination: Tier,
        destination_key: str,
        expected: str | None,
        source_name: str,
        on_verified: Callable[[bytes | memoryview, str], None] | None = None,
    ) -> tuple[ObjectInfo, str]:
        """Stream one shard from ``source`` into ``destination``, verified; return its info and checksum.

        With ``on_verified``, a shard of at most `keep_limit` bytes is also kept in memory and
        handed over, with its checksum, once its size and checksum are verified, while the
        destination is still making its copy durable (readers need not wait for the fsync).
        """
        hasher = new_hasher()
        received = 0
        version = shard.version if source_name == ORIGIN else None
        counter = "bytes_from_origin" if source_name == ORIGIN else "bytes_from_shared"
        events = self._events
        throttle = self._throttle if source_name == ORIGIN else None
        wanted_now, this = WANTED_NOW.get(), object()
        # In flight from here, not from its first chunk: a capped origin may hold that back for minutes.
        events.emit(StagingEvent("started", handle.id, shard.key, destination.kind, source_name, 0))
        if throttle is not None and wanted_now():
            self._want(this)  # from its first request on: the others hold back their next parts
        landing, kept = await self._whole(shard, source, destination, destination_key)
        # Without memory of its own: chunks, hashed here.
        chunks = (
            source.read_into(
                source_key, memoryview(kept)[: shard.size], version=version, hasher=hasher, checked=expected is not None
            )
            if kept is not None
            else self._parts(source, source_key, shard.size, version, wanted_now)
        )

        async def verified_chunks() -> AsyncIterator[bytes | memoryview]:
            nonlocal received
            try:
                async for chunk in chunks:
                    received += len(chunk)
                    if received > shard.size:
                        break
                    if kept is None:
                        hasher.update(chunk)
                    events.count(counter, len(chunk))
                    if throttle is not None:
                        await self._take(throttle, len(chunk), this, wanted_now())
                    events.emit(
                        StagingEvent("bytes", handle.id, shard.key, destination.kind, source_name, len(chunk))
                    )
                    yield chunk
            except BufferError:
                received = shard.size + 1  # the object holds more than the manifest says
            self._unwant(this)  # its bytes are in: the others may move again while it is checked and written
            # Tiers read metadata once the chunks are exhausted (see Tier.put).
            metadata["checksum"] = _checked(handle, shard, source_name, received, hasher, expected, events)
            if kept is not None and on_verified is not None:
                on_verified(memoryview(kept)[: shard.size].toreadonly(), metadata["checksum"])

        # What the copy is: a reader trusts it only with all of this bound together (and a trusted writer).
        metadata = {"dataset": handle.id, "key": shard.key, "version": str(shard.version), "size": str(shard.size)}
        try:
            if landing is not None:
                info = await _landed(destination, destination_key, landing, verified_chunks(), metadata)
            else:
                info = await destination.put(destination_key, verified_chunks(), metadata=metadata)
        finally:
            self._unwant(this)
        checksum = checksum_of(hasher)
        if source_name == ORIGIN and shard.checksum is None:
            logger.debug("dataset %s: learned checksum of %r: %s", handle.id, shard.key, checksum)
        return info, checksum

    async def _whole(
        self, shard: Shard, source: Tier, destination: Tier, destination_key: str
    ) -> tuple[Landing | None, mmap.mmap | bytearray | None]:
        """The memory a shard is read into whole: its new file mapped, or a reused buffer; (None, None): none.

        A shard that fits the keep limit lands once, in memory of its size, read straight into by
        the source (in a thread, which hashes it there too), and is written and served from that
        same memory: no chunk allocated, no join, no hashing on the loop. Where the destination
        maps its new file, that memory is the file's pages, and no write copies the bytes again.
        """
        if shard.size > self.keep_limit or (shard.size > self._part_size and source.kind == "object"):
            return None, None
        landing = await destination.land(destination_key, shard.size)
        return landing, landing.buffer if landing is not None else self._buffers.take(shard.size)

    async def fetch(
        self, handle: DatasetHandle, shard: Shard, source: Tier, source_key: str, expected: str | None, source_name: str
    ) -> tuple[bytes, str]:
        """A small shard's bytes in one read, verified as `copy` verifies them; and their checksum.

        For a batch of small shards (`datacache.staging.batch`): the caller writes them all at once.
        """
        version = shard.version if source_name == ORIGIN else None
        self._events.emit(StagingEvent("started", handle.id, shard.key, "local", source_name, 0))
        if self._throttle is not None and source_name == ORIGIN:
            await self._throttle.take(shard.size)
        async with self._memory:
            data = await source.get(source_key, version=version) if shard.size else b""
        return data, self.verified(handle, shard, data, expected, source_name)

    async def fetch_local(
        self, handle: DatasetHandle, shards: Sequence[Shard]
    ) -> list[tuple[bytes, str] | Exception | None]:
        """`fetch` of many small shards of an origin on this machine's filesystem, in one thread job.

        Each one's bytes and checksum, or its error, or None: `fetch` it the usual way.
        """
        origin = handle.origin
        if not isinstance(origin, ObjectTier) or not origin.has_local_paths:
            return [None] * len(shards)
        for shard in shards:
            self._events.emit(StagingEvent("started", handle.id, shard.key, "local", ORIGIN, 0))
        if self._throttle is not None:
            await self._throttle.take(sum(shard.size for shard in shards))
        found = await origin.get_local_many([shard.key for shard in shards], [shard.version for shard in shards])
        results: list[tuple[bytes, str] | Exception | None] = []
        for shard, data in zip(shards, found, strict=True):
            if not isinstance(data, bytes):
                results.append(data)
                continue
            try:
                results.append((data, self.verified(handle, shard, data, shard.checksum, ORIGIN)))
            except ChecksumMismatchError as exc:
                results.append(exc)
        return results

    def verified(self, handle: DatasetHandle, shard: Shard, data: bytes, expected: str | None, source_name: str) -> str:
        """The checksum of ``data``, once it is known to be ``shard`` whole (its size, and ``expected``)."""
        self._events.count("bytes_from_origin" if source_name == ORIGIN else "bytes_from_shared", len(data))
        self._events.emit(StagingEvent("bytes", handle.id, shard.key, "local", source_name, len(data)))
        hasher = new_hasher()
        hasher.update(data)
        checksum = checksum_of(hasher)
        if len(data) != shard.size:
            got = f"more than {shard.size}" if len(data) > shard.size else str(len(data))
            raise ChecksumMismatchError(
                f"dataset {handle.id}: shard {shard.key!r} from the {source_name}: got {got} bytes, "
                f"the manifest says {shard.size} (the object changed or the transfer was cut short)"
            )
        if expected is not None and checksum != expected:
            self._events.count("checksum_failures")
            raise ChecksumMismatchError(
                f"dataset {handle.id}: shard {shard.key!r} from the {source_name} does not match its checksum"
            )
        return checksum

    async def _take(self, throttle: TokenBucket, amount: int, transfer: object, wanted: bool) -> None:
        """Pass ``amount`` bytes under the bandwidth limit; the others wait while a wanted transfer moves.

        Under a limit the bytes are shared, so a prefetch's bytes come out of the blocked
        reader's: the reader's shard takes the whole rate until it is in (issue 25).
        """
        if wanted:
            self._want(transfer)
        while True:
            while not (wanted or self._may_move()):
                await self._none_wanted.wait()
            async with self._turn:
                # Looked at again in turn: a prefetch queued here before the reader came steps back,
                # so the reader waits for one part at most, not one per transfer.
                if wanted or self._may_move():
                    await throttle.take(amount)
                    return

    def _may_move(self) -> bool:
        """Whether a transfer nobody waits for may pass bytes now."""
        return not self._wanted or bool(self._starved)

    def _settle(self) -> None:
        if self._may_move():
            self._none_wanted.set()
        else:
            self._none_wanted.clear()

    def _want(self, transfer: object) -> None:
        self._wanted.add(transfer)
        self._settle()

    def _unwant(self, transfer: object) -> None:
        self._wanted.discard(transfer)
        self._settle()

    async def _memory_for(self, wanted: Callable[[], bool]) -> None:
        """A permit of the memory budget for one part.

        The prefetches held back for a wanted transfer keep the permits of the parts they
        fetched ahead: when those are all of them, they go on until one is free (else the
        wanted transfer would wait for them, and they for it).
        """
        memory = self._memory
        if not (memory.locked() and wanted()):
            await memory.acquire()
            return
        self._starved += 1
        self._settle()
        try:
            await memory.acquire()
        finally:
            self._starved -= 1
            self._settle()

    async def _parts(
        self, source: Tier, key: str, size: int, version: str | None, wanted: Callable[[], bool]
    ) -> AsyncIterator[bytes]:
        """Yield the object's bytes in order, fetching up to a few parts ahead concurrently.

        Each part in flight holds one permit of the memory budget until it has
        been handed on, so memory stays bounded however many transfers run.
        """
        memory = self._memory
        if size == 0:
            return
        part_size = self._part_size
        if size <= part_size or source.kind != "object":
            # One part, or a file: a single stream in order, nothing buffered. On
            # object stores one GET per shard is also the cheapest in requests.
            async for chunk in source.stream(key, chunk_size=8 << 20, version=version):
                yield chunk
            return
        window = 4
        spans = [ByteRange(start, min(start + part_size, size)) for start in range(0, size, part_size)]
        pending: deque[asyncio.Task[bytes]] = deque()

        def launch(span: ByteRange) -> asyncio.Task[bytes]:
            return asyncio.ensure_future(source.get(key, span, version=version))

        try:
            for span in spans:
                while pending and (len(pending) >= window or memory.locked()):
                    head = pending.popleft()
                    try:
                        yield await head
                    finally:
                        memory.release()
                await self._memory_for(wanted)
                pending.append(launch(span))
            while pending:
                head = pending.popleft()
                try:
                    yield await head
                finally:
                    memory.release()
        finally:
            for task in pending:
                task.cancel()
                memory.release()
            for task in pending:
                with contextlib.suppress(BaseException):
                    await task



def _checked(
    handle: DatasetHandle,
    shard: Shard,
    source: str,
    received: int,
    hasher: Hasher,
    expected: str | None,
    events: Events,
) -> str:
    """The checksum of a shard's bytes, once they are as many as the manifest says and match what it expects."""
    if received != shard.size:
        got = f"more than {shard.size}" if received > shard.size else str(received)
        raise ChecksumMismatchError(
            f"dataset {handle.id}: shard {shard.key!r} from the {source}: got {got} bytes, "
            f"the manifest says {shard.size} (the object changed or the transfer was cut short)"
        )
    checksum = checksum_of(hasher)
    if expected is not None and checksum != expected:
        events.count("checksum_failures")
        raise ChecksumMismatchError(
            f"dataset {handle.id}: shard {shard.key!r} from the {source} does not match its checksum"
        )
    return checksum


async def _landed(
    destination: Tier,
    key: str,
    landing: Landing,
    chunks: AsyncIterator[bytes | memoryview],
    metadata: dict[str, str],
) -> ObjectInfo:
    """Put a landed shard in place once every region of it arrived and the whole was checked."""
    try:
        async for _ in chunks:
            pass  # each region is in the file's pages already; the iteration counts and checks them
    except BaseException:
        await landing.abandon()
        raise
    return await destination.put_landed(key, landing, metadata=metadata)


class _Buffers:
    """Memory for whole shards, reused from one transfer to the next.

    Fresh memory costs a page fault and a zeroing in the kernel per 4 KiB, more
    system time than the copy itself (``bytearray(size)`` also zeroes every byte
    first, on the event loop with the GIL held: a third of a second of the loop's
    time per 260 MB in a profile of a cold fill). So each buffer is an anonymous
    map, taken again once nothing uses it: every view of it (the destination's
    writes, a GET thread, the readers served early) is an export, and a map with
    exports refuses to be resized. At most ``idle`` unused buffers are kept (the
    transfers that may run at once, each within the keep limit: the memory budget).
    """

    def __init__(self, idle: int) -> None:
        self._all: list[mmap.mmap] = []
        self._idle = idle

    def take(self, size: int) -> mmap.mmap | bytearray:
        if not size:
            return bytearray()
        unused = [buffer for buffer in self._all if _unused(buffer)]
        fitting = [buffer for buffer in unused if len(buffer) >= size]
        if fitting:
            taken = min(fitting, key=len)
        else:
            taken = _anonymous(size)
            self._all.append(taken)
        for extra in [buffer for buffer in unused if buffer is not taken][self._idle :]:
            self._all.remove(extra)
            extra.close()
        return taken


def _anonymous(size: int) -> mmap.mmap:
    """Private anonymous memory (Python's default for ``mmap(-1, ...)`` is a shared map: shmem,
    dearer to fault in). Not in huge pages: asking for them (MADV_HUGEPAGE) made a cold fill's
    system time 2.5x on a loaded machine (the kernel compacts memory to find them)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _unused(buffer: mmap.mmap) -> bool:
    """Whether no view of ``buffer`` is left (resizing a map to its own size fails while one is)."""
    try:
        buffer.resize(len(buffer))
    except BufferError:
        return False
    return True
