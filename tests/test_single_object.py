"""A dataset that is one object or one file: warm it, read it, from S3 or a local path."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq
from _helpers import run_cli
from datacache.loaders import CachedIterableDataset
from test_loader import keys_of, write_wds

from datacache.config import Settings

if TYPE_CHECKING:
    # Only for annotations: in the whole suite, `conftest` may resolve to tests/faults/conftest.py.
    from conftest import S3Bucket


def _parquet(rows: list[dict[str, int]]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return bytes(sink.getvalue().to_pybytes())


def test_warm_and_read_one_tar_object(
    s3: S3Bucket, settings: Settings, cache_env: dict[str, str], tmp_path: Path
) -> None:
    expected = write_wds(tmp_path / "upload", samples=25, per_shard=100)
    s3.put("single/one.tar", (tmp_path / "upload" / "train-0000.tar").read_bytes())
    s3.put("single/other.tar", (tmp_path / "upload" / "train-0000.tar").read_bytes())
    env = {
        **cache_env,
        **s3.server.env(),
        "DATACACHE_LOCAL_DIR": str(tmp_path / "local"),
        "DATACACHE_SHARED_DIR": str(tmp_path / "shared"),
    }
    result = run_cli(["warm", s3.url("single/one.tar")], env)
    assert result.returncode == 0, result.stderr
    assert "1/1 shards" in result.stdout + result.stderr, result.stdout + result.stderr
    dataset = CachedIterableDataset(s3.url("single/one.tar"), config=settings, shuffle=False)
    assert keys_of(dataset) == sorted(expected)


def test_read_one_parquet_object_of_a_table(s3: S3Bucket, settings: Settings) -> None:
    s3.put("t/part-0.parquet", _parquet([{"i": i} for i in range(7)]))
    s3.put("t/part-1.parquet", _parquet([{"i": i} for i in range(100, 105)]))
    rows = list(CachedIterableDataset(s3.url("t/part-0.parquet"), config=settings, shuffle=False))
    assert [row["i"] for row in rows] == list(range(7))
    assert rows[0]["__key__"] == "part-0/0"


def test_read_one_local_file(tmp_path: Path, settings: Settings) -> None:
    expected = write_wds(tmp_path / "data", samples=12, per_shard=5)
    path = tmp_path / "data" / "train-0001.tar"
    for spec in (str(path), f"file://{path}"):
        got = keys_of(CachedIterableDataset(spec, config=settings, shuffle=False))
        assert got == sorted(expected)[5:10], spec


def test_one_file_through_the_daemon_and_after_its_death(tmp_path: Path, cache_env: dict[str, str]) -> None:
    from _daemon import start_daemon

    from datacache.config import load_settings

    expected = write_wds(tmp_path / "data", samples=30, per_shard=10)
    path = tmp_path / "data" / "train-0002.tar"
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        settings = load_settings(daemon.env)
        dataset = CachedIterableDataset(str(path), config=settings, shuffle=False)
        assert keys_of(dataset) == sorted(expected)[20:]
        assert dataset.stats().mode == "daemon"
        daemon.kill()  # the reader goes on with its own stager, through the same parent
        again = CachedIterableDataset(str(path), config=settings, shuffle=False)
        assert keys_of(again) == sorted(expected)[20:]
    finally:
        daemon.kill()
