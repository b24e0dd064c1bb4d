"""`SpanTable`: a shard's sample spans as columns, and the binary form readers keep per node.

It holds the spans of `datacache.counting.tarindex` as columns rather than one object per
sample; its binary form is what readers keep per node, because every DataLoader worker of
every epoch loads it again (a JSON index of 600 samples took ~8 ms to decode in a busy
worker, the binary form ~0.2 ms).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from datacache.counting.tarindex import SampleSpan
from datacache.errors import ShardReadError

__all__ = ["SpanTable"]

_TABLE_MAGIC = b"DCSPANS1"
_TABLE_HEADER = struct.Struct("<8sQ")


class SpanTable(Sequence[SampleSpan]):
    """A shard's sample spans in columns: keys, and per field its extension, offset and size.

    Sample ``i``'s fields are entries ``starts[i]:starts[i+1]``. Indexing gives
    a `SampleSpan`; readers use `fields` and `key`, which build nothing more
    than the answer.
    """

    __slots__ = ("_extensions", "_keys", "_offsets", "_sizes", "_starts", "_which", "shard_size")

    def __init__(
        self,
        keys: list[str],
        extensions: list[str],
        starts: list[int],
        which: list[int],
        offsets: list[int],
        sizes: list[int],
        shard_size: int,
    ) -> None:
        self._keys = keys
        self._extensions = extensions
        self._starts = starts
        self._which = which
        self._offsets = offsets
        self._sizes = sizes
        self.shard_size = shard_size

    @classmethod
    def from_spans(cls, spans: Sequence[SampleSpan], *, shard_size: int) -> SpanTable:
        if isinstance(spans, SpanTable):
            return spans
        extensions: dict[str, int] = {}
        starts = [0]
        which: list[int] = []
        offsets: list[int] = []
        sizes: list[int] = []
        for span in spans:
            for extension, offset, size in span.fields:
                which.append(extensions.setdefault(extension, len(extensions)))
                offsets.append(offset)
                sizes.append(size)
            starts.append(len(offsets))
        return cls([span.key for span in spans], list(extensions), starts, which, offsets, sizes, shard_size)

    def __len__(self) -> int:
        return len(self._keys)

    @overload
    def __getitem__(self, index: int) -> SampleSpan: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[SampleSpan]: ...

    def __getitem__(self, index: int | slice) -> SampleSpan | Sequence[SampleSpan]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return SampleSpan(self._keys[index], tuple(self.fields(index)))

    def __iter__(self) -> Iterator[SampleSpan]:
        return (self[i] for i in range(len(self)))

    def key(self, index: int) -> str:
        return self._keys[index]

    def fields(self, index: int) -> list[tuple[str, int, int]]:
        """Sample ``index``'s fields as (extension, offset, size)."""
        extensions, which, offsets, sizes = self._extensions, self._which, self._offsets, self._sizes
        entries = range(self._starts[index], self._starts[index + 1])
        return [(extensions[which[j]], offsets[j], sizes[j]) for j in entries]

    def views(self, index: int, shard: memoryview) -> list[tuple[str, memoryview]]:
        """Sample ``index``'s fields as (extension, slice of ``shard``): the reader's hot path."""
        extensions, which, offsets, sizes = self._extensions, self._which, self._offsets, self._sizes
        return [
            (extensions[which[j]], shard[offsets[j] : offsets[j] + sizes[j]])
            for j in range(self._starts[index], self._starts[index + 1])
        ]

    def to_bytes(self) -> bytes:
        header = json.dumps(
            {"size": self.shard_size, "keys": self._keys, "extensions": self._extensions},
            separators=(",", ":"),
            ensure_ascii=False,
        ).encode("utf-8", "surrogateescape")
        columns = [
            np.asarray(self._starts, dtype="<i8"),
            np.asarray(self._which, dtype="<i8"),
            np.asarray(self._offsets, dtype="<i8"),
            np.asarray(self._sizes, dtype="<i8"),
        ]
        return b"".join([_TABLE_HEADER.pack(_TABLE_MAGIC, len(header)), header, *(c.tobytes() for c in columns)])

    @classmethod
    def from_bytes(cls, raw: bytes, *, where: str) -> SpanTable:
        """Decode `to_bytes`'s output, checking every span lies inside the shard."""
        if len(raw) < _TABLE_HEADER.size:
            raise ShardReadError(f"{where}: not a datacache span table")
        magic, header_size = _TABLE_HEADER.unpack_from(raw)
        body = _TABLE_HEADER.size + header_size
        if magic != _TABLE_MAGIC or body > len(raw):
            raise ShardReadError(f"{where}: not a datacache span table")
        try:
            header = json.loads(raw[_TABLE_HEADER.size : body].decode("utf-8", "surrogateescape"))
            size, keys, extensions = header["size"], header["keys"], header["extensions"]
        except (ValueError, TypeError, KeyError):
            raise ShardReadError(f"{where}: span table header is damaged") from None
        if (
            not isinstance(size, int)
            or not isinstance(keys, list)
            or not isinstance(extensions, list)
            or not all(isinstance(k, str) for k in keys)
            or not all(isinstance(e, str) for e in extensions)
        ):
            raise ShardReadError(f"{where}: span table header is damaged")
        columns = np.frombuffer(raw, dtype="<i8", offset=body) if (len(raw) - body) % 8 == 0 else None
        count = len(keys)
        if columns is None or len(columns) < count + 1 or (len(columns) - (count + 1)) % 3 != 0:
            raise ShardReadError(f"{where}: span table columns are damaged")
        entries = (len(columns) - (count + 1)) // 3
        starts = columns[: count + 1]
        which = columns[count + 1 : count + 1 + entries]
        offsets = columns[count + 1 + entries : count + 1 + 2 * entries]
        sizes = columns[count + 1 + 2 * entries :]
        if (
            starts[0] != 0
            or starts[-1] != entries
            or np.any(np.diff(starts) < 0)
            or (entries and (which.min() < 0 or which.max() >= len(extensions)))
            or (entries and (offsets.min() < 0 or sizes.min() < 0 or sizes.max() > size))
            or (entries and np.any(offsets > size - sizes))  # no overflow: size - sizes >= 0 here
        ):
            raise ShardReadError(f"{where}: a sample in the span table lies outside the shard")
        return cls(keys, extensions, starts.tolist(), which.tolist(), offsets.tolist(), sizes.tolist(), size)
