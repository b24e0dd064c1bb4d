"""The storage protocol every tier implements: a handful of coroutines.

A *key* is a relative, ``/``-separated path (``"imagenet/train-000001.tar"``).
Keys are validated once, here, so that no key can name a file outside the
tier's root: no absolute paths, no ``..`` or ``.`` segments, no empty
segments, no NUL or backslash.
"""

from __future__ import annotations

import abc
import mmap
import re
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol
from urllib.parse import unquote

from datacache.tiers._files import PARTIAL_NAME

from datacache.errors import InvalidKeyError, ShardNotFoundError

if TYPE_CHECKING:
    from datacache.tiers._landing import Landing

__all__ = [
    "ByteRange",
    "Hasher",
    "ObjectInfo",
    "Tier",
    "TierStats",
    "TierUsage",
    "validate_key",
    "validate_url_key",
]

MAX_KEY_BYTES = 1024


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise `InvalidKeyError`.

    The error names the key (shortened) and the rule it breaks.
    """
    shown = key if len(key) <= 120 else key[:117] + "..."
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"invalid key {shown!r}: empty")
    if len(key.encode("utf-8", "surrogateescape")) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"invalid key {shown!r}: longer than {MAX_KEY_BYTES} bytes")
    if "\x00" in key or "\\" in key:
        raise InvalidKeyError(f"invalid key {shown!r}: contains NUL or backslash")
    if key.startswith("/"):
        raise InvalidKeyError(f"invalid key {shown!r}: absolute path")
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidKeyError(
                f"invalid key {shown!r}: '..', '.' or empty path segment would escape or alias a directory"
            )
        if len(segment.encode("utf-8", "surrogateescape")) > 255:
            raise InvalidKeyError(f"invalid key {shown!r}: a path segment is longer than 255 bytes")
    if PARTIAL_NAME.match(key.rsplit("/", 1)[-1]):
        raise InvalidKeyError(f"invalid key {shown!r}: collides with datacache's temporary file names")
    return key


_ESCAPED_SEPARATOR = re.compile(r"%(2f|5c)", re.IGNORECASE)


def validate_url_key(key: str) -> str:
    """`validate_key`, and again as a server decodes it: for a backend that puts the key in a URL (http).

    An http server percent-decodes a path before it resolves it, so ``%2e%2e/private``
    and ``..%2fprivate`` name ``../private`` there while they pass `validate_key` here.
    Every decoding of ``key`` (twice-encoded ``%252e`` too) is checked; an escaped
    ``/`` or ``\\`` is refused outright, since a server may split on it.
    """
    validate_key(key)
    seen = key
    for _ in range(3):
        if _ESCAPED_SEPARATOR.search(seen):
            raise InvalidKeyError(f"invalid key {key[:120]!r}: an escaped '/' or '\\' could name another path")
        decoded = unquote(seen)
        if decoded == seen:
            return key
        try:
            validate_key(decoded)
        except InvalidKeyError:
            raise InvalidKeyError(
                f"invalid key {key[:120]!r}: decoded ({decoded[:120]!r}) it holds a '..', '.' or empty segment, "
                "or a backslash, which would escape or alias a directory"
            ) from None
        seen = decoded
    raise InvalidKeyError(f"invalid key {key[:120]!r}: encoded more than three times")


class Hasher(Protocol):
    """What `Tier.read_into` updates with each region it reads (an xxhash or hashlib object)."""

    def update(self, data: memoryview, /) -> object: ...


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``[start, end)`` of an object; ``end=None`` reads to the end."""

    start: int = 0
    end: int | None = None

    def __post_init__(self) -> None:
        if self.start < 0 or (self.end is not None and self.end < self.start):
            raise ValueError(f"invalid byte range [{self.start}, {self.end})")

    def length(self, size: int) -> int:
        """Number of bytes this range covers in an object of ``size`` bytes."""
        end = size if self.end is None else min(self.end, size)
        return max(0, end - self.start)


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a tier knows of one object.

    ``version`` identifies the object's content at the origin: the ETag for
    object stores, ``mtime_ns:size`` for files. ``metadata`` holds what the
    writer attached (datacache stores the shard checksum and origin version).
    ``writers`` are the uids owning the object's file and its metadata file,
    where the tier has files (``None`` elsewhere): on a directory others can
    write, metadata is only as trustworthy as whoever wrote it.
    """

    key: str
    size: int
    version: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)
    writers: frozenset[int] | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True, slots=True)
class TierUsage:
    """Bytes and objects held by a tier, against its capacity and the device's free space."""

    used_bytes: int
    object_count: int
    capacity_bytes: int | None
    device_free_bytes: int | None


@dataclass(frozen=True, slots=True)
class TierStats:
    """Counters of one tier object since it was created (per process)."""

    bytes_read: int = 0
    bytes_written: int = 0
    requests: int = 0
    retries: int = 0
    errors: int = 0


