"""S3 GETs on a thread pool: synchronous botocore clients, asyncio for orchestration only.

Profiles of ``datacache warm`` showed the one asyncio event loop doing every
``recv`` (at most 256 KiB per call), aiohttp's buffering and botocore's
response CRC in Python, while holding the GIL: about a third of what eight
plain boto3 threads pull from the same server. Here each GET runs in a thread
of a pool owned by the tier: urllib3 reads the body with the GIL released, and
hands chunks to the event loop through a bounded hand-off, so memory stays at
``depth`` chunks per transfer however slow the consumer is.

The synchronous client is built from the very ``S3FileSystem`` that the tier's
other requests use (endpoint, credentials, anonymous access, botocore config),
so both paths talk to the same place with the same identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from datacache.tiers._retry import error_code
from datacache.tiers.base import Hasher

__all__ = ["ThreadedGet", "ThreadedGetInto", "get_request", "past_the_end", "read_object", "sync_client_like"]


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def get_request(bucket: str, key: str, start: int, end: int | None, version: str | None) -> dict[str, Any]:
    """The arguments of a GetObject of bytes ``[start, end)``, conditional on ``version`` (an ETag)."""
    request: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if start or end is not None:
        request["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
    if version is not None:
        request["IfMatch"] = f'"{version}"'
    return request


def past_the_end(request: Mapping[str, Any], error: BaseException) -> bool:
    """Whether ``error`` says a ranged request started at or past the end: no bytes, as for files."""
    return "Range" in request and error_code(error) in ("InvalidRange", "416")


def _check_length(received: int, response: Mapping[str, Any]) -> None:
    expected = response.get("ContentLength")
    if expected is not None and received < int(expected):
        raise ConnectionResetError(f"short body: {received} of {expected} bytes")


def _check_announced(length: Any, room: int) -> None:
    """Refuse a response whose announced ``ContentLength`` is more than the ``room`` left in the buffer."""
    if length is not None and int(length) > room:
        raise BufferError(f"the body holds {length} bytes, more than the {room} expected")


def _check_ended(readinto: Callable[[memoryview], int], length: Any, room: int) -> None:
    """Refuse a body of no announced length that still has bytes once ``room`` bytes filled the buffer."""
    if length is None and readinto(memoryview(bytearray(1))):
        raise BufferError(f"the body holds more than the {room} bytes expected")


def _release_when_read(body: Any) -> None:
    """Return a body's connection to urllib3's pool once it was read to the end around urllib3.

    urllib3 does so itself once its response has been read to the end through it.
    """
    raw = body._raw_stream
    if raw._fp.isclosed():
        raw.release_conn()


def read_object(client: Any, request: Mapping[str, Any]) -> bytes:
    """One blocking GetObject, its whole body read (run it in a pool thread)."""
    response = client.get_object(**request)
    body = response["Body"]
    try:
        data: bytes = body.read()
    finally:
        body.close()
    _check_length(len(data), response)
    return data


def sync_client_like(fs: Any, *, max_pool_connections: int) -> Any:
    """A synchronous botocore S3 client configured as s3fs configured ``fs``'s async one."""
    import botocore.config
    import botocore.session

    client_kwargs = dict(fs.client_kwargs)
    init_kwargs = {
        "aws_access_key_id": fs.key,
        "aws_secret_access_key": fs.secret,
        "aws_session_token": fs.token,
        "endpoint_url": fs.endpoint_url,
    }
    init_kwargs = {k: v for k, v in init_kwargs.items() if v is not None and v != client_kwargs.get(k)}
    if "use_ssl" not in client_kwargs:
        init_kwargs["use_ssl"] = fs.use_ssl
    # aiobotocore's AioConfig takes a few options of its own (connector_args, ...).
    known = set(botocore.config.Config.OPTION_DEFAULTS)
    config_kwargs = {k: v for k, v in fs._prepare_config_kwargs().items() if k in known}
    config_kwargs["max_pool_connections"] = max(
        max_pool_connections, int(config_kwargs.get("max_pool_connections") or 0)
    )
    if fs.anon:
        from botocore import UNSIGNED

        secrets = {"aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
        init_kwargs = {k: v for k, v in init_kwargs.items() if k not in secrets}
        client_kwargs = {k: v for k, v in client_kwargs.items() if k not in secrets}
        config_kwargs["signature_version"] = UNSIGNED
    session = botocore.session.Session(**dict(fs.kwargs)) if fs.kwargs else botocore.session.get_session()
    # The service model and endpoint rules that ``fs``'s session parsed already (100-250 ms of
    # JSON, on a cold epoch's path before its first byte): parsed once, not once per client.
    loader = _data_loader(fs)
    if loader is not None:
        session.register_component("data_loader", loader)
    return session.create_client("s3", config=botocore.config.Config(**config_kwargs), **init_kwargs, **client_kwargs)


def _data_loader(fs: Any) -> Any:
    """The botocore data loader of ``fs``'s session (None before its session is set)."""
    session = getattr(fs, "session", None)
    get_component = getattr(session, "get_component", None)
    return get_component("data_loader") if get_component is not None else None


class ThreadedGet:
    """One GET whose body is read in a pool thread and consumed as an async iterator.

    `start` hands the GET to a pool thread; `chunks` is what the event loop
    iterates. At most ``depth`` chunks wait between them. `abandon` lets the
    thread stop at its next chunk boundary without anyone waiting for it.
    """

    def __init__(
        self,
        client: Any,
        request: Mapping[str, Any],
        *,
        chunk_size: int,
        loop: asyncio.AbstractEventLoop,
        depth: int = 4,
    ) -> None:
        self._client = client
        self._request = dict(request)
        self._chunk_size = chunk_size
        self._loop = loop
        self._queue: asyncio.Queue[bytes | _Failure | None] = asyncio.Queue()  # None: the end
        self._room = threading.Semaphore(depth)
        self._depth = depth
        self._abandoned = threading.Event()

    def start(self, executor: ThreadPoolExecutor) -> None:
        executor.submit(self._run)

    def _hand_over(self, item: bytes | _Failure | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _run(self) -> None:
        try:
            response = self._client.get_object(**self._request)
            body = response["Body"]
            received = 0
            try:
                while True:
                    self._room.acquire()
                    if self._abandoned.is_set():
                        return
                    chunk = body.read(self._chunk_size)
                    if not chunk:
                        break
                    received += len(chunk)
                    self._hand_over(chunk)
            finally:
                body.close()
            _check_length(received, response)
            self._hand_over(None)
        except BaseException as exc:
            self._hand_over(_Failure(exc))

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's chunks in order; the thread's exception, if any, is raised here."""
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, _Failure):
                raise item.error
            self._room.release()
            yield item

    def abandon(self) -> None:
        """Let the thread stop at its next chunk; does not wait for it."""
        self._abandoned.set()
        for _ in range(self._depth + 1):
            self._room.release()


def _direct_reader(body: Any) -> tuple[Callable[[memoryview], int], Any, bool]:
    """How to read ``body`` into memory: ``(readinto, checksum, direct)``.

    botocore's body, and urllib3's response under it, implement ``readinto`` as a
    ``read`` (a fresh ``bytes``) and a copy. The ``http.client`` response under
    both reads straight from the socket into the caller's buffer (GIL released):
    used when urllib3 decodes nothing and has buffered nothing. Then botocore's
    response checksum (CRC32 of a flexible-checksum body), if any, is returned to
    be updated by the caller (zlib releases the GIL too) and checked at the end.
    """
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    decoded = getattr(raw, "_decoded_buffer", None)
    plain = raw is not None and (
        not getattr(raw, "decode_content", True)
        or raw.headers.get("content-encoding", "identity").lower() in ("", "identity")
    )
    if isinstance(fp, http.client.HTTPResponse) and plain and not (decoded is not None and len(decoded)):
        return fp.readinto, getattr(body, "_checksum", None), True
    return body.readinto, None, False


class ThreadedGetInto:
    """One GET whose body a pool thread reads straight into a caller's buffer (one copy: socket -> buffer).

    The thread fills ``buffer`` from ``offset`` in regions of ``step`` bytes, updates
    ``hasher`` with each region, and hands the region's end to the event loop:
    the loop never touches the bytes, and nothing is allocated per chunk. A body
    larger than the room left in ``buffer`` raises `BufferError`. Without ``crc``,
    botocore's CRC32 of the body (sent by S3 for objects stored with one) is not
    computed: the caller checks the bytes against a checksum of its own.
    """

    def __init__(
        self,
        client: Any,
        request: Mapping[str, Any],
        buffer: memoryview,
        *,
        offset: int,
        hasher: Hasher | None,
        loop: asyncio.AbstractEventLoop,
        step: int = 4 << 20,
        crc: bool = True,
    ) -> None:
        self._client = client
        self._request = dict(request)
        self._buffer = buffer
        self._offset = offset
        self._hasher = hasher
        self._loop = loop
        self._step = step
        self._crc = crc
        self._queue: asyncio.Queue[int | _Failure | None] = asyncio.Queue()  # None: the end
        self._abandoned = threading.Event()

    def start(self, executor: ThreadPoolExecutor) -> None:
        executor.submit(self._run)

    def _hand_over(self, item: int | _Failure | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _run(self) -> None:
        try:
            self._read()
        except BaseException as exc:
            self._hand_over(_Failure(exc))

    def _read(self) -> None:
        buffer, hasher, step = self._buffer, self._hasher, self._step
        size = len(buffer)
        offset = start = self._offset
        response = self._client.get_object(**self._request)
        body = response["Body"]
        try:
            length = response.get("ContentLength")
            _check_announced(length, size - start)
            readinto, checksum, direct = _direct_reader(body)
            checksum = checksum if self._crc else None
            while offset < size:
                if self._abandoned.is_set():
                    return
                stop = min(offset + step, size)
                filled = offset
                while filled < stop:
                    count = readinto(buffer[filled:stop])
                    if not count:
                        break
                    filled += count
                if filled > offset:
                    region = buffer[offset:filled]
                    if hasher is not None:
                        hasher.update(region)
                    if checksum is not None:
                        checksum.update(region)
                    offset = filled
                    self._hand_over(filled)
                if filled < stop:
                    break  # the end of the body
            else:
                _check_ended(readinto, length, size - start)
            if direct:
                _release_when_read(body)
        finally:
            body.close()
        _check_length(offset - start, response)
        if checksum is not None:
            body._validate_checksum()
        self._hand_over(None)

    async def regions(self) -> AsyncIterator[memoryview]:
        """The filled regions of the buffer, in order; the thread's exception, if any, is raised here."""
        offset = self._offset
        while True:
            item = await self._queue.get()
            if item is None:
                return
            if isinstance(item, _Failure):
                raise item.error
            region = self._buffer[offset:item]
            offset = item
            yield region

    def abandon(self) -> None:
        """Let the thread stop at its next region; does not wait for it."""
        self._abandoned.set()
