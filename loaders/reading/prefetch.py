"""How far ahead to stage: a prefetch depth that follows a bandwidth target.

The depth starts from what the target needs (units consumed while one unit
stages) and doubles whenever the reader delivers less than its share of the
target while waiting on shards. If it still falls short at the widest depth,
one warning names the stage that holds it back.
"""

from __future__ import annotations

import logging
import math
import time

__all__ = ["PrefetchController"]

logger = logging.getLogger(__name__)

_INTERVAL = 2.0
_MAX_DEPTH = 64


class PrefetchController:
    """Prefetch depth (in units) for one reader, adapted to its share of a bandwidth target.

    Parameters
    ----------
    fixed
        A depth the user chose; never adapted.
    initial
        The depth to start from when not fixed (the loader passes the units one shuffle window spans).
    target
        This reader's share of the per-rank target, in bytes per second.
    unit_bytes
        The mean size of a unit (shard), in bytes.
    """

    def __init__(
        self, *, fixed: int | None, target: float | None, unit_bytes: float, where: str, initial: int = 2
    ) -> None:
        self._fixed = fixed
        self._target = target
        self._unit_bytes = max(unit_bytes, 1.0)
        self._where = where
        self._depth = fixed if fixed is not None else max(initial, 4 if target else 2)
        self._window_start = time.monotonic()
        self._bytes_at_start = 0.0
        self._wait_at_start = 0.0
        self._short_windows = 0
        self._warned = False
        self.limiting_stage: str | None = None

    @property
    def depth(self) -> int:
        return self._depth

    def due(self) -> bool:
        """Whether enough time passed since the last adaptation to observe again."""
        return self._target is not None and time.monotonic() - self._window_start >= _INTERVAL

    def observe(self, *, delivered: float, waited: float, staging_rate: float, breakdown: dict[str, float]) -> None:
        """Feed the reader's running totals; adapts the depth at most every couple of seconds."""
        now = time.monotonic()
        span = now - self._window_start
        if span < _INTERVAL or self._target is None:
            return
        rate = (delivered - self._bytes_at_start) / span
        wait_share = (waited - self._wait_at_start) / span
        self._window_start, self._bytes_at_start, self._wait_at_start = now, delivered, waited
        if staging_rate > 0 and self._fixed is None:
            # Units consumed at the target rate while one unit stages, plus one in hand.
            needed = math.ceil(self._target * (self._unit_bytes / staging_rate) / self._unit_bytes) + 1
            self._depth = max(self._depth, min(_MAX_DEPTH, needed))
        if rate >= self._target * 0.95:
            self._short_windows = 0
            return
        self._short_windows += 1
        if wait_share > 0.02 and self._fixed is None and self._depth < _MAX_DEPTH:
            self._depth = min(_MAX_DEPTH, self._depth * 2)
            return
        if self._short_windows >= 3:
            self.limiting_stage = _limiting(breakdown)
            if not self._warned:
                self._warned = True
                logger.warning(
                    "%s: delivering %.1f MB/s, under the target of %.1f MB/s at prefetch depth %d; "
                    "the limiting stage is %s",
                    self._where,
                    rate / 1e6,
                    self._target / 1e6,
                    self._depth,
                    self.limiting_stage,
                )


def _limiting(breakdown: dict[str, float]) -> str:
    """The stage where most of the reader's time goes."""
    busy = breakdown.get("total", 0.0)
    stages = {k: v for k, v in breakdown.items() if k != "total"}
    if not stages:
        return "unknown"
    stage, seconds = max(stages.items(), key=lambda item: item[1])
    if busy > 0 and seconds < 0.25 * busy:
        return "the reader's own per-sample work (CPU)"
    return stage
