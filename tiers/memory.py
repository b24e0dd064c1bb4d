"""`MemoryTier`: a dict of bytes, for tests and as the model in property tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterable, AsyncIterator, Mapping

from datacache.tiers.base import ByteRange, ObjectInfo, Tier, TierUsage, validate_key

from datacache.errors import OriginChangedError, ShardNotFoundError

__all__ = ["MemoryTier"]


class MemoryTier(Tier):
    """Objects held in this process's memory; each put makes a new version."""

    kind = "memory"

    def __init__(self, *, capacity: int | None = None) -> None:
        self._objects: dict[str, tuple[bytes, str, dict[str, str]]] = {}
        self._capacity = capacity
        self._next_version = 0
        self._name = uuid.uuid4().hex[:12]  # stable across pickling, unlike id()

    @property
    def url(self) -> str:
        return f"memory-tier://{self._name}"

    @property
    def capacity(self) -> int | None:
        return self._capacity

    async def stat(self, key: str) -> ObjectInfo | None:
        validate_key(key)
        entry = self._objects.get(key)
        if entry is None:
            return None
        data, version, metadata = entry
        return ObjectInfo(key=key, size=len(data), version=version, metadata=dict(metadata))

    async def get(
        self, key: str, byte_range: ByteRange | None = None, *, version: str | None = None
    ) -> bytes:
        validate_key(key)
        entry = self._objects.get(key)
        if entry is None:
            raise ShardNotFoundError(f"{self.url}: no object {key!r}")
        data, current, _ = entry
        if version is not None and version != current:
            raise OriginChangedError.since_manifest(f"{self.url}/{key}")
        span = byte_range or ByteRange()
        return data[span.start : span.end]

    @property
    def mappable(self) -> bool:
        return True

    def map(self, key: str, *, version: str | None = None) -> bytes:
        """The object's bytes themselves (immutable: nothing copied, nothing to unmap)."""
        validate_key(key)
        entry = self._objects.get(key)
        if entry is None:
            raise ShardNotFoundError(f"{self.url}: no object {key!r}")
        if version is not None and version != entry[1]:
            raise OriginChangedError.since_manifest(f"{self.url}/{key}")
        return entry[0]

    async def put(
        self,
        key: str,
        chunks: AsyncIterable[bytes | memoryview],
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        validate_key(key)
        parts = [bytes(chunk) async for chunk in chunks]
        data = b"".join(parts)
        self._next_version += 1
        version = f"m{self._next_version}"
        self._objects[key] = (data, version, dict(metadata or {}))
        return ObjectInfo(key=key, size=len(data), version=version, metadata=dict(metadata or {}))

    async def delete(self, key: str) -> bool:
        validate_key(key)
        return self._objects.pop(key, None) is not None

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        for key in sorted(self._objects):
            if key.startswith(prefix):
                data, version, metadata = self._objects[key]
                yield ObjectInfo(key=key, size=len(data), version=version, metadata=dict(metadata))

    async def usage(self) -> TierUsage:
        used = sum(len(data) for data, _, _ in self._objects.values())
        return TierUsage(
            used_bytes=used, object_count=len(self._objects), capacity_bytes=self._capacity, device_free_bytes=None
        )
