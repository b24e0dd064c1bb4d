"""`DirectoryTier`: objects as plain files under a root directory.

The base of `LocalTier` (a node's NVMe) and `SharedTier` (a distributed
filesystem). Objects live under ``<root>/data/<key>``; the metadata a writer
attached lives beside them in ``<root>/meta/<key>.json``. Every path is checked
to stay inside the root, and symlinks are never followed or served: a shared
directory writable by others must not turn a key into a read of ``/etc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import stat as stat_module
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from pathlib import Path

from datacache.tiers._files import PARTIAL_NAME, atomic_write, remove_abandoned_partials
from datacache.tiers.base import ByteRange, ObjectInfo, Tier, TierStats, TierUsage, validate_key

from datacache.errors import InvalidKeyError, OriginChangedError, ShardNotFoundError

__all__ = ["DirectoryTier"]

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class DirectoryTier(Tier):
    """Objects as files under ``root``, written atomically, with an optional byte capacity."""

    kind = "directory"

    def __init__(self, root: str | os.PathLike[str], *, capacity: int | None = None, durable: bool = True) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._root = Path(root).expanduser().absolute()
        self._data = self._root / "data"
        self._meta = self._root / "meta"
        self._capacity = capacity
        self._durable = durable
        self._counters = {"bytes_read": 0, "bytes_written": 0, "requests": 0, "retries": 0, "errors": 0}

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["_counters"] = dict.fromkeys(self._counters, 0)
        return state

    @property
    def url(self) -> str:
        return str(self._root)

    @property
    def root(self) -> Path:
        """The directory this tier owns."""
        return self._root

    @property
    def has_local_paths(self) -> bool:
        return True

    @property
    def capacity(self) -> int | None:
        return self._capacity

    def stats(self) -> TierStats:
        return TierStats(**self._counters)

    # -- paths ----------------------------------------------------------------------------

    def _contained(self, base: Path, key: str, suffix: str = "") -> Path:
        validate_key(key)
        path = base / (key + suffix)
        real_base = os.path.realpath(base)
        real_parent = os.path.realpath(path.parent)
        if real_parent != real_base and not real_parent.startswith(real_base + os.sep):
            raise InvalidKeyError(f"invalid key {key!r}: its directory resolves outside {self._root} (a symlink?)")
        return path

    def path(self, key: str) -> Path:
        return self._contained(self._data, key)

    def _meta_path(self, key: str) -> Path:
        return self._contained(self._meta, key, ".json")

    # -- synchronous helpers, run in threads ---------------------------------------------

    def _stat_sync(self, key: str) -> ObjectInfo | None:
        path = self.path(key)
        try:
            fd = os.open(path, _READ_FLAGS | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symlink: never an object
                return None
            raise
        try:
            st = os.fstat(fd)  # the file opened, not whatever the path names a moment later
        finally:
            os.close(fd)
        if not stat_module.S_ISREG(st.st_mode):
            return None
        metadata: dict[str, str] = {}
        writers = {st.st_uid}
        with contextlib.suppress(OSError, ValueError):
            raw, meta_uid = self._read_small(self._meta_path(key))
            parsed = json.loads(raw)
            if isinstance(parsed, dict):
                metadata = {str(k): str(v) for k, v in parsed.items()}
                writers.add(meta_uid)
        return ObjectInfo(
            key=key,
            size=st.st_size,
            version=f"{st.st_mtime_ns}:{st.st_size}",
            metadata=metadata,
            writers=frozenset(writers),
        )

    @staticmethod
    def _read_small(path: Path) -> tuple[bytes, int]:
        """Read a small regular file (never a link, FIFO or device); return its bytes and owner."""
        fd = os.open(path, _READ_FLAGS | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat_module.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"{path} is not a regular file")
            return os.read(fd, 1 << 20), st.st_uid
        finally:
            os.close(fd)

    def _open_checked(self, key: str, version: str | None) -> int:
        path = self.path(key)
        try:
            fd = os.open(path, _READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            raise ShardNotFoundError(f"{self._root}: no object {key!r}") from None
        except OSError as exc:
            if exc.errno == 40:  # ELOOP: the final component is a symlink
                raise ShardNotFoundError(f"{self._root}: {key!r} is a symlink, not served") from None
            raise
        st = os.fstat(fd)
        if not stat_module.S_ISREG(st.st_mode):
            os.close(fd)
            raise ShardNotFoundError(f"{self._root}: {key!r} is not a regular file")
        if version is not None and version != f"{st.st_mtime_ns}:{st.st_size}":
            os.close(fd)
            raise OriginChangedError(f"{self._root}/{key}: the file changed since the manifest was taken")
        return fd

    def _read_sync(self, key: str, span: ByteRange, version: str | None) -> bytes:
        fd = self._open_checked(key, version)
        try:
            size = os.fstat(fd).st_size
            length = span.length(size)
            return os.pread(fd, length, span.start) if length else b""
        finally:
            os.close(fd)

    def _list_sync(self, prefix: str) -> list[ObjectInfo]:
        found: list[ObjectInfo] = []
        base = self._data
        start = base
        if "/" in prefix:
            start = base / prefix.rsplit("/", 1)[0]
        for directory, dirnames, files in os.walk(start):
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(directory, d))]
            for name in files:
                if PARTIAL_NAME.match(name):
                    continue
                full = os.path.join(directory, name)
                key = os.path.relpath(full, base).replace(os.sep, "/")
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.lstat(full)
                except FileNotFoundError:
                    continue
                if stat_module.S_ISREG(st.st_mode):
                    found.append(ObjectInfo(key=key, size=st.st_size, version=f"{st.st_mtime_ns}:{st.st_size}"))
        found.sort(key=lambda info: info.key)
        return found

    def _usage_sync(self) -> TierUsage:
        used = 0
        count = 0
        for info in self._list_sync(""):
            used += info.size
            count += 1
        free = None
        with contextlib.suppress(OSError):
            self._root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self._root).free
        return TierUsage(used_bytes=used, object_count=count, capacity_bytes=self._capacity, device_free_bytes=free)

    def _delete_sync(self, key: str) -> bool:
        existed = True
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            existed = False
        with contextlib.suppress(FileNotFoundError):
            self._meta_path(key).unlink()
        return existed

    # -- the protocol ---------------------------------------------------------------------

    async def stat(self, key: str) -> ObjectInfo | None:
        self._counters["requests"] += 1
        return await asyncio.to_thread(self._stat_sync, key)

    async def get(
        self, key: str, byte_range: ByteRange | None = None, *, version: str | None = None
    ) -> bytes:
        self._counters["requests"] += 1
        data = await asyncio.to_thread(self._read_sync, key, byte_range or ByteRange(), version)
        self._counters["bytes_read"] += len(data)
        return data

    async def stream(
        self,
        key: str,
        *,
        chunk_size: int = 8 << 20,
        byte_range: ByteRange | None = None,
        version: str | None = None,
    ) -> AsyncIterator[bytes]:
        self._counters["requests"] += 1
        fd = await asyncio.to_thread(self._open_checked, key, version)
        try:
            span = byte_range or ByteRange()
            size = os.fstat(fd).st_size
            offset = span.start
            end = size if span.end is None else min(span.end, size)
            while offset < end:
                data = await asyncio.to_thread(os.pread, fd, min(chunk_size, end - offset), offset)
                if not data:
                    raise ShardNotFoundError(f"{self._root}/{key}: file shrank while being read")
                offset += len(data)
                self._counters["bytes_read"] += len(data)
                yield data
        finally:
            os.close(fd)

    async def put(
        self,
        key: str,
        chunks: AsyncIterable[bytes | memoryview],
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        target = self.path(key)
        self._counters["requests"] += 1
        size = await atomic_write(target, chunks, durable=self._durable)
        self._counters["bytes_written"] += size
        if metadata:
            # After the data: a crash between the two leaves data without (or with
            # older) metadata, which fails verification and is re-staged.
            encoded = json.dumps(dict(metadata), sort_keys=True).encode()

            async def one_chunk() -> AsyncIterator[bytes]:
                yield encoded

            await atomic_write(self._meta_path(key), one_chunk(), durable=False)
        info = await asyncio.to_thread(self._stat_sync, key)
        if info is None:
            raise ShardNotFoundError(f"{self._root}/{key}: vanished right after it was written")
        return info

    async def delete(self, key: str) -> bool:
        self._counters["requests"] += 1
        return await asyncio.to_thread(self._delete_sync, key)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        for info in await asyncio.to_thread(self._list_sync, prefix):
            yield info

    async def usage(self) -> TierUsage:
        return await asyncio.to_thread(self._usage_sync)

    async def remove_partials_of(self, key: str) -> int:
        """Delete the temporary files of writes to ``key`` (its writer is known to be dead)."""

        def remove() -> int:
            target = self.path(key)
            removed = 0
            for base, name in ((target.parent, target.name), (self._meta_path(key).parent, target.name + ".json")):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    for candidate in base.iterdir():
                        if (
                            candidate.name.startswith(f".{name}.")
                            and PARTIAL_NAME.match(candidate.name)
                            and candidate.name.count(".") == name.count(".") + 3
                        ):
                            with contextlib.suppress(FileNotFoundError):
                                candidate.unlink()
                                removed += 1
            return removed

        return await asyncio.to_thread(remove)

    async def remove_abandoned_partials(self, *, min_age: float = 30.0) -> int:
        """Delete temporary files left by killed writers; return how many."""
        removed = 0
        for base in (self._data, self._meta):
            if base.exists():
                removed += len(await asyncio.to_thread(remove_abandoned_partials, base, min_age=min_age))
        return removed
