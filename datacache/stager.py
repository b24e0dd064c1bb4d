"""The stager's public names, where they have always been imported from.

The implementation lives in `datacache.staging` (the `Stager` facade and its
parts) and `datacache.checksum` (the shard hash); new code imports from there.
"""

from __future__ import annotations

from datacache.checksum import checksum_of, new_hasher
from datacache.staging import (
    LOCAL,
    ORIGIN,
    PRIORITY_PREFETCH,
    PRIORITY_URGENT,
    SHARED,
    DatasetHandle,
    FutureOrder,
    Location,
    ReaderProgress,
    Stager,
    StagerStats,
    StagingEvent,
    WarmProgress,
    WarmReport,
)

__all__ = [
    "LOCAL",
    "ORIGIN",
    "PRIORITY_PREFETCH",
    "PRIORITY_URGENT",
    "SHARED",
    "DatasetHandle",
    "FutureOrder",
    "Location",
    "ReaderProgress",
    "Stager",
    "StagerStats",
    "StagingEvent",
    "WarmProgress",
    "WarmReport",
    "checksum_of",
    "new_hasher",
]
