"""The contract of `Tier.map`, part of `datacache.tiers.testing.TierTests` (every tier runs it).

A tier that is `mappable` gives an object's bytes in place; one that is not says so
(`NotImplementedError`). Where a tier's objects are files (`has_local_paths`), whatever is put
in a copy's place that is not a regular file (a symlink, a FIFO, a directory) is refused, and
refused at once: a FIFO opened for reading without ``O_NONBLOCK`` waits for a writer forever,
so each map runs in a thread with a deadline and a hang fails the test instead of the suite.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from datacache.tiers.base import Tier

from datacache.errors import InvalidKeyError, OriginChangedError, ShardNotFoundError

__all__ = ["MAP_DEADLINE", "MapTests", "map_within"]

T = TypeVar("T")

MAP_DEADLINE = 30.0
"""Seconds a map may take before it counts as hung (generous: the suite runs on busy machines)."""


def map_within(tier: Tier, key: str, deadline: float = MAP_DEADLINE) -> Any:
    """``tier.map(key)`` in a thread: what it returned, or the exception it raised; fails if it hangs."""
    outcome: list[Any] = []

    def attempt() -> None:
        try:
            outcome.append(tier.map(key))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=attempt, name=f"map {key}", daemon=True)  # a hung one must not block exit
    thread.start()
    thread.join(deadline)
    if thread.is_alive():
        pytest.fail(f"{type(tier).__name__}.map({key!r}) still waiting after {deadline} s (a FIFO opened blocking?)")
    return outcome[0]


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


class MapTests:
    """`Tier.map`; mixed into `TierTests`, whose ``tier`` fixture and ``run`` it uses."""

    run: Callable[[Tier, Callable[[], Awaitable[Any]]], Any]

    def _put(self, tier: Tier, key: str, data: bytes) -> None:
        self.run(tier, lambda: tier.put(key, _chunks(data)))

    def test_map_gives_the_bytes_read_only_or_says_the_tier_cannot(self, tier: Tier) -> None:
        data = os.urandom(5000)
        self._put(tier, "ds/mapped.bin", data)
        if not tier.mappable:
            with pytest.raises(NotImplementedError, match=type(tier).__name__):
                tier.map("ds/mapped.bin")
            return
        mapped = tier.map("ds/mapped.bin")
        try:
            if bytes(mapped) != data:
                pytest.fail(f"{type(tier).__name__}.map gave other bytes than were put")
            with pytest.raises(TypeError):
                mapped[0] = 0  # type: ignore[index]
        finally:
            if hasattr(mapped, "close"):
                mapped.close()
        self._put(tier, "ds/empty.bin", b"")
        if len(tier.map("ds/empty.bin")) != 0:
            pytest.fail(f"{type(tier).__name__}.map of an empty object is not empty")

    def test_map_of_a_missing_key_an_invalid_key_or_another_version_is_refused(self, tier: Tier) -> None:
        if not tier.mappable:
            pytest.skip(f"{type(tier).__name__} does not map")
        with pytest.raises(ShardNotFoundError):
            tier.map("ds/absent.bin")
        with pytest.raises(InvalidKeyError):
            tier.map("../escape")
        self._put(tier, "ds/versioned.bin", b"first")
        with pytest.raises(OriginChangedError):
            tier.map("ds/versioned.bin", version="not-its-version")

    @pytest.mark.parametrize("impostor", ["symlink", "fifo", "directory"])
    def test_what_is_not_a_regular_file_in_a_copys_place_is_refused_at_once(
        self, tier: Tier, tmp_path: Path, impostor: str
    ) -> None:
        if not (tier.mappable and tier.has_local_paths):
            pytest.skip(f"{type(tier).__name__} holds no files of its own")
        self._put(tier, "ds/swapped.bin", b"the copy")
        secret = tmp_path / "someone-elses-file"
        secret.write_bytes(b"not the copy")
        place = tier.path("ds/swapped.bin")
        place.unlink()
        if impostor == "symlink":
            place.symlink_to(secret)
        elif impostor == "fifo":
            os.mkfifo(place, 0o600)
        else:
            place.mkdir()
        found = map_within(tier, "ds/swapped.bin")
        if not isinstance(found, ShardNotFoundError):
            pytest.fail(f"a {impostor} in the copy's place gave {found!r}")

    def test_a_link_on_the_way_to_a_copy_is_not_followed(self, tier: Tier, tmp_path: Path) -> None:
        if not (tier.mappable and tier.has_local_paths):
            pytest.skip(f"{type(tier).__name__} holds no files of its own")
        self._put(tier, "ds/inner/copy.bin", b"the copy")
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "copy.bin").write_bytes(b"not the copy")
        directory = tier.path("ds/inner/copy.bin").parent
        shutil.rmtree(directory)
        directory.symlink_to(elsewhere, target_is_directory=True)
        found = map_within(tier, "ds/inner/copy.bin")
        if not isinstance(found, InvalidKeyError | ShardNotFoundError):
            pytest.fail(f"a linked directory gave {found!r}")
