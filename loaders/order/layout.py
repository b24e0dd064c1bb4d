"""Who reads what, and how far a layout got: pure arithmetic (numpy, no torch).

**The global order** of an epoch depends only on ``(seed, epoch)``: the shards
are shuffled, their samples laid end to end, and the samples permuted within
consecutive windows of ``window`` samples by a keyed bijection (a bounded
shuffle, so that reads stay local to a few shards at a time; see
`datacache.loaders.order.windows`, which computes all of this per position).

**Dealing** hands that sequence to ``R`` ranks in blocks of ``window``
positions, round robin (rank ``r`` reads blocks ``r, r+R, ...``), so that each
rank reads whole windows and a shard is read by one or two ranks, not all of
them. The last partial round is dealt one sample at a time, so rank streams
differ in length by at most one; they are then made equal by repeating a
rank's first samples (``drop_last=False``) or by dropping its last one
(``drop_last=True``). Within a rank, the stream is cut into chunks of
``chunk`` samples (the DataLoader's batch size) dealt round robin to the
workers, which is the order in which the DataLoader hands their batches back.

**Resuming** records, per layout, how far each worker got (`Cursor`). The
samples a layout consumed are computed exactly from it, removed from the
sequence, and the rest is dealt again, to the same or to a different number
of ranks and workers: no sample is repeated or skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "Cursor",
    "Dealing",
    "Layout",
    "consumed_spots",
    "produced_from_consumed",
    "reader_name",
    "worker_count",
    "worker_ends",
    "worker_positions",
    "worker_spots",
]

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Dealing:
    """How a dataset deals its epochs: the same on every rank and worker."""

    seed: int
    shuffle: bool
    drop_last: bool


@dataclass(frozen=True, slots=True)
class Layout:
    """Who this reader is: rank of ``world_size``, worker of ``num_workers``, reading in chunks."""

    world_size: int = 1
    rank: int = 0
    num_workers: int = 1
    worker: int = 0
    chunk: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"invalid rank {self.rank} of world size {self.world_size}")
        if self.num_workers < 1 or not 0 <= self.worker < self.num_workers:
            raise ValueError(f"invalid worker {self.worker} of {self.num_workers}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be positive, got {self.chunk}")


@dataclass(frozen=True, slots=True)
class Cursor:
    """How far one layout got: samples produced by each worker (the same on every rank)."""

    world_size: int
    num_workers: int
    chunk: int
    produced: tuple[int, ...]
    cold: bool = False
    """Whether the layout read a cold epoch (whole shards dealt, `datacache.loaders.order.cold`)."""

    def to_json(self) -> dict[str, object]:
        document: dict[str, object] = {
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "chunk": self.chunk,
            "produced": list(self.produced),
        }
        if self.cold:
            document["cold"] = True
        return document

    @classmethod
    def from_json(cls, data: object) -> Cursor:
        if not isinstance(data, dict):
            raise ValueError("a cursor must be an object")
        try:
            world = int(data["world_size"])
            workers = int(data["num_workers"])
            chunk = int(data["chunk"])
            produced = tuple(int(n) for n in data["produced"])
        except (KeyError, TypeError, ValueError):
            raise ValueError("a cursor needs world_size, num_workers, chunk and produced") from None
        if world < 1 or workers < 1 or chunk < 1 or len(produced) != workers or min(produced) < 0:
            raise ValueError("a cursor's numbers are out of range")
        return cls(world, workers, chunk, produced, cold=data.get("cold") is True)


def worker_spots(layout: Layout, indexes: IntArray) -> IntArray:
    """The spots of the rank's stream that worker ``layout.worker``'s positions ``indexes`` read.

    The one rule of dealing a rank's stream to its workers: chunks of ``layout.chunk`` spots,
    round robin (`worker_count` counts them, `consumed_spots` inverts them).
    """
    indexes = np.asarray(indexes, dtype=np.int64)
    chunk, workers = layout.chunk, layout.num_workers
    if workers == 1:  # one worker reads every spot: the formula below is the identity
        return indexes
    result: IntArray = ((indexes // chunk) * workers + layout.worker) * chunk + indexes % chunk
    return result


def worker_count(layout: Layout, length: int | IntArray) -> IntArray:
    """How many of a rank stream's first ``length`` spots worker ``layout.worker`` reads."""
    lengths = np.asarray(length, dtype=np.int64)
    chunk, workers, worker = layout.chunk, layout.num_workers, layout.worker
    chunks, rest = lengths // chunk, lengths % chunk
    result: IntArray = (chunks // workers) * chunk + np.where(worker < chunks % workers, chunk, 0)
    return result + np.where(chunks % workers == worker, rest, 0)


def worker_positions(rank_stream: IntArray, num_workers: int, worker: int, chunk: int) -> IntArray:
    """The part of a rank's stream one worker reads: chunks ``worker, worker+W, ...`` of ``chunk`` samples."""
    layout = Layout(1, 0, num_workers, worker, chunk)
    mine: IntArray = rank_stream[worker_spots(layout, np.arange(int(worker_count(layout, len(rank_stream)))))]
    return mine


def worker_ends(cursor: Cursor) -> IntArray:
    """Per worker of ``cursor``'s layout, the spot of its rank's stream it would read next."""
    return np.asarray(
        [
            int(worker_spots(Layout(1, 0, cursor.num_workers, w, cursor.chunk), np.asarray([n]))[0])
            for w, n in enumerate(cursor.produced)
        ],
        dtype=np.int64,
    )


def consumed_spots(cursor: Cursor, spots: IntArray) -> npt.NDArray[np.bool_]:
    """Whether each of a rank stream's ``spots`` was read by the worker it is dealt to, as ``cursor`` says."""
    spots = np.asarray(spots, dtype=np.int64)
    chunk_index = spots // cursor.chunk
    worker = chunk_index % cursor.num_workers
    index = (chunk_index // cursor.num_workers) * cursor.chunk + spots % cursor.chunk
    result: npt.NDArray[np.bool_] = index < np.asarray(cursor.produced, dtype=np.int64)[worker]
    return result


def reader_name(rank: int, worker: int) -> str:
    """How a reader is named in the node's future order: ``"rank.worker"``."""
    return f"{rank}.{worker}"


def produced_from_consumed(consumed: int, num_workers: int, chunk: int) -> tuple[int, ...]:
    """Per-worker samples produced when the DataLoader has handed out ``consumed`` samples of a rank.

    Exact when ``chunk`` is the DataLoader's batch size: it takes batches from
    the workers round robin, and every batch is one chunk.
    """
    full_chunks, partial = divmod(consumed, chunk)
    produced = []
    for worker in range(num_workers):
        chunks = full_chunks // num_workers + (1 if worker < full_chunks % num_workers else 0)
        extra = partial if worker == full_chunks % num_workers else 0
        produced.append(chunks * chunk + extra)
    return tuple(produced)
