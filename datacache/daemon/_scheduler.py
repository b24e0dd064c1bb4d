"""The daemon's prefetch gate: prefetch and warm traffic, paced so that readers never starve.

Readers blocked on a shard (``ensure`` with an urgent priority) go straight to
the `Stager`, whose priority queue puts them first. Everything speculative
(``prefetch``, ``warm``, and ``ensure`` asked at a prefetch priority) waits
here instead, in a priority heap, and at most ``slots`` of it is handed to the
stager at a time. With ``slots`` below the stager's worker count, some workers
are always free for a blocked reader, however long the prefetch backlog; an
optional token bucket also caps the bytes per second prefetching may move.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field

from datacache._rate import TokenBucket
from datacache.errors import DaemonUnavailableError
from datacache.staging import LOCAL, DatasetHandle, Location, Stager
from datacache.staging.batch import Turn

__all__ = ["PrefetchScheduler", "default_prefetch_slots"]

logger = logging.getLogger(__name__)

_Ident = tuple[str, str, str]  # dataset id, shard key, tier


def default_prefetch_slots(concurrency: int) -> int:
    """Prefetch transfers allowed at once; a quarter of the workers (at least one) stay free."""
    if concurrency <= 1:
        return 1
    return max(1, concurrency - max(1, concurrency // 4))


@dataclass(eq=False)
class _Item:
    handle: DatasetHandle
    key: str
    tier: str
    priority: float
    waiters: list[asyncio.Future[Location]] = field(default_factory=list)
    after: Turn | None = None
    """The warm's place of whoever queued it first: its room is reserved in that turn."""
    turns: list[Turn] = field(default_factory=list)
    """Every warm's place in it (released when it ends, however it ends)."""


