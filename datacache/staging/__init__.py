"""Staging: shards moved origin -> shared -> local, once each, verified, atomically.

`Stager` is the facade (``stager``: the warm, over ``verbs``: one shard's verbs, over
``runtime``: the parts per event loop, open, close, recovery); its parts point one way, each handed what it needs:
``types`` (value types) <- ``events`` (listeners, counters) <- ``queue`` (the
job queue), ``transfer`` (one copy in a memory budget), ``residency`` (what
eviction keeps) <- ``shared`` (the shared tier) <- ``local`` (the local tier) <- ``batch``
(a warm's shards staged onto it many at once);
``recovery`` repairs what killed processes left; ``warm`` is the one warm, run by
the facade with the queue or by the daemon with its prefetch gate. No part imports
the facade.
"""

from __future__ import annotations

from datacache.staging.stager import Stager
from datacache.staging.types import (
    LOCAL,
    ORIGIN,
    PRIORITY_PREFETCH,
    PRIORITY_URGENT,
    SHARED,
    DatasetHandle,
    FutureOrder,
    Location,
    ReaderProgress,
    StagerStats,
    StagingEvent,
    WarmReport,
)
from datacache.staging.warm import WarmProgress

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
]
