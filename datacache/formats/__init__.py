"""Sample formats: one module per format, found through one registry (as fsspec finds filesystems).

A format says which files of a listing are its shards (`SampleFormat.detect`,
`SampleFormat.shard_keys`), how many samples each holds before an epoch starts
(`SampleFormat.plan`), how to read them (`SampleFormat.open_reader`) and how a
batch of them is built (`SampleFormat.batch`). The built-in formats are named
by import string in the registry (`datacache.format_registry`, re-exported here) and
imported on first use; a third party adds one with `register_format` or through the
``datacache.formats`` entry point group::

    [project.entry-points."datacache.formats"]
    jsonl = "mypackage.jsonl:FORMAT"

Nothing here imports torch: the loader turns what a reader gives into tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from datacache.format_registry import (
    ENTRY_POINT_GROUP,
    available_formats,
    detect_format_name,
    format_names,
    get_format,
    register_format,
)

if TYPE_CHECKING:
    from datacache.formats._base import (
        BufferReader,
        PlanContext,
        SampleFormat,
        Unit,
        UnitPlan,
        UnitReader,
        count_each_shard,
        one_unit_per_shard,
    )

_WRITING_ONE = (
    "BufferReader",
    "PlanContext",
    "SampleFormat",
    "Unit",
    "UnitPlan",
    "UnitReader",
    "count_each_shard",
    "one_unit_per_shard",
)
"""What a format module is written with; imported on first use (they need numpy; the registry does not)."""

__all__ = [
    "ENTRY_POINT_GROUP",
    "BufferReader",
    "PlanContext",
    "SampleFormat",
    "Unit",
    "UnitPlan",
    "UnitReader",
    "available_formats",
    "count_each_shard",
    "detect_format_name",
    "format_names",
    "get_format",
    "one_unit_per_shard",
    "register_format",
]


def __getattr__(name: str) -> object:
    if name in _WRITING_ONE:
        from datacache.formats import _base

        return getattr(_base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
