"""Prefetches of small shards staged in batches by the stager's queue (a reader's window of small files).

A worker that takes a prefetch of a small shard onto the local tier takes the prefetches of the same
dataset queued behind it too and stages them as one batch (`staging.batch.stage_batch`: one
reservation, one write round, one commit). These tests count the reservations, and hold the batch to
the one-shard way's guarantees: each shard staged once however many ask, every byte the origin's, a
tier smaller than the window never overfilled, a shard too large for a batch staged the one-shard way,
and no batch under a bandwidth limit (a batch lands whole: a reader joining it would wait for all of it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from _helpers import fill_dir, with_stager
from test_warm_batch import TINY, assert_agree, files, rows, tiny_shards

from datacache.catalog import Claim, Reservation, Room
from datacache.config import Settings, load_settings
from datacache.staging import LOCAL, Location, Stager


@pytest.fixture
def settings(tmp_path: Path, cache_env: dict[str, str]) -> Settings:
    """A local tier alone: through a shared tier (or from object storage) a shard is one request each,
    and a batch would make a reader that comes to wait for one of them wait for all."""
    return load_settings(cache_env, overrides={"local_dir": str(tmp_path / "local")})


def count_reservations(stager: Stager) -> list[int]:
    """Each reservation transaction's number of claims, in order, as the catalog makes them (it still makes them)."""
    catalog = stager.catalog
    made: list[int] = []
    reserve: Callable[[str, Sequence[Claim], Room], Awaitable[list[Reservation]]] = catalog.reserve_many

    async def counted(dataset: str, claims: Sequence[Claim], room: Room) -> list[Reservation]:
        made.append(len(claims))
        return await reserve(dataset, claims, room)

    catalog.reserve_many = counted  # type: ignore[method-assign]
    return made


def prefetch_then_read(origin: Path, keys: Sequence[str]) -> Callable[[Stager], Awaitable[Any]]:
    async def body(stager: Stager) -> tuple[list[int], list[Location], Any]:
        handle = await stager.open(str(origin))
        made = count_reservations(stager)
        await stager.prefetch(handle, keys)
        # Readers asking for shards being prefetched join those transfers (one each, however many ask).
        located = await asyncio.gather(*(stager.ensure(handle, key) for key in keys for _ in range(2)))
        return made, located, stager.stats()

    return body


def test_a_window_of_small_shards_prefetched_together_is_reserved_in_one_transaction(
    tmp_path: Path, settings: Settings
) -> None:
    shards = tiny_shards(40)
    origin = fill_dir(tmp_path / "origin", shards)

    made, located, stats = with_stager(settings, prefetch_then_read(origin, list(shards)))

    # One shard a reservation before (40 transactions, with a node lock and two fsyncs each).
    assert made == [40]
    assert stats.shards_staged == 40
    assert {location.tier for location in located} == {LOCAL}
    for location in located:
        assert location.path is not None and location.path.read_bytes() == shards[location.shard.key]
    assert_agree(settings.local_dir, shards)


def test_a_prefetched_batch_keeps_to_a_local_tier_smaller_than_it(tmp_path: Path, cache_env: dict[str, str]) -> None:
    shards = tiny_shards(60)
    origin = fill_dir(tmp_path / "origin", shards)
    capacity = 25 * TINY
    small = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "small"), "local_capacity": f"{capacity}B"})

    made, located, _ = with_stager(small, prefetch_then_read(origin, list(shards)))

    assert made[0] == 60  # the batch's one reservation; the shards it found no room for were read from below
    assert sum(size for _, size in rows(small.local_dir).values()) <= capacity
    assert sum(len(data) for data in files(small.local_dir).values()) <= capacity
    for location in located:
        data = location.path.read_bytes() if location.path is not None else None
        assert data in (None, shards[location.shard.key])
    assert_agree(small.local_dir, {key: shards[key] for key in files(small.local_dir)})


def test_a_shard_too_large_for_a_batch_is_prefetched_the_one_shard_way(tmp_path: Path, settings: Settings) -> None:
    shards = {**tiny_shards(6), "large.bin": b"x" * (1 << 20)}
    origin = fill_dir(tmp_path / "origin", shards)
    keys = ["large.bin", *tiny_shards(6)]

    made, located, stats = with_stager(settings, prefetch_then_read(origin, keys))

    assert sorted(made) == [1, 6]  # the large one alone (streamed to its file), the small ones together
    assert stats.shards_staged == 7
    for location in located:
        assert location.path is not None and location.path.read_bytes() == shards[location.shard.key]


def test_a_prefetch_asked_again_while_its_shards_are_on_their_way_looks_none_of_them_up(
    tmp_path: Path, settings: Settings
) -> None:
    shards = tiny_shards(30)
    origin = fill_dir(tmp_path / "origin", shards)
    keys = list(shards)

    async def body(stager: Stager) -> tuple[list[int], list[Location]]:
        handle = await stager.open(str(origin))
        local = (await stager._ready()).local
        looked: list[int] = []
        hits = local.hits

        async def counted(handle: Any, shards: Sequence[Any]) -> Any:
            looked.append(len(shards))
            return await hits(handle, shards)

        local.hits = counted  # type: ignore[method-assign]
        await stager.prefetch(handle, keys)
        # Asked again at once (a reader closing a unit asks again for those ahead): all still on their way.
        await stager.prefetch(handle, keys[5:])
        return looked, [await stager.ensure(handle, key) for key in keys]

    looked, located = with_stager(settings, body)

    # The first ask's look-up, then the batch's own (`stage_batch`); the second ask looked its 25 up again
    # before (a catalog read and a stat each).
    assert looked[0] == 30 and 25 not in looked
    for location in located:
        assert location.path is not None and location.path.read_bytes() == shards[location.shard.key]


def test_under_a_bandwidth_limit_each_prefetched_shard_is_staged_alone(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    shards = tiny_shards(8)
    origin = fill_dir(tmp_path / "origin", shards)
    paced = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "local"), "bandwidth_limit": "100MB/s"})

    made, located, stats = with_stager(paced, prefetch_then_read(origin, list(shards)))

    assert made == [1] * 8  # each arrives as its share of the rate allows, not with the last of a batch
    assert stats.shards_staged == 8
    for location in located:
        assert location.path is not None and location.path.read_bytes() == shards[location.shard.key]
