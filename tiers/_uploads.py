"""Writes to object stores for `ObjectTier.put`: S3 multipart uploads, and a spooled upload for the rest."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping
from typing import Any

from datacache.tiers._backends import set_metadata

__all__ = ["multipart_upload", "spooled_upload"]

# Runs one request under the tier's retry policy and counters (`ObjectTier._call` for one key).
Call = Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]


async def multipart_upload(
    fs: Any,
    path: str,
    chunks: AsyncIterable[bytes | memoryview],
    metadata: Mapping[str, str] | None,
    *,
    part_size: int,
    call: Call,
) -> int:
    """Upload ``chunks`` to S3: one PUT when they fit in a part, else a multipart upload aborted on error.

    ``metadata`` is read when it is sent: with the single PUT once the chunks are exhausted; a
    multipart upload sends it at the start and, if it changed by the end, sets it again with a
    server-side copy (the `Tier.put` contract: a writer may complete it while streaming).
    """
    upload = _Multipart(fs, path, metadata, call)
    buffer = bytearray()
    size = 0
    try:
        async for chunk in chunks:
            buffer += chunk
            size += len(chunk)
            while len(buffer) >= part_size:
                part, buffer = bytes(buffer[:part_size]), buffer[part_size:]
                await upload.send_part(part)
        if upload.upload_id is None:
            await upload.put_whole(bytes(buffer))
            return size
        if buffer:
            await upload.send_part(bytes(buffer))
        await upload.complete()
        return size
    except BaseException:
        await upload.abort()
        raise


class _Multipart:
    """One S3 multipart upload, begun with its first part; each request runs through ``call``."""

    def __init__(self, fs: Any, path: str, metadata: Mapping[str, str] | None, call: Call) -> None:
        self.fs = fs
        self.bucket, self.key, _ = fs.split_path(path)
        self.metadata = metadata
        self.call = call
        self.upload_id: str | None = None
        self.parts: list[dict[str, Any]] = []
        self.sent: dict[str, str] = {}  # metadata as sent with create_multipart_upload

    def _extra(self) -> dict[str, Any]:  # read when used: the writer may complete it while streaming
        return {"Metadata": dict(self.metadata)} if self.metadata else {}

    async def _s3(self, method: str, fields: Callable[[], dict[str, Any]]) -> Any:
        """One request; ``fields`` is read at each attempt (the metadata may have been completed since)."""

        async def request() -> Any:
            return await self.fs._call_s3(method, Bucket=self.bucket, Key=self.key, **fields())

        return await self.call(request)

    def _create_fields(self) -> dict[str, Any]:
        extra = self._extra()
        self.sent.update(extra.get("Metadata", {}))
        return extra

    async def send_part(self, data: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = (await self._s3("create_multipart_upload", self._create_fields))["UploadId"]
        number, upload_id = len(self.parts) + 1, self.upload_id
        response = await self._s3(
            "upload_part", lambda: {"UploadId": upload_id, "PartNumber": number, "Body": data}
        )
        self.parts.append({"PartNumber": number, "ETag": response["ETag"]})

    async def put_whole(self, body: bytes) -> None:
        """No part was sent: the object in one PUT, with the metadata as it is now."""
        await self._s3("put_object", lambda: {"Body": body, **self._extra()})

    async def complete(self) -> None:
        done = {"UploadId": self.upload_id, "MultipartUpload": {"Parts": self.parts}}
        await self._s3("complete_multipart_upload", lambda: done)
        metadata = self.metadata
        if metadata and dict(metadata) != self.sent:  # completed after the upload began: set it now
            source = {"Bucket": self.bucket, "Key": self.key}
            await self._s3(
                "copy_object",
                lambda: {"CopySource": source, "Metadata": dict(metadata), "MetadataDirective": "REPLACE"},
            )

    async def abort(self) -> None:
        if self.upload_id is not None:
            abort = {"UploadId": self.upload_id}
            await asyncio.shield(self._s3("abort_multipart_upload", lambda: abort))


async def spooled_upload(
    fs: Any,
    path: str,
    chunks: AsyncIterable[bytes | memoryview],
    metadata: Mapping[str, str] | None,
    *,
    protocol: str,
    call: Call,
) -> int:
    """Other backends: spool to a local temporary file (memory stays bounded), then one upload."""
    fd, spool = tempfile.mkstemp(prefix="datacache-upload-")
    try:
        size = 0
        with os.fdopen(fd, "wb") as out:
            async for chunk in chunks:
                await asyncio.to_thread(out.write, chunk)
                size += len(chunk)

        final = dict(metadata or {})  # read now: the chunks are exhausted

        async def upload() -> Any:
            if final and protocol in ("gs", "gcs"):
                return await fs._put_file(spool, path, metadata=final)
            return await fs._put_file(spool, path)

        await call(upload)
        if final and protocol not in ("gs", "gcs"):
            await call(lambda: set_metadata(fs, protocol, path, final))
        return size
    finally:
        os.unlink(spool)
