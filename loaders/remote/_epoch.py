"""`RemoteEpoch`: a rank's epoch whose batches remote workers make, handed to the training loop in order.

The rank's stream is the one a single in-process reader would read, in batches of the dataset's
``batch_size`` (`_worker.EpochKey`); batch ``k`` is the same whoever makes it. This iterator asks
the pool for runs of consecutive batches, at most ``in_flight`` batches ahead of the one the
loop takes next (the memory bound: made, being made, or waiting for their turn), and hands them
over strictly in order. A run whose worker died, or whose result was lost with its node, is asked
of another worker; a batch is handed over once, so nothing is lost or repeated. ``produced`` is
what an in-process reader's would be after the same batches, so the dataset's `state_dict`
resumes it exactly, on any world size and any pool size.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from datacache.loaders.order.layout import Cursor, Layout
from datacache.loaders.remote._pool import RayPool, Worker, Workers
from datacache.loaders.remote._sizing import Measured, workers_needed
from datacache.loaders.remote._worker import COUNTED, EpochKey, Made, Run
from datacache.loaders.stats import Counter, LoaderStats, RemoteStats, publish_reader, reader_figures
from torch.utils.data import get_worker_info

from datacache.errors import ConfigError

if TYPE_CHECKING:
    from datacache.loaders.dataset import CachedIterableDataset

__all__ = ["RemoteEpoch", "remote_epoch", "with_remote"]

logger = logging.getLogger(__name__)

_WAIT_STEP = 1.0
"""Seconds one wait for a worker's answer lasts before the pool is looked at again."""
_STALL_LIMIT = 600.0
"""Seconds with no answer from any worker after which the epoch fails, saying so."""
_REPORT_EVERY = 1.0
"""Seconds between two reports to `datacache top` and the daemon's metrics (`top` refreshes every second)."""
_LOSS_LIMIT = 8
"""Workers lost in a row, with no batch made between, after which the epoch fails (they cannot start)."""


@dataclass
class _Limiting:
    """What the dataset's stats read from a reader's prefetch controller."""

    limiting_stage: str | None = None


def remote_epoch(
    dataset: CachedIterableDataset, layout: Layout, epoch: int, cursors: tuple[Cursor, ...]
) -> RemoteEpoch:
    """The rank's epoch ``epoch`` made by the dataset's remote pool (the dataset's hook for ``remote=``)."""
    pool = dataset.remote
    if not isinstance(pool, RayPool) or not dataset.batch_size:  # pragma: no cover - checked at construction
        raise ConfigError("remote= needs a RayPool and batch_size=")
    if get_worker_info() is not None:
        raise ConfigError(
            "remote= streams batches to the training process: use DataLoader(ds, batch_size=None, num_workers=0)"
        )
    return RemoteEpoch(dataset, pool.open(), layout, epoch, cursors)


