"""The stager in-process: tiers, single-flight, integrity, origin changes, recovery."""

from __future__ import annotations

import asyncio
import os
import pickle
import sqlite3
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _helpers import checksum, fill_bucket, fill_dir, make_shards, partial_files, with_stager

from datacache.catalog import Catalog, ShardState
from datacache.config import DatasetConfig, Settings, resolve_dataset
from datacache.errors import OriginChangedError, ShardNotFoundError, TierFullError
from datacache.staging import PRIORITY_PREFETCH, DatasetHandle, Location, Stager, StagerStats, WarmReport

if TYPE_CHECKING:
    from conftest import S3Bucket


def s3_dataset(s3: S3Bucket, settings: Settings, prefix: str = "ds") -> DatasetConfig:
    dataset = resolve_dataset(s3.url(prefix), settings)
    return replace(dataset, storage_options=s3.storage_options)


def gets_per_object(s3: S3Bucket, prefix: str = "ds") -> dict[str, int]:
    counts = s3.server.request_counts()
    return {
        name.removeprefix(f"GET /{s3.name}/{prefix}/"): count
        for name, count in counts.items()
        if name.startswith(f"GET /{s3.name}/{prefix}/")
    }


def flip_byte(path: Path, offset: int = 100) -> None:
    with path.open("r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def catalog_rows(settings: Settings) -> list[tuple[str, str, str, str | None]]:
    with sqlite3.connect(settings.local_dir / "catalog.sqlite") as connection:
        return connection.execute(
            "SELECT dataset, key, state, checksum FROM shards ORDER BY key"
        ).fetchall()


def test_warm_file_origin_through_shared_to_local(tmp_path: Path, settings: Settings) -> None:
    shards = make_shards(4, 50_000)
    origin = fill_dir(tmp_path / "origin", shards)

    async def body(stager: Stager) -> tuple[WarmReport, WarmReport, DatasetHandle]:
        handle = await stager.open(str(origin))
        first = await stager.warm(handle)
        second = await stager.warm(handle)
        return first, second, handle

    first, second, handle = with_stager(settings, body)
    assert first.complete and first.shards_resident == 4
    assert first.bytes_transferred == 200_000 and first.shards_transferred == 4
    assert second.complete and second.bytes_transferred == 0 and second.shards_transferred == 0
    assert settings.shared_dir is not None
    for key, data in shards.items():
        assert (settings.local_dir / "data" / handle.id / key).read_bytes() == data
        assert (settings.shared_dir / "data" / handle.id / key).read_bytes() == data
    rows = catalog_rows(settings)
    assert [(r[1], r[2], r[3]) for r in rows] == [
        (k, "resident", checksum(v)) for k, v in shards.items()
    ]
    assert partial_files(settings.local_dir, settings.shared_dir) == []


def test_warm_to_the_shared_tier_only(tmp_path: Path, settings: Settings) -> None:
    shards = make_shards(2, 1000)
    origin = fill_dir(tmp_path / "origin", shards)

    async def body(stager: Stager) -> WarmReport:
        handle = await stager.open(str(origin))
        return await stager.warm(handle, tier="shared")

    report = with_stager(settings, body)
    assert report.complete and report.bytes_transferred == 2000
    assert catalog_rows(settings) == []
    assert not (settings.local_dir / "data").exists() or not any(
        (settings.local_dir / "data").rglob("*.tar")
    )


def test_concurrent_ensures_fetch_each_part_once(s3: S3Bucket, settings: Settings) -> None:
    settings = replace(settings, part_size=64_000)
    shards = make_shards(3, 200_000)
    fill_bucket(s3.client, s3.name, "ds", shards)
    dataset = s3_dataset(s3, settings)

    async def body(stager: Stager) -> tuple[list[Location], StagerStats, dict[str, int]]:
        handle = await stager.open(dataset)
        s3.server.reset_counts()
        calls = [stager.ensure(handle, key) for key in shards for _ in range(6)]
        locations = await asyncio.gather(*calls)
        assert stager.shared is not None
        written = {"local": stager.local.stats().bytes_written, "shared": stager.shared.stats().bytes_written}
        return locations, stager.stats(), written

    locations, stats, written = with_stager(settings, body)
    # One transfer per shard and tier, however many asked (issue 12 item 26: the origin GETs alone
    # let duplicates through, absorbed by the shared tier).
    assert (stats.shards_staged, stats.bytes_to_local) == (3, 600_000)
    assert (stats.shards_to_shared, stats.bytes_to_shared) == (3, 600_000)
    assert written == {"local": 600_000, "shared": 600_000}
    assert {loc.tier for loc in locations} == {"local"}
    for location in locations:
        assert location.path is not None
        assert location.path.read_bytes() == shards[location.shard.key]
        assert location.checksum == checksum(shards[location.shard.key])
    # 200 kB in 64 kB parts: 4 ranged GETs per shard, made once however many asked.
    assert gets_per_object(s3) == dict.fromkeys(shards, 4)


def test_read_from_each_tier_is_checked(tmp_path: Path, settings: Settings) -> None:
    shards = make_shards(2, 10_000)
    origin = fill_dir(tmp_path / "origin", shards)
    key = next(iter(shards))

    async def body(stager: Stager) -> None:
        handle = await stager.open(str(origin))
        assert (await stager.locate(handle, key)).tier == "origin"
        assert await stager.read(handle, key) == shards[key]
        await stager.warm(handle, tier="shared")
        assert (await stager.locate(handle, key)).tier == "shared"
        assert await stager.read(handle, key) == shards[key]
        await stager.warm(handle)
        location = await stager.locate(handle, key)
        assert location.tier == "local" and location.checksum == checksum(shards[key])
        assert await stager.read(handle, key) == shards[key]
        from datacache.tiers import ByteRange

        assert await stager.read(handle, key, ByteRange(10, 20)) == shards[key][10:20]

    with_stager(settings, body)


# -- integrity ----------------------------------------------------------------


def test_corrupt_local_copy_is_detected_by_verify_and_restaged(
    tmp_path: Path, settings: Settings
) -> None:
    shards = make_shards(3, 20_000)
    origin = fill_dir(tmp_path / "origin", shards)
    bad_key = list(shards)[1]

    async def warm(stager: Stager, verify: bool) -> tuple[WarmReport, DatasetHandle]:
        handle = await stager.open(str(origin))
        return await stager.warm(handle, verify=verify), handle

    _, handle = with_stager(settings, lambda s: warm(s, False))
    local_file = settings.local_dir / "data" / handle.id / bad_key
    flip_byte(local_file)
    report, _ = with_stager(settings, lambda s: warm(s, True))
    assert report.complete
    assert report.shards_verified == 2, "the two good copies verified, the bad one dropped"
    assert report.shards_transferred == 1
    assert local_file.read_bytes() == shards[bad_key]
    assert partial_files(settings.local_dir) == []


def test_corrupt_local_copy_is_never_served(tmp_path: Path, settings: Settings) -> None:
    shards = make_shards(2, 20_000)
    origin = fill_dir(tmp_path / "origin", shards)
    key = next(iter(shards))

    async def body(stager: Stager) -> bytes:
        handle = await stager.open(str(origin))
        await stager.warm(handle)
        flip_byte(settings.local_dir / "data" / handle.id / key)
        data = await stager.read(handle, key)
        location = await stager.ensure(handle, key)
        assert location.tier == "local"
        assert location.path is not None and location.path.read_bytes() == shards[key]
        return data

    assert with_stager(settings, body) == shards[key]


def test_corrupt_shared_copy_is_refetched_from_the_origin(s3: S3Bucket, settings: Settings) -> None:
    shards = make_shards(3, 30_000)
    fill_bucket(s3.client, s3.name, "ds", shards)
    dataset = s3_dataset(s3, settings)
    bad_key = list(shards)[2]
    assert settings.shared_dir is not None

    async def warm_shared(stager: Stager) -> DatasetHandle:
        handle = await stager.open(dataset)
        assert (await stager.warm(handle, tier="shared")).complete
        return handle

    handle = with_stager(settings, warm_shared)
    shared_file = settings.shared_dir / "data" / handle.id / bad_key
    flip_byte(shared_file, 5)
    s3.server.reset_counts()

    async def warm_local(stager: Stager) -> WarmReport:
        return await stager.warm(await stager.open(dataset))

    report = with_stager(settings, warm_local)
    assert report.complete and report.shards_transferred == 3
    for key, data in shards.items():
        assert (settings.local_dir / "data" / handle.id / key).read_bytes() == data
    assert shared_file.read_bytes() == shards[bad_key], "the shared copy was repaired"
    assert gets_per_object(s3) == {bad_key: 1}, "only the corrupt shard went back to the origin"


def test_manifest_checksum_rejects_bad_origin_bytes(tmp_path: Path, settings: Settings) -> None:
    """A shard whose origin bytes do not match the manifest's checksum is never made resident."""
    shards = make_shards(2, 1000)
    origin = fill_dir(tmp_path / "origin", shards)

    async def body(stager: Stager) -> WarmReport:
        handle = await stager.open(str(origin))
        lying = replace(
            handle.manifest,
            shards=tuple(
                replace(s, checksum="xxh3_64:0000000000000000") for s in handle.manifest.shards
            ),
        )
        return await stager.warm(replace(handle, manifest=lying), tier="local")

    report = with_stager(settings, body)
    assert not report.complete and report.shards_resident == 0
    assert all("checksum" in error for _, error in report.failures)
    assert catalog_rows(settings) == []
    assert settings.shared_dir is not None
    assert partial_files(settings.local_dir, settings.shared_dir) == []
    assert not list((settings.local_dir / "data").rglob("*.tar"))


# -- origin changes -----------------------------------------------------------


def test_changed_s3_object_fails_instead_of_mixing_versions(
    s3: S3Bucket, settings: Settings
) -> None:
    settings = replace(settings, part_size=16_000)
    shards = make_shards(2, 50_000)
    fill_bucket(s3.client, s3.name, "ds", shards)
    dataset = s3_dataset(s3, settings)
    changed_key = next(iter(shards))
    new_data = os.urandom(50_000)  # same size: only the ETag tells

    async def take(stager: Stager) -> DatasetHandle:
        return await stager.open(dataset)

    handle = with_stager(settings, take)
    s3.put(f"ds/{changed_key}", new_data)

    async def warm(stager: Stager, refresh: bool) -> WarmReport:
        return await stager.warm(await stager.open(dataset, refresh=refresh))

    report = with_stager(settings, lambda s: warm(s, False))
    assert not report.complete
    assert [key for key, _ in report.failures] == [changed_key]
    assert "changed at the origin" in report.failures[0][1]
    assert not (settings.local_dir / "data" / handle.id / changed_key).exists()
    assert settings.shared_dir is not None
    assert not (settings.shared_dir / "data" / handle.id / changed_key).exists()

    with pytest.raises(OriginChangedError, match=r"datacache warm --refresh|refresh=True"):
        with_stager(settings, lambda s: _ensure(s, dataset, changed_key))

    report = with_stager(settings, lambda s: warm(s, True))
    assert report.complete
    assert (settings.local_dir / "data" / handle.id / changed_key).read_bytes() == new_data


async def _ensure(stager: Stager, dataset: DatasetConfig, key: str) -> Location:
    return await stager.ensure(await stager.open(dataset), key)


def test_refresh_restages_a_changed_file_origin(tmp_path: Path, settings: Settings) -> None:
    shards = make_shards(2, 1000)
    origin = fill_dir(tmp_path / "origin", shards)
    key = next(iter(shards))

    async def warm(stager: Stager, refresh: bool) -> tuple[WarmReport, DatasetHandle]:
        handle = await stager.open(str(origin), refresh=refresh)
        return await stager.warm(handle), handle

    first, handle = with_stager(settings, lambda s: warm(s, False))
    assert first.complete
    (origin / key).write_bytes(b"a new version, of another size")
    same, _ = with_stager(settings, lambda s: warm(s, False))
    assert same.complete and same.bytes_transferred == 0, "the manifest is a snapshot"
    assert (settings.local_dir / "data" / handle.id / key).read_bytes() == shards[key]
    refreshed, _ = with_stager(settings, lambda s: warm(s, True))
    assert refreshed.complete and refreshed.shards_transferred == 1
    assert (
        settings.local_dir / "data" / handle.id / key
    ).read_bytes() == b"a new version, of another size"


# -- capacity -----------------------------------------------------------------


def test_shard_larger_than_the_local_capacity(tmp_path: Path, settings: Settings) -> None:
    origin = fill_dir(tmp_path / "origin", make_shards(2, 5000))
    small = replace(settings, local_capacity=4000, shared_dir=None)

    async def body(stager: Stager) -> None:
        handle = await stager.open(str(origin))
        with pytest.raises(TierFullError, match="larger than the local tier's capacity"):
            await stager.ensure(handle, handle.manifest.shards[0].key)

    with_stager(small, body)


# -- recovery and pickling ----------------------------------------------------


def test_reconcile_repairs_what_a_dead_process_left(tmp_path: Path, settings: Settings) -> None:
    shards = make_shards(3, 1000)
    origin = fill_dir(tmp_path / "origin", shards)
    keys = list(shards)

    async def warm(stager: Stager) -> DatasetHandle:
        handle = await stager.open(str(origin))
        assert (await stager.warm(handle)).complete
        return handle

    handle = with_stager(settings, warm)
    data_dir = settings.local_dir / "data" / handle.id
    # A dead process's transfer: a STAGING row owned by a pid that is gone, and its partial.
    dead = f"{os.uname().nodename}:{_dead_pid()}"
    with sqlite3.connect(settings.local_dir / "catalog.sqlite") as connection:
        connection.execute(
            "INSERT INTO shards (dataset, key, size, version, state, owner, last_access)"
            " VALUES (?, 'ghost.tar', 10, 'v', 'staging', ?, 0)",
            (handle.id, dead),
        )
        connection.execute(
            "UPDATE shards SET state='evicting', owner=? WHERE key=?", (dead, keys[0])
        )
    (data_dir / f".ghost.tar.{'0' * 32}.partial").write_bytes(b"half")
    manifest_partial = settings.local_dir / "manifests" / f".{handle.id}.json.{'1' * 32}.partial"
    manifest_partial.write_bytes(b"{half a manif")
    (data_dir / keys[1]).unlink()  # a resident file that vanished
    (data_dir / "stray.bin").write_bytes(b"no metadata, no row")
    # The dead process had opened the tier: it took the clean marker and left its session (`staging.sessions`).
    (settings.local_dir / "locks" / "clean").unlink()
    (settings.local_dir / "locks" / "sessions" / dead).touch()

    counts = with_stager(settings, lambda s: s.reconcile(), reconcile=False)
    assert counts["stale_rows"] == 2
    assert counts["missing_files"] == 1
    assert counts["partials"] == 2
    assert counts["orphans_removed"] == 1
    assert [(r[1], r[2]) for r in catalog_rows(settings)] == [(keys[2], "resident")]
    assert partial_files(settings.local_dir) == []
    assert not (data_dir / "stray.bin").exists()
    # ...and a warm afterwards puts back exactly what is missing.
    again = with_stager(settings, lambda s: _warm_report(s, origin))
    assert again.complete and again.shards_transferred == 2


async def _warm_report(stager: Stager, origin: Path) -> WarmReport:
    return await stager.warm(await stager.open(str(origin)))


def _dead_pid() -> int:
    """A pid that is not running: a child that has exited and been reaped."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_stager_and_catalog_pickle_without_runtime_state(
    tmp_path: Path, settings: Settings
) -> None:
    origin = fill_dir(tmp_path / "origin", make_shards(1, 100))

    async def body(stager: Stager) -> bytes:
        handle = await stager.open(str(origin))
        await stager.warm(handle)
        return pickle.dumps(stager)

    clone = pickle.loads(with_stager(settings, body))
    assert isinstance(clone, Stager)
    assert clone.settings == settings
    assert clone._loop is None and clone._parts is None and clone._origins.tiers() == []
    catalog = pickle.loads(pickle.dumps(Catalog(settings.local_dir / "catalog.sqlite")))
    entries = asyncio.run(_entries_and_close(catalog))
    assert [e.state for e in entries] == [ShardState.RESIDENT]


async def _entries_and_close(catalog: Catalog) -> list[object]:
    try:
        return list(await catalog.entries())
    finally:
        await catalog.close()


def test_nested_unicode_and_empty_shards(s3: S3Bucket, settings: Settings) -> None:
    shards = {
        "a/b/deep.tar": os.urandom(3000),
        "ü nicode + space.tar": os.urandom(2000),
        "empty.tar": b"",
        "x%20y.tar": os.urandom(10),
    }
    fill_bucket(s3.client, s3.name, "ds", shards)
    dataset = s3_dataset(s3, settings)

    async def body(stager: Stager) -> tuple[WarmReport, DatasetHandle]:
        handle = await stager.open(dataset)
        return await stager.warm(handle), handle

    report, handle = with_stager(settings, body)
    assert report.complete, report.failures
    assert sorted(s.key for s in handle.manifest.shards) == sorted(shards)
    for key, data in shards.items():
        assert (settings.local_dir / "data" / handle.id / key).read_bytes() == data
    assert [r[3] for r in catalog_rows(settings)] == [checksum(shards[k]) for k in sorted(shards)]


def test_a_change_of_event_loop_releases_the_earlier_runtime(s3: S3Bucket, settings: Settings) -> None:
    """One `asyncio.run` per call is how sync code drives a stager: each change of loop used to keep a
    lock-waiter pool, the origin's GET threads and its clients alive (issue 12 item 22)."""
    import threading

    shards = make_shards(4, 50_000)
    fill_bucket(s3.client, s3.name, "ds", shards)
    dataset = s3_dataset(s3, settings)
    stager = Stager(settings)
    keys = sorted(shards)

    async def use(key: str) -> None:
        handle = await stager.open(dataset)
        await stager.ensure(handle, key)

    known = set(threading.enumerate())
    earlier: set[threading.Thread] = set()
    for index, key in enumerate(keys):
        asyncio.run(use(key))
        started = set(threading.enumerate()) - known
        known |= started
        if index < len(keys) - 1:
            # A later change of loop must let these go; the catalog's one thread is the stager's
            # own (not a loop's), kept for its whole life.
            earlier |= {thread for thread in started if not thread.name.startswith("datacache-catalog")}
    # Each earlier runtime let its threads go, whatever the last one holds (its pools start
    # threads as their work needs). They end on their own schedule (pools are shut down without
    # waiting): poll, with a deadline.
    deadline = time.monotonic() + 30
    while any(thread.is_alive() for thread in earlier):
        assert time.monotonic() < deadline, [t.name for t in earlier if t.is_alive()]
        time.sleep(0.05)  # sleep-ok: polling thread exits, with a deadline
    asyncio.run(stager.close())


def test_prefetch_asks_no_more_for_a_shard_the_origin_refused(s3: S3Bucket, settings: Settings) -> None:
    # One worker: jobs run one after another in priority order, so waiting on the shard queued
    # after the missing one means the missing one's job (if any) has run.
    settings = replace(settings, concurrency=1)
    shards = make_shards(3, 20_000)
    fill_bucket(s3.client, s3.name, "ds", shards)
    dataset = s3_dataset(s3, settings)
    bad, first, second = shards

    async def body(stager: Stager) -> None:
        handle = await stager.open(dataset)
        s3.client.delete_object(Bucket=s3.name, Key=f"ds/{bad}")
        s3.server.reset_counts()
        after = PRIORITY_PREFETCH + 1  # joins the prefetch's job without moving it ahead
        await stager.prefetch(handle, [bad, first])
        await stager.ensure(handle, first, priority=after)
        assert gets_per_object(s3) == {bad: 1, first: 1}
        await stager.prefetch(handle, [bad, second])
        await stager.ensure(handle, second, priority=after)
        assert gets_per_object(s3) == {bad: 1, first: 1, second: 1}, "prefetch asked again for a refused shard"
        with pytest.raises(ShardNotFoundError, match=bad):
            await stager.ensure(handle, bad)  # a reader still asks, and sees the error
        s3.client.put_object(Bucket=s3.name, Key=f"ds/{bad}", Body=shards[bad])
        location = await stager.ensure(handle, bad)  # and gets the shard once it is back
        assert location.path is not None and location.path.read_bytes() == shards[bad]
        assert gets_per_object(s3) == {bad: 3, first: 1, second: 1}

    with_stager(settings, body)
