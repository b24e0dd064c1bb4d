"""Reading samples out of cached shards, per format, without converting anything.

A dataset is read in *units*: a tar shard, a Parquet file, a plain file, or
one row of chunks of a Zarr array. Each unit has a sample count (known before
the epoch starts, so the global order can be dealt exactly) and the shard keys
it needs. A `UnitReader` serves the samples of one unit from bytes that were
checked against the manifest: an ``mmap`` of a local file, or bytes read from
the next tier.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from datacache.checksum import checksum_of, new_hasher
from datacache.errors import ShardReadError
from datacache.manifest import Manifest, ShardFormat
from datacache.tarindex import SampleSpan, SpanTable, group_samples, scan_tar, split_key
from datacache.units import format_bytes

__all__ = [
    "COUNT_SOURCES",
    "SpanCache",
    "TarReader",
    "Unit",
    "UnitPlan",
    "UnitReader",
    "hash_buffer",
    "map_file",
    "open_unit_reader",
    "sample_of",
    "zarr_plan",
]

Fields = list[tuple[str, memoryview]]
COUNT_SOURCES = "count_sources"
"""The plan's ``extra`` entry naming where its tar sample counts came from (sidecar indexes, the cluster's)."""


@dataclass(frozen=True, slots=True)
class Unit:
    """A run of samples read together: one shard, or one row of Zarr chunks."""

    keys: tuple[str, ...]
    count: int
    label: str


@dataclass(frozen=True)
class UnitPlan:
    """A dataset's units in manifest order, with where each unit's samples start."""

    units: tuple[Unit, ...]
    extra: Mapping[str, Any]
    unreadable: Mapping[str, str] = field(default_factory=dict)
    """Shard key -> why its samples could not be counted; its unit holds no samples."""

    @property
    def counts(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        return np.fromiter((unit.count for unit in self.units), dtype=np.int64, count=len(self.units))

    @property
    def total(self) -> int:
        return sum(unit.count for unit in self.units)

    def to_json(self) -> dict[str, Any]:
        return {
            "units": [[list(u.keys), u.count, u.label] for u in self.units],
            "extra": dict(self.extra),
            "unreadable": dict(self.unreadable),
        }

    @classmethod
    def from_json(cls, data: Any) -> UnitPlan:
        if not isinstance(data, dict) or not isinstance(data.get("units"), list):
            raise ValueError("not a unit plan")
        units = []
        for entry in data["units"]:
            keys, count, label = entry
            units.append(Unit(tuple(str(k) for k in keys), int(count), str(label)))
        unreadable = {str(k): str(v) for k, v in dict(data.get("unreadable") or {}).items()}
        return cls(tuple(units), dict(data.get("extra") or {}), unreadable)


def map_file(path: Path) -> mmap.mmap | bytes:
    """Map a file read-only (shared with the page cache: no copy, no private memory)."""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            return b""
        # No MAP_POPULATE: CPython holds the GIL across mmap(), and populating 64 MB takes
        # ~10 ms, a stall for every other thread. The checksum pass that follows faults the
        # pages in with the GIL released; WILLNEED starts the readahead meanwhile.
        mapping = mmap.mmap(handle.fileno(), size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        with contextlib.suppress(AttributeError, OSError):
            mapping.madvise(mmap.MADV_WILLNEED)
        return mapping


def hash_buffer(buffer: bytes | mmap.mmap | memoryview) -> str:
    """The manifest checksum of ``buffer``."""
    hasher = new_hasher()
    hasher.update(buffer)
    return checksum_of(hasher)


class SpanCache:
    """Tar shard indexes already scanned, so a shard is scanned once per node, not once per epoch and worker.

    Scanning a tar's headers in Python costs ~20-40 us per sample, as much as
    reading the sample. Keyed by what identifies the verified bytes (key,
    size, checksum or version). Held in memory (bounded by samples) and, when
    ``directory`` is given, in small files there, so that new worker processes
    and later runs on the node reuse them.
    """

    def __init__(self, max_samples: int = 1 << 19, directory: Path | None = None) -> None:
        self._entries: OrderedDict[tuple[str, int, str | None], SpanTable] = OrderedDict()
        self._samples = 0
        self._max = max_samples
        self._lock = threading.Lock()
        self._directory = directory

    def _file(self, key: tuple[str, int, str | None]) -> Path | None:
        if self._directory is None:
            return None
        name = hashlib.sha256(json.dumps(list(key)).encode()).hexdigest()[:40]
        return self._directory / f"{name}.spans"

    def get(self, key: tuple[str, int, str | None]) -> SpanTable | None:
        with self._lock:
            spans = self._entries.get(key)
            if spans is not None:
                self._entries.move_to_end(key)
                return spans
        path = self._file(key)
        if path is None:
            return None
        try:
            loaded = SpanTable.from_bytes(path.read_bytes(), where=str(path))
        except (OSError, ShardReadError):
            return None
        if loaded.shard_size != key[1]:
            return None
        self._remember(key, loaded)
        return loaded

    def put(self, key: tuple[str, int, str | None], spans: Sequence[SampleSpan]) -> None:
        spans = SpanTable.from_spans(spans, shard_size=key[1])
        self._remember(key, spans)
        path = self._file(key)
        if path is None or path.exists():
            return
        try:
            for directory in reversed([path.parent, *path.parent.parents][:3]):  # indexes/spans/<id>: private
                with contextlib.suppress(FileExistsError):
                    directory.mkdir(mode=0o700)
            temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            out = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(out, "wb") as handle:
                handle.write(spans.to_bytes())
            os.replace(temporary, path)
        except OSError:
            pass  # an index we could not keep is scanned again next time

    def _remember(self, key: tuple[str, int, str | None], spans: SpanTable) -> None:
        if len(spans) > self._max:
            return
        with self._lock:
            if key in self._entries:
                return
            self._entries[key] = spans
            self._samples += len(spans)
            while self._samples > self._max:
                _, dropped = self._entries.popitem(last=False)
                self._samples -= len(dropped)


def sample_of(fields: Fields, payload: Callable[[memoryview], bytes] = bytes) -> dict[str, Any]:
    """Raw fields as a sample dict: ``__key__`` decoded, each other field's bytes made by ``payload``."""
    sample: dict[str, Any] = {}
    for name, view in fields:
        sample[name] = payload(view) if name != "__key__" else view.tobytes().decode("utf-8", "surrogateescape")
    return sample


