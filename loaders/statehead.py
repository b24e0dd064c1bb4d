"""What a saved state says of the dataset, published by the readers for the training process.

`CachedIterableDataset.state_dict` names the dataset (its id and snapshot, a mix's counts, the
shuffle window) and whether the epoch was dealt cold. All of it comes from a process's runtime,
and with DataLoader worker processes only the workers open one: the training process would open
its own for the first state (list the origin, or ask the daemon), 83-201 ms in a trial's
checkpoints (issue 34 item 7). So each reader writes these few fields, as JSON, into a slot of
shared memory made with the dataset when it plans an epoch (`resume.describe`), and `state_dict`
reads them: no I/O.

A slot is written as: length 0, the bytes, their CRC-32, then the length; a read that sees a
length, bytes and CRC that disagree (a write under way) is no answer, and the caller opens its
own runtime as before. So a state is never made of a half-written slot.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import numpy as np
import torch

__all__ = ["StateHeads"]

_SLOTS = 4
"""Slots, one per worker modulo this: workers write the same fields, so sharing one only costs a retry."""
_SLOT_BYTES = 8192
_HEADER = 8  # the length (4 bytes) and the CRC-32 (4 bytes), little-endian


class StateHeads:
    """Shared memory for `describe`'s fields, written by readers and read by the training process."""

    def __init__(self) -> None:
        self.slots = torch.zeros((_SLOTS, _SLOT_BYTES), dtype=torch.uint8)
        self.slots.share_memory_()  # type: ignore[no-untyped-call]

    def publish(self, reader: int, head: dict[str, Any]) -> None:
        """Write ``head`` in reader ``reader``'s slot (a head too large for one is left out: no answer)."""
        data = json.dumps(head, sort_keys=True).encode()
        slot = self.slots[reader % _SLOTS].numpy()
        if len(data) > _SLOT_BYTES - _HEADER:
            slot[:4] = 0
            return
        slot[:4] = 0  # a reader now sees no length: nothing to take while the bytes change
        slot[_HEADER : _HEADER + len(data)] = np.frombuffer(data, dtype=np.uint8)
        slot[4:8] = np.frombuffer(zlib.crc32(data).to_bytes(4, "little"), dtype=np.uint8)
        slot[:4] = np.frombuffer(len(data).to_bytes(4, "little"), dtype=np.uint8)

    def read(self, epoch: int) -> dict[str, Any] | None:
        """A reader's fields for epoch ``epoch``, whole, or None (none written yet, or one being written)."""
        for number in range(_SLOTS):
            raw = self.slots[number].numpy().tobytes()
            length = int.from_bytes(raw[:4], "little")
            data = raw[_HEADER : _HEADER + length]
            if not 0 < length <= _SLOT_BYTES - _HEADER or zlib.crc32(data) != int.from_bytes(raw[4:8], "little"):
                continue
            head: dict[str, Any] = json.loads(data)
            if head.get("epoch") == epoch:
                return head
        return None
