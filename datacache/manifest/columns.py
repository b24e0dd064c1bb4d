"""A manifest's shards held as columns: one buffer of keys and arrays of sizes, counts, versions, checksums.

A million `Shard` objects cost ~280 MB in every process that holds them (each rank and each of
its workers). `ShardTable` keeps the same facts in a few flat arrays inside one buffer, and makes a
`Shard` only when one is asked for, so it is still a ``Sequence[Shard]`` for the code that walks
shards one at a time, while the plans read whole columns (`ShardTable.sizes`, `ShardTable.samples`).

The buffer is also the file format (`encode`, `map_table`): a node saves it once and every process
on the node maps that one file read-only, so the pages are the page cache's, shared, never copied
per process. The file is trusted data, read only from this node's private manifest directory; its
last 16 bytes are the xxh3-128 digest of all before them, checked (through a small reused buffer,
not the mapping) before the mapping is used: a truncated or altered file is refused.
"""

from __future__ import annotations

import bisect
import itertools
import json
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np
import numpy.typing as npt
import xxhash

from datacache.errors import ConfigError
from datacache.manifest.shard import Shard

__all__ = ["COLUMNS_MAGIC", "ShardTable", "encode", "map_table"]

COLUMNS_MAGIC = b"DCMCOL1\n"
"""The first bytes of a columnar manifest file (its format's version is the digit)."""
_PREAMBLE = struct.Struct("<8sQ")  # magic, header length
_DIGEST = 16
_ALIGN = 8
_STRINGS = ("key", "version", "checksum")
_CHUNK = 4 << 20
_CHUNK_SHARDS = 4096  # decoded at a time by `ShardTable.__iter__`: lazy still, for a walk that stops early


_DTYPES = {
    "sizes": "<i8",
    "samples": "<i8",
    "order": "<i8",
    **{f"{name}_at": "<i8" for name in _STRINGS},
    **{f"{name}_bytes": "|u1" for name in _STRINGS},
    **{f"{name}_set": "|u1" for name in _STRINGS[1:]},
}
"""Every column and its type: a file with any other is refused."""