class RemoteEpoch:
    """Batches of one rank's epoch, made by remote workers, in the stream's order."""

    def __init__(
        self, dataset: CachedIterableDataset, workers: Workers, layout: Layout, epoch: int, cursors: tuple[Cursor, ...]
    ) -> None:
        batch_size = dataset.batch_size or 1
        self.epoch, self.cursors, self.layout = epoch, cursors, layout
        self.produced = 0
        self.controller = _Limiting()
        self._workers = workers
        self._target = workers.pool.target(dataset.target_bandwidth)
        self._key = EpochKey(epoch, cursors, layout.world_size, layout.rank, batch_size)
        self._token, self._shipped = workers.ship(dataset)
        self._limit = workers.in_flight_limit()
        self._per_task = workers.pool.batches_per_task
        self._next = 0  # the next batch the loop takes
        self._asked = 0  # the first batch not yet asked of any worker
        self._again: list[int] = []  # first batches of runs to ask again (their worker was lost)
        self._ready: dict[int, Made] = {}
        self._tasks: dict[Any, tuple[int, Worker]] = {}
        self._end: int | None = None
        self._losses = 0
        self._figures = _Figures()
        self._measured = Measured(0, 0, 0.0)
        self._looked = time.monotonic()
        self._row = dataset._table.row(0).numpy()
        self._start_row()
        # An epoch left before its end (a new one started, the loop broke out) gives its workers back.
        weakref.finalize(self, workers.release, self._tasks)
        self._runtime = dataset._prepare()  # this node's cache: where `datacache top` reads the rank's figures
        self._bandwidth = dataset.target_bandwidth
        self._reported = time.monotonic()

    def _start_row(self) -> None:
        row, now = self._row, time.time()
        row[:] = 0
        row[Counter.ACTIVE] = 1
        row[Counter.STARTED] = now
        row[Counter.UPDATED] = now
        row[Counter.NUM_WORKERS] = 1
        self._last_yield = time.perf_counter()

    def __iter__(self) -> RemoteEpoch:
        return self

    def __next__(self) -> Any:
        asked = time.perf_counter()
        while True:
            if self._end is not None and self._next >= self._end:
                self._finish()
                raise StopIteration
            made = self._ready.pop(self._next, None)
            if made is None:
                self._ask()
                self._receive()
                continue
            self._next += 1
            begin, self.produced = self.produced, made.stop
            self._row[Counter.SKIPPED_SAMPLES] += made.stop - begin - made.samples
            if made.batch is None:
                continue
            self._account(made, asked)
            return made.batch

    def _account(self, made: Made, asked: float) -> None:
        row, now = self._row, time.perf_counter()
        row[Counter.SAMPLES] += made.samples
        row[Counter.BYTES] += made.nbytes
        row[Counter.UPDATED] = time.time()
        row[Counter.CONSUMER_WAIT] += now - asked
        row[Counter.CONSUMER_TIME] += now - self._last_yield
        row[Counter.DEPTH] = self._limit
        self._last_yield = now
        if time.monotonic() - self._reported >= _REPORT_EVERY:
            self._report()

    def _report(self) -> None:
        """Tell the node's daemon (or, embedded, `datacache top`'s report file) this rank's figures and pool size."""
        self._reported = time.monotonic()
        layout, runtime = self.layout, self._runtime
        figures = reader_figures(
            self._row,
            rank=layout.rank,
            world_size=layout.world_size,
            worker=0,
            num_workers=1,
            epoch=self.epoch,
            target=self._bandwidth,
            in_consumer=True,
        )
        figures.update(remote_workers=self._workers.size, remote_max_workers=self._workers.high)
        runtime.submit(publish_reader(runtime.access, runtime.handle, figures))

    # -- asking and receiving ---------------------------------------------------------------

    def _ask(self) -> None:
        """Give runs to workers with room, lost ones first, none beyond ``in_flight`` batches ahead."""
        while True:
            first = self._again[0] if self._again else self._asked
            if self._end is not None and first >= self._end:
                if not self._again:
                    return
                self._again.pop(0)
                continue
            if first + self._per_task > self._next + self._limit and not self._again:
                return
            given = self._workers.submit(self._token, self._shipped, self._key, first)
            if given is None:
                return
            ref, worker = given
            self._tasks[ref] = (first, worker)
            if self._again:
                self._again.pop(0)
            else:
                self._asked += self._per_task
            self._figures.most_in_flight = max(self._figures.most_in_flight, self._held())

    def _held(self) -> int:
        """Batches asked for and not yet taken by the loop (made, being made, or waiting their turn)."""
        return len(self._tasks) * self._per_task + len(self._ready)

    def _receive(self) -> None:
        """Wait for one worker's answer (a bounded wait: the pool is resized between waits)."""
        import ray

        self._resize()
        if not self._workers.live:
            raise RuntimeError("the remote pool has no workers left to make batches")
        waited = time.monotonic()
        while True:
            starting = self._workers.starting()
            done, _ = ray.wait([*self._tasks, *starting], num_returns=1, timeout=_WAIT_STEP)
            if done:
                break
            self._resize()
            if time.monotonic() - waited > _STALL_LIMIT:
                raise RuntimeError(f"no remote worker made a batch for {_STALL_LIMIT:.0f} s (is the Ray cluster up?)")
        ref = done[0]
        if ref in starting:
            self._started(ref, starting[ref])
            return
        first, worker = self._tasks.pop(ref)
        self._workers.answered(worker, ref)
        try:
            run: Run = ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            raise (cause if isinstance(cause, Exception) else exc) from None
        except ray.exceptions.RayError as exc:
            self._lost(first, worker, exc)
            return
        self._took(run)

    def _started(self, probe: Any, worker: Worker) -> None:
        import ray

        try:
            ray.get(probe)
        except ray.exceptions.RayError as exc:  # it died starting (its node lost, its constructor failed)
            self._losses += 1
            if self._losses > _LOSS_LIMIT:
                raise RuntimeError(f"remote workers keep failing to start: {exc}") from exc
            self._workers.died(worker)
            return
        self._workers.started(worker)

    def _took(self, run: Run) -> None:
        self._losses = 0
        for made in run.made:
            if made.index >= self._next:
                self._ready[made.index] = made
        if run.end is not None:
            self._end = run.end if self._end is None else min(self._end, run.end)
        samples = sum(m.samples for m in run.made)
        nbytes = sum(m.nbytes for m in run.made)
        was = self._measured
        self._measured = Measured(was.samples + samples, was.bytes + nbytes, was.busy_seconds + run.seconds)
        self._figures.nodes.add(run.node)
        for column, value in zip(COUNTED, run.counters):
            self._row[column] += value

    def _lost(self, first: int, worker: Worker, exc: Exception) -> None:
        """A run that never came back: ask it of another worker (nothing of it was handed over)."""
        self._losses += 1
        if self._losses > _LOSS_LIMIT:
            raise RuntimeError(f"remote workers keep failing before making a batch: {exc}") from exc
        logger.info("batches %d.. were lost with their worker (%s); asking another", first, type(exc).__name__)
        if isinstance(exc, _actor_errors()):
            self._workers.died(worker)
        self._figures.remade += self._per_task
        self._again.append(first)
        self._again.sort()

    def _resize(self) -> None:
        now = time.monotonic()
        if now - self._looked < self._workers.pool.resize_every:
            return
        self._looked = now
        workers = self._workers
        size = workers_needed(workers.size, self._target, self._measured, workers.low, workers.high)
        if size != workers.size:
            logger.info("remote pool: %d -> %d workers (target %s)", workers.size, size, self._target)
            workers.resize(size)
        self._figures.resizes += 1

    def _finish(self) -> None:
        self._workers.release(self._tasks)  # runs asked past the end, not needed
        self._tasks.clear()
        self._row[Counter.UPDATED] = self._row[Counter.FINISHED] = time.time()
        self._row[Counter.TOTAL] = self.produced
        self._report()

    # -- what stats() says of the pool ------------------------------------------------------

    def pool_stats(self) -> RemoteStats:
        workers, target = self._workers, self._target
        rate = self._measured.per_worker(target.unit if target is not None else "samples")
        return RemoteStats(
            workers=workers.size,
            min_workers=workers.low,
            max_workers=workers.high,
            target_per_second=target.per_second if target is not None else None,
            target_unit=target.unit if target is not None else None,
            per_worker_rate=rate,
            in_flight_limit=self._limit,
            most_in_flight=self._figures.most_in_flight,
            remade_batches=self._figures.remade,
            lost_workers=workers.lost,
            nodes=tuple(sorted(self._figures.nodes)),
        )


@dataclass
class _Figures:
    most_in_flight: int = 0
    remade: int = 0
    resizes: int = 0
    nodes: set[str] = field(default_factory=set)


def _actor_errors() -> tuple[type[Exception], ...]:
    import ray

    return (ray.exceptions.RayActorError,)


def with_remote(stats: LoaderStats, iterator: object) -> LoaderStats:
    """``stats`` with the remote pool's figures, when ``iterator`` (the dataset's last) was a remote epoch."""
    if not isinstance(iterator, RemoteEpoch):
        return stats
    return dataclasses.replace(stats, remote=iterator.pool_stats())
