"""Table rows (Parquet) read many at a time: batches taken by Arrow, samples converted together.

The order, resume and skipping must be exactly those of reading one row at a time: a batch holds
the per-sample order's rows, a state saved mid-chunk resumes at the next row, a file whose data
(not its footer) is damaged opens and is skipped, or named, when its rows are read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from datacache.loaders import CachedIterableDataset
from datacache.loaders.shardfiles import open_unit_reader

from datacache.config import Settings
from datacache.errors import ShardReadError
from datacache.formats._base import Unit
from datacache.manifest import ShardFormat

ROWS = 6000
WIDTH = 2048
"""Rows of 2 KB: about 1,024 rows a decoded slice, so a row group holds several slices."""


def write_rows(origin: Path, files: int = 2) -> list[int]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    origin.mkdir(parents=True)
    for part in range(files):
        ids = np.arange(part * ROWS, (part + 1) * ROWS, dtype=np.int32)
        blob = pa.array([bytes([part]) * WIDTH] * ROWS, pa.binary())
        pq.write_table(pa.table({"id": ids, "blob": blob}), origin / f"part-{part}.parquet", row_group_size=ROWS)
    return list(range(files * ROWS))


def ids_of(items: list[Any]) -> list[int]:
    out: list[int] = []
    for item in items:
        out.extend(item.column("id").to_pylist() if hasattr(item, "column") else [item["id"]])
    return out


def test_batches_are_arrow_rows_in_the_per_sample_order(tmp_path: Path, settings: Settings) -> None:
    import pyarrow as pa

    expected = write_rows(tmp_path / "rows")
    url = str(tmp_path / "rows")
    samples = list(CachedIterableDataset(url, config=settings, seed=3, shuffle_buffer=3000))
    assert sorted(ids_of(samples)) == expected
    batches = list(CachedIterableDataset(url, config=settings, seed=3, shuffle_buffer=3000, batch_size=500))
    assert ids_of(batches) == ids_of(samples)  # the same order, whichever way it is read
    first = batches[0]
    # The file's own column types: never rebuilt from Python objects (which would make id an int64).
    assert first.schema.field("id").type == pa.int32() and first.schema.field("blob").type == pa.binary()
    assert first.column("__key__").to_pylist() == [s["__key__"] for s in samples[:500]]
    assert all(s["__key__"] == f"part-{s['id'] // ROWS}/{s['id'] % ROWS}" for s in samples)
    assert all(s["blob"] == bytes([s["id"] // ROWS]) * WIDTH for s in samples[:50])


@pytest.mark.parametrize("batch_size", [None, 300])
def test_a_state_saved_between_rows_read_together_resumes_at_the_next_row(
    tmp_path: Path, settings: Settings, batch_size: int | None
) -> None:
    write_rows(tmp_path / "rows")
    url = str(tmp_path / "rows")
    whole = ids_of(list(CachedIterableDataset(url, config=settings, seed=5, batch_size=batch_size)))
    dataset = CachedIterableDataset(url, config=settings, seed=5, batch_size=batch_size)
    iterator = iter(dataset)
    head = ids_of([next(iterator) for _ in range(7 if batch_size else 1234)])  # inside a chunk of rows
    state = dataset.state_dict()
    del iterator
    again = CachedIterableDataset(url, config=settings, seed=5, batch_size=batch_size)
    again.load_state_dict(state)
    assert head + ids_of(list(again)) == whole


def damaged_file(tmp_path: Path) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "one.parquet"
    pq.write_table(pa.Table.from_pylist([{"i": j} for j in range(10)]), path)
    raw = bytearray(path.read_bytes())
    raw[4:40] = b"\xff" * 36  # the first column chunk's page header; the footer stays intact
    return bytes(raw)


def test_a_parquet_file_opens_from_its_footer_and_names_damaged_data_when_read(tmp_path: Path) -> None:
    raw = damaged_file(tmp_path)
    unit = Unit(("one.parquet",), 10, "one.parquet")
    reader = open_unit_reader(ShardFormat.PARQUET, unit, "here", {"one.parquet": raw}, {})
    try:
        with pytest.raises(ShardReadError, match=r"here: corrupt Parquet data"):
            reader.sample(3)
    finally:
        reader.close()


def test_damaged_parquet_data_is_skipped_in_batch_mode_on_request(tmp_path: Path, settings: Settings) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    origin = tmp_path / "pq"
    origin.mkdir()
    for part in range(3):
        pq.write_table(pa.Table.from_pylist([{"i": part * 10 + j} for j in range(10)]), origin / f"p{part}.parquet")
    (origin / "p1.parquet").write_bytes(damaged_file(tmp_path))
    with pytest.raises(ShardReadError, match=r"p1\.parquet"):
        list(CachedIterableDataset(str(origin), config=settings, batch_size=4))
    skipping = CachedIterableDataset(str(origin), config=settings, on_error="skip", batch_size=4)
    got = sorted(i for batch in skipping for i in batch.column("i").to_pylist())
    assert got == [*range(10), *range(20, 30)]
    stats = skipping.stats()
    assert stats.skipped_shards == 1 and stats.skipped_samples == 10


def test_a_state_saved_among_rows_around_a_skipped_file_resumes_at_the_next_row(
    tmp_path: Path, settings: Settings
) -> None:
    # Rows read together are yielded without a count per row when none was skipped; a damaged
    # file's positions, shuffled among the others, leave gaps that the saved count must follow.
    import pyarrow as pa
    import pyarrow.parquet as pq

    origin = tmp_path / "pq"
    origin.mkdir()
    for part in range(3):
        pq.write_table(pa.Table.from_pylist([{"i": part * 10 + j} for j in range(10)]), origin / f"p{part}.parquet")
    (origin / "p1.parquet").write_bytes(damaged_file(tmp_path))
    url = str(origin)
    whole = [s["i"] for s in CachedIterableDataset(url, config=settings, on_error="skip", seed=2)]
    assert sorted(whole) == [*range(10), *range(20, 30)]
    for cut in (1, 7, 13, 19):
        dataset = CachedIterableDataset(url, config=settings, on_error="skip", seed=2)
        iterator = iter(dataset)
        head = [next(iterator)["i"] for _ in range(cut)]
        state = dataset.state_dict()
        del iterator
        again = CachedIterableDataset(url, config=settings, on_error="skip", seed=2)
        again.load_state_dict(state)
        assert head + [s["i"] for s in again] == whole, cut


def test_batch_mode_raises_damage_at_the_batch_that_reads_it_not_before(tmp_path: Path, settings: Settings) -> None:
    # Batches are cut from chunks of several batches taken at once: a chunk holding a damaged
    # file's rows must not raise for the batches before them.
    import pyarrow as pa
    import pyarrow.parquet as pq

    origin = tmp_path / "pq"
    origin.mkdir()
    for part in range(3):
        pq.write_table(pa.Table.from_pylist([{"i": part * 10 + j} for j in range(10)]), origin / f"p{part}.parquet")
    (origin / "p1.parquet").write_bytes(damaged_file(tmp_path))
    got: list[int] = []
    with pytest.raises(ShardReadError, match=r"p1\.parquet"):
        for batch in CachedIterableDataset(str(origin), config=settings, shuffle=False, batch_size=4):
            got.extend(batch.column("i").to_pylist())
    assert got == list(range(8))  # rows 8 and 9 share their batch with p1's first rows


def test_rows_become_the_dicts_to_pylist_makes() -> None:
    import pyarrow as pa
    from datacache.loaders.reading.rows import python_rows

    columns = {
        "i": pa.array([1, None, 3], pa.int32()),
        "s": pa.array(["a", "é", None]),
        "b": pa.array([b"x", None, b""], pa.binary()),
        "l": pa.array([[1, 2], [], None], pa.list_(pa.int64())),
        "t": pa.array([{"x": 1}, None, {"x": 3}], pa.struct([("x", pa.int8())])),
    }
    names = list(columns)
    for width in range(1, len(names) + 1):
        for first in range(len(names) - width + 1):
            batch = pa.record_batch({name: columns[name] for name in names[first : first + width]})
            assert python_rows(batch) == batch.to_pylist()
            assert python_rows(batch.slice(1, 2)) == batch.slice(1, 2).to_pylist()
    same = pa.RecordBatch.from_arrays([columns["i"], columns["s"]], names=["a", "a"])
    assert python_rows(same) == same.to_pylist()


def test_batch_mode_yields_a_built_chunks_batches_from_a_list_not_each_through_the_read_ahead(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datacache.loaders.reading.batching import ReadAhead

    origin = tmp_path / "small"
    origin.mkdir()
    for part in range(2):
        ids = np.arange(part * 20_000, (part + 1) * 20_000, dtype=np.int32)
        pq.write_table(pa.table({"id": ids}), origin / f"part-{part}.parquet", row_group_size=1 << 14)
    url = str(origin)
    samples = ids_of(list(CachedIterableDataset(url, config=settings, seed=4)))
    calls: list[int] = []
    schedule = ReadAhead.schedule

    def counted(self: ReadAhead, begin: int, size: int, total: int) -> None:
        calls.append(begin)
        schedule(self, begin, size, total)

    monkeypatch.setattr(ReadAhead, "schedule", counted)
    batches = list(CachedIterableDataset(url, config=settings, seed=4, batch_size=256))
    assert ids_of(batches) == samples  # the per-sample order, whichever way the batches are handed out
    assert len(batches) == 157
    # Small rows: chunks of 16 batches. Handing each batch through the read-ahead (scheduling, release
    # look-ups, counters) cost more CPU than its rows; a chunk built is cut and handed out from a list.
    assert 0 < len(calls) <= len(batches) // 4, len(calls)
