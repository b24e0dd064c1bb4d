"""The reader's own next shard first: under a bandwidth limit, a blocked reader's shard overtakes prefetches."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _helpers import fill_bucket, make_shards, with_stager
from datacache.loaders import CachedIterableDataset
from test_loader import write_wds

from datacache.config import Settings, resolve_dataset
from datacache.staging import Stager, StagingEvent

if TYPE_CHECKING:
    from conftest import S3Bucket

PART = 64 << 10
SHARD = 16 * PART  # sixteen throttled parts per shard: a prefetch in flight has parts left to yield
# The shard in flight that the reader's must beat is LONG (four shards' bytes): with the reader's
# shard taking the whole rate, the margin is ~3 s of the limit, so a loop stalled for a second on a
# busy machine between "bytes are moving" and the reader's ask does not change who finishes first.
LONG = 4 * SHARD


def throttled(settings: Settings, concurrency: int, memory_budget: int = 64 * PART) -> Settings:
    # 1 MB/s: a shard takes ~1 s of the limit; the order, not the time, is what is checked.
    return replace(
        settings,
        shared_dir=None,
        part_size=PART,
        concurrency=concurrency,
        bandwidth_limit=1e6,
        fsync=False,
        memory_budget=memory_budget,
    )


def gets_per_object(s3: S3Bucket, prefix: str = "ds") -> dict[str, int]:
    counts = s3.server.request_counts()
    return {
        name.removeprefix(f"GET /{s3.name}/{prefix}/"): count
        for name, count in counts.items()
        if name.startswith(f"GET /{s3.name}/{prefix}/")
    }


def test_a_blocked_readers_shard_overtakes_every_prefetch_queued_or_in_flight(
    s3: S3Bucket, settings: Settings
) -> None:
    shards = {
        **make_shards(1, LONG, prefix="a-long"),
        **make_shards(3, SHARD // 2, seed=4, prefix="b-short"),
        **make_shards(1, SHARD, seed=5, prefix="c-read"),
    }
    fill_bucket(s3.client, s3.name, "ds", shards)
    keys = list(shards)
    settings = throttled(settings, concurrency=1)
    dataset = replace(resolve_dataset(s3.url("ds"), settings), storage_options=s3.storage_options)

    async def body(stager: Stager) -> list[str]:
        handle = await stager.open(dataset)
        staged: list[str] = []
        first_bytes = asyncio.get_running_loop().create_future()

        def listen(event: StagingEvent) -> None:
            if event.kind == "staged":
                staged.append(event.key)
            elif event.kind == "bytes" and not first_bytes.done():
                first_bytes.set_result(event.key)

        stager.add_listener(listen)
        s3.server.reset_counts()
        await stager.prefetch(handle, keys[:-1])
        # The first prefetch is moving bytes (fifteen of its parts still to come), three wait behind it.
        assert await first_bytes == keys[0]
        await stager.ensure(handle, keys[-1])
        await asyncio.gather(*(stager.ensure(handle, key) for key in keys))
        return staged

    staged = with_stager(settings, body)
    assert staged[0] == keys[-1], f"the reader's shard came after {staged[: staged.index(keys[-1])]}"
    assert sorted(staged) == sorted(keys), "each shard staged once"
    assert gets_per_object(s3) == {key: len(data) // PART for key, data in shards.items()}, "no shard fetched twice"


def test_a_reader_joins_the_prefetch_in_flight_for_its_shard_and_it_overtakes_the_others(
    s3: S3Bucket, settings: Settings
) -> None:
    # The two in flight first are the medium and the long one; the reader wants the long one, which
    # without the jump would finish last of the two (they share the rate), with it first by ~2 s.
    shards = {
        **make_shards(1, 2 * SHARD, seed=1, prefix="a-medium"),
        **make_shards(1, LONG, seed=6, prefix="b-long"),
        **make_shards(2, SHARD, seed=7, prefix="c-rest"),
    }
    fill_bucket(s3.client, s3.name, "ds", shards)
    keys = list(shards)
    settings = throttled(settings, concurrency=2)
    dataset = replace(resolve_dataset(s3.url("ds"), settings), storage_options=s3.storage_options)

    async def body(stager: Stager) -> tuple[list[str], str]:
        handle = await stager.open(dataset)
        staged: list[str] = []
        moving: list[str] = []
        both_moving = asyncio.get_running_loop().create_future()

        def listen(event: StagingEvent) -> None:
            if event.kind == "staged":
                staged.append(event.key)
            elif event.kind == "bytes" and event.key not in moving:
                moving.append(event.key)
                if len(moving) == 2 and not both_moving.done():
                    both_moving.set_result(None)

        stager.add_listener(listen)
        s3.server.reset_counts()
        await stager.prefetch(handle, keys)
        await both_moving
        # The reader wants the longer shard in flight: it joins that transfer, which now goes first.
        wanted = max(moving, key=lambda key: len(shards[key]))
        await stager.ensure(handle, wanted)
        await asyncio.gather(*(stager.ensure(handle, key) for key in keys))
        return staged, wanted

    staged, wanted = with_stager(settings, body)
    assert wanted == keys[1], f"the long shard was not in flight with the first: {wanted}"
    assert staged[0] == wanted, f"the joined transfer came after {staged[: staged.index(wanted)]}"
    assert sorted(staged) == sorted(keys), "each shard staged once"
    expected = {key: len(data) // PART for key, data in shards.items()}
    assert gets_per_object(s3) == expected, "the reader's ask made no GET of its own"


def test_a_reader_whose_parts_wait_for_memory_the_held_back_prefetches_hold_still_gets_its_shard(
    s3: S3Bucket, settings: Settings
) -> None:
    """The prefetches held back for the reader hold the whole memory budget in fetched parts."""
    shards = {**make_shards(1, LONG, seed=2, prefix="long"), **make_shards(1, SHARD, seed=3)}
    fill_bucket(s3.client, s3.name, "ds", shards)
    keys = list(shards)
    settings = throttled(settings, concurrency=1, memory_budget=2 * PART)
    dataset = replace(resolve_dataset(s3.url("ds"), settings), storage_options=s3.storage_options)

    async def body(stager: Stager) -> list[str]:
        handle = await stager.open(dataset)
        staged: list[str] = []
        first_bytes = asyncio.get_running_loop().create_future()

        def listen(event: StagingEvent) -> None:
            if event.kind == "staged":
                staged.append(event.key)
            elif event.kind == "bytes" and not first_bytes.done():
                first_bytes.set_result(event.key)

        stager.add_listener(listen)
        await stager.prefetch(handle, keys[:1])
        await first_bytes
        # A guard against a hang, not a measure: the shard takes ~1 s at the limit.
        await asyncio.wait_for(stager.ensure(handle, keys[1]), timeout=60)
        await stager.ensure(handle, keys[0])
        return staged

    assert with_stager(settings, body) == [keys[1], keys[0]]


def test_a_reader_asks_for_every_shard_of_its_first_window_before_its_first_sample(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window's first sample may come from a shard late in the reader's sequence: the shards
    before it (the same window: needed within a few samples) are asked for with it, not one by one
    as each one's first sample comes up (a cold epoch's first batch waited for each in turn,
    the later ones behind a full set of prefetches: 3 of a 9 s epoch in the issue's benchmark)."""
    origin = tmp_path / "origin"
    write_wds(origin, samples=48, per_shard=6, with_counts=True)  # 8 shards, one shuffle window
    asked: list[str] = []
    real_prefetch, real_ensure = Stager.prefetch, Stager.ensure

    def prefetch(self: Stager, handle: Any, keys: Any, **kwargs: Any) -> Any:
        asked.extend(keys)  # when the reader sends it, not when the loop runs it
        return real_prefetch(self, handle, keys, **kwargs)

    def ensure(self: Stager, handle: Any, key: str, **kwargs: Any) -> Any:
        asked.append(key)
        return real_ensure(self, handle, key, **kwargs)

    monkeypatch.setattr(Stager, "prefetch", prefetch)
    monkeypatch.setattr(Stager, "ensure", ensure)
    local = replace(settings, shared_dir=None, fsync=False)
    for seed in range(4):  # several first samples, in shards at several places of the sequence
        asked.clear()
        dataset = CachedIterableDataset(str(origin), config=replace(local, local_dir=tmp_path / f"local{seed}"),
                                        seed=seed, shuffle=True)  # fmt: skip
        try:
            iterator = iter(dataset)
            next(iterator)
            shards = {path.name for path in origin.glob("*.tar")}
            assert shards <= set(asked), f"seed {seed}: not asked for before the first sample: {shards - set(asked)}"
        finally:
            dataset.close()
