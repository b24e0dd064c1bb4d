"""`CachedIterableDataset`: a drop-in ``IterableDataset`` that reads through the cache.

It holds configuration only. In each process that iterates it (the main
process, or every DataLoader worker, forked or spawned), it lazily opens its
own event loop, stager or daemon client, and the dataset's manifest and unit
plan (both persisted once per node). Each iteration deals this epoch's global
order to the rank and worker it runs in (see `datacache.loaders.order`),
stages the shards it will read next before it reaches them, verifies every
shard before serving a sample from it, and records what it delivered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing.util
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from datacache.loaders.order import (
    Cursor,
    Layout,
    epoch_order,
    equalize,
    produced_from_consumed,
    rank_positions,
    remaining_sequence,
    worker_positions,
)
from datacache.loaders.packing import BufferRing, pack_fields
from datacache.loaders.plan import load_or_build_plan
from datacache.loaders.prefetch import PrefetchController
from datacache.loaders.readers import (
    SpanCache,
    TarReader,
    UnitPlan,
    UnitReader,
    hash_buffer,
    map_file,
    open_unit_reader,
)
from datacache.loaders.stats import Counter, LoaderStats, StatsTable, mode_code
from torch.utils.data import IterableDataset, get_worker_info

from datacache._sync import LoopThread
from datacache.access import ShardAccess, ThroughputReporter, open_access
from datacache.config import DatasetConfig, Settings, load_settings
from datacache.errors import ChecksumMismatchError, ConfigError, DatacacheError, ShardReadError
from datacache.manifest import ShardFormat
from datacache.stager import DatasetHandle, Location
from datacache.units import parse_bandwidth

__all__ = ["CachedIterableDataset"]

logger = logging.getLogger(__name__)

Decoder = Callable[[dict[str, Any]], Any] | Mapping[str, Callable[[Any], Any]] | str
_STATE_VERSION = 1
_REPORT_INTERVAL = 5.0
"""Seconds between throughput reports to the daemon."""
_READER_THREADS = 2
_LOOKAHEAD = 6
"""Batches the reader threads build ahead of the consumer; the ring holds two more."""
"""Threads that read and pack batches ahead in the consumer's process (batch mode, no workers)."""
_ITERATOR_MARK = "datacache_iterator"


@dataclass
class _Runtime:
    """What one process opened for this dataset; never pickled."""

    pid: int
    loop: LoopThread
    settings: Settings
    access: ShardAccess
    handle: DatasetHandle
    plan: UnitPlan
    window: int
    closed: bool = False
    spans: SpanCache = field(default_factory=SpanCache)
    """Tar indexes scanned on this node: later epochs and workers reuse them instead of scanning again."""

    def close(self) -> None:
        if self.pid != os.getpid() or self.closed:
            return
        self.closed = True
        try:
            self.loop.run(self.access.close(), timeout=30)
        finally:
            self.loop.close()


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise ConfigError("RANK and WORLD_SIZE must be integers") from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is not within WORLD_SIZE={world}")
    return rank, world


