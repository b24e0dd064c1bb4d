"""`ObjectTier`: any fsspec URL (s3:// first; file://, memory://, gs://, ...) as a tier.

The origin of every dataset is an `ObjectTier`. It is read-only unless made
writable (``datacache shard`` writes its output through one). What each backend
is told when its filesystem is made (one try per request, timeouts, confined
redirects) is in ``_filesystems``; S3's resumable streamed reads in ``_s3_reads``;
what else differs between backends in ``_backends``.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from datacache.tiers._backends import close_filesystem, content_version, filesystem_class, metadata_of, pinned_cat
from datacache.tiers._backends import past_the_end as backend_past_the_end
from datacache.tiers._files import redact_url, resolves_inside
from datacache.tiers._filesystems import CONFINE_REDIRECTS, backend_options, one_try
from datacache.tiers._listing import ListingBounds, find_all
from datacache.tiers._localread import Found, read_files
from datacache.tiers._options import check_storage_options
from datacache.tiers._retry import RetryPolicy, call_with_retry
from datacache.tiers._s3_reads import S3Object
from datacache.tiers._s3_threads import get_request, past_the_end, read_object, sync_client_like
from datacache.tiers._uploads import multipart_upload, spooled_upload
from datacache.tiers.base import (
    ByteRange,
    Hasher,
    ObjectInfo,
    Tier,
    TierStats,
    TierUsage,
    validate_key,
    validate_url_key,
)

from datacache.errors import ConfigError, OriginChangedError, OriginError, ShardNotFoundError

__all__ = ["CONFINE_REDIRECTS", "ObjectTier"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

_MULTIPART_MIN = 5 << 20


class ObjectTier(Tier):
    """A prefix in an object store or any fsspec filesystem.

    Parameters
    ----------
    url
        Root of the tier, e.g. ``s3://bucket/datasets/imagenet``. Keys are relative to it.
    storage_options
        Passed to the fsspec filesystem (endpoint, credentials, ...). Never logged.
    retry
        How transient errors are retried.
    writable
        Allow `put` and `delete`.
    part_size
        Size of the parts of a multipart upload.
    threads
        S3 only: GETs run in a pool of this many threads with synchronous
        clients (see ``_s3_threads``); other requests stay on asyncio.
    listing
        What one listing may hold (entries, bytes of http(s) pages); past it, `ListingTooLargeError`.
    """

    kind = "object"

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        writable: bool = False,
        part_size: int = 16 << 20,
        threads: int = 16,
        listing: ListingBounds | None = None,
    ) -> None:
        import fsspec.core

        protocol, _ = fsspec.core.split_protocol(url)
        self._protocol = protocol or "file"
        try:
            self._fs_class = filesystem_class(self._protocol)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"cannot open {redact_url(url)}: {exc}") from None
        storage_options = dict(storage_options or {})
        self._confine_redirects = bool(storage_options.pop(CONFINE_REDIRECTS, False))
        try:
            check_storage_options(self._protocol, self._fs_class, storage_options)
        except ConfigError as exc:
            raise ConfigError(f"{redact_url(url.rstrip('/'))}: {exc}") from None
        self._raw_url = url
        self._root = str(self._fs_class._strip_protocol(url)).rstrip("/")
        self._storage_options = dict(storage_options or {})
        self._retry = retry or RetryPolicy()
        self._writable = writable
        self._part_size = max(part_size, _MULTIPART_MIN)
        self._counters = {"bytes_read": 0, "bytes_written": 0, "requests": 0, "retries": 0, "errors": 0}
        self._fs: Any = None
        self._fs_loop: asyncio.AbstractEventLoop | None = None
        self._threads = max(1, threads)
        self._listing = listing or ListingBounds()
        self._get_pool: ThreadPoolExecutor | None = None
        self._get_client: Any = None
        self._get_client_lock: asyncio.Lock | None = None
        self._get_client_lock_loop: asyncio.AbstractEventLoop | None = None
        self._closed_loop: asyncio.AbstractEventLoop | None = None
        """The loop `close` ran on: a request there after it is refused, never given a new client."""

    # -- pickling: configuration only ---------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_fs"] = None
        state["_fs_loop"] = None
        state["_get_pool"] = None
        state["_get_client"] = None
        state["_get_client_lock"] = None
        state["_get_client_lock_loop"] = None
        state["_closed_loop"] = None
        state["_counters"] = dict.fromkeys(self._counters, 0)
        return state

    # -- properties -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return redact_url(self._raw_url.rstrip("/"))

    @property
    def protocol(self) -> str:
        """The fsspec protocol, e.g. ``"s3"``."""
        return self._protocol

    @property
    def writable(self) -> bool:
        return self._writable

    @property
    def is_s3(self) -> bool:
        """Whether requests go to an S3-protocol server (enables conditional GETs)."""
        return self._protocol in ("s3", "s3a")

    @property
    def has_local_paths(self) -> bool:
        return self._protocol in ("file", "local")

    def stats(self) -> TierStats:
        return TierStats(**self._counters)

    # -- the filesystem, created lazily in the running loop ------------------------------

    async def _filesystem(self) -> Any:
        loop = asyncio.get_running_loop()
        if self._fs is not None and self._fs_loop is loop:
            return self._fs
        if self._closed_loop is loop:
            # A request still in flight when the process closed this tier (a prefetch at exit): a new
            # client now would never be closed ("Unclosed client session" after the user's last line).
            raise OriginError(f"{self.url}: this origin's client is closed")
        options = backend_options(
            self._protocol,
            self._fs_class,
            self._raw_url,
            self._storage_options,
            confine_redirects=self._confine_redirects,
        )
        if getattr(self._fs_class, "async_impl", False):
            fs = self._fs_class(asynchronous=True, loop=loop, skip_instance_cache=True, **options)
            one_try(fs, self._protocol)
            if self.is_s3:
                await call_with_retry(fs.set_session, where=self.url, policy=self._retry)
        else:
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            sync_fs = self._fs_class(skip_instance_cache=True, **options)
            fs = AsyncFileSystemWrapper(sync_fs, asynchronous=True)
        self._fs, self._fs_loop = fs, loop
        return fs

    async def _threaded(self) -> tuple[Any, ThreadPoolExecutor]:
        """The synchronous S3 client and the pool its GETs run in, created once."""
        if self._get_client is not None and self._get_pool is not None:
            return self._get_client, self._get_pool
        loop = asyncio.get_running_loop()
        if self._get_client_lock is None or self._get_client_lock_loop is not loop:
            # An asyncio.Lock belongs to one loop; the tier may be used from another later.
            self._get_client_lock, self._get_client_lock_loop = asyncio.Lock(), loop
        async with self._get_client_lock:
            if self._get_client is None or self._get_pool is None:
                fs = await self._filesystem()
                pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="datacache-s3-get")
                # Building a client loads botocore's service model: tens of ms, off the loop.
                self._get_client = await loop.run_in_executor(
                    pool, lambda: sync_client_like(fs, max_pool_connections=self._threads)
                )
                self._get_pool = pool
        return self._get_client, self._get_pool

    async def close(self) -> None:
        self._closed_loop = asyncio.get_running_loop()
        fs, self._fs, self._fs_loop = self._fs, None, None
        if fs is not None:
            await close_filesystem(getattr(fs, "fs", fs))  # an AsyncFileSystemWrapper holds the sync one
        pool, client = self._get_pool, self._get_client
        self._get_pool = self._get_client = None
        if pool is not None:
            # A GET stalled on a dead server ends at its read timeout; nobody waits for it.
            pool.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            client.close()

    def _path(self, key: str) -> str:
        # Every verb reaches the origin through here: an http server decodes what it is sent.
        (validate_url_key if self._protocol in ("http", "https") else validate_key)(key)
        if self._protocol in ("http", "https") and re.search(r"[?#]", self._root):
            # "ok/?x=1" + "/shard.tar" would ask for "ok/" with a query ending in the key: never the object.
            raise ConfigError(
                f"{self.url}: a URL with a query or fragment names one object; no key is read under it "
                "(give the directory without the query)"
            )
        return f"{self._root}/{key}" if self._root else key

    def _key_of(self, path: str) -> str:
        prefix = self._root + "/" if self._root else ""
        path = path.rstrip("/")
        return path[len(prefix) :] if path.startswith(prefix) else path

    async def _call(self, where: str, operation: Callable[[], Awaitable[T]]) -> T:
        def count_retry(_: Exception) -> None:
            self._counters["retries"] += 1

        self._counters["requests"] += 1
        try:
            return await call_with_retry(operation, where=where, policy=self._retry, on_retry=count_retry)
        except Exception:
            self._counters["errors"] += 1
            raise

    def _info_to_object(self, key: str, info: Mapping[str, Any]) -> ObjectInfo:
        size = info.get("size", info.get("Size"))
        if size is None:  # never taken as 0: an empty shard would be "cached" and pass verification
            raise OriginError(
                f"{self.url}/{key}: the size of this object cannot be known (the server sends no "
                "Content-Length); datacache needs each shard's size"
            )
        protocol = self._protocol
        return ObjectInfo(key, int(size), content_version(protocol, info), metadata=metadata_of(protocol, info))

    # -- the protocol ---------------------------------------------------------------------

    async def stat(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        fs = await self._filesystem()

        async def info() -> Any:
            if self.is_s3:  # s3fs's info drops the user metadata: one HEAD that keeps it
                bucket, object_key, _ = fs.split_path(path)
                head = await fs._call_s3("head_object", Bucket=bucket, Key=object_key)
                return {**head, "size": head["ContentLength"], "type": "file"}
            return await fs._info(path)

        try:
            details = await self._call(f"{self.url}/{key}", info)
        except ShardNotFoundError:
            return None
        if details.get("type") == "directory":
            return None
        return self._info_to_object(key, details)

    async def get(self, key: str, byte_range: ByteRange | None = None, *, version: str | None = None) -> bytes:
        path = self._path(key)
        fs = await self._filesystem()
        where = f"{self.url}/{key}"
        span = byte_range or ByteRange()

        if self.is_s3:
            if span.end is not None and span.end == span.start:
                return b""
            bucket, object_key, _ = fs.split_path(path)
            request = get_request(bucket, object_key, span.start, span.end, version)
            client, pool = await self._threaded()
            loop = asyncio.get_running_loop()

            async def get_object() -> bytes:
                try:
                    return await loop.run_in_executor(pool, read_object, client, request)
                except Exception as exc:
                    if past_the_end(request, exc):
                        return b""
                    raise

            data = await self._call(where, get_object)
        else:
            data = await self._get_other(fs, key, span, version)
        if span.end is not None and len(data) > span.end - span.start:
            data = data[: span.end - span.start]
        self._counters["bytes_read"] += len(data)
        return data

    async def get_local_many(self, keys: Sequence[str], versions: Sequence[str | None]) -> list[Found]:
        """`get` of whole small objects of an origin on this machine (`has_local_paths`) in one thread job."""
        files = [(self._path(key), f"{self.url}/{key}", version) for key, version in zip(keys, versions, strict=True)]
        found = await asyncio.to_thread(read_files, files)
        self._counters["requests"] += len(found)
        self._counters["bytes_read"] += sum(len(data) for data in found if isinstance(data, bytes))
        return found

    async def _get_other(self, fs: Any, key: str, span: ByteRange, version: str | None) -> bytes:
        """A read from a backend other than S3: pinned where the backend can name a version."""
        path, where = self._path(key), f"{self.url}/{key}"
        if span.end is not None and span.end == span.start:  # no request for no bytes (Azure refuses one)
            if await self.stat(key) is None:
                raise ShardNotFoundError(f"{where}: not found at the origin")
            return b""
        if version is not None:
            pinned = await self._call(
                where, lambda: pinned_cat(fs, self._protocol, path, span.start, span.end, version, where)
            )
            if pinned is not None:
                return pinned
            # No pinned read here (files): compare, then read; the manifest's checksum catches the rest.
            current = await self.stat(key)
            if current is None:
                raise ShardNotFoundError(f"{where}: not found at the origin")
            if current.version != version:
                raise OriginChangedError.since_manifest(where)

        async def cat() -> bytes:
            try:
                result: bytes = await fs._cat_file(path, start=span.start or None, end=span.end)
            except Exception as exc:
                if backend_past_the_end(exc):
                    return b""  # a range at or past the end: no bytes, as on S3 and files
                raise
            return result

        return await self._call(where, cat)

    async def _s3_object(self, key: str) -> S3Object:
        fs = await self._filesystem()
        client, pool = await self._threaded()
        bucket, object_key, _ = fs.split_path(self._path(key))
        where = f"{self.url}/{key}"
        return S3Object(client, pool, bucket, object_key, where, self._retry, self._counters)

    async def stream(
        self,
        key: str,
        *,
        chunk_size: int = 8 << 20,
        byte_range: ByteRange | None = None,
        version: str | None = None,
    ) -> AsyncIterator[bytes]:
        """Yield the object's bytes as they arrive: one streaming GET, not a buffered one.

        On S3 the body is read by a pool thread (see ``_s3_threads``); a
        connection cut mid-body is resumed from the byte where it stopped (a
        ranged GET, still conditional on ``version``), under the same retry
        policy as every other request (``_s3_reads``). Other backends read
        ranges of ``chunk_size``.
        """
        if not self.is_s3:
            async for chunk in super().stream(key, chunk_size=chunk_size, byte_range=byte_range, version=version):
                yield chunk
            return
        span = byte_range or ByteRange()
        reads = await self._s3_object(key)
        async for chunk in reads.stream(span.start, span.end, version, chunk_size):
            yield chunk

    async def read_into(
        self,
        key: str,
        buffer: memoryview,
        *,
        version: str | None = None,
        hasher: Hasher | None = None,
        checked: bool = False,
    ) -> AsyncIterator[memoryview]:
        """On S3: one GET whose body a pool thread reads straight into ``buffer`` and hashes there.

        The event loop only learns where each filled region ends. A connection cut
        mid-body is resumed from the last region handed over (a ranged GET, still
        conditional on ``version``), under the tier's retry policy, as `stream` does.
        With ``checked``, the body's CRC32 (when S3 sends one) is not computed: the
        caller's checksum of the whole object, known beforehand, is the stronger check.
        """
        if not self.is_s3:
            async for region in super().read_into(key, buffer, version=version, hasher=hasher, checked=checked):
                yield region
            return
        reads = await self._s3_object(key)
        async for region in reads.read_into(buffer, version, hasher, checked=checked):
            yield region

    async def _http_itself(self, fs: Any, base: str) -> ObjectInfo | None:
        """The one object an http(s) URL names, or None when it is a page of links (or nothing)."""
        # One HEAD, not the whole file fetched to look for links in it. Named by its URL less the scheme,
        # as object stores name it, for the manifest's one-object case (`datacache.manifest.listing`).
        try:
            itself = await self._call(self.url, lambda: fs._info(base))
        except FileNotFoundError:
            return None
        if itself is None or itself.get("mimetype") in ("text/html", "application/xhtml+xml"):
            return None
        return self._info_to_object(base.split("://", 1)[1], itself)

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        fs = await self._filesystem()
        base = self._root
        if self._protocol in ("http", "https"):  # a URL naming one object, not a page of links, lists it alone
            itself = await self._http_itself(fs, base)
            if itself is not None:
                yield itself
                return
        found = await self._call(self.url, lambda: find_all(fs, self._protocol, base, self._listing))
        local = self._protocol in ("file", "local")
        for path in sorted(found):
            details = found[path]
            if details.get("type") == "directory":
                continue
            if local and details.get("islink") and not resolves_inside(path, base):
                # A link out of the root: neither its bytes nor its size is the dataset's (a daemon's
                # listing would otherwise tell a client the size of a file only the daemon can read).
                logger.warning("%s: a symlink out of %s; not listed", redact_url(str(path)), redact_url(base))
                continue
            key = self._key_of(path)
            if not key.startswith(prefix) or key == "":
                continue
            if details.get("size", details.get("Size")) is None:
                stated = await self.stat(key)  # a listing page gives no sizes: ask each object (HEAD)
                if stated is not None:
                    yield stated
                continue
            yield self._info_to_object(key, details)

    async def put(
        self,
        key: str,
        chunks: AsyncIterable[bytes | memoryview],
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        if not self._writable:
            raise PermissionError(f"{self.url} is read-only")
        path = self._path(key)
        fs = await self._filesystem()
        where = f"{self.url}/{key}"
        if self.has_local_paths:
            from datacache.tiers._files import atomic_write

            size = await atomic_write(path, chunks)
        elif self.is_s3:
            size = await multipart_upload(
                fs, path, chunks, metadata, part_size=self._part_size, call=lambda op: self._call(where, op)
            )
        else:
            size = await spooled_upload(
                fs, path, chunks, metadata, protocol=self._protocol, call=lambda op: self._call(where, op)
            )
        self._counters["bytes_written"] += size
        info = await self.stat(key)
        return info or ObjectInfo(key=key, size=size)

    async def delete(self, key: str) -> bool:
        if not self._writable:
            raise PermissionError(f"{self.url} is read-only")
        path = self._path(key)
        fs = await self._filesystem()
        if self.is_s3 and await self.stat(key) is None:
            return False  # S3 answers a DELETE of a missing key with success

        async def remove() -> Any:
            return await fs._rm_file(path)

        try:
            await self._call(f"{self.url}/{key}", remove)
        except ShardNotFoundError:
            return False
        return True

    async def usage(self) -> TierUsage:
        used = 0
        count = 0
        async for info in self.list():
            used += info.size
            count += 1
        return TierUsage(used_bytes=used, object_count=count, capacity_bytes=None, device_free_bytes=None)
