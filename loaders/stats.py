"""What a loader delivered and where its time went, gathered across worker processes.

Each reader (a DataLoader worker, or the main process when there are none)
owns one row of a small shared-memory table created with the dataset, so the
main process can report for all of them without any message passing. The
same table carries the epoch from the main process to persistent workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from datacache.loaders.statehead import StateHeads

from datacache.access import ShardAccess, ThroughputReporter
from datacache.activity import write_report_file
from datacache.staging import DatasetHandle, Stager

__all__ = [
    "MAX_READERS",
    "MODES",
    "Counter",
    "LoaderStats",
    "RemoteStats",
    "SourceStats",
    "StatsTable",
    "count_unit_open",
    "mode_code",
    "publish_reader",
    "reader_figures",
    "timed",
]

logger = logging.getLogger(__name__)

MAX_READERS = 256


class Counter(IntEnum):
    """Columns of a reader's row."""

    ACTIVE = 0
    SAMPLES = 1
    BYTES = 2
    STARTED = 3  # wall clock when the reader started its epoch
    UPDATED = 4  # wall clock of the last update
    WAIT = 5  # seconds blocked waiting for shards not yet local
    WAIT_ORIGIN = 6
    WAIT_SHARED = 7
    READ = 8  # seconds opening and verifying local shards
    DECODE = 9
    UNITS_LOCAL = 10
    UNITS_SHARED = 11
    UNITS_ORIGIN = 12
    PADDED = 13
    SKIPPED_SHARDS = 14
    SKIPPED_SAMPLES = 15
    DEPTH = 16
    NUM_WORKERS = 17
    CONSUMER_WAIT = 18  # measured in the consumer's process (num_workers=0, or `timed`)
    CONSUMER_TIME = 19
    CORRUPT = 20
    STAGING_RATE = 21  # bytes/s the stager delivered to this reader, as measured
    TOTAL = 22  # samples this reader will deliver in the epoch
    MODE = 23  # how this reader reaches the cache: see MODES
    RETRIES = 24  # origin requests this reader's process retried (cumulative: see LoaderStats.retries)
    TAKEN = 25  # of the UNITS_*, those taken open from another reader of this process (`OpenUnits.take`)
    FINISHED = 26  # wall clock when the reader ended its epoch (0 while it runs)
    WIDTH = 27


MODES = ("unknown", "embedded", "daemon", "embedded (daemon unavailable)")
"""Values of the MODE column, by index."""


_EPOCH_ROW = MAX_READERS  # the control row: column 0 holds the epoch set by the main process
_CONSUMER_ROW = MAX_READERS + 1  # the consumer's waits, measured by CachedIterableDataset.timed


def count_unit_open(row: npt.NDArray[np.float64], tier: str, seconds: float) -> None:
    """One unit opened from ``tier`` in a reader's ``row``: its ``seconds`` are reading (local) or waiting."""
    if tier == "local":
        row[Counter.UNITS_LOCAL] += 1
        row[Counter.READ] += seconds
        return
    row[Counter.UNITS_SHARED if tier == "shared" else Counter.UNITS_ORIGIN] += 1
    row[Counter.WAIT] += seconds
    row[Counter.WAIT_SHARED if tier == "shared" else Counter.WAIT_ORIGIN] += seconds


def mode_code(mode: str) -> int:
    """The MODE column's value for an access mode."""
    return MODES.index(mode) if mode in MODES else 0


