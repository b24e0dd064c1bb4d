"""One read verb for every `ShardAccess`: verify a whole-shard read, and never serve a bad cached copy.

The stager and the daemon's client read from different places (the
stager's tiers, the files the daemon names), but what a reader gets must be
the same: a whole shard checked against its size and checksum, and a cached
copy found wrong dropped (reported) and the shard read again from below,
once. Only the origin's own bad bytes are an error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from datacache.checksum import copy_problem
from datacache.errors import ChecksumMismatchError
from datacache.manifest import Shard
from datacache.staging.types import ORIGIN, Location
from datacache.tiers import ByteRange

__all__ = ["read_verified"]


def _problem(data: bytes, location: Location, byte_range: ByteRange | None) -> str:
    """What is wrong with ``data`` read whole from ``location`` (empty when nothing is, or a range)."""
    if byte_range is not None and (byte_range.start != 0 or byte_range.end is not None):
        return ""
    shard: Shard = location.shard
    return copy_problem(data, shard.size, location.checksum)


async def read_verified(
    dataset: str,
    byte_range: ByteRange | None,
    *,
    locate: Callable[[], Awaitable[Location]],
    fetch: Callable[[Location], Awaitable[bytes]],
    report_corrupt: Callable[[Location], Awaitable[None]],
) -> bytes:
    """Read from where ``locate`` says; a bad cached copy is reported and the read done again once.

    Raises `ChecksumMismatchError` naming the dataset, shard and tier when
    the bytes are still wrong (the origin's own, or a second bad copy).
    """
    location = await locate()
    data = await fetch(location)
    problem = _problem(data, location, byte_range)
    if problem and location.tier != ORIGIN:
        await report_corrupt(location)
        location = await locate()
        data = await fetch(location)
        problem = _problem(data, location, byte_range)
    if problem:
        raise ChecksumMismatchError(
            f"dataset {dataset}: shard {location.shard.key!r} from the {location.tier} {problem}"
        )
    return data
