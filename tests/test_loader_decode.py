"""Decoders and what each sample carries: ``__key__`` and ``__url__`` whatever the decoder, and decoder failures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from datacache.loaders import CachedIterableDataset
from test_loader import keys_of, payload, write_wds

from datacache.config import Settings
from datacache.errors import DatacacheError


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    directory = tmp_path / "origin"
    write_wds(directory, samples=30, per_shard=10)
    return directory


def test_every_decoder_keeps_url_and_key(origin: Path, settings: Settings) -> None:
    want = f"{origin}/train-0000.tar"
    for decode in ("auto", None, lambda s: s, {"cls": int}):
        first = next(iter(CachedIterableDataset(str(origin), config=settings, shuffle=False, decode=decode)))
        assert first["__key__"] == "sample000000", decode
        assert first["__url__"] == want, decode
    raw = next(iter(CachedIterableDataset(str(origin), config=settings, shuffle=False, decode=None)))
    assert raw["bin"] == payload(0)


def _bad_cls(value: bytes) -> int:
    if value == b"3":
        raise ValueError("three is not allowed")
    return int(value)


@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_decoder_error_names_dataset_shard_key_and_field(
    origin: Path, settings: Settings, batch_size: int | None
) -> None:
    dataset = CachedIterableDataset(
        str(origin), config=settings, shuffle=False, decode={"cls": _bad_cls}, batch_size=batch_size
    )
    with pytest.raises(DatacacheError) as failure:
        list(dataset)
    message = str(failure.value)
    assert "dataset" in message and "'train-0000.tar'" in message
    assert "sample000003" in message and "'cls'" in message and "three is not allowed" in message
    assert isinstance(failure.value.__cause__, ValueError)
    skipping = CachedIterableDataset(
        str(origin), config=settings, shuffle=False, decode={"cls": _bad_cls}, batch_size=batch_size, on_error="skip"
    )
    got = keys_of(skipping)
    assert sorted(got) == [f"sample{i:06d}" for i in range(30) if i % 10 != 3]
    assert skipping.stats().skipped_samples == 3


def test_a_whole_sample_decoder_error_names_the_decoder(origin: Path, settings: Settings) -> None:
    def broken(sample: dict[str, Any]) -> Any:
        return sample["missing"]

    with pytest.raises(DatacacheError, match=r"sample000000.*broken.*KeyError"):
        list(CachedIterableDataset(str(origin), config=settings, shuffle=False, decode=broken))


def test_parquet_rows_have_keys(tmp_path: Path, settings: Settings) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = tmp_path / "pq"
    directory.mkdir()
    for part in range(2):
        pq.write_table(pa.Table.from_pylist([{"i": part * 5 + j} for j in range(5)]), directory / f"p{part}.parquet")
    rows = list(CachedIterableDataset(str(directory), config=settings, shuffle=False))
    assert [row["__key__"] for row in rows] == [f"p{part}/{j}" for part in range(2) for j in range(5)]
    assert [row["i"] for row in rows] == list(range(10))
