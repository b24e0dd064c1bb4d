"""How the staging parts report: events to listeners, and the counters behind `Stager.stats`.

Every part is handed one `Events` and reports through it, so that no part
calls back into the `Stager` facade.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from datacache.staging.types import LOCAL, SHARED, StagingEvent

__all__ = ["COUNTERS", "Events", "Listener"]

logger = logging.getLogger(__name__)

Listener = Callable[[StagingEvent], None]

COUNTERS = (
    "bytes_from_origin",
    "bytes_from_shared",
    "bytes_to_shared",
    "bytes_to_local",
    "shards_staged",
    "shards_to_shared",
    "misses",
    "bypassed",
    "evictions",
    "evicted_bytes",
    "checksum_failures",
    "failures",
    "shared_scans",
)
"""The counters `StagerStats` reports, besides hits per tier and the live queue."""


class Events:
    """Listeners (kept for the stager's life) and counters (reset with its runtime)."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self.counters: dict[str, int] = {}
        self.hits: dict[str, int] = {}
        self.reset_counters()

    def reset_counters(self) -> None:
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.hits = {LOCAL: 0, SHARED: 0}

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        with contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def emit(self, event: StagingEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a broken progress bar must not break a transfer
                logger.exception("staging listener failed")

    def count(self, name: str, amount: int = 1) -> None:
        self.counters[name] += amount

    def hit(self, tier: str) -> None:
        self.hits[tier] += 1