class StatsTable:
    """The shared table: one row per reader and a control row."""

    def __init__(self, sources: int = 1) -> None:
        self.table = torch.zeros((MAX_READERS + 2, Counter.WIDTH), dtype=torch.float64)
        self.table.share_memory_()  # type: ignore[no-untyped-call]
        self.sources = torch.zeros((MAX_READERS, max(1, sources), 2), dtype=torch.float64)
        """Per reader and source: samples and payload bytes delivered this epoch."""
        self.sources.share_memory_()  # type: ignore[no-untyped-call]
        self.heads = StateHeads()
        """What the readers know of the dataset that a saved state names (`statehead`)."""

    def source_row(self, reader: int) -> torch.Tensor:
        """Reader ``reader``'s (samples, bytes) per source."""
        self.row(reader)  # checks the range
        return self.sources[reader]

    def row(self, reader: int) -> torch.Tensor:
        if not 0 <= reader < MAX_READERS:
            raise ValueError(f"reader {reader} out of range (at most {MAX_READERS} workers)")
        return self.table[reader]

    def consumer_row(self) -> torch.Tensor:
        return self.table[_CONSUMER_ROW]

    def ended_since(self, when: float) -> bool:
        """Whether a reading of the epoch ended after ``when`` (wall clock): as many readers as it had
        ended since, and none runs now."""
        rows = self.table[:MAX_READERS].numpy()
        running = (rows[:, Counter.STARTED] > 0) & (rows[:, Counter.FINISHED] < rows[:, Counter.STARTED])
        ended = rows[:, Counter.FINISHED] > when
        if running.any() or not ended.any():
            return False
        return int(ended.sum()) >= int(rows[ended, Counter.NUM_WORKERS].max())

    def reset(self) -> None:
        self.table[:MAX_READERS].zero_()

    @property
    def epoch(self) -> int:
        return int(self.table[_EPOCH_ROW, 0].item())

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.table[_EPOCH_ROW, 0] = float(value)

    def snapshot(self) -> torch.Tensor:
        return self.table[:MAX_READERS].clone()


@dataclass(frozen=True)
class SourceStats:
    """What one source delivered to this rank in the epoch: samples, payload bytes, share of the samples."""

    source: str
    samples: int
    bytes: int
    share: float


@dataclass(frozen=True)
class RemoteStats:
    """A rank's remote pool (``remote=``): its size and bounds, the rate it is sized for, what it remade."""

    workers: int
    min_workers: int
    max_workers: int
    target_per_second: float | None
    target_unit: str | None  # "samples" or "bytes"
    per_worker_rate: float | None  # one worker's measured rate, in target_unit (samples when no target)
    in_flight_limit: int
    most_in_flight: int
    remade_batches: int
    lost_workers: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class LoaderStats:
    """What `CachedIterableDataset.stats` reports for this rank.

    ``stall_fraction`` is the share of the consumer's time spent waiting for
    data when it was measured (no worker processes, or iterating through
    ``timed``); ``reader_wait_fraction`` is the share of the readers' time
    spent blocked on shards that were not yet local. ``retries`` counts the
    origin requests retried after a transient error (throttling, 5xx, reset or
    stalled connections) by the processes that read for this rank, since each
    opened the dataset; with a daemon, its own retries are in its metrics
    (``datacache_origin_retries_total``).
    """

    mode: str
    epoch: int
    samples: int
    bytes: int
    seconds: float
    bytes_per_second: float
    samples_per_second: float
    stall_fraction: float | None
    reader_wait_fraction: float
    hit_ratio: dict[str, float] = field(default_factory=dict)
    prefetch_depth: int = 0
    padded_samples: int = 0
    skipped_shards: int = 0
    skipped_samples: int = 0
    corrupt_copies: int = 0
    retries: int = 0
    readers: int = 0
    target_bandwidth: float | None = None
    meets_target: bool | None = None
    limiting_stage: str | None = None
    sources: tuple[SourceStats, ...] = ()
    """Per source, as the dataset names them (one entry for a dataset of one source)."""
    remote: RemoteStats | None = None
    """The remote pool that made the batches (``remote=``), else None."""

    @classmethod
    def from_table(
        cls,
        rows: torch.Tensor,
        consumer: torch.Tensor,
        *,
        mode: str,
        epoch: int,
        target: float | None,
        limiting: str | None,
        per_source: torch.Tensor | None = None,
        labels: Sequence[str] = (),
    ) -> LoaderStats:
        mask = rows[:, Counter.ACTIVE] > 0
        active = rows[mask]
        if active.shape[0] == 0:
            retries = int(consumer[Counter.RETRIES].item())
            return cls(mode, epoch, 0, 0, 0.0, 0.0, 0.0, None, 0.0, retries=retries, target_bandwidth=target)
        samples = int(_sum(active, Counter.SAMPLES))
        nbytes = int(_sum(active, Counter.BYTES))
        seconds = _elapsed(active, time.time())
        rate = nbytes / seconds
        return cls(
            mode=_readers_mode(active, mode),
            epoch=epoch,
            samples=samples,
            bytes=nbytes,
            seconds=seconds,
            bytes_per_second=rate,
            samples_per_second=samples / seconds,
            stall_fraction=_stall_fraction(active, consumer),
            reader_wait_fraction=_reader_wait_fraction(active),
            hit_ratio=_hit_ratio(active),
            prefetch_depth=int(active[:, Counter.DEPTH].max().item()),
            padded_samples=int(_sum(active, Counter.PADDED)),
            skipped_shards=int(_sum(active, Counter.SKIPPED_SHARDS)),
            skipped_samples=int(_sum(active, Counter.SKIPPED_SAMPLES)),
            corrupt_copies=int(_sum(active, Counter.CORRUPT)),
            retries=int(_sum(active, Counter.RETRIES) + consumer[Counter.RETRIES].item()),
            readers=int(active.shape[0]),
            target_bandwidth=target,
            meets_target=None if target is None or samples == 0 else rate >= target,
            limiting_stage=limiting,
            sources=_per_source(per_source[mask] if per_source is not None else None, labels, samples, nbytes),
        )


