"""`RayPool`: the remote workers, on Ray, that make a dataset's batches; what the training process holds of them.

`RayPool` is configuration only (it pickles with its dataset). The process that iterates the
dataset opens `Workers` from it: Ray actors running `BatchMaker`, spread over the cluster's
nodes, each with a few tasks queued (so it never idles between them), grown and shrunk by
`Workers.resize`, replaced when one dies.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from datacache.loaders.remote._sizing import Target
from datacache.loaders.remote._worker import BatchMaker, EpochKey
from datacache.loaders.stats import StatsTable

from datacache.config import Settings
from datacache.errors import ConfigError

if TYPE_CHECKING:
    from datacache.loaders.dataset import CachedIterableDataset

__all__ = ["TASKS_PER_WORKER", "RayPool", "Worker", "Workers", "check_remote"]

logger = logging.getLogger(__name__)

TASKS_PER_WORKER = 2
"""Tasks queued on each worker: one being made, one waiting, so a worker never waits for the driver."""

_MISSING_RAY = "remote='ray' needs Ray: pip install 'datacache[ray]'"


def _count(value: object, what: str, *, optional: bool = True) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"RayPool {what} must be a positive integer, got {value!r}")


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


@dataclass(eq=False)
class RayPool:
    """CPU workers elsewhere in a Ray cluster that decode, transform and collate a dataset's batches.

    Parameters
    ----------
    workers
        Workers to start with; without a target the pool keeps this size (default: ``max_workers``).
    min_workers, max_workers
        Bounds of the pool's size (default maximum: the cluster's CPUs over ``num_cpus``).
    target_samples
        Samples per second to deliver to this rank; else the dataset's ``target_bandwidth`` (bytes/s).
        With a target, the pool is sized to meet it from each worker's measured rate.
    in_flight
        Batches made or being made and not yet taken by the training loop, at most (the memory bound).
    batches_per_task
        Consecutive batches one task makes (a worker reads a stretch of a shard, not one batch of it).
    num_cpus, resources
        What each worker asks of Ray (``resources={"cpu_node": 1}`` keeps them on nodes that offer it).
    address
        Where to connect when Ray is not initialised yet (``"auto"``, ``"ray://head:10001"``); default:
        ``RAY_ADDRESS``, else a Ray instance on this machine.
    config
        Settings for the workers; default: each node's own (its ``DATACACHE_*`` variables and config file).
    resize_every
        Seconds between two looks at the measured rate; the size moves at most once per look.
    """

    workers: int | None = None
    min_workers: int = 1
    max_workers: int | None = None
    target_samples: float | None = None
    in_flight: int | None = None
    batches_per_task: int = 2
    num_cpus: float = 1.0
    resources: Mapping[str, float] | None = None
    address: str | None = None
    config: Settings | None = None
    resize_every: float = 1.0
    _workers: Workers | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        _count(self.workers, "workers")
        _count(self.min_workers, "min_workers", optional=False)
        _count(self.max_workers, "max_workers")
        _count(self.in_flight, "in_flight")
        _count(self.batches_per_task, "batches_per_task", optional=False)
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ConfigError(f"RayPool max_workers={self.max_workers} is below min_workers={self.min_workers}")
        if self.target_samples is not None and not _positive(self.target_samples):
            raise ConfigError(f"RayPool target_samples must be a positive samples/s, got {self.target_samples!r}")
        if self.in_flight is not None and self.in_flight < self.batches_per_task:
            raise ConfigError(f"RayPool in_flight={self.in_flight} is below batches_per_task={self.batches_per_task}")
        if not _positive(self.num_cpus):
            raise ConfigError(f"RayPool num_cpus must be positive, got {self.num_cpus!r}")
        if not (isinstance(self.resize_every, int | float) and self.resize_every >= 0):
            raise ConfigError(f"RayPool resize_every must be seconds, got {self.resize_every!r}")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_workers"] = None  # actor handles belong to the process that made them
        return state

    def target(self, target_bandwidth: float | None) -> Target | None:
        """The rate the pool is sized for: its own samples/s, else the dataset's bytes/s, else none."""
        if self.target_samples is not None:
            return Target(self.target_samples, "samples")
        return Target(target_bandwidth, "bytes") if target_bandwidth else None

    def open(self) -> Workers:
        """This process's workers (connecting to Ray and starting them the first time)."""
        if self._workers is None:
            self._workers = Workers(self)
        return self._workers

    def close(self) -> None:
        """Stop this process's workers (also done when the process exits)."""
        workers, self._workers = self._workers, None
        if workers is not None:
            workers.stop_all()


def check_remote(remote: object, *, batch_size: int | None, resample: bool) -> RayPool | None:
    """The pool a dataset's ``remote=`` names (``"ray"``: a default `RayPool`), refused in one line if it cannot be."""
    if remote is None:
        return None
    if remote == "ray":
        remote = RayPool()
    if not isinstance(remote, RayPool):
        raise ConfigError(f"remote must be 'ray' or a RayPool, got {remote!r}")
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(_MISSING_RAY)
    if not batch_size:
        raise ConfigError("remote= makes whole batches on the remote workers: give the dataset batch_size=")
    if resample:
        raise ConfigError("remote= reads epochs of a known length: give epoch_size= instead of resample=True")
    return remote