class UnitReader:
    """Serves the samples of one unit. Subclasses implement one format each."""

    def __init__(self, unit: Unit, where: str) -> None:
        self.unit = unit
        self.where = where

    def fields(self, index: int) -> Fields:
        """The raw fields of sample ``index`` as (name, bytes view) pairs; ``__key__`` first."""
        raise NotImplementedError

    def sample(self, index: int) -> dict[str, Any]:
        """Sample ``index`` as a dict: ``__key__`` and one entry per field."""
        return sample_of(self.fields(index))

    @property
    def packable(self) -> bool:
        """Whether `fields` gives raw bytes that batches can pack without decoding."""
        return True

    def close(self) -> None:
        """Release the buffer (unmap the file)."""


class _BufferReader(UnitReader):
    def __init__(self, unit: Unit, where: str, buffer: mmap.mmap | bytes) -> None:
        super().__init__(unit, where)
        self._buffer = buffer
        self._view = memoryview(buffer)

    def close(self) -> None:
        self._view.release()
        if isinstance(self._buffer, mmap.mmap):
            self._buffer.close()


class TarReader(_BufferReader):
    """A WebDataset tar shard: samples are runs of members sharing a key."""

    def __init__(
        self,
        unit: Unit,
        where: str,
        buffer: mmap.mmap | bytes,
        spans: Sequence[SampleSpan] | None = None,
        sources: Sequence[str] = (),
    ) -> None:
        super().__init__(unit, where, buffer)
        try:
            if spans is None:
                try:
                    spans = group_samples(scan_tar(self._view, where=where))
                except ValueError as exc:
                    if isinstance(exc, ShardReadError):
                        raise
                    raise ShardReadError(f"{where}: {exc}") from None
            table = SpanTable.from_spans(spans, shard_size=len(self._view))
            if unit.count >= 0 and len(table) != unit.count:  # a negative count: not known yet (a cold epoch)
                said = f" ({', '.join(sources)})" if sources else ""
                raise ShardReadError(
                    f"{where}: holds {len(table)} samples, its sample index{said} says {unit.count}: "
                    "the index is wrong; fix or delete it, then run `datacache index URL --rescan`"
                )
        except BaseException:
            # The caller unmaps the buffer; an export left in a frame the traceback keeps would forbid it.
            self._view.release()
            raise
        self.spans: SpanTable = table
        self._keys = [memoryview(table.key(i).encode("utf-8", "surrogateescape")) for i in range(len(table))]

    def fields(self, index: int) -> Fields:
        fields: Fields = [("__key__", self._keys[index])]
        fields += self.spans.views(index, self._view)
        return fields


class FileReader(_BufferReader):
    """A plain file: one sample, its field named by the file's extension (``data`` if none)."""

    def __init__(self, unit: Unit, where: str, buffer: mmap.mmap | bytes) -> None:
        super().__init__(unit, where, buffer)
        split = split_key(unit.keys[0])
        self._key, self._field = split if split is not None else (unit.keys[0], "data")
        self._key_bytes = self._key.encode("utf-8", "surrogateescape")

    def fields(self, index: int) -> Fields:
        if index != 0:
            raise IndexError(index)
        return [("__key__", memoryview(self._key_bytes)), (self._field, self._view)]


