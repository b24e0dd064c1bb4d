"""`ShardAccessTests`: one contract suite for every `ShardAccess` implementation.

`Stager` (in-process), `DaemonClient` (the node's daemon) and
`FailoverAccess` (the daemon, else a stager) answer the same verbs, and a
reader must not be able to tell which one it has: the same bytes, the same
errors, the same repair of a corrupt cached copy. As zarr ships
``zarr.testing.store`` and fsspec its abstract tests, this suite ships with
the package: subclass it, say how to build the access and its settings, and
pytest runs every contract test against it.

Example
-------
::

    class TestMyAccess(ShardAccessTests):
        @pytest.fixture
        def node(self, tmp_path):
            return load_settings(overrides={"local_dir": str(tmp_path / "local")})

        def make_access(self, settings):
            return MyAccess(settings)

Each test builds a fresh origin directory of a few random shards, so a
subclass may share one node (one daemon, say) among all its tests.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

from datacache.access import ShardAccess
from datacache.checksum import checksum_of, new_hasher
from datacache.config import Settings
from datacache.errors import ConfigError, ShardNotFoundError
from datacache.staging import DatasetHandle, Location, ReaderProgress
from datacache.tiers import ByteRange

__all__ = ["Origin", "ShardAccessTests"]

T = TypeVar("T")


@dataclass(frozen=True)
class Origin:
    """A dataset made for one test: its URL and every shard's bytes."""

    url: str
    shards: dict[str, bytes]

    @property
    def keys(self) -> list[str]:
        return sorted(self.shards)


def _checksum(data: bytes) -> str:
    hasher = new_hasher()
    hasher.update(data)
    return checksum_of(hasher)


def _corrupt(path: Path) -> None:
    """Flip the bytes of a cached copy in place, keeping its size (so only a checksum can tell)."""
    os.chmod(path, 0o600)
    with path.open("r+b") as file:
        head = file.read(64)
        file.seek(0)
        file.write(bytes(b ^ 0xFF for b in head))


async def _stage_and_corrupt(access: ShardAccess, url: str, key: str) -> tuple[DatasetHandle, Location]:
    handle = await access.open(url)
    location = await access.ensure(handle, key)
    if location.path is None:
        raise AssertionError(f"ensure left {key} on the {location.tier} tier")
    _corrupt(location.path)
    return handle, location


