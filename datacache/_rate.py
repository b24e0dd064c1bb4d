"""Rates: a token bucket to cap bandwidth, and a moving rate meter."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable

__all__ = ["RateMeter", "TokenBucket"]


class TokenBucket:
    """Caps a byte stream at ``rate`` bytes per second, never ahead of it on average.

    The bucket starts empty and holds at most a quarter of a second of bytes, so
    neither the start nor a pause buys a burst that a short transfer would show
    as a higher rate (5 MB/s asked once measured 6.7). A take larger than the
    bucket is paid off by waiting. ``clock`` and ``sleep`` are the time source
    (a test passes a virtual one).
    """

    burst_seconds = 0.25

    def __init__(
        self,
        rate: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        self._rate = rate
        self._clock = clock
        self._sleep = sleep
        self._tokens = 0.0
        self._stamp = clock()
        self._lock: asyncio.Lock | None = None

    @property
    def rate(self) -> float:
        return self._rate

    async def take(self, amount: int) -> None:
        """Wait until ``amount`` bytes may pass."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            now = self._clock()
            self._tokens = min(self._rate * self.burst_seconds, self._tokens + (now - self._stamp) * self._rate)
            self._stamp = now
            self._tokens -= amount
            if self._tokens < 0:
                # Pacing: the debt is paid off by waiting, not by polling.
                await self._sleep(-self._tokens / self._rate)


class RateMeter:
    """Bytes per second over the last ``window`` seconds."""

    def __init__(self, window: float = 5.0) -> None:
        self._window = window
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def add(self, amount: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._events.append((now, amount))
        self._total += amount
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self._window:
            _, amount = self._events.popleft()
            self._total -= amount

    def rate(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._trim(now)
        if not self._events:
            return 0.0
        span = max(now - self._events[0][0], 1e-3)
        return self._total / max(span, min(self._window, 1.0))
