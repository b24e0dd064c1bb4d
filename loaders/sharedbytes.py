"""Per-sample raw fields that leave a DataLoader worker through reused shared memory, not its pipe.

The drop-in form, ``DataLoader(CachedIterableDataset(url), batch_size=64,
num_workers=2)``, has each worker yield sample dicts of ``bytes``; the
DataLoader collates them into lists and pickles every byte through the
worker's pipe, which tops out near its no-I/O ceiling (~450-800 MB/s on two
cores) however fast the cache reads. Here a worker's raw fields are
`RingBytes`: a ``bytes`` subclass, equal to and usable as the bytes it holds,
so decoders, transforms and any ``collate_fn`` in the worker see bytes. When
the DataLoader pickles a batch for the trip (multiprocessing's
``ForkingPickler``, which its queues use), each field is copied into the
worker's `SampleRing`, one reused buffer in shared memory, and only its place
crosses the pipe. The receiving process copies it out into a plain ``bytes``
at once and marks the place read, so the training loop gets exactly what a
plain DataLoader gives (plain ``bytes``, its own, valid as long as it holds
them), and the worker rewrites only places already read.

A field smaller than `SMALL_FIELD` is pickled as before (its place would cost
more than it saves), and so is one that does not fit: a ring whose reader is
behind waits for it briefly, then grows (doubling, up to `MAX_RING_BYTES`). Only the
first field from each ring buffer carries its memory (a file descriptor,
passed by torch); later ones name it by (worker pid, ring, generation).

A ring has one reader: the process that unpickles what the worker's
DataLoader queue carries, in the order it was sent (a multiprocessing queue
keeps each sender's order). Plain ``pickle`` of a `RingBytes` gives plain
``bytes``.
"""

from __future__ import annotations

import itertools
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from datacache.loaders.packing import process_alive, shared_buffer

__all__ = ["MAX_RING_BYTES", "SMALL_FIELD", "RingBytes", "SampleRing"]

SMALL_FIELD = 4096
"""Fields below this many bytes are pickled inline."""
FIRST_RING_BYTES = 16 << 20
"""A worker's first ring buffer (it grows while its reader is behind)."""
MAX_RING_BYTES = 1 << 30
"""A ring never grows past this; a field that does not fit then is pickled inline."""
READER_WAIT = 0.05
"""Seconds a full ring waits for its reader before it grows."""
_HEADER = 64
"""Bytes before the data: the reader's position (int64), on its own cache line."""
_RINGS_PER_WORKER = 3

_RING_TOKENS = itertools.count(1)

STORE_ORDERED = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}
"""Whether this CPU keeps a load before a later store (x86's total store order). The reader marks a
place read by a plain store after copying it out; Python has no memory fence, and on a weakly
ordered CPU (ARM, POWER) that store could be seen before the copy's loads are done, letting the
worker rewrite bytes still being read. There, every field is pickled through the pipe."""


class RingBytes(bytes):
    """A raw field read in a DataLoader worker: ``bytes`` to everyone, shared memory on the way out."""

    ring: SampleRing

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Plain pickle (a user saving a sample): plain bytes, no reference to a ring.
        return bytes, (bytes(self),)


_Place = tuple[int, int, int, int, int, int]
"""Where one field was copied: its ring buffer (pid, ring, generation), its span (start, length), and
the ring position after it. A plain tuple: it is pickled once per field."""