class ShardAccessTests:
    """The contract of `ShardAccess`; subclass with a ``node`` fixture and `make_access`."""

    shard_count = 3
    shard_size = 48_000
    deadline = 30.0
    """Seconds a background verb (prefetch) gets to show its effect."""

    @pytest.fixture
    def node(self) -> Settings:
        """The settings the access works with (its local tier, its daemon socket)."""
        raise NotImplementedError("a ShardAccessTests subclass provides the node fixture")

    def make_access(self, settings: Settings) -> ShardAccess:
        """A fresh access on ``settings``; the suite closes it."""
        raise NotImplementedError("a ShardAccessTests subclass implements make_access")

    @pytest.fixture
    def origin(self, tmp_path: Path) -> Origin:
        rng = random.Random(str(tmp_path))
        directory = tmp_path / f"origin-{uuid.uuid4().hex[:8]}"
        directory.mkdir()
        shards = {f"shard-{i:04d}.tar": rng.randbytes(self.shard_size) for i in range(self.shard_count)}
        for key, data in shards.items():
            (directory / key).write_bytes(data)
        return Origin(str(directory), shards)

    def run(self, settings: Settings, body: Callable[[ShardAccess], Awaitable[T]]) -> T:
        """Run ``body(access)`` in a fresh event loop, closing the access afterwards."""

        async def main() -> T:
            access = self.make_access(settings)
            try:
                return await body(access)
            finally:
                await access.close()

        return asyncio.run(main())

    # -- open ---------------------------------------------------------------------------

    def test_open_lists_every_shard(self, node: Settings, origin: Origin) -> None:
        async def body(access: ShardAccess) -> tuple[DatasetHandle, DatasetHandle]:
            return await access.open(origin.url), await access.open(origin.url)

        first, again = self.run(node, body)
        assert sorted(s.key for s in first.manifest.shards) == origin.keys
        assert {s.key: s.size for s in first.manifest.shards} == {k: len(v) for k, v in origin.shards.items()}
        assert again.id == first.id

    def test_open_of_nothing_raises_shard_not_found(self, node: Settings, tmp_path: Path) -> None:
        missing = tmp_path / "no-such-dataset"
        missing.mkdir()
        with pytest.raises(ShardNotFoundError):
            self.run(node, lambda access: access.open(str(missing)))

    # -- ensure, locate, read -----------------------------------------------------------

    def test_locate_moves_nothing(self, node: Settings, origin: Origin) -> None:
        async def body(access: ShardAccess) -> Location:
            handle = await access.open(origin.url)
            return await access.locate(handle, origin.keys[0])

        location = self.run(node, body)
        assert (location.tier, location.path) == ("origin", None)
        assert location.shard.key == origin.keys[0]

    def test_ensure_makes_a_shard_local_and_says_where(self, node: Settings, origin: Origin) -> None:
        key = origin.keys[1]

        async def body(access: ShardAccess) -> tuple[Location, Location]:
            handle = await access.open(origin.url)
            return await access.ensure(handle, key), await access.locate(handle, key)

        ensured, located = self.run(node, body)
        assert ensured.tier == located.tier == "local"
        assert ensured.path is not None and ensured.path == located.path
        assert ensured.path.read_bytes() == origin.shards[key]
        assert ensured.checksum == located.checksum == _checksum(origin.shards[key])

    def test_note_progress_says_where_the_shards_asked_for_are(self, node: Settings, origin: Origin) -> None:
        staged, other = origin.keys[0], origin.keys[1]

        async def body(access: ShardAccess) -> tuple[list[Location], list[Location]]:
            handle = await access.open(origin.url)
            await access.ensure(handle, staged)
            progress = ReaderProgress("0.0", 0, 0, (staged,))
            located = await access.note_progress(handle, progress, locate=(staged, other))
            silent = await access.note_progress(handle, ReaderProgress("0.0", 0, 1, (other,)))
            with pytest.raises(ShardNotFoundError, match="no-such-shard"):
                await access.note_progress(handle, ReaderProgress("0.0", 0, 1, ()), locate=("no-such-shard.tar",))
            await access.note_progress(handle, ReaderProgress("0.0", 0, 2, ()))
            return located, silent

        located, silent = self.run(node, body)
        assert [(loc.shard.key, loc.tier) for loc in located] == [(staged, "local"), (other, "origin")]
        assert located[0].path is not None and located[0].path.read_bytes() == origin.shards[staged]
        assert located[0].checksum == _checksum(origin.shards[staged])
        assert (located[1].path, silent) == (None, [])

    def test_read_whole_and_ranged_from_any_tier(self, node: Settings, origin: Origin) -> None:
        first, second = origin.keys[0], origin.keys[1]

        async def body(access: ShardAccess) -> list[bytes]:
            handle = await access.open(origin.url)
            from_origin = [await access.read(handle, first), await access.read(handle, first, ByteRange(10, 1000))]
            await access.ensure(handle, second)
            return [*from_origin, await access.read(handle, second), await access.read(handle, second, ByteRange(7))]

        whole, ranged, local_whole, local_tail = self.run(node, body)
        assert whole == origin.shards[first] and ranged == origin.shards[first][10:1000]
        assert local_whole == origin.shards[second] and local_tail == origin.shards[second][7:]

    def test_an_unknown_shard_raises_shard_not_found_naming_it(self, node: Settings, origin: Origin) -> None:
        async def body(access: ShardAccess) -> None:
            handle = await access.open(origin.url)
            for verb in (access.ensure, access.locate, access.read):
                with pytest.raises(ShardNotFoundError, match="no-such-shard"):
                    await verb(handle, "no-such-shard.tar")

        self.run(node, body)

    def test_ensure_on_an_unconfigured_shared_tier_is_a_config_error(self, node: Settings, origin: Origin) -> None:
        if node.shared_dir is not None:
            pytest.skip("this node has a shared tier")

        async def body(access: ShardAccess) -> None:
            handle = await access.open(origin.url)
            with pytest.raises(ConfigError, match="shared"):
                await access.ensure(handle, origin.keys[0], tier="shared")

        self.run(node, body)

    # -- corrupt copies -----------------------------------------------------------------

    def test_a_corrupt_cached_copy_is_never_served_and_is_replaced(self, node: Settings, origin: Origin) -> None:
        key = origin.keys[0]

        async def body(access: ShardAccess) -> tuple[bytes, Location]:
            handle, _ = await _stage_and_corrupt(access, origin.url, key)
            data = await access.read(handle, key)
            return data, await access.ensure(handle, key)

        data, restaged = self.run(node, body)
        assert data == origin.shards[key], "the reader got the origin's bytes, not the corrupt copy's"
        assert restaged.tier == "local" and restaged.path is not None
        assert restaged.path.read_bytes() == origin.shards[key], "the corrupt copy was dropped and staged again"

    def test_report_corrupt_drops_the_copy(self, node: Settings, origin: Origin) -> None:
        key = origin.keys[2]

        async def body(access: ShardAccess) -> tuple[Location, Location]:
            handle, location = await _stage_and_corrupt(access, origin.url, key)
            await access.report_corrupt(handle, location)
            return await access.locate(handle, key), await access.ensure(handle, key)

        located, restaged = self.run(node, body)
        assert located.tier == "origin", "a reported copy is no longer offered"
        assert restaged.path is not None and restaged.path.read_bytes() == origin.shards[key]

    # -- prefetch and the future order --------------------------------------------------

    def test_prefetch_stages_in_the_background(self, node: Settings, origin: Origin) -> None:
        async def body(access: ShardAccess) -> list[str]:
            handle = await access.open(origin.url)
            await access.set_future_order(handle, origin.keys)
            await access.prefetch(handle, origin.keys)
            give_up = time.monotonic() + self.deadline
            while True:
                tiers = [(await access.locate(handle, key)).tier for key in origin.keys]
                if tiers == ["local"] * len(origin.keys) or time.monotonic() > give_up:
                    return tiers
                await asyncio.sleep(0.02)  # sleep-ok: spaces the polls; the deadline ends the wait

        assert self.run(node, body) == ["local"] * len(origin.keys)

    # -- the object itself --------------------------------------------------------------

    def test_mode_retries_and_pickling(self, node: Settings, origin: Origin) -> None:
        async def body(access: ShardAccess) -> tuple[str, int, bytes]:
            copy: ShardAccess = pickle.loads(pickle.dumps(access))  # noqa: S301 - our own object
            try:
                handle = await copy.open(origin.url)
                data = await copy.read(handle, origin.keys[0])
            finally:
                await copy.close()
            return access.mode, access.origin_retries(), data

        mode, retries, data = self.run(node, body)
        assert mode in ("embedded", "daemon", "embedded (daemon unavailable)")
        assert retries == 0
        assert data == origin.shards[origin.keys[0]]
