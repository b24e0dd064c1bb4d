"""Progress of long work (warm, shard) as a live bar, plain periodic lines, or JSON lines."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import IO, Any

from datacache._rate import RateMeter
from datacache.sizes import format_bytes, format_rate

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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.total_items = total_items
        self.total_bytes = total_bytes
        self.done_items = 0
        self.done_bytes = 0
        self.moved_bytes = 0
        self.not_kept = 0
        self._mode = mode
        self._stream = stream
        self._interval = interval
        self._item_name = item_name
        self._clock = clock
        self._started = clock()
        # No line before a first interval has passed: work that ends sooner says nothing (the
        # summary does), and a first line has a rate measured over seconds, not guessed from 0.1.
        self._last_render = self._started
        self._rendered = False
        self._meter = RateMeter(window=5.0)
        self._item_meter = RateMeter(window=5.0)
        self._bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            # A terminal that reports no size (a fresh pty, some CI runners) would get
            # a zero-width, invisible bar: give it a fixed width instead.
            columns = 0
            with contextlib.suppress(OSError, ValueError, AttributeError):
                columns = os.get_terminal_size(stream.fileno()).columns
            self._bar = tqdm(
                total=total_bytes,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,
                desc=what,
                file=stream,
                dynamic_ncols=columns > 0,
                ncols=None if columns > 0 else 100,
                nrows=None if columns > 0 else 20,
                smoothing=0.1,
            )

    def moved(self, amount: int) -> None:
        """Bytes transferred (counted toward the rate)."""
        self.moved_bytes += amount
        self.done_bytes += amount
        self._meter.add(amount, self._clock())
        if self._bar is not None:
            self._bar.update(amount)
        self._maybe_render()

    def item_done(self, size: int, *, transferred: int, items: int = 1) -> None:
        """``items`` finished; ``size - transferred`` of their bytes were already in place."""
        self.done_items += items
        if transferred:
            self._item_meter.add(items, self._clock())
        already = max(0, size - transferred)
        self.done_bytes += already
        if self._bar is not None:
            if already:
                self._bar.update(already)
            self._bar.set_postfix_str(
                f"{self.done_items}/{self.total_items} {self._item_name}, "
                f"{self._item_meter.rate():.0f} {self._item_name}/s",
                refresh=False,
            )
        self._maybe_render()

    def advance_to(self, *, done_items: int, done_bytes: int, moved_bytes: int, not_kept: int = 0) -> None:
        """Jump to totals reported by someone else (the daemon doing the work). ``not_kept``: of the
        items done, those the tier did not keep (said beside the count: the bar still reaches 100%)."""
        self.not_kept = not_kept
        delta = max(0, moved_bytes - self.moved_bytes)
        if delta:
            self.moved_bytes = moved_bytes
            self._meter.add(delta, self._clock())
        if done_items > self.done_items:  # the shards/s of the line: it said 0 on every one
            self._item_meter.add(done_items - self.done_items, self._clock())
        if self._bar is not None:
            self._bar.update(max(0, done_bytes - self.done_bytes))
            counted = f"{done_items}/{self.total_items} {self._item_name}{self._not_kept()}"
            self._bar.set_postfix_str(counted, refresh=False)
        self.done_items = done_items
        self.done_bytes = done_bytes
        self._maybe_render()

    def _not_kept(self) -> str:
        return f" ({self.not_kept} not kept)" if self.not_kept else ""

    def snapshot(self) -> dict[str, Any]:
        now = self._clock()
        elapsed = now - self._started
        rate = self._meter.rate(now)
        remaining = max(0, self.total_bytes - self.done_bytes)
        eta = 0.0 if remaining == 0 else remaining / rate if rate > 0 else None
        return {
            "event": "progress",
            "what": self.what,
            # The words of the daemon's /v1/warm lines (WarmProgress's fields), one vocabulary for both.
            f"{self._item_name}_done": self.done_items,
            f"{self._item_name}_total": self.total_items,
            "bytes_done": self.done_bytes,
            "bytes_total": self.total_bytes,
            "bytes_transferred": self.moved_bytes,
            "rate_bytes_per_s": round(rate, 1),
            f"{self._item_name}_not_kept": self.not_kept,
            f"{self._item_name}_per_s": round(self._item_meter.rate(now), 1),
            "eta_s": round(eta, 1) if eta is not None else None,
            "elapsed_s": round(elapsed, 3),
        }

    def _maybe_render(self, force: bool = False) -> None:
        now = self._clock()
        if self._mode in ("bar", "quiet") or (not force and now - self._last_render < self._interval):
            return
        self._last_render = now
        self._rendered = True
        snap = self.snapshot()
        if self._mode == "json":
            self._stream.write(json.dumps(snap) + "\n")
        else:
            eta = f", ETA {snap['eta_s']:.0f}s" if snap["eta_s"] is not None else ""
            self._stream.write(
                f"{self.what}: {self.done_items}/{self.total_items} {self._item_name}{self._not_kept()}, "
                f"{format_bytes(self.done_bytes)}/{format_bytes(self.total_bytes)}, "
                f"{format_rate(snap['rate_bytes_per_s'])}{eta}, "
                f"{snap[f'{self._item_name}_per_s']:.0f} {self._item_name}/s\n"
            )
        self._stream.flush()

    def tick(self) -> None:
        """Render now if the interval has passed (called by a timer during quiet stretches)."""
        self._maybe_render()

    def close(self) -> None:
        """End the display; where lines were shown, the last one shows the final totals."""
        if self._rendered:
            self._maybe_render(force=True)
        if self._bar is not None:
            self._bar.close()
            self._bar = None
