"""Whole batches of raw bytes in reused buffers, so they cross worker processes without pickling.

A DataLoader with worker processes normally pickles every sample through a
pipe; with two workers that tops out near 450 MB/s on a small machine no
matter how fast the disk is. In batch mode each worker instead copies a
batch's fields into one of a few shared-memory slots it owns and reuses, and
only a handle crosses the pipe. The main process sees `PackedBytes`: one
``uint8`` tensor per field with the offsets of each sample.

A slot is rewritten ``slots`` batches later (per worker). The DataLoader keeps
at most ``prefetch_factor`` batches in flight per worker, so with
``slots >= prefetch_factor + 2`` a batch stays intact until the training loop
has moved at least two batches past it; call `PackedBytes.clone` to keep one
longer. ``pin_memory=True`` copies each batch at once and is always safe.

Only the first batch a worker sends from a slot carries the slot's shared
memory (a file descriptor, passed by torch through a fresh Unix connection:
~0.25 ms each); every later batch from it names the slot by (worker pid,
slot, generation) and the main process finds the mapping it already holds.
"""

from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

__all__ = ["BufferRing", "PackedBytes", "pack_fields", "process_alive", "shared_buffer"]


# Storages of worker ring slots seen by this process, kept mapped: torch maps a
# storage received from another process anew unless it is still alive here, and
# a fresh mapping costs a page fault per 4 KiB on first touch. Bounded, so slots
# of finished workers are let go.
_RECEIVED_SLOTS: OrderedDict[int, torch.UntypedStorage] = OrderedDict()
_RECEIVED_LIMIT = 64


def _received(data: torch.Tensor, offsets: torch.Tensor) -> PackedBytes:
    storage = data.untyped_storage()
    key = storage.data_ptr()
    _RECEIVED_SLOTS[key] = storage
    _RECEIVED_SLOTS.move_to_end(key)
    while len(_RECEIVED_SLOTS) > _RECEIVED_LIMIT:
        _RECEIVED_SLOTS.popitem(last=False)
    return PackedBytes(data, offsets)


@dataclass(frozen=True, slots=True)
class _SlotId:
    """One allocation of one slot of one ring in one worker process."""

    pid: int
    ring: int
    slot: int
    generation: int


_RING_TOKENS = itertools.count(1)

# Slots of worker rings whose memory this process holds, by (pid, ring, slot):
# (generation, the slot's whole buffer). When a slot arrives, entries of
# workers that have exited are dropped, and a worker's rings beyond the newest
# _RINGS_PER_WORKER (earlier epochs of a persistent worker) are let go.
_WORKER_SLOTS: dict[tuple[int, int, int], tuple[int, torch.Tensor]] = {}
_RINGS_PER_WORKER = 3


def shared_buffer(nbytes: int) -> torch.Tensor:
    """A ``uint8`` tensor of ``nbytes`` in shared memory, its pages untouched until written.

    ``torch.empty(n).share_memory_()`` allocates privately, then copies every page into a new
    shared segment: ~5 ms per MB on a busy small machine, paid by every worker for every ring.
    """
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is None:  # pragma: no cover - a torch without it
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        buffer.share_memory_()  # type: ignore[no-untyped-call]
        return buffer
    return torch.empty(0, dtype=torch.uint8).set_(new_shared(nbytes))


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (its shared buffers may still be named)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - alive, someone else's
        return True
    return True


def _forget_old_slots(arriving: _SlotId) -> None:
    rings = sorted({ring for pid, ring, _ in _WORKER_SLOTS if pid == arriving.pid} | {arriving.ring})
    keep = set(rings[-_RINGS_PER_WORKER:])
    for key in list(_WORKER_SLOTS):
        pid, ring, _ = key
        if (pid == arriving.pid and ring not in keep) or (pid != arriving.pid and not process_alive(pid)):
            del _WORKER_SLOTS[key]


def _from_slot(
    ident: _SlotId, buffer: torch.Tensor | None, data_span: tuple[int, int], offsets_span: tuple[int, int]
) -> PackedBytes:
    key = (ident.pid, ident.ring, ident.slot)
    if buffer is not None:
        if key not in _WORKER_SLOTS:
            _forget_old_slots(ident)
        _WORKER_SLOTS[key] = (ident.generation, buffer)
    else:
        held = _WORKER_SLOTS.get(key)
        if held is None or held[0] != ident.generation:
            raise RuntimeError(
                f"a batch from DataLoader worker pid {ident.pid} names slot {ident.slot} of its ring "
                f"{ident.ring} (generation {ident.generation}), whose memory this process does not hold "
                f"(more than {_RINGS_PER_WORKER} datasets iterated at once in one worker?)"
            )
        buffer = held[1]
    start, stop = data_span
    first, last = offsets_span
    return PackedBytes(buffer[start:stop], buffer[first:last].view(torch.int64))


