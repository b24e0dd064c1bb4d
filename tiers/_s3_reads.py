"""S3 reads that survive a cut connection: a streamed GET resumed from the byte where it stopped.

`ObjectTier.stream` and `ObjectTier.read_into` hand S3 reads here. Each GET runs
on the tier's pool (``_s3_threads``); a connection cut mid-body is resumed by a
ranged GET, still conditional on the version, under the tier's `RetryPolicy`:
the same rule, and the same counters, as every other request of the tier.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from datacache.tiers._retry import RetryPolicy, translate_error
from datacache.tiers._s3_threads import ThreadedGet, ThreadedGetInto, get_request, past_the_end
from datacache.tiers.base import Hasher

from datacache.errors import TransientOriginError

__all__ = ["S3Object"]


@dataclass
class S3Object:
    """One object's reads: where it is, the client and pool that read it, and the tier's counters."""

    client: Any
    pool: ThreadPoolExecutor
    bucket: str
    key: str
    where: str
    retry: RetryPolicy
    counters: dict[str, int]

    async def stream(
        self, start: int, end: int | None, version: str | None, chunk_size: int
    ) -> AsyncIterator[bytes]:
        """Bytes ``[start, end)`` as they arrive (see `ObjectTier.stream`)."""
        loop = asyncio.get_running_loop()
        offset, attempt = start, 0
        self.counters["requests"] += 1
        while end is None or offset < end:
            request = get_request(self.bucket, self.key, offset, end, version)
            transfer = ThreadedGet(self.client, request, chunk_size=min(chunk_size, 1 << 20), loop=loop)
            transfer.start(self.pool)
            try:
                async for chunk in transfer.chunks():
                    offset += len(chunk)
                    self.counters["bytes_read"] += len(chunk)
                    yield chunk
                return
            except Exception as exc:
                retry = await self._after_failure(exc, request, attempt)
                if retry is None:
                    return
                attempt = retry
            finally:
                transfer.abandon()

    async def read_into(
        self, buffer: memoryview, version: str | None, hasher: Hasher | None, *, checked: bool = False
    ) -> AsyncIterator[memoryview]:
        """The whole object read into ``buffer``, region by region (see `ObjectTier.read_into`)."""
        loop = asyncio.get_running_loop()
        offset, attempt = 0, 0
        self.counters["requests"] += 1
        while True:
            request = get_request(self.bucket, self.key, offset, None, version)
            transfer = ThreadedGetInto(
                self.client, request, buffer, offset=offset, hasher=hasher, loop=loop, crc=not checked
            )
            transfer.start(self.pool)
            try:
                async for region in transfer.regions():
                    offset += len(region)
                    self.counters["bytes_read"] += len(region)
                    yield region
                return
            except BufferError:
                raise
            except Exception as exc:
                retry = await self._after_failure(exc, request, attempt)
                if retry is None:
                    return
                attempt = retry
            finally:
                transfer.abandon()

    async def _after_failure(self, exc: Exception, request: Any, attempt: int) -> int | None:
        """The retry rule of a streamed GET that failed: None when its range began past the end (done),
        else the attempt number to retry as, after the back-off; the translated error when it is not
        transient or the attempts are spent."""
        if past_the_end(request, exc):
            return None
        error = translate_error(exc, self.where)
        attempt += 1
        if not isinstance(error, TransientOriginError) or attempt >= self.retry.max_attempts:
            self.counters["errors"] += 1
            if isinstance(error, TransientOriginError):
                error = TransientOriginError(f"{error} (gave up after {attempt} attempts)")
            raise error from exc
        self.counters["retries"] += 1
        await asyncio.sleep(self.retry.delay(attempt))
        return attempt
