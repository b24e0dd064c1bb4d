"""Dataset manifests: listing once, format detection, persistence, and the shard manifest file."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from _helpers import checksum, fill_bucket, fill_dir, make_shards, with_stager
from datacache.tiers import ObjectTier

from datacache.config import DatasetConfig, Settings, dataset_id_for, resolve_dataset
from datacache.errors import ConfigError, InvalidKeyError, ShardNotFoundError
from datacache.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestStore,
    Shard,
    ShardFormat,
    detect_format,
    take_manifest,
)
from datacache.staging import Stager

if TYPE_CHECKING:
    from conftest import S3Bucket


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (["a/0.tar", "a/1.tar", "README"], ShardFormat.TAR),
        (["part-0.parquet", "_SUCCESS"], ShardFormat.PARQUET),
        (["arr/zarr.json", "arr/c/0/0"], ShardFormat.ZARR),
        (["arr/.zarray", "arr/0.0"], ShardFormat.ZARR),
        (["img/1.jpg", "img/2.jpg"], ShardFormat.FILES),
    ],
)
def test_detect_format(keys: list[str], expected: ShardFormat) -> None:
    assert detect_format(keys) is expected


def manifest_of(url: str, **kwargs: object) -> Manifest:
    dataset = DatasetConfig(name="ds", url=url, **kwargs)  # type: ignore[arg-type]

    async def body() -> Manifest:
        origin = ObjectTier(url)
        try:
            return await take_manifest(dataset, origin)
        finally:
            await origin.close()

    return asyncio.run(body())


def test_tar_manifest_lists_only_tar_shards(tmp_path: Path) -> None:
    shards = make_shards(3, 100)
    fill_dir(tmp_path / "o", {**shards, "README.md": b"hello", "sub/x.tar": b"y" * 10})
    manifest = manifest_of(str(tmp_path / "o"))
    assert manifest.format is ShardFormat.TAR
    assert [s.key for s in manifest.shards] == sorted([*shards, "sub/x.tar"])
    assert manifest.total_bytes == 310
    assert all(s.version for s in manifest.shards)
    assert manifest.total_samples is None


def test_files_manifest_takes_every_file(tmp_path: Path) -> None:
    fill_dir(tmp_path / "o", {"a.jpg": b"1", "b/c.jpg": b"22"})
    manifest = manifest_of(f"file://{tmp_path / 'o'}")
    assert manifest.format is ShardFormat.FILES
    assert [(s.key, s.size) for s in manifest.shards] == [("a.jpg", 1), ("b/c.jpg", 2)]


def test_configured_format_wins(tmp_path: Path) -> None:
    fill_dir(tmp_path / "o", {"a.tar": b"1", "b.bin": b"2"})
    assert manifest_of(str(tmp_path / "o"), format="files").format is ShardFormat.FILES


def test_empty_origin_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardNotFoundError, match=r"no objects under"):
        manifest_of(str(tmp_path / "empty"))
    with pytest.raises(ShardNotFoundError):
        manifest_of(str(tmp_path / "does-not-exist"))


def test_written_manifest_is_used_with_its_checksums(tmp_path: Path) -> None:
    shards = make_shards(2, 10 * 512)  # 10 samples take 10 tar blocks at least
    written = Manifest(
        dataset="whatever",
        url="elsewhere",
        format=ShardFormat.TAR,
        shards=tuple(Shard(k, len(v), None, checksum(v), 10) for k, v in shards.items()),
    )
    fill_dir(tmp_path / "o", {**shards, MANIFEST_NAME: json.dumps(written.to_json()).encode()})
    manifest = manifest_of(str(tmp_path / "o"))
    assert [s.checksum for s in manifest.shards] == [checksum(v) for v in shards.values()]
    assert manifest.total_samples == 20
    assert all(s.version for s in manifest.shards), "versions come from the listing"
    assert manifest.dataset == dataset_id_for(str(tmp_path / "o")), "the id is the origin's, not the name"


def test_written_manifest_that_disagrees_with_the_origin(tmp_path: Path) -> None:
    written = Manifest("d", "u", ShardFormat.TAR, (Shard("a.tar", 5), Shard("b.tar", 5)))
    fill_dir(
        tmp_path / "o",
        {"a.tar": b"12345", "b.tar": b"123", MANIFEST_NAME: json.dumps(written.to_json()).encode()},
    )
    with pytest.raises(ShardNotFoundError, match=r"'b\.tar'"):
        manifest_of(str(tmp_path / "o"))


def test_manifest_json_round_trip_and_snapshot() -> None:
    manifest = Manifest(
        "d",
        "s3://AKIA:hunter2@b/d",
        ShardFormat.TAR,
        (Shard("a.tar", 3 * 512, "e1", "xxh3_64:00", 3), Shard("b.tar", 7, "e2")),
    )
    document = manifest.to_json()
    assert "hunter2" not in json.dumps(document)
    again = Manifest.from_json(json.loads(json.dumps(document)), "test")
    assert again.shards == manifest.shards
    assert again.snapshot == manifest.snapshot
    changed = Manifest(
        "d", "u", ShardFormat.TAR, (Shard("a.tar", 5, "e1-new"), Shard("b.tar", 7, "e2"))
    )
    assert changed.snapshot != manifest.snapshot


@pytest.mark.parametrize(
    ("shards", "error"),
    [
        ([{"key": "../escape.tar", "size": 1}], InvalidKeyError),
        ([{"key": "/abs.tar", "size": 1}], InvalidKeyError),
        ([{"key": "a.tar", "size": -1}], ConfigError),
        ([{"key": "a.tar", "size": 1}, {"key": "a.tar", "size": 1}], ConfigError),
        ([{"key": "a.tar", "size": 1, "checksum": "md5:00"}], ConfigError),
        ("not a list", ConfigError),
    ],
)
def test_manifest_from_json_rejects(shards: object, error: type[Exception]) -> None:
    document = {"format_version": 1, "format": "tar", "shards": shards}
    with pytest.raises(error):
        Manifest.from_json(document, "test")


def test_select_takes_a_slice_a_step_a_negative_index_or_names_and_refuses_an_unknown_name() -> None:
    manifest = Manifest("d", "u", ShardFormat.TAR, tuple(Shard(f"{i}.tar", 1) for i in range(10)))
    assert [s.key for s in manifest.select("2:4")] == ["2.tar", "3.tar"]
    assert [s.key for s in manifest.select("::5")] == ["0.tar", "5.tar"]
    assert [s.key for s in manifest.select("-1:")] == ["9.tar"]
    assert [s.key for s in manifest.select("1.tar, 7.tar")] == ["1.tar", "7.tar"]
    assert len(manifest.select(None)) == 10
    with pytest.raises(ShardNotFoundError, match=r"no shard 'x\.tar'"):
        manifest.select("x.tar")


def test_select_a_bare_number_is_an_index() -> None:
    manifest = Manifest("d", "u", ShardFormat.TAR, tuple(Shard(f"part-{i}.tar", 1) for i in range(10)))
    assert [s.key for s in manifest.select("3")] == ["part-3.tar"]
    assert [s.key for s in manifest.select("-1")] == ["part-9.tar"]
    assert [s.key for s in manifest.select("0,3")] == ["part-0.tar", "part-3.tar"]
    with pytest.raises(ConfigError, match=r"--shards 10: .*10 shards"):
        manifest.select("10")
    named = Manifest("d", "u", ShardFormat.FILES, (Shard("3", 1), Shard("4", 1)))
    assert [s.key for s in named.select("4")] == ["4"], "a key that is a number is still that key"


def test_a_prefix_with_tars_and_parquet_says_which_it_reads(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fill_dir(tmp_path / "o", {"a.tar": b"x" * 512, "b.tar": b"x" * 512, "a.parquet": b"p"})
    with caplog.at_level(logging.WARNING, logger="datacache.manifest"):
        manifest = manifest_of(str(tmp_path / "o"))
    assert [s.key for s in manifest.shards] == ["a.tar", "b.tar"]
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "2 .tar" in warned and "1 .parquet" in warned and "format" in warned, warned


def test_manifest_store_ignores_unreadable_files(tmp_path: Path) -> None:
    store = ManifestStore(tmp_path / "m")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "d.json").write_text("{not json")
    assert asyncio.run(store.load("d")) is None
    manifest = Manifest("d", "u", ShardFormat.TAR, (Shard("a.tar", 1),))
    asyncio.run(store.save(manifest))
    loaded = asyncio.run(store.load("d"))
    assert loaded is not None and loaded.shards == manifest.shards
    with pytest.raises(InvalidKeyError):
        asyncio.run(store.load("../escape"))


def test_second_open_does_not_list_the_bucket(s3: S3Bucket, settings: Settings) -> None:
    fill_bucket(s3.client, s3.name, "ds", make_shards(3, 1000))
    dataset = resolve_dataset(s3.url("ds"), settings)
    dataset = DatasetConfig(dataset.name, dataset.url, s3.storage_options)

    async def open_twice(stager: Stager) -> tuple[Manifest, Manifest, Manifest]:
        first = await stager.open(dataset)
        second = await stager.open(dataset)
        return first.manifest, second.manifest, (await stager.open(dataset, refresh=True)).manifest

    s3.server.reset_counts()
    first, second, refreshed = with_stager(settings, open_twice)
    lists = {k: v for k, v in s3.server.request_counts().items() if k == f"GET /{s3.name}"}
    assert lists == {f"GET /{s3.name}": 2}, "one listing, then one for --refresh"
    assert first.snapshot == second.snapshot == refreshed.snapshot
    # A new process (a new stager) reuses the persisted manifest too.
    s3.server.reset_counts()
    again = with_stager(settings, lambda stager: stager.open(dataset))
    assert again.manifest.snapshot == first.snapshot
    assert s3.server.request_counts() == {}
    # A copy goes to the shared tier for tools to inspect (never read back as a snapshot).
    assert settings.shared_dir is not None
    assert (settings.shared_dir / "manifests" / f"{dataset.id}.json").is_file()


def test_missing_bucket_and_prefix_messages(s3: S3Bucket, settings: Settings) -> None:
    s3.put("ds/a.tar", b"x")

    def open_url(url: str) -> None:
        dataset = DatasetConfig("d", url, s3.storage_options)
        with_stager(settings, lambda stager: stager.open(dataset))

    with pytest.raises(ShardNotFoundError, match=r"bucket 'no-such-bucket-x1' does not exist"):
        open_url("s3://no-such-bucket-x1/ds")
    with pytest.raises(ShardNotFoundError) as caught:
        open_url(s3.url("nope"))
    assert "bucket" not in str(caught.value)
    assert f"no objects under {s3.url('nope')}" in str(caught.value)