@dataclass
class PackedBytes:
    """The bytes of one field for every sample of a batch, end to end.

    ``data[offsets[i]:offsets[i+1]]`` is sample ``i``'s value.
    """

    data: torch.Tensor
    offsets: torch.Tensor
    _origin: tuple[_SlotId, BufferRing, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.offsets.shape[0]) - 1

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        origin = self._origin
        if origin is None or origin[0].pid != os.getpid():
            return _received, (self.data, self.offsets)
        ident, ring, buffer = origin
        base = buffer.data_ptr()
        start = self.data.data_ptr() - base
        first = self.offsets.data_ptr() - base
        spans = ((start, start + int(self.data.numel())), (first, first + 8 * int(self.offsets.numel())))
        # The first batch from a slot carries its memory; later ones only name it.
        carried = buffer if ring.first_send(ident) else None
        return _from_slot, (ident, carried, *spans)

    def __getitem__(self, index: int) -> torch.Tensor:
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        start, stop = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.data[start:stop]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())

    def tolist(self) -> list[bytes]:
        """Each sample's value as ``bytes`` (a copy)."""
        raw = self.data.numpy().tobytes()
        bounds = self.offsets.tolist()
        return [raw[bounds[i] : bounds[i + 1]] for i in range(len(bounds) - 1)]

    def clone(self) -> PackedBytes:
        """A copy that owns its memory (survives the reuse of the buffer)."""
        return PackedBytes(self.data.clone(), self.offsets.clone())

    def pin_memory(self, device: Any = None) -> PackedBytes:
        """Pinned copy, for ``DataLoader(pin_memory=True)``."""
        return PackedBytes(self.data.pin_memory(), self.offsets.pin_memory())

    def to(self, *args: Any, **kwargs: Any) -> PackedBytes:
        return PackedBytes(self.data.to(*args, **kwargs), self.offsets.to(*args, **kwargs))


class BufferRing:
    """A few reusable byte buffers, in shared memory when ``shared`` (worker processes)."""

    def __init__(self, slots: int, *, shared: bool) -> None:
        if slots < 1:
            raise ValueError(f"slots must be positive, got {slots}")
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._generations = [0] * slots
        self._sent: set[_SlotId] = set()
        self._token = next(_RING_TOKENS)
        self._shared = shared
        self._next = 0

    @property
    def shared(self) -> bool:
        return self._shared

    def slot_id(self, slot: int) -> _SlotId:
        """The identity of slot ``slot``'s current buffer (changes when it is replaced)."""
        index = slot % len(self._buffers)
        return _SlotId(os.getpid(), self._token, index, self._generations[index])

    def first_send(self, ident: _SlotId) -> bool:
        """True the first time a batch from this slot buffer leaves the process."""
        if ident in self._sent:
            return False
        self._sent.add(ident)
        return True

    def next_slot(self) -> int:
        """The next slot in turn."""
        slot = self._next
        self._next = (self._next + 1) % len(self._buffers)
        return slot

    def take(self, nbytes: int, slot: int | None = None) -> torch.Tensor:
        """Slot ``slot`` (modulo the count; the next in turn if None), at least ``nbytes`` long.

        A slot too small is replaced by one half again as large as asked.
        """
        if slot is None:
            slot = self.next_slot()
        index = slot % len(self._buffers)
        buffer = self._buffers[index]
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes + nbytes // 2, 1 << 20)
            buffer = shared_buffer(size) if self._shared else torch.empty(size, dtype=torch.uint8)
            self._buffers[index] = buffer
            self._generations[index] += 1
        return buffer


def pack_fields(
    samples: Sequence[Sequence[tuple[str, memoryview]]], ring: BufferRing, *, slot: int | None = None
) -> dict[str, Any]:
    """Pack raw sample fields into one ring slot; return ``{"__key__": [...], field: PackedBytes}``.

    A field missing from some samples is packed as an empty value for them.
    """
    names, keys, lengths = _measure_fields(samples)
    count = len(samples)
    totals = lengths.sum(axis=1)
    # Offsets live in the slot too (8-byte aligned, after the data): one shared
    # storage per batch, so nothing new is allocated in shared memory per batch.
    data_bytes = int(totals.sum())
    offsets_at = -(-data_bytes // 8) * 8
    if slot is None:
        slot = ring.next_slot()
    buffer = ring.take(offsets_at + 8 * len(names) * (count + 1), slot)
    origin = (ring.slot_id(slot), ring, buffer) if ring.shared else None
    target = buffer.numpy()
    offsets_end = offsets_at + 8 * len(names) * (count + 1)
    all_offsets = buffer[offsets_at:offsets_end].view(torch.int64).view(len(names), count + 1)
    offsets_np = all_offsets.numpy()
    batch: dict[str, Any] = {"__key__": keys}
    start = 0
    for row, name in enumerate(names):
        offsets_np[row, 0] = 0
        np.cumsum(lengths[row], out=offsets_np[row, 1:])
        batch[name] = PackedBytes(buffer[start : start + int(totals[row])], all_offsets[row], origin)
        start += int(totals[row])
    _copy_fields(samples, target, {name: int(batch[name].data.storage_offset()) for name in names})
    return batch


def _measure_fields(
    samples: Sequence[Sequence[tuple[str, memoryview]]],
) -> tuple[list[str], list[str], npt.NDArray[np.int64]]:
    """The field names in order of first appearance, the samples' keys, and each field's length per sample."""
    names: list[str] = []
    for fields in samples:
        for name, _ in fields:
            if name != "__key__" and name not in names:
                names.append(name)
    lengths = np.zeros((len(names), len(samples)), dtype=np.int64)
    column = {name: i for i, name in enumerate(names)}
    keys: list[str] = []
    for j, fields in enumerate(samples):
        for name, view in fields:
            if name == "__key__":
                keys.append(view.tobytes().decode("utf-8", "surrogateescape"))
            else:
                lengths[column[name], j] = view.nbytes
    return names, keys, lengths


def _copy_fields(
    samples: Sequence[Sequence[tuple[str, memoryview]]], target: npt.NDArray[np.uint8], positions: dict[str, int]
) -> None:
    """Copy each field's bytes to its column's next place in ``target`` (``positions``: where each starts)."""
    for fields in samples:
        for name, view in fields:
            if name == "__key__":
                continue
            size = view.nbytes
            if size:
                at = positions[name]
                target[at : at + size] = np.frombuffer(view, dtype=np.uint8)
                positions[name] = at + size