class CachedIterableDataset(IterableDataset[Any]):
    """Samples of a cached dataset, dealt exactly once across ranks and workers.

    Parameters
    ----------
    dataset
        A URL (``s3://bucket/prefix/``, a local path, any fsspec URL) or a dataset name from the config file.
    shuffle
        Shuffle shards, then samples within windows of ``shuffle_buffer``.
    seed
        With the epoch, the only input of the global order.
    shuffle_buffer
        Samples per shuffle window; default: twice the mean samples per shard (at least 256, at most
        16384). Larger mixes more; smaller keeps each window on fewer shards, so that the first batch
        of a cold epoch waits for fewer of them.
    target_bandwidth
        Per-rank bytes per second to deliver (a number or ``"1GB/s"``); prefetch widens to meet it.
    prefetch
        Units (shards) to stage ahead per reader; default: derived from the target and measured rates.
    decode
        ``"auto"`` keeps raw bytes; a callable receives each sample dict; a mapping decodes fields by name.
    drop_last
        Drop the remainder so every rank has ``floor(N / world)`` samples; else pad by repeating.
    config
        `Settings` to use instead of the config file and environment.
    batch_size
        Yield whole batches of this size (use ``DataLoader(ds, batch_size=None)``): raw fields come as
        `PackedBytes` in reused shared memory, which skips per-sample pickling between processes. It is
        also the chunk in which each rank's samples are dealt to workers, which makes resume exact.
    on_error
        ``"raise"`` (default) or ``"skip"``: skip a shard that is corrupt or unreadable, and count it.
    """

    def __init__(
        self,
        dataset: str | DatasetConfig,
        *,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int | None = None,
        target_bandwidth: str | float | None = None,
        prefetch: int | None = None,
        decode: Decoder = "auto",
        drop_last: bool = False,
        config: Settings | None = None,
        batch_size: int | None = None,
        on_error: str = "raise",
    ) -> None:
        super().__init__()
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if shuffle_buffer is not None and shuffle_buffer < 1:
            raise ConfigError(f"shuffle_buffer must be positive, got {shuffle_buffer}")
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        if prefetch is not None and prefetch < 0:
            raise ConfigError(f"prefetch must not be negative, got {prefetch}")
        if not (decode == "auto" or callable(decode) or isinstance(decode, Mapping)):
            raise ConfigError("decode must be 'auto', a callable, or a mapping of field name to callable")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = int(seed)
        self.shuffle_buffer = shuffle_buffer
        self.target_bandwidth = parse_bandwidth(target_bandwidth) if target_bandwidth is not None else None
        self.prefetch = prefetch
        self.decode = decode
        self.drop_last = drop_last
        self.config = config
        self.batch_size = batch_size
        self.on_error = on_error
        self._epoch = 0
        self._cursors: tuple[Cursor, ...] = ()
        self._resume_epoch: int | None = None
        self._table = StatsTable()
        self._layout_hint: tuple[int, int] | None = None
        self._runtime: _Runtime | None = None
        self._main_iterator: _EpochIterator | None = None

    # -- pickling: configuration only --------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_runtime"] = None
        state["_main_iterator"] = None
        # Captured here, in the process that hands the dataset to spawned workers,
        # where torch.distributed is initialised.
        state["_layout_hint"] = _rank_and_world()
        return state

    # -- process-local runtime -----------------------------------------------------------

    def _prepare(self) -> _Runtime:
        runtime = self._runtime
        if runtime is not None and runtime.pid == os.getpid():
            return runtime
        settings = self.config if self.config is not None else load_settings()
        loop = LoopThread(name="datacache-loader")
        in_worker = get_worker_info() is not None
        access: ShardAccess | None = None
        try:
            access = loop.run(open_access(settings, reconcile=not in_worker))
            handle = loop.run(access.open(self.dataset))
            plan = loop.run(load_or_build_plan(access, handle, settings))
        except BaseException:
            if access is not None:
                # Stop its transfers cleanly (no temporary file left open) and close its sessions.
                with contextlib.suppress(Exception):
                    loop.run(access.close(), timeout=30)
            loop.close()
            raise
        spans = SpanCache(directory=settings.local_dir / "indexes" / "spans" / handle.id)
        window = self.shuffle_buffer or _auto_window(plan)
        runtime = _Runtime(os.getpid(), loop, settings, access, handle, plan, window, spans=spans)
        self._runtime = runtime
        # Runs at exit in the main process and in DataLoader workers alike (they
        # leave through multiprocessing, which skips plain atexit handlers).
        multiprocessing.util.Finalize(runtime, runtime.close, exitpriority=100)
        return runtime

    def close(self) -> None:
        """Release this process's loop, stager and connections (also done at exit)."""
        runtime, self._runtime = self._runtime, None
        if runtime is not None and runtime.pid == os.getpid():
            runtime.close()

    def _rank_world(self) -> tuple[int, int]:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if get_worker_info() is not None and self._layout_hint is not None and not distributed:
            return self._layout_hint
        return _rank_and_world()

    # -- the epoch ------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next (also reaches persistent workers)."""
        if epoch < 0:
            raise ConfigError(f"epoch must not be negative, got {epoch}")
        if epoch != self._epoch:
            self._cursors = ()
        self._epoch = int(epoch)
        self._table.epoch = self._epoch

    @property
    def epoch(self) -> int:
        return self._epoch

    def __len__(self) -> int:
        """Samples (or batches, in batch mode) this rank delivers per epoch."""
        total = self._prepare().plan.total
        _, world = self._rank_world()
        per_rank = total // world if self.drop_last else -(-total // world)
        if self.batch_size:
            return max(0, -(-per_rank // self.batch_size))
        return max(0, per_rank)

    def __iter__(self) -> Iterator[Any]:
        runtime = self._prepare()
        info = get_worker_info()
        rank, world = self._rank_world()
        layout = Layout(
            world_size=world,
            rank=rank,
            num_workers=info.num_workers if info is not None else 1,
            worker=info.id if info is not None else 0,
            chunk=self.batch_size or 1,
        )
        epoch = self._table.epoch if info is not None else self._epoch
        cursors = self._cursors if (self._resume_epoch is None or self._resume_epoch == epoch) else ()
        iterator = _EpochIterator(self, runtime, layout, epoch, cursors)
        if info is None:
            self._main_iterator = iterator
        return iterator

    # -- resume ---------------------------------------------------------------------------

    def state_dict(self, samples_consumed: int | None = None) -> dict[str, Any]:
        """A few integers that resume this epoch exactly, on any number of ranks and workers.

        Parameters
        ----------
        samples_consumed
            Samples this rank's training loop has taken from the DataLoader in this
            epoch (steps times batch size). Needed with DataLoader worker processes,
            where the main process cannot see their progress; with
            ``num_workers=0`` it is tracked automatically.
        """
        _, world = self._rank_world()
        chunk = self.batch_size or 1
        if get_worker_info() is not None:
            return {"version": _STATE_VERSION, "epoch": self._epoch}
        if samples_consumed is not None:
            if samples_consumed < 0:
                raise ConfigError(f"samples_consumed must not be negative, got {samples_consumed}")
            workers = int(self._table.row(0)[Counter.NUM_WORKERS].item()) or 1
            cursor = Cursor(world, workers, chunk, produced_from_consumed(samples_consumed, workers, chunk))
        elif self._main_iterator is not None and self._main_iterator.epoch == self._epoch:
            cursor = Cursor(world, 1, chunk, (self._main_iterator.produced,))
        elif int(self._table.row(0)[Counter.NUM_WORKERS].item()) > 1 or self._table.row(0)[Counter.ACTIVE] > 0:
            raise ConfigError(
                "with DataLoader worker processes, call state_dict(samples_consumed=steps * batch_size) "
                "or use torchdata's StatefulDataLoader"
            )
        else:
            cursor = Cursor(world, 1, chunk, (0,))
        return self._state((*self._cursors, cursor))

    def _state(self, cursors: tuple[Cursor, ...]) -> dict[str, Any]:
        runtime = self._prepare()
        return {
            "version": _STATE_VERSION,
            "dataset": runtime.handle.id,
            "snapshot": runtime.handle.manifest.snapshot,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": runtime.window,
            "drop_last": self.drop_last,
            "epoch": self._epoch,
            "cursors": [cursor.to_json() for cursor in cursors],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from `state_dict` output, or from a torchdata ``StatefulDataLoader.state_dict()``.

        The next iteration continues the saved epoch where it stopped, dealt to
        however many ranks and workers this job has.
        """
        if not isinstance(state, Mapping):
            raise ConfigError("load_state_dict expects the mapping state_dict() returned")
        if get_worker_info() is not None and set(state) <= {"version", "epoch"}:
            self._epoch = int(state.get("epoch", self._epoch))
            return
        iterator_states = _find_iterator_states(state)
        if "cursors" not in state and iterator_states:
            state = _state_from_iterators(iterator_states)
        try:
            version = state["version"]
            cursors = tuple(Cursor.from_json(c) for c in state["cursors"])
            epoch = int(state["epoch"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"not a CachedIterableDataset state: {exc}") from None
        if version != _STATE_VERSION:
            raise ConfigError(f"unsupported state version {version!r}")
        ours = {"seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}
        if "shuffle_buffer" in state:
            ours["shuffle_buffer"] = self._prepare().window
        for name, value in ours.items():
            if name in state and state[name] != value:
                raise ConfigError(f"the saved state used {name}={state[name]!r}, this dataset has {value!r}")
        if "snapshot" in state:
            runtime = self._prepare()
            if state["snapshot"] != runtime.handle.manifest.snapshot:
                raise ConfigError(
                    f"dataset {runtime.handle.id}: the saved state is for manifest snapshot {state['snapshot']}, "
                    f"the cache now holds {runtime.handle.manifest.snapshot}; resume needs the same snapshot"
                )
        self._epoch = epoch
        self._table.epoch = epoch
        self._cursors = cursors
        self._resume_epoch = epoch

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> LoaderStats:
        """Delivered bandwidth and samples/s, data-stall fraction, hit ratio per tier, prefetch depth."""
        runtime = self._runtime
        mode = runtime.access.mode if runtime is not None else "embedded"
        limiting = self._main_iterator.controller.limiting_stage if self._main_iterator is not None else None
        consumer = self._table.consumer_row().clone()
        if runtime is not None and runtime.pid == os.getpid():
            # This process's own origin retries (its readers, or its plan building); worker
            # processes put theirs in their rows.
            consumer[Counter.RETRIES] = runtime.access.origin_retries()
        return LoaderStats.from_table(
            self._table.snapshot(),
            consumer,
            mode=mode,
            epoch=self._epoch,
            target=self.target_bandwidth,
            limiting=limiting,
        )

    def timed(self, loader: Any) -> Iterator[Any]:
        """Iterate ``loader`` while measuring how long the consumer waits for each batch.

        The result is the ``stall_fraction`` of `stats` (the first batch, which
        waits for the workers to start, is not counted). Without worker
        processes it is measured anyway.
        """
        row = self._table.consumer_row().numpy()
        row[:] = 0
        iterator = iter(loader)
        try:
            # The first batch waits for workers to start: start-up, not a stall.
            yield next(iterator)
        except StopIteration:
            return
        last = time.perf_counter()
        while True:
            asked = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            got = time.perf_counter()
            row[Counter.CONSUMER_WAIT] += got - asked
            row[Counter.CONSUMER_TIME] += got - last
            last = got
            yield batch


def _find_iterator_states(state: Any) -> list[Mapping[str, Any]]:
    found: list[Mapping[str, Any]] = []
    if isinstance(state, Mapping):
        if state.get(_ITERATOR_MARK) == 1:
            return [state]
        for value in state.values():
            found.extend(_find_iterator_states(value))
    elif isinstance(state, list | tuple):
        for value in state:
            found.extend(_find_iterator_states(value))
    return found


def _state_from_iterators(states: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Turn the per-worker iterator states a StatefulDataLoader saved into one dataset state."""
    first = states[0]
    layout = first["layout"]
    produced = [0] * int(layout["num_workers"])
    for entry in states:
        produced[int(entry["layout"]["worker"])] = int(entry["produced"])
    cursor = Cursor(int(layout["world_size"]), int(layout["num_workers"]), int(layout["chunk"]), tuple(produced))
    return {
        "version": _STATE_VERSION,
        "epoch": int(first["epoch"]),
        "seed": first["seed"],
        "cursors": [*first["cursors"], cursor.to_json()],
    }


class _EpochIterator:
    """One reader's pass over its share of an epoch; `Stateful` for torchdata."""

    def __init__(
        self,
        dataset: CachedIterableDataset,
        runtime: _Runtime,
        layout: Layout,
        epoch: int,
        cursors: tuple[Cursor, ...],
    ) -> None:
        self.dataset = dataset
        self.runtime = runtime
        self.layout = layout
        self.epoch = epoch
        self.cursors = cursors
        self.produced = 0
        plan = runtime.plan
        self._plan = plan
        self._format = runtime.handle.manifest.format
        self._where = f"dataset {runtime.handle.id}"
        counts = plan.counts
        order = epoch_order(
            counts, seed=dataset.seed, epoch=epoch, shuffle=dataset.shuffle, window=runtime.window
        )
        sequence = remaining_sequence(order, cursors, runtime.window)
        total = len(sequence)
        own = rank_positions(total, layout.world_size, layout.rank, runtime.window)
        natural = len(own)
        positions, _ = equalize(own, total, layout.world_size, drop_last=dataset.drop_last)
        padded = np.arange(len(positions)) >= natural
        indexes = np.arange(len(positions), dtype=np.int64)
        mine = worker_positions(indexes, layout.num_workers, layout.worker, layout.chunk)
        self._ids = sequence[positions[mine]]
        self._padded = int(padded[mine].sum())
        starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        self._unit_of = np.searchsorted(starts, self._ids, side="right") - 1
        # Units with no samples share a start with the next one; searchsorted picks the last of them.
        self._local = self._ids - starts[self._unit_of]
        self._last_use: dict[int, int] = {}
        for position, unit in enumerate(self._unit_of.tolist()):
            self._last_use[unit] = position
        first_use: dict[int, int] = {}
        for position, unit in enumerate(self._unit_of.tolist()):
            first_use.setdefault(unit, position)
        self._first_use = first_use
        self._unit_sequence = sorted(first_use, key=first_use.__getitem__)
        self._preopened: set[int] = set()
        self._next_unit_index = 0
        self._prefetched_until = 0
        self._readers: dict[int, UnitReader] = {}
        self._skipped_units: set[int] = set()
        mean_bytes = runtime.handle.manifest.total_bytes / max(1, len(plan.units))
        share = dataset.target_bandwidth / layout.num_workers if dataset.target_bandwidth else None
        # By default, stage everything the next shuffle window will touch while this one is read,
        # and at least enough to keep every transfer slot of the stager busy.
        per_unit = max(1.0, plan.total / max(1, len(plan.units)))
        initial = min(64, max(int(-(-runtime.window // per_unit)) + 2, runtime.settings.concurrency))
        self.controller = PrefetchController(
            fixed=dataset.prefetch,
            initial=initial,
            target=share,
            unit_bytes=mean_bytes,
            where=f"{self._where} reader {layout.worker}",
        )
        self._ring: BufferRing | None = None
        self._row = dataset._table.row(layout.worker).numpy()
        self._row[:] = 0
        now = time.time()
        self._row[Counter.ACTIVE] = 1
        self._row[Counter.STARTED] = now
        self._row[Counter.UPDATED] = now
        self._row[Counter.NUM_WORKERS] = layout.num_workers
        self._row[Counter.PADDED] = self._padded
        self._row[Counter.TOTAL] = len(self._ids)
        self._row[Counter.MODE] = mode_code(runtime.access.mode)
        self._reported_at = time.monotonic()
        self._in_consumer = get_worker_info() is None
        self._last_yield = time.perf_counter()
        self._staged_bytes = 0.0
        self._staging_seconds = 0.0
        self._lock = threading.Lock()
        self._unit_locks: dict[int, threading.Lock] = {}
        self._threads = _READER_THREADS if (self._in_consumer and dataset.batch_size) else 0
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[int, concurrent.futures.Future[tuple[Any, int, int] | None]] = {}
        self._future_told = False
        self._skip_to(0)
        self._note_retries()

    # -- Stateful ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            _ITERATOR_MARK: 1,
            "epoch": self.epoch,
            "seed": self.dataset.seed,
            "produced": self.produced,
            "cursors": [c.to_json() for c in self.cursors],
            "layout": {
                "world_size": self.layout.world_size,
                "rank": self.layout.rank,
                "num_workers": self.layout.num_workers,
                "worker": self.layout.worker,
                "chunk": self.layout.chunk,
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        layout = state.get("layout", {})
        same = (
            int(state.get("epoch", -1)) == self.epoch
            and [Cursor.from_json(c) for c in state.get("cursors", [])] == list(self.cursors)
            and layout.get("world_size") == self.layout.world_size
            and layout.get("rank") == self.layout.rank
            and layout.get("num_workers") == self.layout.num_workers
            and layout.get("worker") == self.layout.worker
            and layout.get("chunk") == self.layout.chunk
        )
        if not same:
            raise ConfigError(
                "this iterator state was saved with another layout or epoch; "
                "resume through CachedIterableDataset.load_state_dict(loader.state_dict()) instead"
            )
        self._skip_to(int(state["produced"]))

    def _skip_to(self, produced: int) -> None:
        self._drain()
        self.produced = min(produced, len(self._ids))
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        if self.produced:
            upcoming = set(self._unit_of[self.produced :].tolist())
            self._unit_sequence = [u for u in self._unit_sequence if u in upcoming]
        self._next_unit_index = 0
        self._prefetched_until = 0

    # -- iteration ------------------------------------------------------------------------

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        started = time.perf_counter()
        try:
            if self.dataset.batch_size:
                return self._next_batch(self.dataset.batch_size)
            return self._next_sample()
        finally:
            if self._in_consumer:
                now = time.perf_counter()
                self._row[Counter.CONSUMER_WAIT] += now - started
                self._row[Counter.CONSUMER_TIME] += now - self._last_yield
                self._last_yield = now

    def _next_sample(self) -> Any:
        while True:
            if self.produced >= len(self._ids):
                self._finish()
                raise StopIteration
            position = self.produced
            reader = self._reader_at(position)
            self.produced += 1
            if reader is None:
                self._row[Counter.SKIPPED_SAMPLES] += 1
                continue
            sample = reader.sample(int(self._local[position]))
            self._account(sample_bytes(sample), 1)
            self._release_after(position)
            return self._decode(sample, reader)

    def _next_batch(self, size: int) -> Any:
        while True:
            if self.produced >= len(self._ids):
                self._finish()
                raise StopIteration
            begin = self.produced
            if self._threads:
                self._schedule(size)
                built = self._pending.pop(begin).result()
            else:
                built = self._build_batch(begin, size)
            stop = min(begin + size, len(self._ids))
            self.produced = stop
            for position in range(begin, stop):
                self._release_after(position)
            if built is not None:
                batch, nbytes, count = built
                self._account(nbytes, count)
                return batch

    def _schedule(self, size: int) -> None:
        """Keep the reader threads busy on the next few batches, in order.

        Then open (map and verify) the shards the next shuffle window needs,
        so that crossing into it costs no wait: opening a 64 MB shard takes
        tens of milliseconds, several batches' worth.
        """
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self._threads, thread_name_prefix="datacache-reader")
        begin = self.produced
        for _ in range(_LOOKAHEAD):
            if begin >= len(self._ids):
                break
            if begin not in self._pending:
                self._pending[begin] = self._pool.submit(self._build_batch, begin, size)
            begin += size
        horizon = begin + self.runtime.window
        for unit in self._unit_sequence[self._next_unit_index :]:
            position = self._first_use[unit]
            if position >= horizon:
                break
            if position >= begin and unit not in self._preopened and unit not in self._readers:
                self._preopened.add(unit)
                self._pool.submit(self._preopen, position)

    def _preopen(self, position: int) -> None:
        """Open the unit first used at ``position`` ahead of need; errors surface when it is used."""
        with contextlib.suppress(Exception):
            self._reader_at(position)

    def _drain(self) -> None:
        pending, self._pending = self._pending, {}
        for future in pending.values():
            future.cancel()
        for future in pending.values():
            if not future.cancelled():
                with contextlib.suppress(Exception):
                    future.result()

    def _build_batch(self, begin: int, size: int) -> tuple[Any, int, int] | None:
        """Read and pack the batch of positions ``[begin, begin + size)``; None if all were skipped.

        Runs on reader threads (file reads, hashing and copies release the GIL)
        or inline. Batch ``n`` is packed into ring slot ``n % slots``: a slot is
        rewritten only after the consumer has taken two later batches.
        """
        stop = min(begin + size, len(self._ids))
        raw: list[list[tuple[str, memoryview]]] = []
        decoded: list[Any] = []
        zarr_rows: list[tuple[UnitReader, int]] = []
        skipped = 0
        for position in range(begin, stop):
            if self._threads and position % 8 == 0:
                # Hand the GIL over now and then: a thread that holds it until the interpreter
                # forces a switch (5 ms) would make the training loop wait that long.
                time.sleep(0)
            reader = self._reader_at(position)
            if reader is None:
                skipped += 1
                continue
            local = int(self._local[position])
            if self.dataset.decode == "auto" and reader.packable:
                raw.append(reader.fields(local))
            elif self.dataset.decode == "auto" and self._format is ShardFormat.ZARR:
                zarr_rows.append((reader, local))
            else:
                decoded.append(self._decode(reader.sample(local), reader))
        if skipped:
            with self._lock:
                self._row[Counter.SKIPPED_SAMPLES] += skipped
        if raw:
            with self._lock:
                if self._ring is None:
                    slots = _LOOKAHEAD + 2 if self._threads else 4
                    self._ring = BufferRing(slots, shared=not self._in_consumer)
            batch = pack_fields(raw, self._ring, slot=begin // size)
            del raw  # the views pin the mapped shards; drop them before any is unmapped
            nbytes = sum(v.nbytes for k, v in batch.items() if k != "__key__")
            return batch, nbytes, len(batch["__key__"])
        if zarr_rows:
            batch = _stack_zarr(zarr_rows)
            return batch, sum(v.nbytes for k, v in batch.items() if k != "__key__"), len(zarr_rows)
        if decoded:
            if self._format is ShardFormat.PARQUET and self.dataset.decode == "auto":
                import pyarrow as pa

                record_batch = pa.RecordBatch.from_pylist(decoded)
                return record_batch, record_batch.nbytes, len(decoded)
            return torch.utils.data.default_collate(decoded), sum(map(_payload_bytes, decoded)), len(decoded)
        return None

    def _decode(self, sample: dict[str, Any], reader: UnitReader) -> Any:
        decode = self.dataset.decode
        if decode == "auto":
            if reader.packable:
                sample["__url__"] = f"{self.runtime.handle.config.url.rstrip('/')}/{reader.unit.keys[0]}"
            return sample
        started = time.perf_counter()
        try:
            if isinstance(decode, Mapping):
                return {k: (decode[k](v) if k in decode else v) for k, v in sample.items()}
            if callable(decode):
                return decode(sample)
            return sample
        finally:
            self._row[Counter.DECODE] += time.perf_counter() - started

    def _account(self, nbytes: int, samples: int) -> None:
        with self._lock:
            self._account_locked(nbytes, samples)

    def _account_locked(self, nbytes: int, samples: int) -> None:
        row = self._row
        row[Counter.SAMPLES] += samples
        row[Counter.BYTES] += nbytes
        row[Counter.UPDATED] = time.time()
        row[Counter.DEPTH] = self.controller.depth
        now = time.monotonic()
        if now - self._reported_at >= _REPORT_INTERVAL:
            self._reported_at = now
            self._report()
        if not self.controller.due():
            return
        self.controller.observe(
            delivered=float(row[Counter.BYTES]),
            waited=float(row[Counter.WAIT]),
            staging_rate=self._staged_bytes / self._staging_seconds if self._staging_seconds else 0.0,
            breakdown={
                "origin": float(row[Counter.WAIT_ORIGIN]),
                "shared tier": float(row[Counter.WAIT_SHARED]),
                "local disk": float(row[Counter.READ]),
                "decode": float(row[Counter.DECODE]),
                "total": float(row[Counter.UPDATED] - row[Counter.STARTED]),
            },
        )

    def _report(self) -> None:
        """Tell the daemon (if one serves this reader) what it delivered, for its metrics."""
        access = self.runtime.access
        row = self._row
        row[Counter.MODE] = mode_code(access.mode)
        if not isinstance(access, ThroughputReporter):
            return
        elapsed = max(float(row[Counter.UPDATED] - row[Counter.STARTED]), 1e-9)
        if self._in_consumer and row[Counter.CONSUMER_TIME] > 0:
            stall = float(row[Counter.CONSUMER_WAIT] / row[Counter.CONSUMER_TIME])
        else:
            stall = min(1.0, float(row[Counter.WAIT]) / elapsed)
        self.runtime.loop.submit(
            access.report(
                delivered_bytes_per_s=float(row[Counter.BYTES]) / elapsed,
                stall_fraction=stall,
                delivered_bytes=int(row[Counter.BYTES]),
                dataset=self.runtime.handle.id,
            )
        )

    def _note_retries(self) -> None:
        """Copy this worker process's origin retries into its row (the consumer's are read by `stats`)."""
        if not self._in_consumer:
            self._row[Counter.RETRIES] = self.runtime.access.origin_retries()

    def _finish(self) -> None:
        self._note_retries()
        self._report()
        self._drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self._row[Counter.UPDATED] = time.time()

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _release_after(self, position: int) -> None:
        unit = int(self._unit_of[position])
        if self._last_use.get(unit) == position:
            reader = self._readers.pop(unit, None)
            if reader is not None:
                if self._pool is not None:
                    # Unmapping 64 MB takes milliseconds: not in the consumer's thread.
                    self._pool.submit(reader.close)
                else:
                    reader.close()

    # -- units: prefetch, open, verify ----------------------------------------------------

    def _reader_at(self, position: int) -> UnitReader | None:
        unit = int(self._unit_of[position])
        reader = self._readers.get(unit)
        if reader is not None:
            return reader
        with self._lock:
            if unit in self._skipped_units:
                return None
            unit_lock = self._unit_locks.setdefault(unit, threading.Lock())
            self._advance_prefetch(unit)
        with unit_lock:  # one thread opens a unit; the others wait for it
            reader = self._readers.get(unit)
            if reader is not None:
                return reader
            if unit in self._skipped_units:
                return None
            try:
                reader = self._open(unit)
            except (ShardReadError, ChecksumMismatchError) as exc:
                if self.dataset.on_error != "skip":
                    raise
                logger.warning("%s: skipping %s: %s", self._where, self._plan.units[unit].label, exc)
                with self._lock:
                    self._skipped_units.add(unit)
                    self._row[Counter.SKIPPED_SHARDS] += 1
                return None
            self._readers[unit] = reader
            return reader

    def _advance_prefetch(self, unit: int) -> None:
        sequence = self._unit_sequence
        while self._next_unit_index < len(sequence) and sequence[self._next_unit_index] != unit:
            self._next_unit_index += 1
        depth = self.controller.depth
        until = min(len(sequence), self._next_unit_index + 1 + depth)
        if until <= self._prefetched_until or depth == 0:
            return
        start = max(self._prefetched_until, self._next_unit_index + 1)
        keys = [key for u in sequence[start:until] for key in self._plan.units[u].keys]
        self._prefetched_until = until
        runtime = self.runtime
        if not self._future_told:
            self._future_told = True
            future = [key for u in sequence for key in self._plan.units[u].keys]
            runtime.loop.submit(runtime.access.set_future_order(runtime.handle, future))
        if keys:
            runtime.loop.submit(runtime.access.prefetch(runtime.handle, keys))

    def _open(self, unit_index: int) -> UnitReader:
        unit = self._plan.units[unit_index]
        runtime = self.runtime
        where = f"{self._where}: shard {unit.label!r}"
        # Three tries: a bad local copy is dropped, then a bad shared copy, then the origin's bytes.
        for attempt in range(3):
            started = time.perf_counter()
            locations, tier = runtime.loop.run(_locate_all(runtime.access, runtime.handle, unit.keys))
            waited = time.perf_counter() - started
            buffers: dict[str, Any] = {}
            try:
                read_started = time.perf_counter()
                for location in locations:
                    buffers[location.shard.key] = self._load(location, where)
                read_seconds = time.perf_counter() - read_started
                index_key = None
                identity = (locations[0].checksum or locations[0].shard.version) if len(locations) == 1 else None
                if self._format is ShardFormat.TAR and identity is not None:
                    index_key = (locations[0].shard.key, locations[0].shard.size, identity)
                known = runtime.spans.get(index_key) if index_key is not None else None
                reader = open_unit_reader(self._format, unit, where, buffers, self._plan.extra, spans=known)
                if index_key is not None and known is None and isinstance(reader, TarReader):
                    runtime.spans.put(index_key, reader.spans)
            except ChecksumMismatchError as exc:
                for buffer in buffers.values():
                    if hasattr(buffer, "close"):
                        buffer.close()
                bad = [loc for loc in locations if loc.path is not None]
                self._row[Counter.CORRUPT] += 1
                for location in bad:
                    runtime.loop.run(runtime.access.report_corrupt(runtime.handle, location))
                if attempt == 2:
                    raise ChecksumMismatchError(f"{where}: {exc}") from exc
                continue
            except FileNotFoundError:
                # Evicted between locate and open: locate again.
                if attempt == 2:
                    raise
                continue
            row = self._row
            if tier == "local":
                row[Counter.UNITS_LOCAL] += 1
                row[Counter.READ] += read_seconds + waited
            else:
                row[Counter.UNITS_SHARED if tier == "shared" else Counter.UNITS_ORIGIN] += 1
                row[Counter.WAIT] += waited + read_seconds
                row[Counter.WAIT_SHARED if tier == "shared" else Counter.WAIT_ORIGIN] += waited + read_seconds
                size = sum(loc.shard.size for loc in locations)
                self._staged_bytes += size
                self._staging_seconds += waited + read_seconds
            self._note_retries()
            return reader
        raise DatacacheError(f"{where}: could not be read")  # pragma: no cover - loop always returns or raises

    def _load(self, location: Location, where: str) -> Any:
        runtime = self.runtime
        if location.path is None:
            return runtime.loop.run(runtime.access.read(runtime.handle, location.shard.key))
        buffer = map_file(location.path)
        problem = None
        if len(buffer) != location.shard.size:
            problem = f"{len(buffer)} bytes on the {location.tier} tier, expected {location.shard.size}"
        elif (
            runtime.settings.verify_on_read
            and location.checksum is not None
            and hash_buffer(buffer) != location.checksum
        ):
            problem = f"the copy on the {location.tier} tier does not match its checksum"
        if problem is not None:
            if hasattr(buffer, "close"):
                buffer.close()
            raise ChecksumMismatchError(f"{where}: {problem}")
        return buffer


async def _locate_all(
    access: ShardAccess, handle: DatasetHandle, keys: tuple[str, ...]
) -> tuple[list[Location], str]:
    """Where each key can be read: local, else shared (its local copy goes on), else staged now.

    Also returns the slowest tier the unit was found on when asked for:
    ``"origin"`` means the reader had to wait for a transfer.
    """
    found: list[str] = []

    async def one(key: str) -> Location:
        location = await access.locate(handle, key)
        found.append(location.tier)
        if location.tier in ("local", "shared"):
            return location
        return await access.ensure(handle, key)

    locations = list(await asyncio.gather(*(one(key) for key in keys)))
    tier = "origin" if "origin" in found else "shared" if "shared" in found else "local"
    return locations, tier


def _auto_window(plan: UnitPlan) -> int:
    """Default shuffle window: two shards' worth of samples, within [256, 16384]."""
    per_unit = plan.total / max(1, len(plan.units))
    return int(min(16384, max(256, round(2 * per_unit))))


def _payload_bytes(sample: Any) -> int:
    return sample_bytes(sample) if isinstance(sample, Mapping) else 0


def sample_bytes(sample: Mapping[str, Any]) -> int:
    """Bytes of payload in a sample dict (bytes, arrays, tensors)."""
    total = 0
    for key, value in sample.items():
        if key.startswith("__"):
            continue
        if isinstance(value, bytes | bytearray | memoryview):
            total += len(value)
        elif hasattr(value, "nbytes"):
            total += int(value.nbytes)
    return total


def _stack_zarr(rows: list[tuple[UnitReader, int]]) -> dict[str, Any]:
    batch: dict[str, Any] = {"__key__": []}
    columns: dict[str, list[Any]] = {}
    for reader, index in rows:
        sample = reader.sample(index)
        batch["__key__"].append(sample["__key__"])
        for name, value in sample.items():
            if name != "__key__":
                columns.setdefault(name, []).append(value)
    for name, values in columns.items():
        batch[name] = torch.from_numpy(np.stack(values))
    return batch
