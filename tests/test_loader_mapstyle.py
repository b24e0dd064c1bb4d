"""`CachedMapDataset`: ``len`` and ``ds[i]`` give what the iterable dataset gives, for tar, Parquet and Zarr."""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from _ranks import gather_json, process_group, spawn_ranks
from datacache.loaders import CachedIterableDataset, CachedMapDataset
from test_loader import payload, write_wds
from torch.utils.data import DataLoader, DistributedSampler

from datacache.config import Settings
from datacache.errors import ConfigError, SampleDecodeError

if TYPE_CHECKING:
    # Only for annotations: in the whole suite, `conftest` may resolve to tests/faults/conftest.py.
    from conftest import S3Bucket


def _same(left: dict[str, Any], right: dict[str, Any]) -> bool:
    return left.keys() == right.keys() and all(np.array_equal(left[k], right[k]) for k in left)


def _assert_same_as_iterable(url: str, settings: Settings) -> CachedMapDataset:
    reference = list(CachedIterableDataset(url, config=settings, shuffle=False))
    mapped = CachedMapDataset(url, config=settings)
    assert len(mapped) == len(reference)
    for index in reversed(range(len(reference))):  # backwards: every shard opened out of order
        assert _same(mapped[index], reference[index]), index
    return mapped


@pytest.fixture
def uploaded(s3: S3Bucket, tmp_path: Path) -> dict[str, dict[str, bytes]]:
    expected = write_wds(tmp_path / "upload", samples=58, per_shard=12)
    for path in sorted((tmp_path / "upload").glob("*.tar")):
        s3.put(f"wds/{path.name}", path.read_bytes())
    return expected


def test_tar_from_s3_same_bytes_as_the_iterable_for_every_index_one_get_per_shard(
    s3: S3Bucket, uploaded: dict[str, dict[str, bytes]], settings: Settings
) -> None:
    mapped = CachedMapDataset(s3.url("wds"), config=settings)
    s3.server.reset_counts()
    assert len(mapped) == 58  # counts the shards' samples first (the dataset has no index)
    got = [mapped[i] for i in range(58)]
    assert [s["__key__"] for s in got] == sorted(uploaded)
    assert all(s["bin"] == uploaded[s["__key__"]]["bin"] for s in got)
    assert got[13]["__url__"] == s3.url("wds/train-0001.tar")

    def shard_gets() -> list[int]:
        counts = s3.server.request_counts()
        return [n for k, n in counts.items() if k.startswith("GET") and k.endswith(".tar")]

    assert len(shard_gets()) == 5 and max(shard_gets()) <= 2  # counted and staged: not a GET per sample
    s3.server.reset_counts()
    again = CachedMapDataset(s3.url("wds"), config=settings)  # opens every shard anew
    assert [again[i]["bin"] for i in reversed(range(58))] == [s["bin"] for s in reversed(got)]
    assert shard_gets() == []  # staged: read from the local tier
    _assert_same_as_iterable(s3.url("wds"), settings)


def test_parquet_rows_by_row_group_and_offset(tmp_path: Path, settings: Settings) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    origin = tmp_path / "parquet"
    origin.mkdir()
    rows = [{"id": i, "text": f"row {i}"} for i in range(130)]
    for part in range(3):
        chunk = rows[part * 50 : (part + 1) * 50]
        pq.write_table(pa.Table.from_pylist(chunk), origin / f"part-{part}.parquet", row_group_size=7)
    mapped = _assert_same_as_iterable(str(origin), settings)
    assert mapped[57] == {"id": 57, "text": "row 57", "__key__": "part-1/7"}


def test_zarr_rows(tmp_path: Path, settings: Settings) -> None:
    import zarr

    path = tmp_path / "array.zarr"
    data = np.arange(47 * 3, dtype=np.int32).reshape(47, 3)
    zarr.open_array(str(path), mode="w", shape=data.shape, chunks=(10, 3), dtype="i4")[:] = data
    mapped = _assert_same_as_iterable(str(path), settings)
    np.testing.assert_array_equal(mapped[46]["data"], data[46])