def _sum(active: torch.Tensor, column: Counter) -> Any:
    """One counter summed over the active readers, as a Python number."""
    return active[:, column].sum().item()


def _readers_mode(active: torch.Tensor, mode: str) -> str:
    """What the readers themselves used: with worker processes the main process never opens the cache itself."""
    codes = {int(code) for code in active[:, Counter.MODE].tolist() if code}
    return " + ".join(MODES[code] for code in sorted(codes)) if codes else mode


def _elapsed(active: torch.Tensor, now: float) -> float:
    """Seconds from the first reader's start to the last one's update (to now while none updated yet)."""
    started = float(active[:, Counter.STARTED].min().item())
    ended = float(active[:, Counter.UPDATED].max().item())
    return max((ended if ended > started else now) - started, 1e-9)


def _stall_fraction(active: torch.Tensor, consumer: torch.Tensor) -> float | None:
    """The share of the consumers' time spent waiting for data (None before any was measured)."""
    consumer_time = float(_sum(active, Counter.CONSUMER_TIME) + consumer[Counter.CONSUMER_TIME].item())
    consumer_wait = float(_sum(active, Counter.CONSUMER_WAIT) + consumer[Counter.CONSUMER_WAIT].item())
    return consumer_wait / consumer_time if consumer_time > 0 else None


def _reader_wait_fraction(active: torch.Tensor) -> float:
    reader_time = float((active[:, Counter.UPDATED] - active[:, Counter.STARTED]).clamp(min=1e-9).sum().item())
    wait = float(_sum(active, Counter.WAIT))
    return min(1.0, wait / reader_time) if reader_time > 0 else 0.0


def _hit_ratio(active: torch.Tensor) -> dict[str, float]:
    """Of the units the readers opened, the share found on each tier."""
    units = {
        "local": float(_sum(active, Counter.UNITS_LOCAL)),
        "shared": float(_sum(active, Counter.UNITS_SHARED)),
        "origin": float(_sum(active, Counter.UNITS_ORIGIN)),
    }
    opened = sum(units.values())
    return {tier: (count / opened if opened else 0.0) for tier, count in units.items()}


def _per_source(
    rows: torch.Tensor | None, labels: Sequence[str], samples: int, nbytes: int
) -> tuple[SourceStats, ...]:
    """Each source's totals over the active readers; one source's are the reader totals."""
    if len(labels) == 1 or rows is None:
        return tuple(SourceStats(label, samples, nbytes, 1.0 if samples else 0.0) for label in labels[:1])
    totals = rows.sum(dim=0)
    found = []
    for index, label in enumerate(labels):
        count = int(totals[index, 0].item())
        found.append(SourceStats(label, count, int(totals[index, 1].item()), count / samples if samples else 0.0))
    return tuple(found)


# -- what one reader tells `datacache top` ------------------------------------------------------


