"""`CachedIterableDataset`: a drop-in ``IterableDataset`` that reads through the cache.

It holds configuration only. In each process that iterates it (the main
process, or every DataLoader worker, forked or spawned), it lazily opens its
own event loop, stager or daemon client, and the dataset's manifest and unit
plan (both persisted once per node). Each iteration deals this epoch's global
order to the rank and worker it runs in (see `datacache.loaders.order.layout`),
stages the shards it will read next before it reaches them, verifies every
shard before serving a sample from it, and records what it delivered.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from datacache.loaders.decode import Compose, Decoder, SampleDecoding, check_decoder, check_transform
from datacache.loaders.order.layout import Cursor, Layout, produced_from_consumed
from datacache.loaders.plans.interface import Dealing, Planner
from datacache.loaders.precheck import check_keywords, check_options, check_sources, target_rate
from datacache.loaders.processes import keep_until_exit, open_runtime
from datacache.loaders.reading.iterator import EpochIterator, ReadOptions
from datacache.loaders.remote import RayPool, RemoteEpoch, check_remote, remote_epoch, with_remote
from datacache.loaders.resume import STATE_VERSION, check_same, describe, loader_batch, read_state
from datacache.loaders.runtime import KEEP_RELEASED, Runtime, rank_and_world
from datacache.loaders.sources import Given, names_shards, reads_a_mix, resolve_sources
from datacache.loaders.stats import Counter, LoaderStats, StatsTable, timed
from torch.utils.data import IterableDataset, get_worker_info

from datacache._logging import FirstFew
from datacache.config import Settings
from datacache.errors import ConfigError

__all__ = ["CachedIterableDataset"]

logger = logging.getLogger(__name__)


class CachedIterableDataset(IterableDataset[Any]):
    """Samples of a cached dataset, dealt exactly once across ranks and workers.

    Parameters
    ----------
    dataset
        A URL (``s3://bucket/prefix/``, a local path, any fsspec URL), a dataset name from the config file, a
        brace pattern of shard URLs (``s3://bucket/shard-{0000..0099}.tar``), a `Source`, or a list of these:
        several sources mixed into each epoch (README, "Mixing sources and epoch length").
    shuffle
        Shuffle shards, then samples within windows of ``shuffle_buffer``.
    seed
        With the epoch, the only input of the global order.
    shuffle_buffer
        Samples per shuffle window; default: twice the mean samples per shard (at least 256, at most
        16384). Larger mixes more; smaller keeps each window on fewer shards, so that the first batch
        of a cold epoch waits for fewer of them.
    target_bandwidth
        Per-rank bytes per second to deliver: a number, or a size per second (``"1GB/s"``; a size
        without ``/s`` is refused); prefetch widens to meet it.
    prefetch
        Units (shards) to stage ahead per reader; default: derived from the target and measured rates.
    decode
        ``"auto"`` or None keeps raw bytes; ``"basic"``, ``"pil"``, ``"numpy"`` or ``"torch"`` pick a
        built-in decoder set (see `datacache.loaders.decode.DECODERS`); a callable receives each sample
        dict (``__key__`` and ``__url__`` are kept in the dict it returns); a mapping decodes fields by
        name. A decoder's exception is raised as `SampleDecodeError` naming the dataset, shard, sample
        key and field; ``on_error="skip"`` skips that sample instead.
    drop_last
        Drop the remainder so every rank has ``floor(N / world)`` samples; else pad by repeating.
    config
        `Settings` to use instead of the config file and environment.
    batch_size
        Yield whole batches of this size (use ``DataLoader(ds, batch_size=None)``): raw fields come as
        `PackedBytes` in reused shared memory, which skips per-sample pickling between processes. It is
        also the chunk in which each rank's samples are dealt to workers, which makes resume exact.
    on_error
        ``"raise"`` (default) or ``"skip"``: skip a shard that is corrupt or unreadable, or a sample its
        decoder or transform fails on, and count it.
    transform
        A callable applied to each decoded sample, in the process that reads it (the DataLoader
        worker); what it returns is what the sample becomes. In batch mode it runs on each sample
        before the batch is collated (``default_collate``), so batches are no longer packed bytes.
        Its exception is a `SampleDecodeError` like a decoder's. Must pickle for spawned workers.
    weights
        With a list of sources: each source's proportion of the epoch, one per source.
    epoch_size
        Samples per epoch across all ranks (default: the sources' sizes, as their weights, repeat or
        choose say). Consecutive epochs continue each source's permutation, so that every sample is read
        before any repeats.
    replacement
        Draw each epoch's samples of a source with replacement instead.
    resample
        Iterate endlessly: epoch after epoch from the one set, with no end (``len()`` is undefined).
    remote
        ``"ray"`` or a `RayPool`: CPU workers elsewhere in a Ray cluster read, decode, transform and collate the
        batches (``batch_size=`` needed), which come to this process in order (README, "Preprocessing on CPU nodes").
    """

    @check_keywords("CachedIterableDataset")
    def __init__(
        self,
        dataset: Given,
        *,
        shuffle: bool = True,
        seed: int = 0,
        shuffle_buffer: int | None = None,
        target_bandwidth: str | float | None = None,
        prefetch: int | None = None,
        decode: Decoder | None = "auto",
        drop_last: bool = False,
        config: Settings | None = None,
        batch_size: int | None = None,
        on_error: str = "raise",
        weights: Sequence[float] | None = None,
        epoch_size: int | None = None,
        replacement: bool = False,
        resample: bool = False,
        transform: Callable[[Any], Any] | None = None,
        remote: RayPool | str | None = None,
    ) -> None:
        super().__init__()
        check_options(epoch_size=epoch_size, on_error=on_error, shuffle_buffer=shuffle_buffer,
                      batch_size=batch_size, prefetch=prefetch)
        self._sources = resolve_sources(dataset, weights)
        check_sources([spec for spec in self._sources if not names_shards(spec)], config)  # no listing
        self._mixed = reads_a_mix(self._sources, epoch_size is not None or replacement or resample)
        self.weights = tuple(weights) if weights is not None else None
        self.epoch_size = epoch_size
        self.replacement = bool(replacement)
        self.resample = bool(resample)
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = int(seed)
        self.shuffle_buffer = shuffle_buffer
        self.target_bandwidth = target_rate(target_bandwidth)
        self.prefetch = prefetch
        self.decode = check_decoder(decode)
        self.drop_last = drop_last
        self.config = config
        self.batch_size = batch_size
        self.on_error = on_error
        self.transform = check_transform(transform)
        self.remote = check_remote(remote, batch_size=batch_size, resample=self.resample)
        self._epoch = 0
        self._cursors: tuple[Cursor, ...] = ()
        self._len_unknown: tuple[int, float, int] | None = None  # epoch, when, shards uncounted: `__len__`
        self._resume_epoch: int | None = None
        self._table = StatsTable(sources=len(self._sources))
        self._layout_hint: tuple[int, int] | None = None
        self._runtime: Runtime | None = None
        self._planner: Planner | None = None
        self._main_iterator: EpochIterator | RemoteEpoch | None = None
        self._decoding: tuple[SampleDecoding, FirstFew] | None = None  # made once per process: `_options`
        if any(names_shards(spec) for spec in self._sources):
            # Shards named one by one (a pattern, a list, a glob) must be listed: refused here, in one line, not
            # in a DataLoader worker's traceback. Opens the runtime len() or iter() would (pickling drops it).
            self._prepare()

    # -- pickling: configuration only --------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_runtime=None, _planner=None, _main_iterator=None, _decoding=None)
        # Captured here, in the process that hands the dataset to spawned workers,
        # where torch.distributed is initialised.
        state["_layout_hint"] = rank_and_world()
        return state

    def map(self, function: Callable[[Any], Any]) -> CachedIterableDataset:
        """A copy of this dataset whose samples also go through ``function``, after any transform.

        This dataset is unchanged. The copy has the same configuration, epoch and resume state,
        and its own statistics and runtime.
        """
        if not callable(function):
            raise ConfigError(f"map() takes a callable, got {type(function).__name__}")
        mapped = copy.copy(self)
        table = StatsTable(sources=len(self._sources))
        mapped.__dict__.update(_runtime=None, _planner=None, _main_iterator=None, _decoding=None, _table=table)
        mapped._table.epoch = self._epoch
        mapped.transform = Compose.of(self.transform, function)
        return mapped

    # -- process-local runtime -----------------------------------------------------------

    def _prepare(self) -> Runtime:
        runtime = self._runtime
        if runtime is not None and runtime.pid == os.getpid():
            return runtime
        runtime, self._planner = open_runtime(
            self.config,
            self._sources,
            mixed=self._mixed,
            epoch_size=self.epoch_size,
            replacement=self.replacement,
            shuffle_buffer=self.shuffle_buffer,
        )
        self._runtime = runtime
        keep_until_exit(runtime)
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
        return rank_and_world()

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

    def _plans(self) -> Planner:
        """This process's planner of the dataset's epochs (made with its runtime)."""
        self._prepare()
        if self._planner is None:
            raise RuntimeError("a dataset's runtime was made without its planner")
        return self._planner

    def _dealing(self) -> Dealing:
        return Dealing(self.seed, self.shuffle, self.drop_last)

    def with_all_counts(self) -> Runtime:
        """This process's runtime once every shard's sample count is known (waits for them).

        Random access (`MapStyleDataset`) needs it: a global index names a sample only when
        every count before it is exact.
        """
        self._plans().complete()
        return self._prepare()

    def _reader(self, layout: Layout, epoch: int, cursors: tuple[Cursor, ...]) -> EpochIterator:
        """Reader ``layout``'s iterator over epoch ``epoch``, resumed after ``cursors``."""
        runtime, planner = self._prepare(), self._plans()
        plan = planner.plan(layout, self._dealing(), epoch=epoch, cursors=cursors)
        if get_worker_info() is not None:  # for the training process's state_dict, which then opens nothing
            self._table.heads.publish(layout.worker, describe(planner, runtime.window or None, epoch, plan))
        rows = self._table.row(layout.worker).numpy(), self._table.source_row(layout.worker).numpy()
        return EpochIterator(self._options(), runtime, plan, layout, epoch, cursors, rows)

    def _options(self) -> ReadOptions:
        """What a reader takes of this configuration (frozen: `map` makes a copy with its own); the decoding
        and the log of skipped samples are made once per process, and every epoch's reader calls them."""
        if self._decoding is None:
            skips = FirstFew("skipped samples", "stats().skipped_samples")
            self._decoding = SampleDecoding(self.decode, self.transform), skips
        skip, rate = self.on_error == "skip", self.target_bandwidth
        return ReadOptions(self.seed, self.batch_size, *self._decoding, skip, rate, self.prefetch)

    def __len__(self) -> int:
        """Samples (or batches) this rank delivers per epoch; `TypeError` ("no length") while a count is unknown."""
        if self.resample:
            raise TypeError("a dataset with resample=True is endless and has no len(); give epoch_size= instead")
        # Never waits to count shards (DataLoader, tqdm, Lightning take TypeError); an unknown answer holds
        # to the epoch's end (Lightning asks again after starting the workers: a flip made it int(inf)).
        if (book := None if self._mixed else self._prepare().book) is not None:
            unknown = self._len_unknown
            if unknown is None or unknown[0] != self._epoch or self._table.ended_since(unknown[1]):
                unknown = None if book.adopt_saved() else (self._epoch, time.time(), int((book.counts < 0).sum()))
            self._len_unknown = unknown
            if unknown is not None:
                raise TypeError(
                    f"len(): {unknown[2]} of {len(book.counts)} shards had no sample count yet as this epoch "
                    "began; known after it, or at once with an index (datacache index URL)"
                )
        total = self._plans().total()
        _, world = self._rank_world()
        per_rank = total // world if self.drop_last else -(-total // world)
        if self.batch_size:
            return max(0, -(-per_rank // self.batch_size))
        return max(0, per_rank)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        layout = self._layout(info.num_workers if info is not None else 1, info.id if info is not None else 0)
        epoch = self._table.epoch if info is not None else self._epoch
        cursors = self._cursors_for(epoch)
        if self.resample:
            return self._endless(layout, epoch, cursors)
        iterator = remote_epoch(self, layout, epoch, cursors) if self.remote else self._reader(layout, epoch, cursors)
        if info is None:
            self._main_iterator = iterator
        return iterator

    def _layout(self, num_workers: int, worker: int) -> Layout:
        rank, world = self._rank_world()
        return Layout(world_size=world, rank=rank, num_workers=num_workers, worker=worker, chunk=self.batch_size or 1)

    def _cursors_for(self, epoch: int) -> tuple[Cursor, ...]:
        return self._cursors if (self._resume_epoch is None or self._resume_epoch == epoch) else ()

    def as_workers(self, num_workers: int) -> list[EpochIterator]:
        """This epoch as ``num_workers`` DataLoader workers would each read it, read in this process.

        Iterator ``i`` yields exactly the samples, in the same order, that worker ``i`` of a
        DataLoader with ``num_workers`` workers would (`dataloader.DataLoader` batches them).
        The readers keep released shards open for each other; call `done_as_workers` after.
        """
        if self.resample:
            raise ConfigError("a resample=True stream is read by DataLoader worker processes, not as workers here")
        runtime = self._prepare()
        runtime.opened.keep = KEEP_RELEASED if num_workers > 1 else 0
        cursors = self._cursors_for(self._epoch)
        return [self._reader(self._layout(num_workers, worker), self._epoch, cursors) for worker in range(num_workers)]

    def done_as_workers(self) -> None:
        """Close the shards the readers of `as_workers` kept open for each other."""
        runtime = self._runtime
        if runtime is not None:
            runtime.opened.keep = 0
            for reader in runtime.opened.close_idle():
                reader.close()

    def _endless(self, layout: Layout, epoch: int, cursors: tuple[Cursor, ...]) -> Iterator[Any]:
        """Epoch after epoch from ``epoch`` on (``resample=True``); the main process's epoch follows."""
        if self._plans().empty():
            raise ConfigError("resample=True with an epoch of 0 samples would never yield one")
        while True:
            iterator = self._reader(layout, epoch, cursors)
            if layout.num_workers == 1 and get_worker_info() is None:
                self._main_iterator = iterator
                self._epoch = epoch
                self._table.epoch = epoch
                if self._resume_epoch != epoch:
                    self._cursors = ()
            yield from iterator
            epoch, cursors = epoch + 1, ()

    # -- resume ---------------------------------------------------------------------------

    def state_dict(self, samples_consumed: int | None = None, batch_size: int | None = None) -> dict[str, Any]:
        """A few integers that resume this epoch exactly, on any number of ranks and workers.

        Parameters
        ----------
        samples_consumed
            Samples this rank's training loop has taken from the DataLoader in this
            epoch (steps times batch size). Needed with DataLoader worker processes,
            where the main process cannot see their progress; with
            ``num_workers=0`` it is tracked automatically.
        batch_size
            The DataLoader's batch size, needed with ``samples_consumed`` and more than
            one worker process unless the dataset itself batches: the DataLoader takes
            whole batches from each worker in turn, so it says how many samples each
            worker made.
        """
        _, world = self._rank_world()
        chunk = self.batch_size or 1
        if get_worker_info() is not None:
            return {"version": STATE_VERSION, "epoch": self._epoch}
        if self.resample and (self._main_iterator is None or samples_consumed is not None):
            # Each worker walks the endless stream on its own: no count of the consumer's says where.
            raise ConfigError(
                "a resample=True stream is resumed only when read without DataLoader worker processes "
                "(num_workers=0); with workers, give epoch_size= and resume at an epoch"
            )
        if samples_consumed is not None:
            if samples_consumed < 0:
                raise ConfigError(f"samples_consumed must not be negative, got {samples_consumed}")
            workers = int(self._table.row(0)[Counter.NUM_WORKERS].item()) or 1
            taken = loader_batch(self.batch_size, batch_size, workers)
            cursor = Cursor(world, workers, chunk, produced_from_consumed(samples_consumed, workers, taken))
        elif self._main_iterator is not None and self._main_iterator.epoch == self._epoch:
            cursor = Cursor(world, 1, chunk, (self._main_iterator.produced,))
        elif int(self._table.row(0)[Counter.NUM_WORKERS].item()) > 1 or self._table.row(0)[Counter.ACTIVE] > 0:
            raise ConfigError(
                "with DataLoader worker processes, call state_dict(samples_consumed=steps * batch_size, "
                "batch_size=batch_size) or use torchdata's StatefulDataLoader"
            )
        else:
            cursor = Cursor(world, 1, chunk, (0,))
        head = self._head()
        if not self._cursors and head["cold"]:
            # What a cold epoch consumed is computed from its own dealing (`order.cold.cold_remaining`).
            cursor = Cursor(cursor.world_size, cursor.num_workers, cursor.chunk, cursor.produced, cold=True)
        return self._state((*self._cursors, cursor), head)

    def _head(self) -> dict[str, Any]:
        """The dataset's fields of a state: a reader's (`statehead`) where this process opened nothing."""
        runtime = self._runtime
        if runtime is None or runtime.pid != os.getpid():
            published = self._table.heads.read(self._epoch)
            if published is not None:
                return published
        runtime, planner = self._prepare(), self._plans()
        dataset, snapshot = planner.identity()
        cold = planner.cold(self._dealing(), self._epoch)
        fields = planner.state_fields()
        return {"cold": cold, "dataset": dataset, "snapshot": snapshot, "fields": fields, "window": runtime.window}

    def _state(self, cursors: tuple[Cursor, ...], head: dict[str, Any]) -> dict[str, Any]:
        # Never waits for sample counts (a cold first epoch's are still arriving): the default
        # window follows from the snapshot, which the state names, so it is kept as None.
        return {
            "version": STATE_VERSION,
            "dataset": head["dataset"],
            "snapshot": head["snapshot"],
            **head["fields"],
            "seed": self.seed,
            "shuffle": self.shuffle,
            "shuffle_buffer": head["window"] or self.shuffle_buffer,
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
        state, epoch, cursors = read_state(state)
        ours: dict[str, object] = {"seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last}
        if state.get("shuffle_buffer") is not None:
            ours["shuffle_buffer"] = self.with_all_counts().window
        fields = self._plans().state_fields()
        if "mix" in state or fields:
            ours["mix"] = fields.get("mix")
            ours["replacement"] = self.replacement
        check_same(state, ours, self._plans().identity)
        self._epoch = epoch
        self._table.epoch = epoch
        self._cursors = cursors
        self._resume_epoch = epoch

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> LoaderStats:
        """Delivered bandwidth and samples/s, data-stall fraction, hit ratio per tier, prefetch depth."""
        runtime = self._runtime
        mode = runtime.mode if runtime is not None else "embedded"
        limiting = self._main_iterator.controller.limiting_stage if self._main_iterator is not None else None
        consumer = self._table.consumer_row().clone()
        if runtime is not None and runtime.pid == os.getpid():
            # This process's own origin retries (its readers, its plan building); workers put theirs in their rows.
            consumer[Counter.RETRIES] = runtime.access.origin_retries()
        stats = LoaderStats.from_table(
            self._table.snapshot(),
            consumer,
            mode=mode,
            epoch=self._epoch,
            target=self.target_bandwidth,
            limiting=limiting,
            per_source=self._table.sources.clone(),
            labels=[spec.label for spec in self._sources],
        )
        return with_remote(stats, self._main_iterator)

    def timed(self, loader: Any) -> Iterator[Any]:
        """Iterate ``loader`` while measuring how long the consumer waits for each batch.

        The result is the ``stall_fraction`` of `stats` (the first batch, which
        waits for the workers to start, is not counted). Without worker
        processes it is measured anyway.
        """
        return timed(loader, self._table.consumer_row().numpy())