def test_indexes_out_of_range_or_of_the_wrong_type_are_refused(tmp_path: Path, settings: Settings) -> None:
    write_wds(tmp_path / "origin", samples=10, per_shard=5)
    mapped = CachedMapDataset(str(tmp_path / "origin"), config=settings)
    assert mapped[np.int64(9)]["__key__"] == "sample000009"
    for index in (10, -1, -11, 1 << 40):
        with pytest.raises(IndexError, match=f"index {index} is out of range.*0 to 9"):
            mapped[index]
    with pytest.raises(TypeError, match="integers"):
        mapped[1:3]  # type: ignore[index]
    with pytest.raises(ConfigError, match="max_open"):
        CachedMapDataset(str(tmp_path / "origin"), config=settings, max_open=0)


def test_a_brace_pattern_indexes_the_shards_it_names_and_several_sources_are_refused(
    tmp_path: Path, settings: Settings
) -> None:
    write_wds(tmp_path / "origin", samples=50, per_shard=10)
    mapped = CachedMapDataset(str(tmp_path / "origin" / "train-{0001..0002}.tar"), config=settings)
    assert [mapped[i]["__key__"] for i in range(len(mapped))] == [f"sample{i:06d}" for i in range(10, 30)]
    with pytest.raises(ConfigError, match=r"one source.*ConcatDataset"):
        CachedMapDataset([str(tmp_path / "origin"), str(tmp_path / "origin")], config=settings)


def _size_and_label(sample: dict[str, Any]) -> tuple[str, int, int]:
    return sample["__key__"], len(sample["bin"]), sample["cls"]


def _reject_four(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["__key__"].endswith("4"):
        raise ValueError("four")
    return sample


def test_decode_and_transform_and_their_errors(tmp_path: Path, settings: Settings) -> None:
    write_wds(tmp_path / "origin", samples=10, per_shard=5)
    url = str(tmp_path / "origin")
    mapped = CachedMapDataset(url, config=settings, decode="basic", transform=_size_and_label, max_open=1)
    seven, zero = ("sample000007", len(payload(7)), 7), ("sample000000", len(payload(0)), 0)
    assert [mapped[i] for i in (7, 0, 7)] == [seven, zero, seven]  # max_open=1: shards closed and reopened
    with pytest.raises(SampleDecodeError, match=r"'train-0000.tar'.*sample000004.*transform '_reject_four'.*four"):
        CachedMapDataset(url, config=settings, transform=_reject_four)[4]


def test_dataloader_workers_and_pickling_read_every_index_once(tmp_path: Path, settings: Settings) -> None:
    expected = write_wds(tmp_path / "origin", samples=45, per_shard=10)
    mapped = CachedMapDataset(str(tmp_path / "origin"), config=settings, transform=_size_and_label)
    assert pickle.loads(pickle.dumps(mapped))[3] == mapped[3]
    loader = DataLoader(mapped, batch_size=4, shuffle=True, num_workers=2)
    got = [(key, int(size)) for keys, sizes, _ in loader for key, size in zip(keys, sizes, strict=True)]
    assert sorted(got) == sorted((key, len(fields["bin"])) for key, fields in expected.items())


def _rank_main(rank: int, world: int, init_file: str, origin: str, settings_blob: bytes, out: str) -> None:
    with process_group(rank, world, init_file):
        mapped = CachedMapDataset(origin, config=pickle.loads(settings_blob))
        sampler = DistributedSampler(mapped, shuffle=True, seed=5)
        keys = [key for batch in DataLoader(mapped, batch_size=3, sampler=sampler) for key in batch["__key__"]]
        gather_json(keys, out)


def test_distributed_sampler_over_two_gloo_ranks_covers_every_index_once(tmp_path: Path, settings: Settings) -> None:
    expected = write_wds(tmp_path / "origin", samples=52, per_shard=10)
    out = tmp_path / "result.json"
    spawn_ranks(_rank_main, tmp_path / "init", str(tmp_path / "origin"), pickle.dumps(settings), str(out))
    first, second = json.loads(out.read_text())
    assert len(first) == len(second) == 26
    assert Counter(first + second) == Counter(set(expected))  # each key once
