"""Units open in one process, shared by the readers of a dataset there (`OpenUnits`)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator

from datacache.loaders.shardfiles import UnitReader

__all__ = ["KEEP_RELEASED", "OpenUnits"]

KEEP_RELEASED = 8
"""Units no reader holds that stay open for the next reader, while several read in one process (`OpenUnits`)."""


class OpenUnits:
    """Units open in one process, shared by its readers of one dataset.

    `dataloader.DataLoader` reads as N workers would, in one process: each of them
    reads from most shards, and would otherwise map, verify and index each shard up
    to N times. While ``keep`` is set, a unit no reader holds stays open until
    ``keep`` later ones are released (the next worker to read it takes it as it is);
    otherwise it is closed at once, as with one reader. A unit held by a reader that
    never finished (its iterator abandoned) goes with that reader.
    """

    def __init__(self) -> None:
        self.keep = 0
        self._lock = threading.Lock()
        self._open: weakref.WeakValueDictionary[int, UnitReader] = weakref.WeakValueDictionary()
        self._users: dict[int, int] = {}
        """id() of each open reader -> how many readers hold it."""
        self._idle: OrderedDict[int, UnitReader] = OrderedDict()
        """Released units kept open, by unit, the oldest first."""
        self._opening: dict[int, threading.Lock] = {}
        self._tiers: dict[int, str] = {}
        """id() of each open reader -> the tier its opener found the unit on."""

    def acquire(self, unit: int, opener: Callable[[], UnitReader]) -> UnitReader:
        """The open reader of ``unit``, or ``opener()`` if none is."""
        with self.gate(unit) as waited:
            found = self.get(unit, waited=waited)
            if found is not None:
                return found[0]
            reader = opener()
            self.add(unit, reader, "local")
            return reader

    @contextlib.contextmanager
    def gate(self, unit: int) -> Iterator[bool]:
        """Held while ``unit`` is looked up and, if need be, opened: one opening per unit at a time.

        Yields whether another reader held it first (then `get` most likely finds what it opened).
        """
        with self._lock:
            gate = self._opening.setdefault(unit, threading.Lock())
        waited = not gate.acquire(blocking=False)
        if waited:
            gate.acquire()
        try:
            yield waited
        finally:
            gate.release()

    def get(self, unit: int, *, waited: bool) -> tuple[UnitReader, str] | None:
        """``unit``'s open reader, taken by one more reader, and the tier this one counts it as; None: not open.

        The tier is where this reader would have found the unit had it opened it itself, as a
        worker process would (its hit): the opener's tier when it ``waited`` for that opening,
        "local" when the unit was open already.
        """
        with self._lock:
            reader = self._idle.pop(unit, None) or self._open.get(unit)
            if reader is None or id(reader) not in self._users:
                return None
            self._users[id(reader)] += 1
            return reader, (self._tiers.get(id(reader), "local") if waited else "local")

    def add(self, unit: int, reader: UnitReader, tier: str) -> None:
        """``reader`` of ``unit`` was just opened (under `gate`), from ``tier``: held by one reader."""
        with self._lock:
            self._open[unit] = reader
            self._users[id(reader)] = 1
            self._tiers[id(reader)] = tier
            weakref.finalize(reader, self._forget, id(reader))

    def _forget(self, ident: int) -> None:
        with self._lock:
            self._users.pop(ident, None)
            self._tiers.pop(ident, None)

    def release(self, unit: int, reader: UnitReader) -> list[UnitReader]:
        """One reader is done with ``reader`` (of ``unit``); returns the units to close now."""
        with self._lock:
            left = self._users.get(id(reader), 1) - 1
            self._users[id(reader)] = left
            if left > 0:
                return []
            self._idle[unit] = reader
            closing = []
            while len(self._idle) > self.keep:
                _, oldest = self._idle.popitem(last=False)
                self._users.pop(id(oldest), None)
                closing.append(oldest)
            return closing

    def close_idle(self) -> list[UnitReader]:
        """Every released unit still open (the dataset is done with this process's readers)."""
        with self._lock:
            closing = list(self._idle.values())
            for reader in closing:
                self._users.pop(id(reader), None)
            self._idle.clear()
            return closing