class ParquetReader(UnitReader):
    """A Parquet file: one sample per row, as a dict of column values, decoded a batch at a time."""

    def __init__(self, unit: Unit, where: str, buffer: mmap.mmap | bytes) -> None:
        super().__init__(unit, where)
        import pyarrow as pa
        from datacache.loaders._parquet import ParquetRows

        try:
            self._rows = ParquetRows(buffer)
        except (pa.ArrowException, OSError, ValueError) as exc:  # ValueError: a column name that is not UTF-8
            raise ShardReadError(f"{where}: corrupt Parquet file ({exc})") from None
        if self._rows.num_rows != unit.count:
            self._rows.close()
            raise ShardReadError(f"{where}: holds {self._rows.num_rows} rows, its footer said {unit.count}")
        self._buffer = buffer
        self._stem = unit.keys[0].removesuffix(".parquet")

    @property
    def packable(self) -> bool:
        return False

    def sample(self, index: int) -> dict[str, Any]:
        import pyarrow as pa

        try:
            row = self._rows.row(index)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise ShardReadError(f"{self.where}: corrupt Parquet data at row {index} ({exc})") from None
        row.setdefault("__key__", f"{self._stem}/{index}")  # cached with its batch: set once
        return row

    def close(self) -> None:
        self._rows.close()
        if isinstance(self._buffer, mmap.mmap):
            # Arrow may still hold a view of the mapping (it frees its buffers lazily): then the
            # mapping is released with the last view instead of now.
            with contextlib.suppress(BufferError):
                self._buffer.close()


class ZarrReader(UnitReader):
    """One row of chunks of a Zarr array (or of every array of a group), as numpy rows."""

    def __init__(self, unit: Unit, where: str, files: Mapping[str, bytes], extra: Mapping[str, Any]) -> None:
        super().__init__(unit, where)
        import zarr
        from zarr.core.buffer import cpu
        from zarr.storage import MemoryStore

        store = MemoryStore({key: cpu.Buffer.from_bytes(data) for key, data in files.items()}, read_only=True)
        start = int(extra["row_starts"][int(unit.label)])
        stop = start + unit.count
        arrays: dict[str, Any] = {}
        backing = sum(len(data) for data in files.values())
        try:
            for name in extra["arrays"]:
                path = name if name else None
                array = zarr.open_array(store=store, path=path or "", mode="r")
                _check_backed(array, stop - start, backing, f"{where}: Zarr array {name or '/'}")
                arrays[name or "data"] = np.asarray(array[start:stop])
        except ShardReadError:
            raise
        except Exception as exc:  # zarr raises many types for bad metadata or codecs
            raise ShardReadError(f"{where}: cannot read Zarr chunks ({type(exc).__name__}: {exc})") from None
        self._arrays = arrays
        self._start = start

    @property
    def packable(self) -> bool:
        return False

    def sample(self, index: int) -> dict[str, Any]:
        sample: dict[str, Any] = {"__key__": str(self._start + index)}
        for name, rows in self._arrays.items():
            sample[name] = rows[index]
        return sample

    def rows(self, indexes: Sequence[int]) -> dict[str, Any]:
        """Several samples at once, stacked per array."""
        return {name: rows[np.asarray(indexes)] for name, rows in self._arrays.items()}


ZARR_UNBACKED_BYTES = 64 << 20
"""What a row of Zarr chunks may decode to whatever its stored bytes (missing chunks are fill values)."""
ZARR_MAX_RATIO = 1024
"""Beyond that, decoded bytes per stored byte, at most: a declared shape must be backed by data."""


def _check_backed(array: Any, rows: int, backing: int, where: str) -> None:
    """Refuse, before allocating, rows whose declared size no stored bytes back (a 157-byte
    ``.zarray`` can declare an 8000x8000 chunk of float64: 512 MB of fill values)."""
    declared = rows * math.prod(int(n) for n in array.shape[1:]) * np.dtype(array.dtype).itemsize
    allowed = max(ZARR_UNBACKED_BYTES, ZARR_MAX_RATIO * backing)
    if declared > allowed:
        raise ShardReadError(
            f"{where}: rows of {format_bytes(declared)} declared, backed by {format_bytes(backing)} of chunks "
            f"(at most {format_bytes(ZARR_UNBACKED_BYTES)} or {ZARR_MAX_RATIO}x the stored bytes are decoded)"
        )