class ShardTable(Sequence[Shard]):
    """The shards of a manifest, in manifest order, as columns; each item a `Shard` made on access.

    ``buffer`` holds the columns at the byte ranges ``layout`` gives (name -> (offset, items, dtype)).
    String columns are a ``<name>_at`` offsets array (n + 1 items) into a ``<name>_bytes`` blob;
    ``version`` and ``checksum`` have a ``<name>_set`` mask (None is not the empty string). ``order``
    lists the positions sorted by key, for lookups by key in log(n) steps with no dict of n keys.
    """

    def __init__(self, buffer: Any, layout: dict[str, tuple[int, int, str]], count: int) -> None:
        self._buffer = buffer
        self._layout = layout
        self._count = count
        if {name: dtype for name, (_, _, dtype) in layout.items()} != _DTYPES:
            raise ConfigError("columnar manifest: not the columns of this version")
        self._columns: dict[str, npt.NDArray[Any]] = {}
        for name, (offset, items, dtype) in layout.items():
            column = np.frombuffer(buffer, dtype=np.dtype(dtype), count=items, offset=offset)
            column.flags.writeable = False
            self._columns[name] = column
        self._check_shape()

    def _check_shape(self) -> None:
        """Refuse columns of the wrong lengths; their values are the digest's to vouch for.

        Only lengths are checked: a pass over the values would fault every page of every column
        into each process (~40 MB at 1e6 shards) where a plan reads one column.
        """
        n = self._count
        for name, column in self._columns.items():
            expected = n + 1 if name.endswith("_at") else None if name.endswith("_bytes") else n
            if expected is not None and len(column) != expected:
                raise ConfigError(f"columnar manifest: column {name} has {len(column)} items, not {expected}")

    @classmethod
    def from_shards(cls, shards: Iterable[Shard]) -> ShardTable:
        """The table of ``shards`` (each a `Shard`), built in memory."""
        return cls.from_bytes(encode_columns(tuple(shards)))

    @classmethod
    def from_bytes(cls, parts: tuple[dict[str, tuple[int, int, str]], int, bytes]) -> ShardTable:
        layout, count, data = parts
        return cls(data, layout, count)

    # -- the columns ----------------------------------------------------------------------------

    @property
    def sizes(self) -> npt.NDArray[np.int64]:
        """Every shard's size in bytes, in manifest order (read-only, no copy)."""
        return self._columns["sizes"]

    @property
    def samples(self) -> npt.NDArray[np.int64]:
        """Every shard's sample count, -1 where the manifest does not know it (read-only, no copy)."""
        return self._columns["samples"]

    def _string(self, name: str, index: int) -> str | None:
        if name != "key" and not self._columns[f"{name}_set"][index]:
            return None
        at = self._columns[f"{name}_at"]
        start, stop = int(at[index]), int(at[index + 1])
        return self._columns[f"{name}_bytes"][start:stop].tobytes().decode()

    def key(self, index: int) -> str:
        """The key of the shard at ``index`` (no `Shard` made)."""
        return self._string("key", self._checked(index)) or ""

    def keys(self) -> Iterator[str]:
        """Every key, in manifest order."""
        blob = self._columns["key_bytes"]
        for start, stop in itertools.pairwise(self._columns["key_at"].tolist()):
            yield blob[start:stop].tobytes().decode()

    def keys_at(self, indices: npt.NDArray[np.int64]) -> list[str]:
        """The keys of the shards at ``indices`` (each in range), one pass over the key column's blob."""
        at = self._columns["key_at"]
        starts, stops = at[indices].tolist(), at[np.asarray(indices) + 1].tolist()
        blob = self._columns["key_bytes"]
        low, high = (min(starts), max(stops)) if starts else (0, 0)
        data = blob[low:high].tobytes()
        return [data[a - low : b - low].decode() for a, b in zip(starts, stops, strict=True)]

    def position(self, key: str) -> int | None:
        """The index of the shard ``key``, or None: a binary search over the keys in sorted order."""
        order = self._columns["order"]
        encoded = key.encode()
        found = bisect.bisect_left(order, encoded, key=self._key_bytes)
        if found < self._count and self._key_bytes(int(order[found])) == encoded:
            return int(order[found])
        return None

    def positions(self, keys: Sequence[str]) -> npt.NDArray[np.int64]:
        """The index of each shard of ``keys``, -1 for a key not in the table.

        Many keys (a cluster index's batch of counts: every shard) cost one decode of the key
        column, not a binary search each (~50 us a key: 2e4 keys were a second node's 2 s).
        """
        if len(keys) * 16 < self._count:
            return np.fromiter(
                (-1 if (at := self.position(key)) is None else at for key in keys), dtype=np.int64, count=len(keys)
            )
        index = dict(zip(self.keys(), range(self._count), strict=True))
        return np.fromiter((index.get(key, -1) for key in keys), dtype=np.int64, count=len(keys))

    def _key_bytes(self, index: Any) -> bytes:
        at = self._columns["key_at"]
        return self._columns["key_bytes"][int(at[index]) : int(at[index + 1])].tobytes()

    # -- Sequence[Shard] ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._count

    def _checked(self, index: int) -> int:
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError("shard index out of range")
        return index

    @overload
    def __getitem__(self, index: int) -> Shard: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Shard, ...]: ...
    def __getitem__(self, index: int | slice) -> Shard | tuple[Shard, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(self._count)))
        i = self._checked(index)
        samples = int(self._columns["samples"][i])
        return Shard(
            self._string("key", i) or "",
            int(self._columns["sizes"][i]),
            self._string("version", i),
            self._string("checksum", i),
            None if samples < 0 else samples,
        )

    def __iter__(self) -> Iterator[Shard]:
        # A block of whole columns to Python values at a time: a `Shard` made through `self[i]` was
        # ~13 us, 1.4 s of each walk of 1e5 shards (a warm walks them twice).
        for start in range(0, self._count, _CHUNK_SHARDS):
            yield from self._block(start, min(start + _CHUNK_SHARDS, self._count))

    def _block(self, start: int, stop: int) -> list[Shard]:
        """The shards ``start:stop``, decoded column by column."""
        strings: list[list[str | None]] = []
        for name in _STRINGS:
            at = self._columns[f"{name}_at"][start : stop + 1].tolist()
            blob = self._columns[f"{name}_bytes"][at[0] : at[-1]].tobytes()
            texts: list[str | None] = [blob[a - at[0] : b - at[0]].decode() for a, b in itertools.pairwise(at)]
            if name != "key":
                given = self._columns[f"{name}_set"][start:stop].tolist()
                texts = [text if isset else None for text, isset in zip(texts, given, strict=True)]
            strings.append(texts)
        sizes, samples = self._columns["sizes"][start:stop].tolist(), self._columns["samples"][start:stop].tolist()
        return [
            Shard(key or "", size, version, checksum, None if count < 0 else count)
            for key, size, version, checksum, count in zip(*strings[:1], sizes, *strings[1:], samples, strict=True)
        ]

    def __contains__(self, shard: object) -> bool:
        position = self.position(getattr(shard, "key", ""))
        return position is not None and self[position] == shard

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardTable):
            return self._layout == other._layout and memoryview(self._buffer) == memoryview(other._buffer)
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardTable({self._count} shards)"

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy of the columns (a mapping is this process's): the receiver holds the bytes, not the file.
        return (ShardTable, (bytes(memoryview(self._buffer)), self._layout, self._count))


def encode_columns(shards: tuple[Shard, ...]) -> tuple[dict[str, tuple[int, int, str]], int, bytes]:
    """The columns of ``shards`` packed into one buffer: (layout, count, bytes); offsets 8-aligned."""
    n = len(shards)
    arrays: dict[str, npt.NDArray[Any]] = {
        "sizes": np.fromiter((s.size for s in shards), dtype="<i8", count=n),
        "samples": np.fromiter((-1 if s.samples is None else s.samples for s in shards), dtype="<i8", count=n),
    }
    keys: list[str] = []
    for name in _STRINGS:
        values = [getattr(s, name) for s in shards]
        if name == "key":
            keys = values
        else:
            arrays[f"{name}_set"] = np.fromiter((v is not None for v in values), dtype="u1", count=n)
        encoded = [(v or "").encode() for v in values]
        lengths = np.fromiter((len(e) for e in encoded), dtype="<i8", count=n)
        arrays[f"{name}_at"] = np.concatenate(([0], np.cumsum(lengths))).astype("<i8")
        arrays[f"{name}_bytes"] = np.frombuffer(b"".join(encoded), dtype="u1")
    arrays["order"] = np.array(sorted(range(n), key=keys.__getitem__), dtype="<i8").reshape(n)
    layout: dict[str, tuple[int, int, str]] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, array in arrays.items():
        layout[name] = (offset, len(array), array.dtype.str)
        raw = array.tobytes()
        pad = -len(raw) % _ALIGN
        chunks.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    return layout, n, b"".join(chunks)


def encode(header: dict[str, Any], table: ShardTable) -> list[bytes]:
    """The file of a manifest: magic, header length, JSON ``header`` (with the layout), columns, digest."""
    document = json.dumps({**header, "count": table._count, "layout": table._layout}, separators=(",", ":")).encode()
    document += b" " * (-(len(document) + _PREAMBLE.size) % _ALIGN)
    head = _PREAMBLE.pack(COLUMNS_MAGIC, len(document)) + document
    body = memoryview(table._buffer)
    digest = xxhash.xxh3_128()
    digest.update(head)
    digest.update(body)
    return [head, bytes(body), digest.digest()]


def _verify(fd: int, size: int, where: str) -> None:
    """Check the digest of the open file ``fd`` (``size`` bytes) by plain reads: the mapping stays untouched."""
    if size < _PREAMBLE.size + _DIGEST:
        raise ConfigError(f"{where}: {size} bytes, too short for a columnar manifest (truncated?)")
    digest = xxhash.xxh3_128()
    buffer = bytearray(min(_CHUNK, size))
    view = memoryview(buffer)
    position, end = 0, size - _DIGEST
    while position < end:
        count = os.preadv(fd, [view[: min(len(buffer), end - position)]], position)
        if count <= 0:
            raise ConfigError(f"{where}: shorter than its size while read (truncated?)")
        digest.update(view[:count])
        position += count
    if os.pread(fd, _DIGEST, end) != digest.digest():
        raise ConfigError(f"{where}: its digest does not match its bytes (truncated or altered); not used")


def map_table(fd: int, size: int, where: str) -> tuple[dict[str, Any], ShardTable]:
    """Map the columnar manifest open at ``fd`` (read-only, shared) once its digest is checked: (header, table)."""
    _verify(fd, size, where)
    magic, length = _PREAMBLE.unpack(os.pread(fd, _PREAMBLE.size, 0))
    if magic != COLUMNS_MAGIC or _PREAMBLE.size + length > size - _DIGEST:
        raise ConfigError(f"{where}: not a columnar manifest of this version")
    try:
        header = json.loads(os.pread(fd, length, _PREAMBLE.size))
        layout = {str(k): (int(v[0]), int(v[1]), str(v[2])) for k, v in dict(header.pop("layout")).items()}
        count = int(header.pop("count"))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"{where}: an unreadable columnar manifest header ({exc})") from None
    start = _PREAMBLE.size + length
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    body = memoryview(mapping)[start : size - _DIGEST]
    try:
        return header, ShardTable(body, layout, count)
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{where}: columns that do not fit the file ({exc})") from None
