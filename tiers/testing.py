"""`TierTests`: the contract every `Tier` promises, as a pytest suite any tier can run.

As zarr ships ``zarr.testing.store`` and fsspec its abstract tests, this suite
ships with the package, so that a third-party tier (registered under the
``datacache.tiers`` entry-point group) proves itself with the same tests as
datacache's own. It needs pytest, imported here only: ``import
datacache.tiers`` never imports it.

Example
-------
::

    import pytest
    from datacache.tiers.testing import KeepsMetadataTests

    class TestMyTier(KeepsMetadataTests):
        def make_tier(self, request: pytest.FixtureRequest, tmp_path):
            return MyTier(tmp_path / "root")

        def temp_files(self, tier):  # optional: what a failed or cancelled put may leave behind
            return []

`TierTests` is the whole contract; `KeepsMetadataTests` adds the tests for
tiers whose `stat` returns the metadata a put attached.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pickle
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from datacache.tiers.base import ByteRange, Tier
from datacache.tiers.memory import MemoryTier
from datacache.tiers.testing_map import MapTests

from datacache.errors import InvalidKeyError, OriginChangedError, ShardNotFoundError

__all__ = [
    "BAD_KEYS",
    "Boom",
    "KeepsMetadataTests",
    "TierTests",
    "chunks_of",
    "failing_chunks",
    "keys_of",
    "put",
]

T = TypeVar("T")

BAD_KEYS = [
    "",
    "../escape",
    "a/../../escape",
    "a/../b",
    "/etc/passwd",
    "a//b",
    "a/./b",
    "./a",
    "a/",
    "a\\b",
    "a\x00b",
    ".x.0123456789abcdef0123456789abcdef.partial",
]


class Boom(RuntimeError):
    """Raised by a chunk iterator to abort a put."""


async def chunks_of(data: bytes, size: int = 7) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


async def failing_chunks(data: bytes, size: int = 7) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]
    raise Boom("the source failed half-way")


async def put(tier: Tier, key: str, data: bytes, **kwargs: Any) -> None:
    info = await tier.put(key, chunks_of(data), **kwargs)
    assert info.key == key
    assert info.size == len(data)


async def keys_of(tier: Tier, prefix: str = "") -> list[str]:
    return [info.key async for info in tier.list(prefix)]


class TierTests(MapTests):
    """The contract of `datacache.tiers.base.Tier` (`Tier.map`'s in `MapTests`); subclasses provide ``make_tier``."""

    @pytest.fixture
    def tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tier]:
        yield self.make_tier(request, tmp_path)

    def make_tier(self, request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
        raise NotImplementedError

    def temp_files(self, tier: Tier) -> list[str]:
        """Anything the tier left behind that is not a committed object."""
        return []

    def run(self, tier: Tier, body: Callable[[], Awaitable[T]]) -> T:
        async def main() -> T:
            try:
                return await body()
            finally:
                await tier.close()

        return asyncio.run(main())

    # -- stat / get ------------------------------------------------------------------------

    def test_stat_of_missing_key_is_none(self, tier: Tier) -> None:
        assert self.run(tier, lambda: tier.stat("nope/missing.tar")) is None

    def test_get_of_missing_key_raises_shard_not_found(self, tier: Tier) -> None:
        with pytest.raises(ShardNotFoundError) as caught:
            self.run(tier, lambda: tier.get("nope/missing.tar"))
        assert isinstance(caught.value, FileNotFoundError)

    def test_put_then_get_and_stat(self, tier: Tier) -> None:
        data = os.urandom(1000)

        async def body() -> None:
            await put(tier, "ds/a.tar", data)
            info = await tier.stat("ds/a.tar")
            assert info is not None
            assert info.size == 1000
            assert info.key == "ds/a.tar"
            assert await tier.get("ds/a.tar") == data

        self.run(tier, body)

    def test_empty_object(self, tier: Tier) -> None:
        async def body() -> None:
            await put(tier, "empty", b"")
            info = await tier.stat("empty")
            assert info is not None and info.size == 0
            assert await tier.get("empty") == b""
            assert await tier.get("empty", ByteRange(0, 10)) == b""

        self.run(tier, body)

    def test_ranged_get_edge_cases(self, tier: Tier) -> None:
        data = bytes(range(100))

        async def body() -> None:
            await put(tier, "r", data)
            assert await tier.get("r", ByteRange(10, 20)) == data[10:20]
            assert await tier.get("r", ByteRange(0, 1)) == data[:1]
            assert await tier.get("r", ByteRange(90)) == data[90:]
            assert await tier.get("r", ByteRange()) == data
            assert await tier.get("r", ByteRange(0, 100)) == data
            assert await tier.get("r", ByteRange(99, 100)) == data[99:]
            assert await tier.get("r", ByteRange(95, 500)) == data[95:]
            assert await tier.get("r", ByteRange(5, 5)) == b""
            assert await tier.get("r", ByteRange(0, 0)) == b""
            assert await tier.get("r", ByteRange(100)) == b""
            assert await tier.get("r", ByteRange(150, 200)) == b""

        self.run(tier, body)

    def test_stream_yields_bounded_chunks_in_order(self, tier: Tier) -> None:
        data = os.urandom(1000)

        async def body() -> None:
            await put(tier, "s", data)
            parts = [chunk async for chunk in tier.stream("s", chunk_size=128)]
            assert b"".join(parts) == data
            assert all(0 < len(p) <= 128 for p in parts)
            ranged = [chunk async for chunk in tier.stream("s", chunk_size=100, byte_range=ByteRange(250, 777))]
            assert b"".join(ranged) == data[250:777]

        self.run(tier, body)

    def test_stream_of_missing_key_raises(self, tier: Tier) -> None:
        async def body() -> None:
            async for _ in tier.stream("missing"):
                pass

        with pytest.raises(ShardNotFoundError):
            self.run(tier, body)

    def test_read_into_fills_the_buffer_in_order_and_hashes(self, tier: Tier) -> None:
        # Under 1 MiB: the GCS and Azure clients put a larger body as raw bytes, which aiohttp warns of.
        data = os.urandom((1 << 20) - 4096)

        async def body() -> None:
            # Odd-sized chunks, but not 7 bytes: 1 MiB of those is 150k puts and ~15 s a tier.
            info = await tier.put("ri", chunks_of(data, (1 << 16) + 7))
            assert info.size == len(data)
            buffer = bytearray(len(data))
            hasher = hashlib.sha256()
            regions = [bytes(region) async for region in tier.read_into("ri", memoryview(buffer), hasher=hasher)]
            assert b"".join(regions) == data
            assert all(regions)
            assert bytes(buffer) == data
            assert hasher.digest() == hashlib.sha256(data).digest()
            roomy = bytearray(len(data) + 10)
            async for _ in tier.read_into("ri", memoryview(roomy)):
                pass
            assert bytes(roomy[: len(data)]) == data
            await put(tier, "empty", b"")
            assert [r async for r in tier.read_into("empty", memoryview(bytearray(0)))] == []

        self.run(tier, body)

    def test_read_into_a_buffer_too_small_raises_buffer_error(self, tier: Tier) -> None:
        async def body() -> None:
            await put(tier, "big", os.urandom(1000))
            async for _ in tier.read_into("big", memoryview(bytearray(999))):
                pass

        with pytest.raises(BufferError):
            self.run(tier, body)

    def test_read_into_of_missing_key_raises(self, tier: Tier) -> None:
        async def body() -> None:
            async for _ in tier.read_into("missing", memoryview(bytearray(10))):
                pass

        with pytest.raises(ShardNotFoundError):
            self.run(tier, body)

    def test_read_into_is_conditional_on_the_version(self, tier: Tier) -> None:
        async def body() -> None:
            await put(tier, "v", b"first version")
            info = await tier.stat("v")
            assert info is not None and info.version is not None
            await put(tier, "v", b"the second, longer version")
            async for _ in tier.read_into("v", memoryview(bytearray(100)), version=info.version):
                pass

        with pytest.raises(OriginChangedError):
            self.run(tier, body)

    def test_conditional_get_detects_a_changed_object(self, tier: Tier) -> None:
        async def body() -> None:
            await put(tier, "v", b"first version")
            info = await tier.stat("v")
            assert info is not None and info.version is not None
            assert await tier.get("v", version=info.version) == b"first version"
            # A different size, so that even a coarse mtime gives a new version.
            await put(tier, "v", b"the second, longer version")
            with pytest.raises(OriginChangedError):
                await tier.get("v", version=info.version)
            with pytest.raises(OriginChangedError):
                await tier.get("v", ByteRange(0, 3), version=info.version)

        self.run(tier, body)

    def test_byte_range_validation(self) -> None:
        with pytest.raises(ValueError, match="invalid byte range"):
            ByteRange(-1, 5)
        with pytest.raises(ValueError, match="invalid byte range"):
            ByteRange(10, 5)
        assert ByteRange(3, 10).length(5) == 2
        assert ByteRange(7).length(5) == 0
        assert ByteRange().length(5) == 5

    # -- put ---------------------------------------------------------------------------------

    def test_put_overwrites(self, tier: Tier) -> None:
        async def body() -> None:
            await put(tier, "o", b"old contents")
            await put(tier, "o", b"new")
            assert await tier.get("o") == b"new"
            assert await keys_of(tier) == ["o"]

        self.run(tier, body)

    def test_put_with_memoryview_chunks(self, tier: Tier) -> None:
        data = os.urandom(300)

        async def views() -> AsyncIterator[memoryview]:
            view = memoryview(data)
            for start in range(0, 300, 64):
                yield view[start : start + 64]

        async def body() -> None:
            await tier.put("mv", views())
            assert await tier.get("mv") == data

        self.run(tier, body)

    def test_failed_put_leaves_nothing_visible(self, tier: Tier) -> None:
        async def body() -> None:
            with pytest.raises(Boom):
                await tier.put("ds/half.tar", failing_chunks(os.urandom(500)))
            assert await tier.stat("ds/half.tar") is None
            with pytest.raises(ShardNotFoundError):
                await tier.get("ds/half.tar")
            assert await keys_of(tier) == []

        self.run(tier, body)
        assert self.temp_files(tier) == []

    def test_failed_overwrite_keeps_the_old_object(self, tier: Tier) -> None:
        async def body() -> None:
            await put(tier, "keep", b"old and whole")
            with pytest.raises(Boom):
                await tier.put("keep", failing_chunks(os.urandom(500)))
            assert await tier.get("keep") == b"old and whole"

        self.run(tier, body)
        assert self.temp_files(tier) == []

    def test_cancelled_put_leaves_nothing(self, tier: Tier) -> None:
        started = asyncio.Event

        async def body() -> None:
            gate = started()
            never = asyncio.Event()

            async def stalled() -> AsyncIterator[bytes]:
                yield b"x" * 100
                gate.set()
                await never.wait()
                yield b"y"

            task = asyncio.create_task(tier.put("cancelled", stalled()))
            await gate.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await tier.stat("cancelled") is None

        self.run(tier, body)
        assert self.temp_files(tier) == []

    # -- delete / list / usage -----------------------------------------------------------------

    def test_delete(self, tier: Tier) -> None:
        async def body() -> None:
            await put(tier, "d/x", b"123")
            assert await tier.delete("d/x") is True
            assert await tier.stat("d/x") is None
            assert await tier.delete("d/x") is False
            assert await keys_of(tier) == []

        self.run(tier, body)

    def test_list_by_prefix_in_key_order(self, tier: Tier) -> None:
        keys = ["b/2", "a/10", "a/1", "ab", "a/2", "a/sub/z", "c"]

        async def body() -> None:
            for key in keys:
                await put(tier, key, key.encode())
            assert await keys_of(tier) == sorted(keys)
            assert await keys_of(tier, "a/") == ["a/1", "a/10", "a/2", "a/sub/z"]
            assert await keys_of(tier, "a") == ["a/1", "a/10", "a/2", "a/sub/z", "ab"]
            assert await keys_of(tier, "a/sub/") == ["a/sub/z"]
            assert await keys_of(tier, "zzz") == []
            sizes = {info.key: info.size async for info in tier.list()}
            assert sizes == {key: len(key) for key in keys}

        self.run(tier, body)

    def test_list_and_stat_see_later_writes(self, tier: Tier) -> None:
        """No stale listing: what a tier lists or stats follows its own puts and deletes."""

        async def body() -> None:
            await put(tier, "l/a", b"1")
            assert await keys_of(tier) == ["l/a"]
            first = await tier.stat("l/a")
            await put(tier, "l/b", b"22")
            await put(tier, "l/a", b"333")
            assert await keys_of(tier) == ["l/a", "l/b"]
            assert await keys_of(tier, "l/") == ["l/a", "l/b"]
            again = await tier.stat("l/a")
            assert again is not None and again.size == 3
            assert first is not None and again.version != first.version
            assert await tier.delete("l/b")
            assert await keys_of(tier) == ["l/a"]
            assert await tier.stat("l/b") is None

        self.run(tier, body)

    def test_list_of_empty_tier(self, tier: Tier) -> None:
        assert self.run(tier, lambda: keys_of(tier)) == []

    def test_usage(self, tier: Tier) -> None:
        async def body() -> None:
            before = await tier.usage()
            assert before.used_bytes == 0 and before.object_count == 0
            await put(tier, "u/1", b"x" * 100)
            await put(tier, "u/2", b"y" * 50)
            usage = await tier.usage()
            assert usage.used_bytes == 150
            assert usage.object_count == 2
            assert usage.capacity_bytes == tier.capacity

        self.run(tier, body)

    # -- keys --------------------------------------------------------------------------------

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_invalid_keys_are_rejected(self, tier: Tier, key: str) -> None:
        async def body() -> None:
            with pytest.raises(InvalidKeyError):
                await tier.stat(key)
            with pytest.raises(InvalidKeyError):
                await tier.get(key)
            with pytest.raises(InvalidKeyError):
                await tier.put(key, chunks_of(b"evil"))
            if tier.writable:
                with pytest.raises(InvalidKeyError):
                    await tier.delete(key)

        self.run(tier, body)
        assert self.temp_files(tier) == []

    # -- pickling ----------------------------------------------------------------------------

    def test_pickle_round_trip_before_use(self, tier: Tier) -> None:
        clone = pickle.loads(pickle.dumps(tier))  # noqa: S301 - our own object
        assert type(clone) is type(tier)
        assert clone.url == tier.url
        assert clone.capacity == tier.capacity

    def test_pickled_after_use_carries_no_client(self, tier: Tier) -> None:
        async def body() -> None:
            await put(tier, "p/1", b"pickled")
            assert await tier.get("p/1") == b"pickled"

        self.run(tier, body)  # closes the tier's clients afterwards, as a user would...

        async def use_again() -> None:
            assert await tier.stat("p/1") is not None

        # ...but a tier used and *not* closed must pickle without its client too.
        async def main() -> bytes:
            await use_again()
            payload = pickle.dumps(tier)
            await tier.close()
            return payload

        payload = asyncio.run(main())
        clone = pickle.loads(payload)  # noqa: S301 - our own object
        for name, value in vars(clone).items():
            if isinstance(value, type):
                continue
            module = type(value).__module__.split(".")[0]
            assert module not in {
                "aiobotocore",
                "aiohttp",
                "botocore",
                "s3fs",
                "fsspec",
                "asyncio",
                "sqlite3",
            }, f"{type(tier).__name__}.{name} pickled a {type(value)}"
        assert clone.stats().requests == 0
        if not isinstance(tier, MemoryTier):
            assert self.run(clone, lambda: clone.get("p/1")) == b"pickled"


class KeepsMetadataTests(TierTests):
    """For tiers whose `stat` returns the metadata a put attached (directory and memory tiers).

    Object stores keep S3 user metadata only for single-part uploads, so
    datacache never relies on it there and does not test it.
    """

    def test_metadata_is_kept(self, tier: Tier) -> None:

        async def body() -> None:
            await tier.put("m", chunks_of(b"abc"), metadata={"checksum": "xxh3_64:1", "version": "v1"})
            info = await tier.stat("m")
            assert info is not None
            assert info.metadata["checksum"] == "xxh3_64:1"
            assert info.metadata["version"] == "v1"

        self.run(tier, body)

    def test_metadata_completed_while_streaming(self, tier: Tier) -> None:
        """`Tier.put` reads the metadata once the chunks are exhausted."""
        metadata: dict[str, str] = {}

        async def produce() -> AsyncIterator[bytes]:
            yield b"abc"
            metadata["checksum"] = "learned-at-the-end"

        async def body() -> None:
            await tier.put("late", produce(), metadata=metadata)
            info = await tier.stat("late")
            assert info is not None and info.metadata.get("checksum") == "learned-at-the-end"

        self.run(tier, body)