def open_unit_reader(
    fmt: ShardFormat,
    unit: Unit,
    where: str,
    buffers: Mapping[str, mmap.mmap | bytes],
    extra: Mapping[str, Any],
    *,
    spans: Sequence[SampleSpan] | None = None,
) -> UnitReader:
    """A reader for ``unit`` over the verified bytes of its shards (``spans``: a tar shard's known index)."""
    if fmt is ShardFormat.TAR:
        return TarReader(unit, where, buffers[unit.keys[0]], spans, tuple(extra.get(COUNT_SOURCES, ())))
    if fmt is ShardFormat.PARQUET:
        return ParquetReader(unit, where, buffers[unit.keys[0]])
    if fmt is ShardFormat.FILES:
        return FileReader(unit, where, buffers[unit.keys[0]])
    files = {key: bytes(buffer) for key, buffer in buffers.items()}
    return ZarrReader(unit, where, files, extra)


# -- unit plans -------------------------------------------------------------------------------


def _table(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _dimensions(value: Any, least: int) -> TypeGuard[list[int]]:
    """Whether ``value`` is a non-empty list of integers, each at least ``least``."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= least for n in value)
    )


def zarr_plan(manifest: Manifest, read_metadata: Callable[[str], bytes]) -> UnitPlan:
    """Units of a Zarr store: one per row of chunks along the first axis.

    Works for a single array or a group whose arrays share their first
    dimension and its chunking (each sample is then one row of every array).
    """
    keys = {shard.key for shard in manifest.shards}
    metadata_keys = sorted(k for k in keys if k.rsplit("/", 1)[-1] in ("zarr.json", ".zarray", ".zgroup", ".zattrs"))
    arrays: dict[str, dict[str, Any]] = {}
    for key in metadata_keys:
        name = key.rsplit("/", 1)[-1]
        prefix = key[: -len(name)].rstrip("/")
        if name not in ("zarr.json", ".zarray"):
            continue
        try:
            document = json.loads(read_metadata(key))
        except ValueError as exc:
            raise ShardReadError(f"dataset {manifest.dataset}: {key}: invalid Zarr metadata ({exc})") from None
        if not isinstance(document, dict):
            raise ShardReadError(f"dataset {manifest.dataset}: {key}: Zarr metadata must be a JSON object")
        if name == "zarr.json" and document.get("node_type") != "array":
            continue
        shape = document.get("shape")
        if name == "zarr.json":
            grid = _table(_table(document.get("chunk_grid")).get("configuration")).get("chunk_shape")
            encoding = _table(document.get("chunk_key_encoding"))
            separator = _table(encoding.get("configuration")).get("separator", "/")
            kind = encoding.get("name", "default")
        else:
            grid = document.get("chunks")
            separator = document.get("dimension_separator", ".") or "."
            kind = "v2"
        if not _dimensions(shape, 0) or not _dimensions(grid, 1) or len(grid) != len(shape):
            raise ShardReadError(f"dataset {manifest.dataset}: {key}: Zarr metadata lacks shape or chunks")
        if separator not in (".", "/") or not isinstance(kind, str):
            raise ShardReadError(f"dataset {manifest.dataset}: {key}: unsupported Zarr chunk key encoding")
        arrays[prefix] = {"shape": shape, "chunks": grid, "separator": separator, "kind": kind}
    if not arrays:
        raise ShardReadError(f"dataset {manifest.dataset}: no Zarr array found")
    first = next(iter(arrays.values()))
    rows, row_chunk = int(first["shape"][0]), int(first["chunks"][0])
    for prefix, info in arrays.items():
        if int(info["shape"][0]) != rows or int(info["chunks"][0]) != row_chunk:
            raise ShardReadError(
                f"dataset {manifest.dataset}: Zarr array {prefix or '/'} does not share the first axis "
                f"({info['shape'][0]} rows in chunks of {info['chunks'][0]}) with the others"
            )
    chunk_rows = -(-rows // row_chunk) if rows else 0
    if chunk_rows > 1000 * len(keys):
        raise ShardReadError(
            f"dataset {manifest.dataset}: the Zarr metadata declares {chunk_rows} rows of chunks, "
            f"but the store holds {len(keys)} objects"
        )
    units = []
    row_starts = []
    for row in range(chunk_rows):
        needed = list(metadata_keys)
        for prefix, info in arrays.items():
            base = f"{prefix}/" if prefix else ""
            lead = f"{base}c{info['separator']}{row}" if info["kind"] == "default" else f"{base}{row}"
            sep = info["separator"]
            for key in keys:
                if key == lead or key.startswith(lead + sep):
                    needed.append(key)
        start = row * row_chunk
        row_starts.append(start)
        units.append(Unit(tuple(sorted(set(needed))), min(row_chunk, rows - start), str(row)))
    extra = {"arrays": sorted(arrays), "row_starts": row_starts}
    return UnitPlan(tuple(units), extra)
