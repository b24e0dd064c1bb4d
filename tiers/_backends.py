"""What differs between fsspec backends, kept out of `ObjectTier`: closing clients, pinned reads.

Each backend (s3fs, gcsfs, adlfs, fsspec's HTTP) opens its own client in the event
loop that first uses it, and each pins a version its own way: S3 by a conditional
GET on the ETag (``_s3_threads``), GCS by reading a named *generation*, Azure by a
download conditional on the blob's ETag. A pinned read never returns bytes of
another version: it raises `OriginChangedError` instead.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from datacache.errors import OriginChangedError

__all__ = [
    "close_filesystem",
    "filesystem_class",
    "metadata_of",
    "past_the_end",
    "pinned_cat",
    "set_metadata",
    "version_of",
]


AZURE_SCHEMES = ("az", "abfs", "abfss")


def filesystem_class(protocol: str) -> Any:
    """The fsspec filesystem class for ``protocol``.

    gs:// uses gcsfs's JSON-API filesystem, not the class fsspec registers since gcsfs 2026
    (which first asks the gRPC control plane for each bucket's layout, for hierarchical
    and zonal buckets): datacache only stats, lists and reads objects, which the JSON API
    serves for every bucket, and the lookup costs a minute of retries wherever gRPC is
    not reachable (an emulator, a proxy that passes only HTTPS). Its requests are tried
    once (``_gcs``): the tier's retry policy is the one rule.
    """
    import fsspec

    if protocol in ("gs", "gcs"):
        from datacache.tiers._gcs import OneTryGCSFileSystem

        return OneTryGCSFileSystem
    return fsspec.get_filesystem_class(protocol)


async def close_filesystem(fs: Any) -> None:
    """Close the clients and sessions ``fs`` opened in the running loop."""
    import aiohttp

    s3 = getattr(fs, "_s3", None)
    if s3 is not None:
        await s3.__aexit__(None, None, None)
    session = getattr(fs, "_session", None)  # gcsfs and HTTP: one aiohttp session
    if isinstance(session, aiohttp.ClientSession) and not session.closed:
        await session.close()
    service = getattr(fs, "service_client", None)  # adlfs: the async Azure SDK client
    if service is not None and hasattr(service, "close"):
        await service.close()
        credential = getattr(fs, "credential", None)
        if credential is not None and hasattr(credential, "close"):
            result = credential.close()
            if hasattr(result, "__await__"):
                await result


def version_of(protocol: str, info: Any) -> str | None:
    """The token that names this content at the origin, or None where the backend has none.

    GCS: the object's generation (changes on every rewrite, and a read can name it).
    Others: the ETag where there is one.
    """
    if protocol in ("gs", "gcs"):
        generation = info.get("generation")
        return str(generation) if generation else None
    etag = info.get("ETag") or info.get("etag")
    return str(etag).strip('"') if etag else None


def content_version(protocol: str, info: Any) -> str | None:
    """`version_of`, else the modification time and size (a local file, an http server without ETags)."""
    version = version_of(protocol, info)
    if version:
        return version
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created")
    if isinstance(mtime, datetime):
        mtime = mtime.timestamp()
    if mtime is None:
        return None
    return f"{int(float(mtime) * 1e9)}:{int(info.get('size') or 0)}"


def metadata_of(protocol: str, info: Any) -> dict[str, str]:
    """The user metadata in a backend's info (S3 as `ObjectTier.stat` reads it, GCS, Azure)."""
    found = info.get("Metadata") or info.get("metadata") or {}
    if not isinstance(found, dict):
        return {}
    # adlfs marks every blob it writes with is_directory; that is adlfs's, not the writer's.
    return {str(k): str(v) for k, v in found.items() if not (protocol in AZURE_SCHEMES and k == "is_directory")}


async def set_metadata(fs: Any, protocol: str, path: str, metadata: dict[str, str]) -> None:
    """Attach ``metadata`` to an object an upload just wrote, where the upload could not (Azure)."""
    if protocol in AZURE_SCHEMES:
        container, blob, _ = fs.split_path(path)
        client = fs.service_client.get_blob_client(container, blob)
        async with client:
            await client.set_blob_metadata({"is_directory": "false", **metadata})


def past_the_end(exc: BaseException) -> bool:
    """Whether ``exc`` is a backend's 416: a range at or past the object's end (no bytes, not an error)."""
    return any(getattr(exc, name, None) == 416 for name in ("code", "status", "status_code"))


def _changed(where: str) -> OriginChangedError:
    return OriginChangedError.since_manifest(where)


async def pinned_cat(
    fs: Any, protocol: str, path: str, start: int, end: int | None, version: str, where: str
) -> bytes | None:
    """Read bytes ``[start, end)`` of ``version`` of ``path``; None where the backend cannot pin a read.

    Raises `OriginChangedError` when the object now has another version.
    """
    try:
        if protocol in ("gs", "gcs"):
            return await _gcs_generation(fs, path, start, end, version, where)
        if protocol in AZURE_SCHEMES:
            return await _azure_if_match(fs, path, start, end, version, where)
    except Exception as exc:
        if past_the_end(exc):
            return b""
        raise
    return None


async def _gcs_generation(fs: Any, path: str, start: int, end: int | None, version: str, where: str) -> bytes:
    try:
        data: bytes = await fs._cat_file(path, start=start or None, end=end, generation=version)
    except FileNotFoundError:
        # That generation is gone (rewritten, or deleted): say which.
        if await fs._exists(path):
            raise _changed(where) from None
        raise
    return data


async def _azure_if_match(fs: Any, path: str, start: int, end: int | None, version: str, where: str) -> bytes:
    from azure.core import MatchConditions
    from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError

    container, blob, _ = fs.split_path(path)
    client = fs.service_client.get_blob_client(container, blob)
    length = None if end is None else end - start
    try:
        async with client:
            downloader = await client.download_blob(
                offset=start, length=length, etag=f'"{version}"', match_condition=MatchConditions.IfNotModified
            )
            data: bytes = await downloader.readall()
    except ResourceModifiedError:
        raise _changed(where) from None
    except ResourceNotFoundError as exc:
        raise FileNotFoundError(where) from exc
    return data
