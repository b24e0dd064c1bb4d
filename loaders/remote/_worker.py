"""What one remote worker does: make whole batches of a rank's stream, reading through its node's cache.

A worker (the body of a Ray actor, `BatchMaker`) holds a copy of the dataset's configuration
and, for the epoch it is asked about, the reader a single in-process reader of that rank would
have (`Layout(world_size, rank, num_workers=1, chunk=batch_size)`). Batch ``k`` is the rank
stream's positions ``[k * batch_size, (k + 1) * batch_size)``: the same batch whichever worker
makes it and however many there are, so any worker can make any batch, again if need be. The
settings are the node's own (its ``DATACACHE_*`` variables and config file, as ``datacache
serve`` there reads them) unless the pool was given some: each node reads through its own
local tier and daemon, and the cluster's shared tier.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from datacache.loaders.order.layout import Cursor, Layout
from datacache.loaders.stats import Counter

from datacache.config import Settings, load_settings

if TYPE_CHECKING:
    from datacache.loaders.dataset import CachedIterableDataset
    from datacache.loaders.reading.iterator import EpochIterator

__all__ = ["COUNTED", "BatchMaker", "EpochKey", "Made", "Run", "make_batch"]

COUNTED = (
    Counter.UNITS_LOCAL,
    Counter.UNITS_SHARED,
    Counter.UNITS_ORIGIN,
    Counter.WAIT,
    Counter.WAIT_ORIGIN,
    Counter.WAIT_SHARED,
    Counter.READ,
    Counter.DECODE,
    Counter.CORRUPT,
)
"""A worker reader's columns the training process adds to its own row, so that `stats()` says them."""

logger = logging.getLogger(__name__)

_KEPT_DATASETS = 2
"""Dataset copies a worker keeps (a pool shared by two datasets, or a dataset and its `map`)."""


@dataclass(frozen=True, slots=True)
class EpochKey:
    """Which rank stream a batch index counts in: the epoch, its resume cursors, the rank's layout."""

    epoch: int
    cursors: tuple[Cursor, ...]
    world_size: int
    rank: int
    batch_size: int

    def layout(self) -> Layout:
        return Layout(world_size=self.world_size, rank=self.rank, num_workers=1, worker=0, chunk=self.batch_size)


@dataclass(frozen=True, slots=True)
class Made:
    """Batch ``index`` of a rank stream: the batch (None: every sample in it was skipped) and its extent."""

    index: int
    batch: Any
    stop: int
    """The stream position after the batch's last: the reader's count of samples produced once it is taken."""
    nbytes: int
    samples: int


@dataclass(frozen=True, slots=True)
class Run:
    """What one task made: consecutive batches, where the epoch ended if it did, and who made them how fast."""

    made: tuple[Made, ...]
    end: int | None
    """The first batch index past the epoch's end, when this run reached it."""
    seconds: float
    node: str
    pid: int
    counters: tuple[float, ...] = ()
    """What the worker's reader counted making it, by `COUNTED` column: where its shards came from, its waits."""


def make_batch(iterator: EpochIterator, index: int, batch_size: int) -> Made | None:
    """Batch ``index`` of ``iterator``'s stream, read and collated in this process; None past the end.

    The reader is moved to the batch's first position if it is elsewhere (a worker makes batches
    that others between its own have made). What it reads counts in its stats row.
    """
    begin = index * batch_size
    if iterator.produced != begin:
        iterator._skip_to(begin)
    known = iterator._known(begin + batch_size)
    if begin >= known:
        return None
    total = iterator._epoch_plan.readable(begin, batch_size, known)
    built = iterator._builder.build(begin, batch_size)
    stop = min(begin + batch_size, total)
    iterator.produced = stop
    for position in range(begin, stop):
        iterator._units.release_after(position, None)
    if built is None:
        return Made(index, None, stop, 0, 0)
    batch, nbytes, count = built
    iterator._account(nbytes, count)
    return Made(index, batch, stop, nbytes, count)


class BatchMaker:
    """A remote worker: dataset copies by token, and its reader of the epoch it was last asked about."""

    def __init__(self, config: Settings | None) -> None:
        # One core per worker: torch's own threads would compete with the pool's other workers.
        torch.set_num_threads(1)
        self._config = config
        self._datasets: dict[str, CachedIterableDataset] = {}
        self._reading: tuple[str, EpochKey, EpochIterator] | None = None
        import ray

        # The Ray node's id, not the host name: a test cluster's nodes share one host.
        self._node = ray.get_runtime_context().get_node_id()

    def where(self) -> tuple[str, int]:
        """This worker's Ray node and process id (the pool's probe that it runs)."""
        return self._node, os.getpid()

    def make(self, token: str, shipped: list[Any], key: EpochKey, first: int, count: int) -> Run:
        """Batches ``first .. first + count - 1`` of ``key``'s stream (fewer when the epoch ends among them).

        ``shipped`` holds the dataset (a Ray object reference, fetched once per ``token``).
        """
        started = time.perf_counter()
        iterator = self._iterator(token, shipped, key)
        row = iterator._row
        before = [float(row[column]) for column in COUNTED]
        made: list[Made] = []
        end = None
        for index in range(first, first + count):
            batch = make_batch(iterator, index, key.batch_size)
            if batch is None:
                end = index
                break
            made.append(batch)
        counted = tuple(float(row[column]) - was for column, was in zip(COUNTED, before))
        return Run(tuple(made), end, time.perf_counter() - started, self._node, os.getpid(), counted)

    def _iterator(self, token: str, shipped: list[Any], key: EpochKey) -> EpochIterator:
        reading = self._reading
        if reading is not None and reading[0] == token and reading[1] == key:
            return reading[2]
        if reading is not None:
            reading[2]._units.close_all()  # another epoch or dataset: its shards are not read here again
        dataset = self._dataset(token, shipped)
        iterator = dataset._reader(key.layout(), key.epoch, key.cursors)
        self._reading = (token, key, iterator)
        return iterator

    def _dataset(self, token: str, shipped: list[Any]) -> CachedIterableDataset:
        dataset = self._datasets.get(token)
        if dataset is None:
            import ray

            dataset = ray.get(shipped[0])
            dataset.config = self._config if self._config is not None else load_settings()
            while len(self._datasets) >= _KEPT_DATASETS:
                self._datasets.pop(next(iter(self._datasets))).close()
            self._datasets[token] = dataset
        return dataset

    def close(self) -> None:
        """Release the shards and runtimes this worker holds (the pool calls it before it lets one go)."""
        if self._reading is not None:
            self._reading[2]._units.close_all()
            self._reading = None
        for dataset in self._datasets.values():
            dataset.close()
        self._datasets.clear()
