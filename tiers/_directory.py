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
import mmap
import os
import shutil
import stat as stat_module
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from datacache.tiers._acl import ReadersIds, acl_refused, readers_mode
from datacache.tiers._batch import BatchItem, write_batch
from datacache.tiers._dirfd import (
    READ_FLAGS,
    Place,
    UnsafeFileError,
    fill_region,
    map_open_file,
    read_bounded_stat,
    server_now,
    sizes_by_folder,
)
from datacache.tiers._files import (
    PARTIAL_NAME,
    atomic_write,
    remove_abandoned_partials,
    remove_if_abandoned,
    write_small,
)
from datacache.tiers.base import ByteRange, Hasher, ObjectInfo, Tier, TierStats, TierUsage, validate_key

from datacache.errors import InvalidKeyError, OriginChangedError, ShardNotFoundError

__all__ = ["DirectoryTier"]

T = TypeVar("T")

META_LIMIT = 1 << 20
"""The largest metadata file read (a writer's is a few hundred bytes; a planted one may be anything)."""


class DirectoryTier(Tier):
    """Objects as files under ``root``, written atomically, with an optional byte capacity."""

    kind = "directory"
    dir_mode: int | None = None
    """The exact mode of the directories this tier creates (``None``: the umask decides)."""
    file_mode: int | None = None
    """The exact mode of the files this tier writes (``None``: 0644 less the umask)."""
    private_file_mode: int | None = None
    """Where set, the mode of the files of a dataset not in `shared_datasets`: readable by their writer only."""

    def __init__(self, root: str | os.PathLike[str], *, capacity: int | None = None, durable: bool = True) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._root = Path(root).expanduser().absolute()
        self._data = self._root / "data"
        self._meta = self._root / "meta"
        self._capacity = capacity
        self._durable = durable
        self.shared_datasets: set[str] = set()
        """The ids of the datasets declared shared (docs/SECURITY.md, "Who may read what")."""
        self.dataset_readers: dict[str, ReadersIds] = {}
        """Of those, the ones declared shared with named readers: (uids, gids) their files admit."""
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

    # -- places: every file is reached by walking from the root, never by its path --------

    def mode_for(self, key: str) -> int | None:
        """The mode of ``key``'s files: its readers' (an ACL), the tier's, or its writer's alone if not shared."""
        dataset = key.split("/", 1)[0]
        if dataset in self.dataset_readers and self.file_mode is not None:
            return readers_mode(self.file_mode, self.dataset_readers[dataset], self._root)
        if self.private_file_mode is None or dataset in self.shared_datasets:
            return self.file_mode
        return self.private_file_mode

    def acl_refused(self) -> list[str]:
        """The datasets whose readers only an ACL can name, where this tier's filesystem refuses ACLs."""
        return acl_refused(self._root, self.file_mode, self.dataset_readers)

    def _place(self, area: str, key: str, suffix: str = "") -> Place:
        validate_key(key)
        *parents, name = (key + suffix).split("/")
        return Place(self._root, (area, *parents), name, self.dir_mode)

    def _data_place(self, key: str) -> Place:
        return self._place("data", key)

    def _meta_place(self, key: str) -> Place:
        return self._place("meta", key, ".json")

    def _contained(self, base: Path, key: str, suffix: str = "") -> Path:
        """The path of ``key`` under ``base`` (a directory of the root), after checking no link lies on its way."""
        if base.parent != self._root:
            raise InvalidKeyError(f"{base} is not a directory of the tier {self._root}")
        place = self._place(base.name, key, suffix)
        try:
            os.close(place.open_parent())
        except (FileNotFoundError, NotADirectoryError):
            pass
        except UnsafeFileError as exc:
            raise InvalidKeyError(f"invalid key {key!r}: {exc}") from None
        return place.path

    @property
    def mappable(self) -> bool:
        return True

    def map(self, key: str, *, version: str | None = None) -> mmap.mmap | bytes:
        self._counters["requests"] += 1
        fd = self._open_checked(key, version)  # no link followed, O_NONBLOCK, a regular file
        try:
            mapped = map_open_file(fd)
        finally:
            os.close(fd)
        self._counters["bytes_read"] += len(mapped)
        return mapped

    def path(self, key: str) -> Path:
        """Where ``key``'s file is, for a reader that opens it; checked for links now, not when it is opened."""
        return self._contained(self._data, key)

    def sizes(self, keys: Sequence[str]) -> list[tuple[Path, int]]:
        """Each key's path (as `path` says it) and its file's size, -1 if no regular file is there (blocking)."""
        sizes, paths = self._sized(keys, paths=True)
        return list(zip(paths, sizes, strict=True))

    def file_sizes(self, keys: Sequence[str]) -> list[int]:
        """`sizes` without the paths: what a warm of resident shards asks (a path a key was ~2 s of 1e5)."""
        return self._sized(keys, paths=False)[0]

    def _sized(self, keys: Sequence[str], *, paths: bool) -> tuple[list[int], list[Path]]:
        for key in keys:
            validate_key(key)
        try:
            return sizes_by_folder(keys, self._data_place, self._root, paths=paths)
        except UnsafeFileError as exc:
            raise InvalidKeyError(f"invalid key: {exc}") from None

    def _meta_path(self, key: str) -> Path:
        return self._contained(self._meta, key, ".json")

    def _in_parent(self, place: Place, act: Callable[[int, str], T], *, missing: T) -> T:
        """``act(dir_fd, name)`` in ``place``'s directory; ``missing`` if a directory on the way is absent."""
        try:
            fd = place.open_parent()
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return missing  # absent, or not this user's to see (outside the shared tier's group): read around it
        except UnsafeFileError as exc:
            raise InvalidKeyError(f"invalid key: {exc}") from None
        try:
            return act(fd, place.name)
        finally:
            os.close(fd)

    # -- synchronous helpers, run in threads ---------------------------------------------

    def _stat_sync(self, key: str) -> ObjectInfo | None:
        def look(fd: int, name: str) -> os.stat_result | None:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                return os.stat(name, dir_fd=fd, follow_symlinks=False)
            return None

        st = self._in_parent(self._data_place(key), look, missing=None)
        if st is None or not stat_module.S_ISREG(st.st_mode):
            return None
        metadata: dict[str, str] = {}
        writers = {st.st_uid}
        with contextlib.suppress(OSError, ValueError):
            meta_st, raw = read_bounded_stat(self._meta_place(key), META_LIMIT)
            parsed = json.loads(raw)
            if isinstance(parsed, dict):
                metadata = {str(k): str(v) for k, v in parsed.items()}
                writers.add(meta_st.st_uid)
        return ObjectInfo(
            key=key,
            size=st.st_size,
            version=f"{st.st_mtime_ns}:{st.st_size}",
            metadata=metadata,
            writers=frozenset(writers),
        )

    def _open_checked(self, key: str, version: str | None) -> int:
        def open_file(dir_fd: int, name: str) -> int:
            try:
                return os.open(name, READ_FLAGS, dir_fd=dir_fd)
            except (FileNotFoundError, NotADirectoryError):
                raise ShardNotFoundError(f"{self._root}: no object {key!r}") from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:  # the final component is a symlink
                    raise ShardNotFoundError(f"{self._root}: {key!r} is a symlink, not served") from None
                raise

        def absent() -> int:
            raise ShardNotFoundError(f"{self._root}: no object {key!r}")

        fd = self._in_parent(self._data_place(key), open_file, missing=-1)
        if fd < 0:
            absent()
        st = os.fstat(fd)
        if not stat_module.S_ISREG(st.st_mode):
            os.close(fd)
            raise ShardNotFoundError(f"{self._root}: {key!r} is not a regular file")
        if version is not None and version != f"{st.st_mtime_ns}:{st.st_size}":
            os.close(fd)
            raise OriginChangedError.since_manifest(f"{self._root}/{key}", "file")
        return fd

    def _describe_sync(self, key: str, metadata: bytes | None) -> ObjectInfo | None:
        """Write ``key``'s metadata file (if any), then stat it: what `put` does once the data is in place."""
        if metadata is not None:
            write_small(self._meta_place(key), metadata, self.mode_for(key))
        return self._stat_sync(key)

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
        start = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        try:
            top = Place(self._root, ("data", *filter(None, start.split("/"))), ".").open_parent()
        except (FileNotFoundError, NotADirectoryError, PermissionError, UnsafeFileError):
            return found
        try:
            # fwalk never descends through a link; each name is looked at in its directory's fd.
            for directory, _, files, dir_fd in os.fwalk(".", dir_fd=top):
                for name in files:
                    if PARTIAL_NAME.match(name):
                        continue
                    key = os.path.normpath(os.path.join(start, directory, name))
                    if not key.startswith(prefix):
                        continue
                    try:
                        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat_module.S_ISREG(st.st_mode):
                        found.append(ObjectInfo(key=key, size=st.st_size, version=f"{st.st_mtime_ns}:{st.st_size}"))
        finally:
            os.close(top)
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
            os.close(Place(self._root, (), ".", self.dir_mode).open_parent(create=True))
            free = shutil.disk_usage(self._root).free
        return TierUsage(used_bytes=used, object_count=count, capacity_bytes=self._capacity, device_free_bytes=free)

    def _delete_sync(self, key: str) -> bool:
        def unlink(fd: int, name: str) -> bool:
            try:
                os.unlink(name, dir_fd=fd)
            except FileNotFoundError:
                return False
            return True

        existed = self._in_parent(self._data_place(key), unlink, missing=False)
        self._in_parent(self._meta_place(key), unlink, missing=False)
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

    async def read_into(
        self,
        key: str,
        buffer: memoryview,
        *,
        version: str | None = None,
        hasher: Hasher | None = None,
        checked: bool = False,
    ) -> AsyncIterator[memoryview]:
        """The file read with ``preadv`` straight into ``buffer``, and hashed, in a thread: region by region."""
        self._counters["requests"] += 1
        fd = await asyncio.to_thread(self._open_checked, key, version)
        try:
            size = os.fstat(fd).st_size
            if size > len(buffer):
                raise BufferError(f"{self._root}/{key}: {size} bytes, more than the {len(buffer)} expected")
            offset = 0
            while offset < size:
                end = min(offset + (8 << 20), size)
                await asyncio.to_thread(fill_region, fd, buffer[offset:end], offset, hasher)
                region = buffer[offset:end]
                offset = end
                self._counters["bytes_read"] += len(region)
                yield region
        finally:
            os.close(fd)

    async def put(
        self,
        key: str,
        chunks: AsyncIterable[bytes | memoryview],
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        target = self._data_place(key)
        self._counters["requests"] += 1
        try:
            size = await atomic_write(target, chunks, durable=self._durable, file_mode=self.mode_for(key))
        except UnsafeFileError as exc:
            raise InvalidKeyError(f"invalid key {key!r}: {exc}") from None
        return await self._published(key, size, metadata)

    async def _published(self, key: str, size: int, metadata: Mapping[str, str] | None) -> ObjectInfo:
        """What `put` does once the data is in place: its metadata written, the file described."""
        self._counters["bytes_written"] += size
        # After the data, in one thread job with the stat: a crash between the two leaves data
        # without (or with older) metadata, which fails verification and is re-staged.
        encoded = json.dumps(dict(metadata), sort_keys=True).encode() if metadata else None
        try:
            info = await asyncio.to_thread(self._describe_sync, key, encoded)
        except UnsafeFileError as exc:
            raise InvalidKeyError(f"invalid key {key!r}: {exc}") from None
        if info is None:
            raise ShardNotFoundError(f"{self._root}/{key}: vanished right after it was written")
        return info

    async def put_many(
        self, items: Sequence[tuple[str, bytes | memoryview, Mapping[str, str]]]
    ) -> list[Path | Exception]:
        """`put` each ``(key, body, metadata)`` of a batch of small objects at once: where each landed, or why not.

        The same atomic, durable write per file as `put`, its system calls taken batch-wide
        (`write_batch`): what makes a tiny object cost a few system calls, not a dozen thread
        round trips and two fsyncs. The paths were reached without following a link.
        """
        outcomes: list[Path | Exception] = []
        batch: list[BatchItem] = []
        for key, body, metadata in items:
            try:
                batch.append(BatchItem(self._data_place(key), self._meta_place(key), body, metadata))
            except InvalidKeyError as exc:
                outcomes.append(exc)
            else:
                outcomes.append(batch[-1].data.path)
        self._counters["requests"] += len(batch)
        modes = {self.mode_for(key) for key, _, _ in items}
        mode = modes.pop() if len(modes) == 1 else self.private_file_mode  # one mode a batch: else the narrowest
        errors = iter(await write_batch(batch, durable=self._durable, file_mode=mode))
        for index, ((key, body, _), outcome) in enumerate(zip(items, outcomes, strict=True)):
            if isinstance(outcome, Exception):
                continue
            error = next(errors)
            if isinstance(error, UnsafeFileError):
                outcomes[index] = InvalidKeyError(f"invalid key {key!r}: {error}")
            elif error is not None:
                outcomes[index] = error
            else:
                self._counters["bytes_written"] += len(body)
        return outcomes

    async def delete(self, key: str) -> bool:
        self._counters["requests"] += 1
        return await asyncio.to_thread(self._delete_sync, key)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        for info in await asyncio.to_thread(self._list_sync, prefix):
            yield info

    async def usage(self) -> TierUsage:
        return await asyncio.to_thread(self._usage_sync)

    async def remove_partials_of(self, key: str, *, min_age: float = 30.0) -> int:
        """Delete the temporary files of writes to ``key`` whose writer is gone.

        Called by the taker of a stale lease. A partial still locked by a writer on
        this node, or written less than ``min_age`` seconds ago by the file
        server's clock (a writer on another node still at work), is kept.
        """

        def remove(fd: int, name: str) -> int:
            now = server_now(fd)
            return sum(
                remove_if_abandoned(fd, candidate, now, min_age)
                for candidate in os.listdir(fd)
                if candidate.startswith(f".{name}.")
                and PARTIAL_NAME.match(candidate)
                and candidate.count(".") == name.count(".") + 3
            )

        def remove_both() -> int:
            return self._in_parent(self._data_place(key), remove, missing=0) + self._in_parent(
                self._meta_place(key), remove, missing=0
            )

        return await asyncio.to_thread(remove_both)

    async def remove_abandoned_partials(self, *, min_age: float = 30.0) -> int:
        """Delete temporary files left by killed writers; return how many."""
        removed = 0
        for area in ("data", "meta"):
            place = Place(self._root, (area,), ".")
            removed += len(await asyncio.to_thread(remove_abandoned_partials, place, min_age=min_age))
        return removed

