"""Zarr stores: one unit per row of chunks along the first axis; a sample is one row of every array.

Counts come from the arrays' metadata (``zarr.json`` or ``.zarray``); a group
whose arrays share their first dimension and its chunking reads as one dataset.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, TypeGuard

import numpy as np

from datacache.errors import ShardReadError
from datacache.formats._base import Buffer, PlanContext, SampleFormat, Unit, UnitPlan, UnitReader
from datacache.manifest import Manifest
from datacache.sizes import format_bytes

__all__ = ["FORMAT", "ZarrFormat", "ZarrReader", "zarr_plan"]

ARRAY_METADATA = ("zarr.json", ".zarray")
"""The names of a Zarr array's metadata (v3, v2): one of them anywhere makes a listing a Zarr store."""


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


def _table(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _dimensions(value: Any, least: int) -> TypeGuard[list[int]]:
    """Whether ``value`` is a non-empty list of integers, each at least ``least``."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= least for n in value)
    )


def _array_layout(dataset: str, key: str, document: Any) -> dict[str, Any] | None:
    """One array's shape, chunks and chunk key encoding from its metadata (None: a v3 group)."""
    name = key.rsplit("/", 1)[-1]
    if not isinstance(document, dict):
        raise ShardReadError(f"dataset {dataset}: {key}: Zarr metadata must be a JSON object")
    if name == "zarr.json" and document.get("node_type") != "array":
        return None
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
        raise ShardReadError(f"dataset {dataset}: {key}: Zarr metadata lacks shape or chunks")
    if separator not in (".", "/") or not isinstance(kind, str):
        raise ShardReadError(f"dataset {dataset}: {key}: unsupported Zarr chunk key encoding")
    return {"shape": shape, "chunks": grid, "separator": separator, "kind": kind}


def _arrays(manifest: Manifest, metadata_keys: list[str], read_metadata: Callable[[str], bytes]) -> dict[str, Any]:
    """Every array of the store by its prefix; they must share the first axis and its chunking."""
    arrays: dict[str, dict[str, Any]] = {}
    for key in metadata_keys:
        name = key.rsplit("/", 1)[-1]
        if name not in ("zarr.json", ".zarray"):
            continue
        try:
            document = json.loads(read_metadata(key))
        except ValueError as exc:
            raise ShardReadError(f"dataset {manifest.dataset}: {key}: invalid Zarr metadata ({exc})") from None
        layout = _array_layout(manifest.dataset, key, document)
        if layout is not None:
            arrays[key[: -len(name)].rstrip("/")] = layout
    if not arrays:
        raise ShardReadError(f"dataset {manifest.dataset}: no Zarr array found")
    first = next(iter(arrays.values()))
    for prefix, info in arrays.items():
        if info["shape"][0] != first["shape"][0] or info["chunks"][0] != first["chunks"][0]:
            raise ShardReadError(
                f"dataset {manifest.dataset}: Zarr array {prefix or '/'} does not share the first axis "
                f"({info['shape'][0]} rows in chunks of {info['chunks'][0]}) with the others"
            )
    return arrays


def _row_keys(arrays: dict[str, Any], keys: set[str], row: int) -> list[str]:
    """The chunk objects of one row of chunks, in every array."""
    needed: list[str] = []
    for prefix, info in arrays.items():
        base = f"{prefix}/" if prefix else ""
        lead = f"{base}c{info['separator']}{row}" if info["kind"] == "default" else f"{base}{row}"
        sep = info["separator"]
        needed.extend(key for key in keys if key == lead or key.startswith(lead + sep))
    return needed


def zarr_plan(manifest: Manifest, read_metadata: Callable[[str], bytes]) -> UnitPlan:
    """Units of a Zarr store: one per row of chunks along the first axis.

    Works for a single array or a group whose arrays share their first
    dimension and its chunking (each sample is then one row of every array).
    """
    keys = {shard.key for shard in manifest.shards}
    metadata_keys = sorted(k for k in keys if k.rsplit("/", 1)[-1] in ("zarr.json", ".zarray", ".zgroup", ".zattrs"))
    arrays = _arrays(manifest, metadata_keys, read_metadata)
    first = next(iter(arrays.values()))
    rows, row_chunk = int(first["shape"][0]), int(first["chunks"][0])
    chunk_rows = -(-rows // row_chunk) if rows else 0
    if chunk_rows > 1000 * len(keys):
        raise ShardReadError(
            f"dataset {manifest.dataset}: the Zarr metadata declares {chunk_rows} rows of chunks, "
            f"but the store holds {len(keys)} objects"
        )
    units = []
    row_starts = []
    for row in range(chunk_rows):
        needed = metadata_keys + _row_keys(arrays, keys, row)
        start = row * row_chunk
        row_starts.append(start)
        units.append(Unit(tuple(sorted(set(needed))), min(row_chunk, rows - start), str(row)))
    extra = {"arrays": sorted(arrays), "row_starts": row_starts}
    return UnitPlan(tuple(units), extra)


class ZarrFormat(SampleFormat):
    """A Zarr store (v2 or v3) read by rows of chunks; batch mode stacks rows into tensors."""

    name = "zarr"
    rechunker = "datacache.shard.columnar:ZARR"
    priority = 0
    batch = "arrays"

    def detect(self, keys: Collection[str]) -> bool:
        return any(key.rsplit("/", 1)[-1] in ARRAY_METADATA for key in keys)

    async def plan(self, context: PlanContext, *, wait: bool) -> UnitPlan:
        metadata: dict[str, bytes] = {}
        for shard in context.manifest.shards:
            if shard.key.rsplit("/", 1)[-1] in ARRAY_METADATA:
                metadata[shard.key] = await context.read(shard.key, None)
        return zarr_plan(context.manifest, metadata.__getitem__)

    def open_reader(
        self, unit: Unit, where: str, buffers: Mapping[str, Buffer], extra: Mapping[str, Any], *, index: Any = None
    ) -> UnitReader:
        files = {key: bytes(buffer) for key, buffer in buffers.items()}
        return ZarrReader(unit, where, files, extra)


FORMAT = ZarrFormat()
