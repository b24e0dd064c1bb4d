"""The job queue: one transfer per (dataset, shard, tier), run by a bounded pool of workers.

A reader blocked on a shard jumps ahead of every prefetch: a job re-submitted
with a smaller priority number is queued again, and the stale entry skipped.
When every worker is busy, a job a reader waits for starts at once beside them
(`BESIDE` such at most: each may hold a transfer's share of the memory budget),
rather than after a whole prefetch; a reader
that asks for a shard in flight joins its transfer, which becomes wanted now
(`WANTED_NOW`: under a bandwidth limit it then takes the whole rate).
A shard the origin refused for good (missing, or forbidden) is remembered until
it is staged, so that prefetches stop asking the origin for it again; a reader
still asks (and so sees the error, or the shard once it is back).

A worker stays with a local-tier job only until its bytes are in and verified
(`serve_early`): making the copy durable (fsync, rename, catalog) goes on
behind it while it starts the next transfer, at most ``concurrency`` such
tails at once. Otherwise the disk's durable rate would decide when the next
GET may start, and a cold epoch would be bound by it.

A worker that takes a job the runtime can stage in a batch (``batchable``: a prefetch of a small
shard onto the local tier) takes the batchable jobs of the same dataset queued behind it too, the
soonest first, and stages them together (``run_batch``: one catalog transaction and one round of
syncs for the lot, `staging.batch`). A window of small files asked for one by one cost a node lock,
two catalog transactions and two fsyncs each: most of a cold epoch of 1e6 rows in 100 files.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from datacache.errors import OriginPermissionError, ShardNotFoundError, StagerClosedError
from datacache.manifest import Shard
from datacache.staging.events import Events
from datacache.staging.types import LOCAL, PRIORITY_URGENT, WANTED_NOW, DatasetHandle, Job, Location, StagingEvent

if TYPE_CHECKING:
    from datacache.staging.batch import Turn

__all__ = ["JobQueue", "first_answer", "serve_early"]

_Ident = tuple[str, str, str]
RunBatch = Callable[[Sequence[Job]], Awaitable[list[Location | BaseException]]]
"""Stages a batch of jobs of one dataset together: where each one's shard is, or why it is not."""

BATCH_JOBS = 256
"""The most jobs one worker stages together (as a warm's batch: `staging.batch.BATCH_SHARDS`)."""

BESIDE = 1
"""Jobs a reader waits for that may run beside busy workers (memory: `Transfer.keep_limit` each)."""

DURABLE_WAIT = 20.0
"""Seconds `JobQueue.close` waits for copies whose bytes are all in to become durable."""

# The origin's final answers: asking again gets the same one (the retry policy never retries them).
_REFUSALS = (ShardNotFoundError, OriginPermissionError)