@dataclass(eq=False)
class Worker:
    """One remote worker: its actor and the tasks it has been given and not answered."""

    handle: Any
    number: int
    probe: Any = None
    """Answered once the actor runs: until then it takes no task (it may wait for a node with room)."""
    tasks: set[Any] = field(default_factory=set)
    retiring: bool = False


class Workers:
    """The live workers of a `RayPool` in this process: started, given tasks, resized, replaced."""

    def __init__(self, pool: RayPool) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError(_MISSING_RAY) from None
        if not ray.is_initialized():
            ray.init(address=pool.address, include_dashboard=False, logging_level=logging.WARNING)
        self._ray = ray
        self.pool = pool
        resources: Any = ray.cluster_resources  # untyped in Ray
        cpus = float(resources().get("CPU", 1.0))
        self.high = pool.max_workers or max(pool.min_workers, int(cpus // pool.num_cpus))
        self.low = min(pool.min_workers, self.high)
        self.live: dict[int, Worker] = {}
        self._numbers = iter(range(1 << 62))
        wanted = dict(pool.resources or {}) or None
        self._actor = ray.remote(BatchMaker).options(
            num_cpus=pool.num_cpus, resources=wanted, scheduling_strategy="SPREAD", max_restarts=0
        )
        self._shipped: weakref.WeakKeyDictionary[CachedIterableDataset, tuple[str, list[Any]]]
        self._shipped = weakref.WeakKeyDictionary()
        self.lost = 0
        start = pool.workers or (self.low if pool.target_samples else self.high)
        self.resize(min(max(start, self.low), self.high))

    @property
    def size(self) -> int:
        """Workers taking tasks (those retiring finish theirs and are not counted)."""
        return sum(1 for worker in self.live.values() if not worker.retiring)

    def in_flight_limit(self) -> int:
        """Batches the pool may hold made or being made: the pool's ``in_flight``, else two tasks per worker."""
        pool = self.pool
        return pool.in_flight or TASKS_PER_WORKER * pool.batches_per_task * self.high

    def ship(self, dataset: CachedIterableDataset) -> tuple[str, list[Any]]:
        """The dataset's configuration in Ray's object store, once per dataset object (a token names it)."""
        shipped = self._shipped.get(dataset)
        if shipped is None:
            clone = copy.copy(dataset)
            table = StatsTable(sources=len(dataset._sources))
            clone.__dict__.update(remote=None, _runtime=None, _planner=None, _main_iterator=None, _table=table)
            shipped = (uuid.uuid4().hex, [self._ray.put(clone)])
            self._shipped[dataset] = shipped
        return shipped

    def resize(self, size: int) -> None:
        """Start or retire workers until ``size`` take tasks (retiring ones finish what they were given)."""
        size = min(max(size, self.low), self.high)
        while self.size < size:
            number = next(self._numbers)
            handle: Any = self._actor.remote(self.pool.config)
            self.live[number] = Worker(handle, number, probe=handle.where.remote())
        taking = sorted((w for w in self.live.values() if not w.retiring), key=lambda w: len(w.tasks))
        for worker in taking[: max(0, len(taking) - size)]:
            worker.retiring = True
            worker.handle.close.remote()
            worker.handle.__ray_terminate__.remote()  # after the tasks it was given
            self._forget_if_done(worker)

    def submit(self, token: str, shipped: list[Any], key: EpochKey, first: int) -> tuple[Any, Worker] | None:
        """Give batches ``first ..`` to the least busy worker with room; None while every one is full."""
        free = [w for w in self.live.values() if w.probe is None and not w.retiring and len(w.tasks) < TASKS_PER_WORKER]
        if not free:
            return None
        worker = min(free, key=lambda w: (len(w.tasks), w.number))
        ref = worker.handle.make.remote(token, shipped, key, first, self.pool.batches_per_task)
        worker.tasks.add(ref)
        return ref, worker

    def starting(self) -> dict[Any, Worker]:
        """The probes of workers not yet running, by reference."""
        return {w.probe: w for w in self.live.values() if w.probe is not None}

    def started(self, worker: Worker) -> None:
        """``worker``'s probe was answered: it runs, and takes tasks from now on."""
        worker.probe = None
        self._forget_if_done(worker)

    def release(self, tasks: Mapping[Any, tuple[int, Worker]]) -> None:
        """Drop an epoch's unanswered ``tasks`` (it ended or was left): cancelled if not started, never waited for."""
        for ref, (_, worker) in list(tasks.items()):
            worker.tasks.discard(ref)
            with contextlib.suppress(Exception):  # already done, or its actor gone: nothing to cancel
                self._ray.cancel(ref)
            self._forget_if_done(worker)

    def answered(self, worker: Worker, ref: Any) -> None:
        worker.tasks.discard(ref)
        self._forget_if_done(worker)

    def died(self, worker: Worker) -> None:
        """``worker``'s actor is gone (killed, its node lost): forget it and start another in its place."""
        if self.live.pop(worker.number, None) is None:
            return
        self.lost += 1
        logger.warning("a remote worker was lost; its batches are made again by the others")
        if not worker.retiring:
            self.resize(self.size + 1)

    def _forget_if_done(self, worker: Worker) -> None:
        if worker.retiring and not worker.tasks:
            self.live.pop(worker.number, None)

    def stop_all(self) -> None:
        for worker in list(self.live.values()):
            self._ray.kill(worker.handle)
        self.live.clear()
