"""Progress of long work (warm, shard) as a live bar, plain periodic lines, or JSON lines."""

from __future__ import annotations

import json
import time
from typing import IO, Any

from datacache._rate import RateMeter
from datacache.units import format_bytes, format_rate

__all__ = ["Progress"]


class Progress:
    """Counts shards and bytes toward a total and renders them.

    ``mode`` is ``"bar"`` (a terminal: tqdm), ``"lines"`` (a plain line every
    ``interval`` seconds, for logs) or ``"json"`` (one JSON object per line, for
    orchestrators) or ``"quiet"``.
    """

    def __init__(
        self,
        *,
        what: str,
        total_items: int,
        total_bytes: int,
        mode: str,
        stream: IO[str],
        interval: float = 2.0,
        item_name: str = "shards",
    ) -> None:
        self.what = what
        self.total_items = total_items
        self.total_bytes = total_bytes
        self.done_items = 0
        self.done_bytes = 0
        self.moved_bytes = 0
        self._mode = mode
        self._stream = stream
        self._interval = interval
        self._item_name = item_name
        self._started = time.monotonic()
        self._last_render = 0.0
        self._meter = RateMeter(window=5.0)
        self._bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                desc=what,
                file=stream,
                dynamic_ncols=True,
                smoothing=0.1,
            )

    def moved(self, amount: int) -> None:
        """Bytes transferred (counted toward the rate)."""
        self.moved_bytes += amount
        self.done_bytes += amount
        self._meter.add(amount)
        if self._bar is not None:
            self._bar.update(amount)
        self._maybe_render()

    def item_done(self, size: int, *, transferred: int) -> None:
        """One item finished; ``size - transferred`` of its bytes were already in place."""
        self.done_items += 1
        already = max(0, size - transferred)
        self.done_bytes += already
        if self._bar is not None:
            if already:
                self._bar.update(already)
            self._bar.set_postfix_str(f"{self.done_items}/{self.total_items} {self._item_name}", refresh=False)
        self._maybe_render()

    def snapshot(self) -> dict[str, Any]:
        elapsed = time.monotonic() - self._started
        rate = self._meter.rate()
        remaining = max(0, self.total_bytes - self.done_bytes)
        eta = remaining / rate if rate > 0 else None
        return {
            "event": "progress",
            "what": self.what,
            self._item_name: self.done_items,
            f"{self._item_name}_total": self.total_items,
            "bytes": self.done_bytes,
            "bytes_total": self.total_bytes,
            "bytes_transferred": self.moved_bytes,
            "rate_bytes_per_s": round(rate, 1),
            "eta_s": round(eta, 1) if eta is not None else None,
            "elapsed_s": round(elapsed, 3),
        }

    def _maybe_render(self, force: bool = False) -> None:
        now = time.monotonic()
        if self._mode in ("bar", "quiet") or (not force and now - self._last_render < self._interval):
            return
        self._last_render = now
        snap = self.snapshot()
        if self._mode == "json":
            self._stream.write(json.dumps(snap) + "\n")
        else:
            eta = f", ETA {snap['eta_s']:.0f}s" if snap["eta_s"] is not None else ""
            self._stream.write(
                f"{self.what}: {self.done_items}/{self.total_items} {self._item_name}, "
                f"{format_bytes(self.done_bytes)}/{format_bytes(self.total_bytes)}, "
                f"{format_rate(snap['rate_bytes_per_s'])}{eta}\n"
            )
        self._stream.flush()

    def tick(self) -> None:
        """Render now if the interval has passed (called by a timer during quiet stretches)."""
        self._maybe_render()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