class JobQueue:
    """Priority-ordered staging jobs and the workers that run them; bound to the running loop.

    Parameters
    ----------
    run
        Performs one job and returns where its shard now is.
    events
        Where failures are counted and reported.
    concurrency
        How many jobs run at once.
    run_batch, batchable
        Stages several jobs together, and which jobs it may take (see the module's docstring).
    """

    def __init__(
        self,
        run: Callable[[Job], Awaitable[Location]],
        events: Events,
        concurrency: int,
        *,
        run_batch: RunBatch | None = None,
        batchable: Callable[[Job], bool] | None = None,
    ) -> None:
        self._run = run
        self._run_batch = run_batch
        self._batchable = batchable
        self._events = events
        self._loop = asyncio.get_running_loop()
        self._jobs: dict[_Ident, Job] = {}
        self._queue: asyncio.PriorityQueue[tuple[float, int, Job]] = asyncio.PriorityQueue()
        self._sequence = itertools.count()
        self._refused: set[_Ident] = set()
        self._concurrency = concurrency
        self._idle = 0
        self._beside: set[asyncio.Task[None]] = set()
        """Jobs a reader waits for, started beside busy workers."""
        self.tails: set[asyncio.Task[None]] = set()
        """Jobs whose bytes are in, still being made durable, that no worker waits for."""
        self.workers = [asyncio.create_task(self._worker(), name=f"datacache-stager-{i}") for i in range(concurrency)]

    @property
    def depth(self) -> int:
        """Jobs waiting for a worker."""
        return sum(1 for job in self._jobs.values() if not job.started)

    @property
    def in_flight(self) -> int:
        """Jobs a worker is running."""
        return sum(1 for job in self._jobs.values() if job.started)

    def pending(self, handle: DatasetHandle, shard: Shard, tier: str) -> bool:
        """Whether a job for this shard and tier is queued or running (not settled yet)."""
        job = self._jobs.get((handle.id, shard.key, tier))
        return job is not None and not job.future.done()

    def refused(self, handle: DatasetHandle, shard: Shard, tier: str) -> bool:
        """Whether the last job for this shard and tier failed with a refusal of the origin."""
        return (handle.id, shard.key, tier) in self._refused

    def submit(
        self, handle: DatasetHandle, shard: Shard, tier: str, priority: float, turn: Turn | None = None
    ) -> Job:
        """Queue a job, or join the one already queued or running for the same shard and tier.

        ``turn``: a warm's place; a job it makes reserves room in that turn, and the turn is released
        when the job ends however it does (a job joined reserves when it would have).
        """
        job = self._submit(handle, shard, tier, priority, turn)
        if turn is not None:
            job.future.add_done_callback(lambda _: turn.release())
        return job

    def _submit(self, handle: DatasetHandle, shard: Shard, tier: str, priority: float, turn: Turn | None) -> Job:
        ident = (handle.id, shard.key, tier)
        job = self._jobs.get(ident)
        if job is None or job.future.done():
            job = Job(handle, shard, tier, priority, self._loop.create_future(), after=turn)
            self._jobs[ident] = job
            job.future.add_done_callback(lambda _: self._forget(ident, job))
            # Its waiters may all be gone (a cancelled warm, Ctrl-C): the failure is theirs to see,
            # never asyncio's "Future exception was never retrieved" at exit.
            job.future.add_done_callback(_mark_retrieved)
        elif priority < job.priority:
            job.priority = priority  # a reader now waits on it: it jumps the queue, or is wanted now
            if job.started:
                return job
        else:
            return job
        if job.priority <= PRIORITY_URGENT and not self._idle and len(self._beside) < BESIDE:
            # Every worker is on a transfer: the reader would wait for a whole one first.
            job.started = True
            task = asyncio.create_task(self._complete(job), name="datacache-stager-urgent")
            self._beside.add(task)
            task.add_done_callback(self._beside.discard)
            return job
        self._queue.put_nowait((job.priority, next(self._sequence), job))
        return job

    def _forget(self, ident: _Ident, job: Job) -> None:
        if self._jobs.get(ident) is job:
            del self._jobs[ident]
        if job.early is not None and not job.early.done():
            job.early.cancel()  # never verified early (failed, or bypassed): its waiters take ``future``
        # Its bytes in memory were for the readers that asked before the copy was durable: one that
        # asks now takes ``future``. A job outlives its staging in whatever still holds it (a reader's
        # coroutine, a traceback), and its early bytes are the landed file's own pages: the file
        # would stay mapped (and its blocks held after an eviction) for as long.
        job.early = None

    async def _next_job(self) -> Job:
        while True:
            self._idle += 1
            try:
                priority, _, job = await self._queue.get()
            finally:
                self._idle -= 1
            if job.started or job.future.done() or priority != job.priority:
                continue  # a stale entry: the job was re-queued sooner, or is done
            job.started = True
            return job

    def _batch_behind(self, first: Job) -> list[Job]:
        """``first`` and the batchable jobs of its dataset queued now, in priority order (started, all of them).

        The queue is looked through only so far (`BATCH_JOBS` entries past those taken): what is not
        taken goes back as it was.
        """
        batchable = self._batchable
        if self._run_batch is None or batchable is None or not batchable(first):
            return [first]
        jobs, kept, looked = [first], [], 0
        queue = self._queue
        while len(jobs) < BATCH_JOBS and looked < 2 * BATCH_JOBS and not queue.empty():
            entry = queue.get_nowait()
            looked += 1
            priority, _, job = entry
            if job.started or job.future.done() or priority != job.priority:
                continue  # a stale entry, as `_next_job` skips
            if job.handle.id == first.handle.id and batchable(job):
                job.started = True
                jobs.append(job)
            else:
                kept.append(entry)
        for entry in kept:
            queue.put_nowait(entry)
        return jobs

    async def _worker(self) -> None:
        while True:
            job = await self._next_job()
            jobs = self._batch_behind(job)
            if len(jobs) > 1:
                await self._complete_batch(jobs)
                continue
            task = asyncio.create_task(self._complete(job))
            try:
                await self._until_transferred(job, task)
            except asyncio.CancelledError:
                if task not in self.tails:
                    # Still transferring: abandoned, and cleaned up (its partial file, its
                    # catalog row) before this worker counts as stopped. A tail is `close`'s.
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                raise

    async def _until_transferred(self, job: Job, task: asyncio.Task[None]) -> None:
        """Wait until ``job`` is done, or its bytes are verified and fewer than `concurrency` tails run."""
        if job.early is None:
            job.early = self._loop.create_future()
        await asyncio.wait((task, job.early), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return
        self.tails.add(task)
        task.add_done_callback(self.tails.discard)
        while len(self.tails) > self._concurrency and not task.done():
            # The disk is behind the network: this worker waits for a tail before its next GET.
            await asyncio.wait(set(self.tails), return_when=asyncio.FIRST_COMPLETED)

    async def _complete(self, job: Job) -> None:
        """Run ``job`` and settle its future."""
        WANTED_NOW.set(lambda: job.priority <= PRIORITY_URGENT)  # this task's own context
        try:
            location = await self._run(job)
        except asyncio.CancelledError:
            _closed(job)
            raise
        except Exception as exc:
            self._settle(job, exc)
        else:
            self._settle(job, location)

    async def _complete_batch(self, jobs: Sequence[Job]) -> None:
        """Run ``jobs`` as one batch (in the worker's task) and settle each one's future."""
        run_batch = self._run_batch
        if run_batch is None:  # pragma: no cover - `_batch_behind` batches only with one
            raise AssertionError("no batch runner")
        # A reader may join one of them meanwhile (a transfer under a bandwidth limit then takes the whole rate).
        token = WANTED_NOW.set(lambda: any(job.priority <= PRIORITY_URGENT for job in jobs))
        try:
            outcomes = await run_batch(jobs)
        except asyncio.CancelledError:
            for job in jobs:
                _closed(job)
            raise
        except Exception as exc:
            outcomes = [exc] * len(jobs)
        finally:
            WANTED_NOW.reset(token)
        for job, outcome in zip(jobs, outcomes, strict=True):
            self._settle(job, outcome)

    def _settle(self, job: Job, outcome: Location | BaseException) -> None:
        if isinstance(outcome, BaseException):
            self._events.count("failures")
            if isinstance(outcome, _REFUSALS):
                self._refused.add((job.handle.id, job.shard.key, job.tier))
            self._events.emit(StagingEvent("failed", job.handle.id, job.shard.key, job.tier, error=str(outcome)))
            if not job.future.done():
                job.future.set_exception(outcome)
        else:
            self._refused.discard((job.handle.id, job.shard.key, job.tier))
            if not job.future.done():
                job.future.set_result(outcome)

    async def close(self, *, durable_wait: float = DURABLE_WAIT) -> None:
        """Stop the workers and fail every job still waiting.

        Transfers still receiving bytes are abandoned (their shards are staged again
        next time); copies whose bytes are all in are given up to ``durable_wait``
        seconds to become durable first, so that a process leaving right after an
        epoch keeps what it read.
        """
        workers, self.workers = [*self.workers, *self._beside], []
        self._beside = set()
        for task in workers:
            task.cancel()
        for task in workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        tails, self.tails = set(self.tails), set()
        if tails:
            _, late = await asyncio.wait(tails, timeout=durable_wait)
            for task in late:
                task.cancel()
            for task in late:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for job in self._jobs.values():
            if not job.future.done():
                job.future.set_exception(StagerClosedError("the stager closed before this shard was staged"))
        self._jobs.clear()


def _closed(job: Job) -> None:
    if not job.future.done():
        job.future.set_exception(StagerClosedError("the stager stopped before this shard was staged"))


def _mark_retrieved(future: asyncio.Future[Location]) -> None:
    if not future.cancelled():
        future.exception()


def serve_early(job: Job, data: bytes | memoryview, checksum: str) -> None:
    """The job's bytes are verified: readers waiting early read them now (see `Stager.ensure`)."""
    if job.early is None:
        job.early = asyncio.get_running_loop().create_future()  # for readers that ask during the fsync
    if not job.early.done():
        job.early.set_result(Location(LOCAL, None, job.shard, checksum, data))


async def first_answer(job: Job) -> Location:
    """The job's early answer (its bytes in memory) or its durable one, whichever comes first."""
    if job.early is None:
        job.early = asyncio.get_running_loop().create_future()
    early = job.early
    await asyncio.wait((job.future, early), return_when=asyncio.FIRST_COMPLETED)
    if job.future.done() or early.cancelled():
        return await asyncio.shield(job.future)
    return early.result()