class Tier(abc.ABC):
    """One level of storage: an origin (object store), a shared directory or a local disk.

    Implementations hold configuration only; clients, sessions and event-loop
    bound state are created lazily in the process and loop that use them, and
    dropped when pickled, so a tier can cross a fork or a spawn.
    """

    kind: ClassVar[str] = "tier"

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where this tier keeps its objects (never with credentials)."""

    @property
    def writable(self) -> bool:
        """Whether `put` and `delete` are allowed."""
        return True

    @property
    def has_local_paths(self) -> bool:
        """Whether objects are plain files that `path` can name."""
        return False

    @property
    def mappable(self) -> bool:
        """Whether `map` gives an object's bytes in place (files, or memory); else it raises."""
        return False

    @property
    def capacity(self) -> int | None:
        """Configured capacity in bytes, or ``None`` when unbounded."""
        return None

    @abc.abstractmethod
    async def stat(self, key: str) -> ObjectInfo | None:
        """Return the object's info, or ``None`` if it does not exist."""

    @abc.abstractmethod
    async def get(self, key: str, byte_range: ByteRange | None = None, *, version: str | None = None) -> bytes:
        """Return the object's bytes, or a range of them.

        Raises `ShardNotFoundError` if the object is missing, and
        `OriginChangedError` if ``version`` is given and the object's version
        differs (a conditional read, so that one copy never mixes two versions).
        """

    async def stream(
        self,
        key: str,
        *,
        chunk_size: int = 8 << 20,
        byte_range: ByteRange | None = None,
        version: str | None = None,
    ) -> AsyncIterator[bytes]:
        """Yield the object's bytes in chunks of at most ``chunk_size``, in order."""
        info = await self.stat(key)
        if info is None:
            raise ShardNotFoundError(f"{self.url}: no object {key!r}")
        span = byte_range or ByteRange()
        end = info.size if span.end is None else min(span.end, info.size)
        offset = span.start
        while offset < end:
            stop = min(offset + chunk_size, end)
            yield await self.get(key, ByteRange(offset, stop), version=version)
            offset = stop

    async def read_into(
        self,
        key: str,
        buffer: memoryview,
        *,
        version: str | None = None,
        hasher: Hasher | None = None,
        checked: bool = False,
    ) -> AsyncIterator[memoryview]:
        """Read the whole object into the start of ``buffer``; yield each region of it as it is filled.

        The regions are consecutive views of ``buffer``; once the last is yielded,
        ``buffer[:total]`` holds the object. ``hasher``, when given, is updated with
        each region before it is yielded (where a tier reads in a thread, the hash is
        computed there, off the event loop). An object larger than ``buffer`` raises
        `BufferError` (what fitted has been yielded). Tiers that can read straight into
        memory (files with ``preadv``, S3 bodies with ``readinto``) override this: one
        copy per byte, no allocation per chunk. ``checked`` says the caller checks the
        whole object against a checksum it already knows (with ``hasher``): a tier may
        then skip a transport checksum of its own (S3's CRC32 of a body, ~0.5 CPU s per GB).
        """
        size = len(buffer)
        offset = 0
        async for chunk in self.stream(key, chunk_size=min(8 << 20, max(1, size)), version=version):
            end = offset + len(chunk)
            if end > size:
                raise BufferError(f"{self.url}: {key!r} holds more than the {size} bytes expected")
            buffer[offset:end] = chunk
            region = buffer[offset:end]
            if hasher is not None:
                hasher.update(region)
            offset = end
            yield region

    @abc.abstractmethod
    async def put(
        self,
        key: str,
        chunks: AsyncIterable[bytes | memoryview],
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        """Store the concatenated ``chunks`` under ``key`` atomically.

        Either the whole object becomes visible at once, or (on any error,
        cancellation or crash) nothing does and no temporary file remains
        visible under a valid key. An exception raised by ``chunks`` itself
        (a failed checksum) aborts the write the same way.

        ``metadata`` is read once ``chunks`` is exhausted, so a writer may
        complete it while streaming (the checksum of what it wrote).
        """

    async def land(self, key: str, size: int) -> Landing | None:
        """Memory that is ``key``'s new file of ``size`` bytes, to copy them into once; None: use `put`.

        Tiers whose files can be mapped (the node's local disk) return a `Landing`: its
        ``buffer`` is written, then `put_landed` makes it visible as `put` would, or
        ``abandon`` removes it. Others return None.
        """
        return None

    async def put_landed(
        self, key: str, landing: Landing, *, metadata: Mapping[str, str] | None = None
    ) -> ObjectInfo:
        """Make a filled `Landing` of ``key`` visible, whole and atomically, as `put` does."""
        raise NotImplementedError(f"{type(self).__name__} does not land objects")

    @abc.abstractmethod
    async def delete(self, key: str) -> bool:
        """Remove ``key``; return whether it existed."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Yield every object whose key starts with ``prefix``, in key order."""

    @abc.abstractmethod
    async def usage(self) -> TierUsage:
        """Return bytes and objects held, with capacity and device free space."""

    def path(self, key: str) -> Path:
        """Return the local file holding ``key`` (only where `has_local_paths`)."""
        raise NotImplementedError(f"{type(self).__name__} has no local paths")

    def map(self, key: str, *, version: str | None = None) -> mmap.mmap | bytes:
        """The object's bytes in place, read-only: its file mapped (only where `mappable`).

        Blocking (run it in a thread from an event loop). The file is reached and opened
        without following a link, non-blocking, and mapped only if ``fstat`` says it is a
        regular file: a link, a FIFO or a directory swapped into its place raises
        `ShardNotFoundError`, as a missing one does, and never hangs the reader. ``version``
        makes it conditional, as in `get`. Tiers with no files raise `NotImplementedError`.
        """
        raise NotImplementedError(f"{type(self).__name__} ({self.url}) holds no files to map: read with get")

    def stats(self) -> TierStats:
        """Return this tier object's counters."""
        return TierStats()

    async def close(self) -> None:  # noqa: B027 - optional hook, most tiers hold nothing to close
        """Release clients and sessions created in this process."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
