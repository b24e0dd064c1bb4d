"""Arrow IPC files (``.arrow``, the file and the stream format): every row of every record batch is a sample.

The proof that a format is one module: `datacache.formats.arrow` and these
tests, and one line in the registry's list.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pytest
from datacache.loaders import CachedIterableDataset
from torch.utils.data import DataLoader

from datacache.config import Settings
from datacache.formats import detect_format_name, get_format
from datacache.formats.testing import FormatTests

if TYPE_CHECKING:
    from conftest import S3Bucket


def arrow_file(rows: list[dict[str, Any]], batch_rows: int = 16) -> bytes:
    """An Arrow IPC file of ``rows``, in record batches of ``batch_rows``."""
    table = pa.Table.from_pylist(rows)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    return bytes(sink.getvalue())


def table_rows(start: int, stop: int) -> list[dict[str, Any]]:
    return [{"id": i, "text": f"row {i}", "score": i / 4} for i in range(start, stop)]


def write_arrow_dataset(directory: Path, parts: int = 3, rows: int = 50) -> dict[str, bytes]:
    files = {f"part-{part}.arrow": arrow_file(table_rows(part * rows, (part + 1) * rows)) for part in range(parts)}
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return files


class TestArrowFormat(FormatTests):
    format_name = "arrow"

    def write_dataset(self, directory: Path) -> dict[str, int]:
        (directory / "part-0.arrow").write_bytes(arrow_file(table_rows(0, 40), batch_rows=7))
        (directory / "part-1.arrow").write_bytes(arrow_file(table_rows(40, 45)))
        (directory / "empty.arrow").write_bytes(_empty())
        (directory / "README.md").write_bytes(b"a table")
        return {"part-0.arrow": 40, "part-1.arrow": 5, "empty.arrow": 0}


def _empty() -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, pa.schema([("id", pa.int64())])):
        pass
    return bytes(sink.getvalue())


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        (["a.arrow", "b.arrow", "README.md"], "arrow"),
        (["a.tar", "a.arrow"], "tar"),
        (["a.parquet", "a.arrow"], "parquet"),
        (["a.jpg", "a.feather"], "files"),
    ],
)
def test_detection(keys: list[str], expected: str) -> None:
    assert detect_format_name(keys) == expected


def test_sample_counts_and_their_bound(tmp_path: Path) -> None:
    fmt = get_format("arrow")
    data = arrow_file(table_rows(0, 33), batch_rows=10)
    assert fmt.max_samples(len(data)) is not None and fmt.max_samples(len(data)) >= 33  # type: ignore[operator]


def test_read_exactly_once_from_a_directory(tmp_path: Path, settings: Settings) -> None:
    write_arrow_dataset(tmp_path)
    dataset = CachedIterableDataset(str(tmp_path), config=settings, seed=3, shuffle_buffer=40)
    assert len(dataset) == 150
    got = list(dataset)
    keys = [row.pop("__key__") for row in got]
    assert len(set(keys)) == 150 and all(key.startswith("part-") for key in keys)
    assert sorted(got, key=lambda row: row["id"]) == table_rows(0, 150)


def test_read_exactly_once_from_s3_in_batches(s3: S3Bucket, settings: Settings, tmp_path: Path) -> None:
    for name, data in write_arrow_dataset(tmp_path, parts=4, rows=30).items():
        s3.put(f"arrow/{name}", data)
    rows = list(CachedIterableDataset(s3.url("arrow/"), config=settings, seed=1))
    assert sorted(row["id"] for row in rows) == list(range(120))
    batches = CachedIterableDataset(s3.url("arrow/"), config=settings, batch_size=32)
    collected = list(DataLoader(batches, batch_size=None, num_workers=2))
    assert all(isinstance(batch, pa.RecordBatch) for batch in collected)
    assert sorted(i for batch in collected for i in batch.column("id").to_pylist()) == list(range(120))


def arrow_stream(rows: list[dict[str, Any]], batch_rows: int = 16) -> bytes:
    """An Arrow IPC stream of ``rows`` (what Hugging Face `datasets` writes: `pa.ipc.new_stream`)."""
    table = pa.Table.from_pylist(rows)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    return bytes(sink.getvalue())


class TestArrowStreamFormat(FormatTests):
    """The contract over stream files (no footer: counted from the batches), one file beside them."""

    format_name = "arrow"

    def write_dataset(self, directory: Path) -> dict[str, int]:
        (directory / "data-00000-of-00002.arrow").write_bytes(arrow_stream(table_rows(0, 40), batch_rows=7))
        (directory / "data-00001-of-00002.arrow").write_bytes(arrow_stream(table_rows(40, 45)))
        (directory / "empty.arrow").write_bytes(_empty_stream())
        (directory / "file.arrow").write_bytes(arrow_file(table_rows(45, 50)))
        return {"data-00000-of-00002.arrow": 40, "data-00001-of-00002.arrow": 5, "empty.arrow": 0, "file.arrow": 5}


def _empty_stream() -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, pa.schema([("id", pa.int64())])):
        pass
    return bytes(sink.getvalue())


def test_a_stream_file_is_read_exactly_once(tmp_path: Path, settings: Settings) -> None:
    """Hugging Face `datasets` writes its cache files with `pa.ipc.new_stream`: they were refused."""
    for part in range(3):
        (tmp_path / f"data-{part:05d}-of-00003.arrow").write_bytes(arrow_stream(table_rows(part * 30, part * 30 + 30)))
    dataset = CachedIterableDataset(str(tmp_path), config=settings, seed=5)
    assert len(dataset) == 90
    rows = list(dataset)
    assert sorted(row["id"] for row in rows) == list(range(90))
    batches = list(CachedIterableDataset(str(tmp_path), config=settings, batch_size=32))
    assert sorted(i for batch in batches for i in batch.column("id").to_pylist()) == list(range(90))


def test_a_truncated_stream_is_refused_in_one_line(tmp_path: Path, settings: Settings) -> None:
    data = arrow_stream(table_rows(0, 50), batch_rows=10)
    (tmp_path / "s.arrow").write_bytes(data[: len(data) - 8])  # whole batches, no end-of-stream marker
    with pytest.raises(Exception, match=r"s\.arrow.*Arrow IPC stream.*end-of-stream marker") as caught:
        list(CachedIterableDataset(str(tmp_path), config=settings))
    assert "\n" not in str(caught.value)
