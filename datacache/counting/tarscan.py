"""Counting the samples of a tar shard from its headers alone: from the origin's stream or from a cached copy.

Nothing is kept but the headers (`TarScanner`), so memory stays at one chunk
whatever the shard's size.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from datacache.counting.tarindex import TarScanner, group_samples, scan_tar
from datacache.errors import ShardReadError
from datacache.manifest import Shard
from datacache.tiers import Tier, open_origin

__all__ = ["count_batch_sync", "count_tar_bytes", "count_tar_file", "count_tar_samples"]


def _samples(scanner: TarScanner, seen: int, shard: Shard, where: str) -> int:
    if seen != shard.size:
        raise ShardReadError(f"{where}: read {seen} bytes, the manifest says {shard.size}")
    try:
        return len(group_samples(scanner.finish()))
    except ValueError as exc:
        raise ShardReadError(f"{where}: {exc}") from None


async def count_tar_samples(origin: Tier, shard: Shard, *, where: str) -> int:
    """Samples in a tar shard, from one streaming read of the origin; nothing is kept but headers."""
    scanner = TarScanner(where=where)
    seen = 0
    async for chunk in origin.stream(shard.key, version=shard.version):
        scanner.feed(chunk)
        seen += len(chunk)
    return _samples(scanner, seen, shard, where)


def count_tar_bytes(buffer: bytes | bytearray | memoryview, shard: Shard, *, where: str) -> int:
    """Samples in a tar shard's bytes (a copy in memory, or a mapped file)."""
    if len(buffer) != shard.size:
        raise ShardReadError(f"{where}: the cached copy holds {len(buffer)} bytes, the manifest says {shard.size}")
    try:
        return len(group_samples(scan_tar(buffer, where=where)))
    except ValueError as exc:
        raise ShardReadError(f"{where}: {exc}") from None


def count_tar_file(path: Path, shard: Shard, *, where: str) -> int:
    """Samples in a cached copy of a tar shard (blocking: run it in a thread); only header pages are read."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return count_tar_bytes(b"", shard, where=where)
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            return count_tar_bytes(view, shard, where=where)


def count_batch_sync(
    number: int, url: str, storage_options: Mapping[str, Any], shards: Sequence[tuple[str, int, str | None]], where: str
) -> tuple[int, dict[str, int | str]]:
    """One batch as an engine task: each shard's sample count, or why it could not be counted."""

    async def run() -> dict[str, int | str]:
        origin = open_origin(url, storage_options=storage_options)
        counts: dict[str, int | str] = {}
        try:
            for key, size, version in shards:
                try:
                    counts[key] = await count_tar_samples(
                        origin, Shard(key, size, version), where=f"{where}: shard {key!r}"
                    )
                except ShardReadError as exc:
                    counts[key] = str(exc)
        finally:
            await origin.close()
        return counts

    return number, asyncio.run(run())