class PrefetchScheduler:
    """A priority heap of speculative transfers, drained by ``slots`` pumps into the stager.

    Parameters
    ----------
    stager
        Where transfers run.
    slots
        Prefetch transfers handed to the stager at once.
    bandwidth
        Optional cap, in bytes per second, on what prefetching transfers.
    max_pending
        Fire-and-forget prefetches beyond this many pending are dropped
        (prefetching is advice; the reader's own ``ensure`` still fetches them).
    """

    def __init__(
        self,
        stager: Stager,
        *,
        slots: int,
        bandwidth: float | None = None,
        max_pending: int = 200_000,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be at least 1, got {slots}")
        self._stager = stager
        self.slots = slots
        self.bandwidth = bandwidth
        self._bucket = TokenBucket(bandwidth) if bandwidth else None
        self._max_pending = max_pending
        self._heap: list[tuple[float, int, _Ident]] = []
        self._pending: dict[_Ident, _Item] = {}
        self._running: dict[_Ident, _Item] = {}
        self._sequence = itertools.count()
        self._wakeup = asyncio.Event()
        self._pumps: list[asyncio.Task[None]] = []
        self._stopping = False
        self._dropped = 0
        self._last_drop_warning = 0.0

    @property
    def pending(self) -> int:
        """Transfers waiting for a slot."""
        return len(self._pending)

    @property
    def running(self) -> int:
        """Transfers holding a slot now."""
        return len(self._running)

    @property
    def dropped(self) -> int:
        """Prefetches dropped because the backlog was full."""
        return self._dropped

    def start(self) -> None:
        """Start the pumps (in the running event loop)."""
        if not self._pumps:
            self._pumps = [
                asyncio.create_task(self._pump(), name=f"datacache-prefetch-{i}")
                for i in range(self.slots)
            ]

    def submit(
        self,
        handle: DatasetHandle,
        key: str,
        *,
        tier: str = LOCAL,
        priority: float,
        wait: bool = False,
        turn: Turn | None = None,
    ) -> asyncio.Future[Location] | None:
        """Queue a transfer; with ``wait``, return a future for its `Location`.

        A shard already pending keeps one entry, at the lowest priority asked. ``turn``: a warm's
        place (`staging.batch.Turn`): the pumps run several transfers at once, and without it the
        first to reach the catalog took the room, not the shard the warm asked for first.
        """
        try:
            return self._submit(handle, key, tier, priority, wait, turn)
        except BaseException:
            if turn is not None:
                turn.release()
            raise

    def _submit(
        self, handle: DatasetHandle, key: str, tier: str, priority: float, wait: bool, turn: Turn | None
    ) -> asyncio.Future[Location] | None:
        if self._stopping:
            raise DaemonUnavailableError("the daemon is shutting down")
        ident = (handle.id, key, tier)
        future: asyncio.Future[Location] | None = None
        if wait:
            future = asyncio.get_running_loop().create_future()
        item = self._running.get(ident)
        if item is None:
            item = self._pending.get(ident)
            if item is None:
                if future is None and len(self._pending) >= self._max_pending:
                    self._drop()
                    if turn is not None:
                        turn.release()
                    return None
                item = _Item(handle, key, tier, priority, after=turn)
                self._pending[ident] = item
                heapq.heappush(self._heap, (priority, next(self._sequence), ident))
            elif priority < item.priority:
                item.priority = priority
                heapq.heappush(self._heap, (priority, next(self._sequence), ident))
            self._wakeup.set()
        if future is not None:
            item.waiters.append(future)
        if turn is not None:
            item.turns.append(turn)  # released when it ends
        return future

    def _drop(self) -> None:
        self._dropped += 1
        now = time.monotonic()
        if now - self._last_drop_warning > 60:
            self._last_drop_warning = now
            logger.warning(
                "prefetch backlog full (%d pending): dropping prefetches; readers fetch on demand",
                len(self._pending),
                extra={"event": "prefetch_dropped", "pending": len(self._pending)},
            )

    def _pop(self) -> _Item | None:
        while self._heap:
            priority, _, ident = heapq.heappop(self._heap)
            item = self._pending.get(ident)
            if item is None or item.priority != priority:
                continue  # a stale entry: re-queued sooner, or already taken
            del self._pending[ident]
            return item
        return None

    async def _pump(self) -> None:
        while True:
            item = self._pop()
            if item is None:
                if self._stopping:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self._stopping:
                self._fail(item, DaemonUnavailableError("the daemon is shutting down"))
                continue
            ident = (item.handle.id, item.key, item.tier)
            self._running[ident] = item
            try:
                location = await self._transfer(item)
            except asyncio.CancelledError:
                self._fail(
                    item, DaemonUnavailableError("the daemon stopped before this shard was staged")
                )
                raise
            except Exception as exc:
                logger.debug("prefetch of %s/%s failed: %s", item.handle.id, item.key, exc)
                self._fail(item, exc)
            else:
                for waiter in item.waiters:
                    if not waiter.done():
                        waiter.set_result(location)
            finally:
                self._running.pop(ident, None)
                for turn in item.turns:
                    turn.release()

    async def _transfer(self, item: _Item) -> Location:
        if item.tier == LOCAL:
            location = await self._stager.locate(item.handle, item.key)
            if location.tier == LOCAL:
                return location
        if self._bucket is not None:
            await self._bucket.take(item.handle.manifest.shard(item.key).size)
        if item.after is None:  # not a warm's: as any stager's ensure
            return await self._stager.ensure(item.handle, item.key, tier=item.tier, priority=item.priority)
        return await self._stager.ensure(
            item.handle, item.key, tier=item.tier, priority=item.priority, turn=item.after
        )

    @staticmethod
    def _fail(item: _Item, exc: BaseException) -> None:
        for turn in item.turns:
            turn.release()
        for waiter in item.waiters:
            if not waiter.done():
                waiter.set_exception(exc)
                waiter.exception()  # retrieved here; the awaiting request re-raises it

    async def stop(self, grace: float) -> None:
        """Take nothing more, fail what waits; let running transfers finish within ``grace`` s."""
        self._stopping = True
        for item in self._pending.values():
            self._fail(item, DaemonUnavailableError("the daemon is shutting down"))
        self._pending.clear()
        self._heap.clear()
        self._wakeup.set()
        pumps, self._pumps = self._pumps, []
        if pumps:
            _, still = await asyncio.wait(pumps, timeout=grace)
            for task in still:
                task.cancel()
            for task in still:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
