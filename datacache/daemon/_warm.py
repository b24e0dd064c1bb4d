"""The daemon's warm: `Stager.warm` itself, its shards admitted through the prefetch gate, streamed.

The reply is JSON lines (docs/DAEMON.md): a start line, progress at most once a
second, then `WarmReport`'s one wire form, or an error line once the reply has begun.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

from datacache._protocol import error_for, warm_progress_to_wire, warm_report_to_wire
from datacache.daemon._lifecycle import Lifecycle
from datacache.daemon._scheduler import PrefetchScheduler
from datacache.errors import DatacacheError
from datacache.manifest import Shard, listing_notices
from datacache.staging import DatasetHandle, Location, Stager, WarmProgress
from datacache.staging.batch import Turn
from datacache.tiers import redact_url

__all__ = ["WarmRun"]


class WarmRun:
    """One client's warm of ``handle`` onto ``tier`` through the daemon's stager and prefetch gate."""

    def __init__(self, stager: Stager, scheduler: PrefetchScheduler, handle: DatasetHandle, tier: str) -> None:
        self.stager, self.scheduler, self.handle, self.tier = stager, scheduler, handle, tier
        self._last: Turn | None = None

    async def submit(self, shard: Shard, priority: float) -> Location:
        """A warm's shards pass the prefetch gate: readers always find free workers.

        Each reserves its room after the one submitted before it (`Turn`, as a warm in one process
        does): a warm bigger than the tier keeps the shards asked for first, not those whose transfer
        worker reached the catalog first.
        """
        self._last = turn = Turn(self._last)
        future = self.scheduler.submit(
            self.handle, shard.key, tier=self.tier, priority=priority, wait=True, turn=turn
        )
        if future is None:  # pragma: no cover - waited submissions are never dropped
            raise DatacacheError("the prefetch backlog is full")
        return await future

    async def stream(
        self,
        request: web.Request,
        shards: Sequence[Shard],
        lifecycle: Lifecycle,
        *,
        verify: bool,
        bandwidth: float | None,
    ) -> web.StreamResponse:
        """Run the warm (tracked by the drain) and stream its lines as the reply to ``request``."""
        handle, tier = self.handle, self.tier
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        lines = _Lines(response)
        total = sum(shard.size for shard in shards)
        await lines.send(
            {
                "event": "start",
                "dataset": handle.id,
                "tier": tier,
                "shards_total": len(shards),
                "bytes_total": total,
                "notices": listing_notices(handle.manifest),  # the client says them too, not only our log
            }
        )
        run = self.stager.warm(
            handle, shards, tier=tier, verify=verify, bandwidth=bandwidth, progress=lines.progress, submit=self.submit
        )
        warm = asyncio.ensure_future(run)
        lifecycle.track(warm)
        lines.on_gone = warm.cancel  # the client went away: stop queueing its shards
        try:
            report = await asyncio.shield(warm)
        except asyncio.CancelledError:
            warm.cancel()
            raise
        except Exception as exc:  # the reply has begun: the error travels as the last line
            code, _ = error_for(exc)
            line = redact_url((str(exc) or type(exc).__name__).strip().splitlines()[0])
            report = None
            await lines.send({"event": "error", "code": code, "message": line})
        try:
            if report is not None:
                await lines.close(warm_report_to_wire(report, handle.config.url))
            await response.write_eof()
        except ConnectionResetError:
            warm.cancel()
        return response


class _Lines:
    """A warm's reply: JSON lines, progress at most once a second, written in order by one task."""

    def __init__(self, response: web.StreamResponse) -> None:
        self._response = response
        self._queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._last = 0.0
        self._writer: asyncio.Task[None] | None = None
        self.on_gone: Callable[[], object] = lambda: None

    async def send(self, document: dict[str, Any]) -> None:
        await self._response.write((json.dumps(document) + "\n").encode())

    def progress(self, progress: WarmProgress) -> None:
        now = time.monotonic()
        if now - self._last < 1.0 and progress.shards_done < progress.shards_total:
            return
        self._last = now
        if self._writer is None:
            self._writer = asyncio.ensure_future(self._write())
        self._queue.put_nowait(warm_progress_to_wire(progress))

    async def _write(self) -> None:
        while (document := await self._queue.get()) is not None:
            try:
                await self.send(document)
            except ConnectionResetError:
                self.on_gone()
                return

    async def close(self, last: dict[str, Any]) -> None:
        """Flush the progress lines, then write ``last``."""
        if self._writer is not None:
            self._queue.put_nowait(None)
            await self._writer
        await self.send(last)
