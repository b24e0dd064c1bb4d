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
    bucket, object_key, _ = fs.split_path(path)
    sent: dict[str, str] = {}  # metadata as sent with create_multipart_upload

    def extra() -> dict[str, Any]:  # read when used: the writer may complete it while streaming
        return {"Metadata": dict(metadata)} if metadata else {}

    buffer = bytearray()
    size = 0
    upload_id: str | None = None
    parts: list[dict[str, Any]] = []

    async def send_part(data: bytes) -> None:
        number = len(parts) + 1

        async def upload() -> Any:
            return await fs._call_s3(
                "upload_part", Bucket=bucket, Key=object_key, UploadId=upload_id, PartNumber=number, Body=data
            )

        response = await call(upload)
        parts.append({"PartNumber": number, "ETag": response["ETag"]})

    try:
        async for chunk in chunks:
            buffer += chunk
            size += len(chunk)
            while len(buffer) >= part_size:
                if upload_id is None:

                    async def create() -> Any:
                        sent.update(extra().get("Metadata", {}))
                        return await fs._call_s3(
                            "create_multipart_upload", Bucket=bucket, Key=object_key, **extra()
                        )

                    upload_id = (await call(create))["UploadId"]
                part, buffer = bytes(buffer[: part_size]), buffer[part_size :]
                await send_part(part)
        if upload_id is None:
            body = bytes(buffer)

            async def put_object() -> Any:
                return await fs._call_s3("put_object", Bucket=bucket, Key=object_key, Body=body, **extra())

            await call(put_object)
            return size
        if buffer:
            await send_part(bytes(buffer))

        async def complete() -> Any:
            return await fs._call_s3(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=object_key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )

        await call(complete)
        if metadata and dict(metadata) != sent:  # completed after the upload began: set it now

            async def replace_metadata() -> Any:
                source = {"Bucket": bucket, "Key": object_key}
                return await fs._call_s3(
                    "copy_object", Bucket=bucket, Key=object_key, CopySource=source,
                    Metadata=dict(metadata), MetadataDirective="REPLACE",
                )

            await call(replace_metadata)
        return size
    except BaseException:
        if upload_id is not None:
            abort_id = upload_id

            async def abort() -> Any:
                return await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=object_key, UploadId=abort_id)

            await asyncio.shield(call(abort))
        raise

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
