"""How many remote workers meet a target rate: pure arithmetic over what the pool measured.

The pool measures, per batch made, the samples and payload bytes in it and the seconds a
worker spent making it. From those, one worker's rate follows (samples, or bytes, per busy
second), and the workers a target needs is the target over that rate, with some headroom.
The pool moves toward that number: at most doubling when it grows, one worker at a time when
it shrinks (a slow start or one busy node must not empty it), always within its bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["HEADROOM", "Measured", "Target", "workers_needed"]

HEADROOM = 1.25
"""Workers are sized for this multiple of the target: rates vary between batches and nodes."""


@dataclass(frozen=True, slots=True)
class Target:
    """The rate the training process asks for: samples per second, or payload bytes per second."""

    per_second: float
    unit: str  # "samples" or "bytes"

    def __post_init__(self) -> None:
        if self.unit not in ("samples", "bytes"):
            raise ValueError(f"a target's unit is samples or bytes, got {self.unit!r}")
        if not self.per_second > 0:
            raise ValueError(f"a target rate must be positive, got {self.per_second!r}")


@dataclass(frozen=True, slots=True)
class Measured:
    """What the pool's workers made since sizing last looked: totals over the batches received."""

    samples: int
    bytes: int
    busy_seconds: float

    def per_worker(self, unit: str) -> float | None:
        """One worker's rate in ``unit`` per busy second (None before anything was measured)."""
        made = self.samples if unit == "samples" else self.bytes
        if made <= 0 or self.busy_seconds <= 0:
            return None
        return made / self.busy_seconds


def workers_needed(current: int, target: Target | None, measured: Measured, low: int, high: int) -> int:
    """The pool's next size: ``current`` moved toward what ``target`` needs at the measured rate.

    Without a target, or before any rate is measured, the size stays (within ``[low, high]``).
    """
    if low < 1 or high < low:
        raise ValueError(f"pool bounds must satisfy 1 <= low <= high, got {low}..{high}")
    current = min(max(current, low), high)
    rate = measured.per_worker(target.unit) if target is not None else None
    if target is None or rate is None:
        return current
    wanted = min(max(math.ceil(target.per_second * HEADROOM / rate), low), high)
    if wanted > current:
        return min(wanted, 2 * current)
    if wanted < current:
        return current - 1
    return current
