"""The counts' running sum shared while its array lives (`order.windows.unit_starts`), and dropped with it."""

from __future__ import annotations

import threading

import numpy as np
from datacache.loaders.order import windows
from datacache.loaders.order.windows import read_only, unit_starts


def test_one_sum_serves_every_holder_of_a_read_only_counts_array() -> None:
    counts = read_only(np.arange(1, 9))
    assert unit_starts(counts) is unit_starts(counts)
    assert unit_starts(counts).tolist() == [0, *np.cumsum(np.arange(1, 9)).tolist()]
    writable = np.arange(1, 9)
    assert unit_starts(writable) is not unit_starts(writable)  # its writer could change it under a shared sum


def test_a_counts_array_dying_inside_the_lock_does_not_wait_for_it() -> None:
    """A test process hung 20 minutes: the collector ran a dead array's callback inside `unit_starts`'s
    own ``with _SHARED_LOCK``, and the callback took the lock its thread held."""
    holder = [read_only(np.arange(1, 9))]
    unit_starts(holder[0])
    key = id(holder[0])
    finished = threading.Event()

    def drop_it_inside_the_lock() -> None:
        with windows._SHARED_LOCK:
            holder.clear()  # the last reference: its callback runs here, as the collector's would
            finished.set()

    thread = threading.Thread(target=drop_it_inside_the_lock, daemon=True)
    thread.start()
    thread.join(60)
    assert finished.is_set(), "the callback waited for the lock its own thread held"
    assert key not in windows._SHARED_STARTS
