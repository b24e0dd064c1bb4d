"""Reading samples out of cached shards: mapping the bytes, and the format's reader.

What a unit is and how each format reads one are in `datacache.formats` (one
module per format, torch-free); this module maps a local copy (``mmap``,
shared with the page cache), keeps tar indexes per node
(`SpanCache`), and asks the dataset's format for a `UnitReader`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from datacache.tiers.files import map_regular

from datacache.counting.spantable import SpanTable
from datacache.counting.tarindex import SampleSpan
from datacache.errors import ShardReadError
from datacache.formats import get_format
from datacache.formats._base import COUNT_SOURCES, Unit, UnitPlan, UnitReader, sample_of
from datacache.formats.tar import TarReader
from datacache.formats.zarr import zarr_plan
from datacache.manifest import ShardFormat

__all__ = [
    "COUNT_SOURCES",
    "SpanCache",
    "TarReader",
    "Unit",
    "UnitPlan",
    "UnitReader",
    "map_file",
    "open_unit_reader",
    "sample_of",
    "zarr_plan",
]


def map_file(path: Path) -> mmap.mmap | bytes:
    """Map a copy read-only (shared with the page cache: no copy, no private memory).

    Through `tiers.files.map_regular`: the last component is not followed and the open does not
    block, so a link or a FIFO another uid put in a shared copy's place between the tier's check and
    this open raises `UnsafeFileError` at once instead of hanging the reader or reading elsewhere.
    """
    return map_regular(path)


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
        if path is None:
            return
        try:
            if path.exists():  # may raise: a daemon's private folder another user's reader cannot enter
                return
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
    return get_format(fmt.value).open_reader(unit, where, buffers, extra, index=spans)
