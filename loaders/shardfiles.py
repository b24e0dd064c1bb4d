"""Reading samples out of cached shards: mapping the bytes, and the format's reader.

What a unit is and how each format reads one are in `datacache.formats` (one
module per format, torch-free); this module names what the loaders use of them, and asks the dataset's format for
a `UnitReader` (a copy is mapped by `reading.units.map_file`; the tar indexes a
node keeps are `runtime.SpanCache`).
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping, Sequence
from typing import Any

from datacache.counting.tarindex import SampleSpan
from datacache.formats import get_format
from datacache.formats._base import COUNT_SOURCES, ShardUnits, Unit, UnitPlan, UnitReader, sample_of
from datacache.formats.tar import TarReader
from datacache.formats.zarr import zarr_plan
from datacache.manifest import ShardFormat

__all__ = [
    "COUNT_SOURCES",
    "ShardUnits",
    "TarReader",
    "Unit",
    "UnitPlan",
    "UnitReader",
    "open_unit_reader",
    "sample_of",
    "zarr_plan",
]


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