def reader_figures(
    row: Any,
    *,
    rank: int,
    world_size: int,
    worker: int,
    num_workers: int,
    epoch: int,
    target: float | None,
    in_consumer: bool,
) -> dict[str, Any]:
    """One reader's row (a tensor or array of `Counter` columns) as its report's fields.

    The fields are `datacache.activity.READER_FIELDS`.
    Summed over a rank's readers they give what `LoaderStats.from_table` gives: samples, bytes,
    units per tier (the hit ratio), the deepest prefetch, the wait.
    """
    values = row.tolist()
    started, updated = values[Counter.STARTED], values[Counter.UPDATED]
    elapsed = max(updated - started, 1e-9)
    if in_consumer and values[Counter.CONSUMER_TIME] > 0:
        stall = values[Counter.CONSUMER_WAIT] / values[Counter.CONSUMER_TIME]
    else:
        stall = min(1.0, values[Counter.WAIT] / elapsed)
    figures: dict[str, Any] = {
        "delivered_bytes_per_s": values[Counter.BYTES] / elapsed,
        "stall_fraction": min(1.0, max(0.0, stall)),
        "delivered_bytes": int(values[Counter.BYTES]),
        "rank": rank,
        "world_size": world_size,
        "worker": worker,
        "num_workers": num_workers,
        "epoch": epoch,
        "samples": int(values[Counter.SAMPLES]),
        "samples_total": int(values[Counter.TOTAL]),
        "started": started,
        "updated": updated,
        "wait_seconds": values[Counter.WAIT],
        "samples_per_s": values[Counter.SAMPLES] / elapsed,
        "prefetch_depth": int(values[Counter.DEPTH]),
        "units_local": int(values[Counter.UNITS_LOCAL]),
        "units_shared": int(values[Counter.UNITS_SHARED]),
        "units_origin": int(values[Counter.UNITS_ORIGIN]),
        "mode": MODES[int(values[Counter.MODE])] if 0 <= int(values[Counter.MODE]) < len(MODES) else "unknown",
    }
    if target is not None:
        figures["target_bytes_per_s"] = float(target)
    return figures


async def publish_reader(access: ShardAccess, handle: DatasetHandle, figures: dict[str, Any]) -> None:
    """Pass a reader's figures on: to the daemon's report verb, or (embedded) to this process's report file.

    Called at the reader's reporting interval, on the loader's event loop: never per sample.
    """
    figures = {**figures, "dataset": handle.id}
    if handle.config.name != handle.id:  # opened by its configured name: top shows that, not the id
        figures["dataset_name"] = handle.config.name[:64]
    if isinstance(access, ThroughputReporter):
        await access.report(**figures)
        return
    if not isinstance(access, Stager):
        return
    host, pid = socket.gethostname(), os.getpid()
    activity = access.activity
    document = {
        "version": 1,
        "host": host,
        "pid": pid,
        "written": time.time(),
        "client": f"{host}:{pid}:r{figures['rank']}w{figures['worker']}",
        "reader": figures,
        "policy": handle.config.policy,
        "stager": dataclasses.asdict(access.stats()),
        "activity": activity.counters(),
        "transfers": [t.to_json(_size_of(handle, t.dataset, t.key)) for t in activity.in_flight()],
    }
    name = f"{pid}-{handle.id[:24]}-r{figures['rank']}w{figures['worker']}"
    try:
        await asyncio.to_thread(write_report_file, access.settings.local_dir, name, document)
    except OSError as exc:  # a full or read-only disk must not stop a reader
        logger.debug("cannot write the report file for datacache top: %s", exc)


def _size_of(handle: DatasetHandle, dataset: str, key: str) -> int | None:
    if dataset != handle.id:
        return None
    try:
        return handle.manifest.shard(key).size
    except (LookupError, OSError):  # not in this snapshot's manifest
        return None


def timed(loader: Any, row: npt.NDArray[np.float64]) -> Iterator[Any]:
    """`CachedIterableDataset.timed`: iterate ``loader``, adding to the consumer's ``row`` how long it waited."""
    row[:] = 0
    iterator = iter(loader)
    try:
        yield next(iterator)  # it waits for the workers to start: start-up, not a stall
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
