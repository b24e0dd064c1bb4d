"""The contract of `Tier.land` for tiers that land objects (their files mapped for writing).

Mixed into a `datacache.tiers.testing.TierTests` subclass::

    class TestLocalTier(LandingTests, DirectoryTierTests): ...
"""

from __future__ import annotations

import os

import pytest
from datacache.tiers.base import Tier
from datacache.tiers.testing import TierTests, keys_of, put

__all__ = ["LandingTests"]


def _expect(holds: bool, what: str) -> None:
    """Fail the contract test unless ``holds`` (a bare assert in a shipped module vanishes under -O)."""
    if not holds:
        pytest.fail(what)


class LandingTests(TierTests):
    """`Tier.land` and `Tier.put_landed`: the object is visible whole only once put; an abandoned one leaves nothing."""

    def test_a_landed_object_is_visible_whole_only_once_put(self, tier: Tier) -> None:
        data = os.urandom(3000)

        async def body() -> None:
            landing = await tier.land("ds/landed.tar", len(data))
            if landing is None:
                pytest.fail(f"{type(tier).__name__} lands objects, yet land() gave None")
            landing.buffer[: len(data)] = data
            _expect(await tier.stat("ds/landed.tar") is None, "nothing is visible before it is put")
            info = await tier.put_landed("ds/landed.tar", landing, metadata={"checksum": "xxh3_64:2"})
            _expect(info.size == len(data), f"put_landed says {info.size} bytes, not {len(data)}")
            _expect(await tier.get("ds/landed.tar") == data, "the landed object reads back whole")
            stat = await tier.stat("ds/landed.tar")
            _expect(stat is not None and stat.metadata.get("checksum") == "xxh3_64:2", "its metadata is kept")

        self.run(tier, body)
        _expect(self.temp_files(tier) == [], f"temporary files left: {self.temp_files(tier)}")

    def test_an_abandoned_landing_leaves_nothing_and_keeps_the_old_object(self, tier: Tier) -> None:
        async def body() -> None:
            await put(tier, "keep", b"old and whole")
            landing = await tier.land("keep", 100)
            if landing is None:
                pytest.fail(f"{type(tier).__name__} lands objects, yet land() gave None")
            view = memoryview(landing.buffer)
            view[:3] = b"new"
            await landing.abandon()
            _expect(bytes(view[:3]) == b"new", "a view still held stays readable")
            view.release()
            _expect(await tier.get("keep") == b"old and whole", "the old object is kept whole")
            _expect(await keys_of(tier) == ["keep"], "nothing but the old object is listed")

        self.run(tier, body)
        _expect(self.temp_files(tier) == [], f"temporary files left: {self.temp_files(tier)}")

    def test_an_empty_object_is_not_landed(self, tier: Tier) -> None:
        _expect(self.run(tier, lambda: tier.land("empty", 0)) is None, "an empty object is not landed")
