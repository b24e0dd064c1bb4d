"""One rule checks a shard's bytes against its manifest entry (`datacache.checksum.copy_problem`).

The stager's verified read (`staging.reading.read_verified`) and the loaders' mapped copies
(`loaders.reading.units.load_verified`) both ask it: the size first, then the checksum.
"""

from __future__ import annotations

import asyncio

import pytest

from datacache.checksum import checksum_of, copy_problem, new_hasher
from datacache.errors import ChecksumMismatchError
from datacache.manifest import Shard
from datacache.staging.reading import read_verified
from datacache.staging.types import Location


def _checksum(data: bytes) -> str:
    hasher = new_hasher()
    hasher.update(data)
    return checksum_of(hasher)


def test_a_copy_is_checked_for_its_size_then_its_checksum() -> None:
    data = b"0123456789"
    assert copy_problem(data, 10, _checksum(data)) == ""
    assert copy_problem(data, 9, _checksum(data)) == "has 10 bytes, the manifest says 9"
    assert copy_problem(data, 10, _checksum(b"9876543210")) == "does not match its checksum"
    assert copy_problem(data, 10, _checksum(b"9876543210"), hashed=False) == "", "unhashed: the size only"
    assert copy_problem(data, 10, None) == "", "no checksum in the manifest: the size only"


def test_the_stagers_verified_read_names_the_problem_the_rule_finds() -> None:
    data = b"0123456789"
    shard = Shard(key="a.tar", size=10, version="1", checksum=_checksum(b"other"))
    origin = Location(shard=shard, tier="origin", path=None, checksum=shard.checksum)

    async def locate() -> Location:
        return origin

    async def fetch(location: Location) -> bytes:
        return data

    async def report(location: Location) -> None:
        raise AssertionError("the origin's own bytes are not reported as a bad copy")

    with pytest.raises(ChecksumMismatchError, match=r"shard 'a\.tar' from the origin does not match its checksum"):
        asyncio.run(read_verified("d", None, locate=locate, fetch=fetch, report_corrupt=report))