class SampleRing:
    """One worker's reused shared-memory buffer for fields on their way to the training process.

    Written at ``head`` (a position that only grows; the buffer index is it
    modulo the capacity); the reader stores in the header the position after
    the last field it copied out. A field is written only where the reader has
    been, so nothing unread is overwritten.
    """

    def __init__(self, *, first_bytes: int | None = None, max_bytes: int | None = None) -> None:
        first_bytes = FIRST_RING_BYTES if first_bytes is None else first_bytes
        max_bytes = MAX_RING_BYTES if max_bytes is None else max_bytes
        if not 0 < first_bytes <= max_bytes:
            raise ValueError(f"ring sizes must satisfy 0 < first ({first_bytes}) <= max ({max_bytes})")
        self.pid = os.getpid()
        self._first = first_bytes
        self._max = max_bytes
        self._token = next(_RING_TOKENS)
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        self._data: memoryview | None = None
        self._read_to: npt.NDArray[np.int64] | None = None
        self._generation = 0
        self._head = 0
        self._carried = False

    def wrap(self, view: memoryview) -> bytes:
        """``view``'s bytes, as `RingBytes` tied to this ring when large enough to be worth it."""
        if view.nbytes < SMALL_FIELD:
            return bytes(view)
        value = RingBytes(view)
        value.ring = self
        return value

    def place(self, value: bytes) -> tuple[_Place, torch.Tensor | None] | None:
        """Copy ``value`` into the ring; its place, and the buffer if this is its first trip. None: no room."""
        size = len(value)
        if not STORE_ORDERED:
            return None
        with self._lock:
            if 4 * size > self._max - _HEADER:
                return None
            if self._buffer is None or 4 * size > self._capacity:
                self._grow(max(self._first, 4 * size + _HEADER))
            capacity = self._capacity
            start = self._head
            if start % capacity + size > capacity:
                start += capacity - start % capacity  # no field wraps round the end
            if not self._reader_at(start + size - capacity):
                if 2 * capacity + _HEADER > self._max:
                    return None  # the reader is far behind: pickle this one instead
                self._grow(2 * capacity + _HEADER)
                start = 0
            at = _HEADER + start % capacity
            data = self._data
            if data is None:  # pragma: no cover - _grow set it
                raise RuntimeError("ring buffer missing")
            data[at : at + size] = value
            self._head = start + size
            carried = None if self._carried else self._buffer
            self._carried = True
            return (self.pid, self._token, self._generation, at, size, self._head), carried

    @property
    def _capacity(self) -> int:
        return 0 if self._buffer is None else int(self._buffer.numel()) - _HEADER

    def _reader_position(self) -> int:
        read_to = self._read_to
        return 0 if read_to is None else int(read_to[0])

    def _reader_at(self, position: int) -> bool:
        """Whether the reader has read up to ``position``, waiting up to `READER_WAIT` for it.

        It reads what was sent before this field whatever this thread does, so waiting cannot
        stall it; waiting in vain means what is in flight does not fit (a batch larger than the
        ring, or a consumer slower than the DataLoader's prefetch), and the ring grows. Growing at
        once instead would touch fresh pages (a page fault each 4 KiB, in the worker and in the
        reader) for every short lag of the reader.
        """
        deadline = time.monotonic() + READER_WAIT
        while self._reader_position() < position:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)  # sleep-ok: polls a position in shared memory, with a deadline
        return True

    def _grow(self, nbytes: int) -> None:
        nbytes = min(max(nbytes, _HEADER + 1), self._max)
        buffer = shared_buffer(nbytes)
        buffer[:_HEADER] = 0  # the reader's position starts at 0
        self._buffer = buffer
        array = buffer.numpy()
        self._data = array.data
        self._read_to = array[:8].view(np.int64)
        self._generation += 1
        self._head = 0
        self._carried = False


# -- the reading side -------------------------------------------------------------------------


@dataclass
class _Held:
    buffer: torch.Tensor
    data: memoryview
    read_to: npt.NDArray[np.int64]


# Ring buffers of workers whose fields this process has received, by (pid, ring, generation):
# kept mapped while fields from them may still arrive (see `_keep`).
_HELD: dict[tuple[int, int, int], _Held] = {}


def _keep(key: tuple[int, int, int], buffer: torch.Tensor) -> None:
    """Hold a newly arrived ring buffer; let go of those no field can name any more.

    A worker's fields arrive in the order it sent them, so once a buffer of a
    ring arrives, its earlier generations are done with; a worker keeps its
    newest few rings (persistent workers start one per epoch); an exited
    worker's rings are done with.
    """
    pid, ring, generation = key
    rings = sorted({r for p, r, _ in _HELD if p == pid} | {ring})[-_RINGS_PER_WORKER:]
    for other in list(_HELD):
        o_pid, o_ring, o_generation = other
        if o_pid == pid:
            stale = o_ring not in rings or (o_ring == ring and o_generation < generation)
        else:
            stale = not process_alive(o_pid)
        if stale:
            del _HELD[other]
    array = buffer.numpy()
    _HELD[key] = _Held(buffer, array.data, array[:8].view(np.int64))


def _from_ring(place: _Place, carried: torch.Tensor | None) -> bytes:
    """Unpickling a field: copy it out of the worker's ring and tell the worker it was read."""
    pid, ring, generation, start, length, end = place
    key = (pid, ring, generation)
    if carried is not None:
        _keep(key, carried)
    held = _HELD.get(key)
    if held is None:
        raise RuntimeError(
            f"a sample field from DataLoader worker pid {pid} names ring {ring} (generation {generation}), "
            "whose shared memory this process does not hold: a worker's samples are read by one process, "
            "the one its DataLoader delivers to"
        )
    value = bytes(held.data[start : start + length])
    held.read_to[0] = end
    return value


def _reduce(value: RingBytes) -> tuple[Callable[..., bytes], tuple[Any, ...]]:
    ring = value.__dict__.get("ring")
    placed = ring.place(value) if isinstance(ring, SampleRing) and ring.pid == os.getpid() else None
    if placed is None:
        return bytes, (bytes(value),)
    return _from_ring, placed


# The DataLoader's queues pickle with ForkingPickler; its reducers apply to them only.
ForkingPickler.register(RingBytes, _reduce)
