"""Objects rewritten at the origin while an epoch reads them: the snapshot holds, or the epoch fails clearly.

An epoch never mixes two versions of a shard: shards already cached serve the
manifest's version, a shard staged after the rewrite fails with
`OriginChangedError` (S3 conditional GETs on the snapshot's ETag), and a
refreshed manifest serves the new version whole.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _faultdata import (
    Samples,
    catalog,
    check_cache,
    make_dataset,
    partials,
    proxied_options,
    record,
    tar_shard,
)
from _faultproxy import FaultProxy
from datacache.loaders import CachedIterableDataset

from datacache.config import DatasetConfig, Settings
from datacache.errors import OriginChangedError
from datacache.manifest import MANIFEST_NAME
from datacache.staging import Stager

if TYPE_CHECKING:
    from conftest import S3Bucket


def publish(s3: S3Bucket, prefix: str, files: dict[str, bytes], expected: Samples) -> None:
    """Upload shards with the manifest ``datacache shard`` writes (sizes and sample counts)."""
    counts: dict[str, int] = {}
    for key in expected:
        shard = f"shard-{int(key[1:4]):04d}.tar"
        counts[shard] = counts.get(shard, 0) + 1
    entries = [{"key": name, "size": len(data), "samples": counts[name]} for name, data in sorted(files.items())]
    document = {"format_version": 1, "dataset": prefix, "url": "", "format": "tar", "shards": entries}
    for name, data in files.items():
        s3.put(f"{prefix}/{name}", data)
    s3.put(f"{prefix}/{MANIFEST_NAME}", json.dumps(document).encode())


def rewritten(shard: int, per_shard: int, seed: int) -> tuple[bytes, Samples]:
    """A new version of shard ``shard``: the same keys, other bytes (and another size)."""
    _, fresh = make_dataset(shard + 1, per_shard, seed=seed, version="v2", size=(800, 2500))
    samples = {key: fields for key, fields in fresh.items() if key.startswith(f"s{shard:03d}_")}
    return tar_shard(samples.items()), samples


def test_a_rewrite_during_an_epoch_never_mixes_versions(s3: S3Bucket, settings: Settings) -> None:
    files, expected = make_dataset(6, 10, seed=21)
    publish(s3, "wds", files, expected)
    url = s3.url("wds")
    dataset = CachedIterableDataset(url, config=settings, shuffle=False, prefetch=0)
    iterator = iter(dataset)
    head = [next(iterator) for _ in range(25)]  # shards 0, 1 and half of 2 are cached now
    new_bytes, new_samples = rewritten(4, 10, seed=99)
    s3.put("wds/shard-0004.tar", new_bytes)
    served = list(head)
    with pytest.raises(OriginChangedError, match=r"shard-0004\.tar.*changed at the origin"):
        for sample in iterator:
            served.append(sample)
    # Everything served came whole from the snapshot's version: the old bytes, never the new ones.
    assert len(served) == 40
    for sample in served:
        assert sample["ver"] == b"v1" and sample["bin"] == expected[sample["__key__"]]["bin"]
    assert partials(settings.local_dir, settings.shared_dir) == []
    assert "shard-0004.tar" not in {key for _, key, *_ in catalog(settings.local_dir)}

    # The publisher updates the dataset's manifest too; a refreshed manifest is a new snapshot.
    files["shard-0004.tar"] = new_bytes
    publish(s3, "wds", files, expected)
    asyncio.run(_refresh(settings, url))
    fresh = CachedIterableDataset(url, config=settings, shuffle=False)
    now = {**expected, **new_samples}
    got = {sample["__key__"]: sample for sample in fresh}
    assert set(got) == set(now)
    for key, sample in got.items():
        assert sample["bin"] == now[key]["bin"] and sample["ver"] == now[key]["ver"], key
    versions = {sample["ver"] for key, sample in got.items() if key.startswith("s004_")}
    assert versions == {b"v2"}, "a shard is read whole from one version"
    check_cache(settings.local_dir, settings.shared_dir, files)
    record("origin_rewrite_epoch", served_before_error=len(served), mixed=0, samples=len(got))


async def _refresh(settings: Settings, url: str) -> None:
    async with Stager(settings) as stager:
        await stager.open(url, refresh=True)


def test_an_epoch_whose_shards_are_cached_stays_on_its_snapshot(s3: S3Bucket, settings: Settings) -> None:
    files, expected = make_dataset(4, 8, seed=22)
    publish(s3, "wds", files, expected)
    url = s3.url("wds")
    first = CachedIterableDataset(url, config=settings, shuffle=False)
    assert len(list(first)) == 32  # every shard cached
    new_bytes, _ = rewritten(1, 8, seed=5)
    s3.put("wds/shard-0001.tar", new_bytes)
    again = CachedIterableDataset(url, config=settings, seed=3)
    got = {sample["__key__"]: sample for sample in again}
    assert {key: sample["bin"] for key, sample in got.items()} == {k: v["bin"] for k, v in expected.items()}


def test_a_rewrite_in_the_middle_of_a_transfer_is_refused(s3: S3Bucket, proxy: FaultProxy, settings: Settings) -> None:
    """The object changes between two ranged GETs of one transfer: nothing of either version is kept."""
    files, _ = make_dataset(3, 20, seed=23)
    for name, data in files.items():
        s3.put(f"wds/{name}", data)
    new_bytes, _ = rewritten(1, 20, seed=6)
    gets = 0

    def rewrite_after_the_first_part(_: str) -> None:
        nonlocal gets
        gets += 1
        if gets == 2:
            s3.put("wds/shard-0001.tar", new_bytes)  # straight to the server, between two parts

    config = DatasetConfig(name="changing", url=s3.url("wds"), storage_options=proxied_options(proxy.endpoint))
    tuned = replace(settings, part_size=4096, memory_budget=4096, concurrency=1)

    async def main() -> None:
        async with Stager(tuned) as stager:
            handle = await stager.open(config)
            proxy.add_hook(rf"^GET /{s3.name}/wds/shard-0001\.tar$", rewrite_after_the_first_part)
            with pytest.raises(OriginChangedError, match=r"shard-0001\.tar"):
                await stager.ensure(handle, "shard-0001.tar")
            assert (await stager.ensure(handle, "shard-0002.tar")).tier == "local"

    asyncio.run(main())
    assert gets >= 2
    assert partials(settings.local_dir, settings.shared_dir) == []
    assert [key for _, key, *_ in catalog(settings.local_dir)] == ["shard-0002.tar"]
    check_cache(settings.local_dir, settings.shared_dir, files)
    assert not list(Path(settings.local_dir / "data").rglob("shard-0001.tar"))
