"""Who reads what, and how far a layout got: pure arithmetic (numpy, no torch).

**The global order** of an epoch depends only on ``(seed, epoch)``: the shards
are shuffled, their samples laid end to end, and the samples permuted within
consecutive windows of ``window`` samples by a keyed bijection (a bounded
shuffle, so that reads stay local to a few shards at a time; see
`datacache.loaders.sequence`, which computes all of this per position).

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
    "Layout",
    "produced_from_consumed",
    "worker_positions",
]

IntArray = npt.NDArray[np.int64]


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
    """Whether the layout read a cold epoch (whole shards dealt, `datacache.loaders.coldorder`)."""

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


def worker_positions(rank_stream: IntArray, num_workers: int, worker: int, chunk: int) -> IntArray:
    """The part of a rank's stream one worker reads: chunks ``worker, worker+W, ...`` of ``chunk`` samples."""
    if num_workers == 1:
        return rank_stream
    chunk_of = np.arange(len(rank_stream), dtype=np.int64) // chunk
    mine: IntArray = rank_stream[chunk_of % num_workers == worker]
    return mine


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
