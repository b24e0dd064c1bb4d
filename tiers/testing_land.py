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


class LandingTests(TierTests):
    """`Tier.land` and `Tier.put_landed`: the object is visible whole only once put; an abandoned one leaves nothing."""

    def test_a_landed_object_is_visible_whole_only_once_put(self, tier: Tier) -> None:
        data = os.urandom(3000)

        async def body() -> None:
            landing = await tier.land("ds/landed.tar", len(data))
            if landing is None:
                pytest.fail(f"{type(tier).__name__} lands objects, yet land() gave None")
            landing.buffer[: len(data)] = data
            assert await tier.stat("ds/landed.tar") is None, "nothing is visible before it is put"
            info = await tier.put_landed("ds/landed.tar", landing, metadata={"checksum": "xxh3_64:2"})
            assert info.size == len(data)
            assert await tier.get("ds/landed.tar") == data
            stat = await tier.stat("ds/landed.tar")
            assert stat is not None and stat.metadata.get("checksum") == "xxh3_64:2"

        self.run(tier, body)
        assert self.temp_files(tier) == []

    def test_an_abandoned_landing_leaves_nothing_and_keeps_the_old_object(self, tier: Tier) -> None:
        async def body() -> None:
            await put(tier, "keep", b"old and whole")
            landing = await tier.land("keep", 100)
            assert landing is not None
            view = memoryview(landing.buffer)
            view[:3] = b"new"
            await landing.abandon()
            assert bytes(view[:3]) == b"new", "a view still held stays readable"
            view.release()
            assert await tier.get("keep") == b"old and whole"
            assert await keys_of(tier) == ["keep"]

        self.run(tier, body)
        assert self.temp_files(tier) == []

    def test_an_empty_object_is_not_landed(self, tier: Tier) -> None:
        assert self.run(tier, lambda: tier.land("empty", 0)) is None
