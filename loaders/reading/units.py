"""Opening units for one reader: lease, locate, map, verify, and close after use.

A unit is what the plan deals samples from: one shard, or several files read
together (a Zarr chunk row). `UnitReaders` keeps the units a reader has open,
opens each once however many threads ask (the others wait for it), leases what
it holds and is about to open (one note to the stager), verifies every mapped
copy against the manifest before a sample is served from it, and drops a bad
copy so that the next try reads the next tier. What it asks for ahead of use is
its `reading.prefetch.Prefetch`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import mmap
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from datacache.loaders.plans.interface import Opening
from datacache.loaders.plans.positions import Positions
from datacache.loaders.reading.prefetch import Prefetch
from datacache.loaders.runtime import NodeFuture, Runtime
from datacache.loaders.shardfiles import UnitReader
from datacache.loaders.stats import Counter, count_unit_open
from datacache.tiers.files import UnsafeFileError, map_regular

from datacache.access import ShardAccess
from datacache.checksum import copy_problem
from datacache.errors import ChecksumMismatchError, DatacacheError, ShardReadError
from datacache.staging import DatasetHandle, Location, ReaderProgress, Stager

__all__ = ["HOLD_AHEAD", "UnitReaders"]

logger = logging.getLogger(__name__)

HOLD_AHEAD = 4
"""Units after the one being opened that a reader's note leases (and maps later without asking).

Few: a held shard cannot be evicted, and every reader of the node holds its own. More where they are
small (`HOLD_AHEAD_BYTES`)."""

HOLD_AHEAD_BYTES = 64 * 2**20
"""Past `HOLD_AHEAD` units, a note leases as many more mean-sized units as fit in this (and in a
sixteenth of a capped local tier), at most `HOLD_AHEAD_MAX`.

A shuffle window of tiny shards opens its units in any order: leased and located together, in one
note (one catalog transaction), instead of a note, a catalog write and a prefetch every few shards."""

HOLD_AHEAD_MAX = 16384


def hold_ahead(unit_bytes: float, local_capacity: int | None) -> int:
    """How many units after the one being opened a reader's note leases (see `HOLD_AHEAD_BYTES`)."""
    budget = HOLD_AHEAD_BYTES if local_capacity is None else min(HOLD_AHEAD_BYTES, local_capacity // 16)
    return max(HOLD_AHEAD, min(HOLD_AHEAD_MAX, int(budget // max(unit_bytes, 1.0))))


class UnitReaders:
    """The units one reader has open this epoch, opened in plan order and closed after last use.

    ``opening``'s ``row`` is the reader's stats row; its ``lock`` guards it and the
    bookkeeping here (reader threads and the consumer share both).
    """

    def __init__(self, runtime: Runtime, epoch: Positions, opening: Opening, future: NodeFuture | None = None) -> None:
        self.runtime = runtime
        self._future = future
        self._opening: set[int] = set()
        """Units being located and mapped now (by any thread): leased with the open ones."""
        self._note_lock = threading.Lock()
        self._positions: Mapping[int, int] = future.key_positions(runtime.units) if future is not None else {}
        self._epoch = epoch
        self._plan = runtime.units
        self._kind = runtime.kind
        self._where = runtime.where
        self.url = runtime.url
        """The URL (credentials redacted) this dataset's shard keys are relative to."""
        self._row = opening.row
        self._lock = opening.lock
        self._skip_bad = opening.skip_bad
        self._in_consumer = opening.in_consumer
        self._prefetch = Prefetch(runtime, epoch, opening.controller, future, opening.lock)
        self.readers: dict[int, UnitReader] = {}
        self.skipped: set[int] = set()
        self.skipped_why: dict[int, str] = {}
        """Why each skipped unit could not be read (a cold epoch records it in the plan)."""
        self._unit_locks: dict[int, threading.Lock] = {}
        self._preopened: set[int] = set()
        self._leased: dict[int, list[Location]] = {}
        """Units not opened yet whose local copies an earlier note leased and located: opened without asking."""
        self._hold = hold_ahead(runtime.unit_bytes, runtime.settings.local_capacity)  # the most a note leases
        self._holding = HOLD_AHEAD
        """How many the next note leases: doubled while notes find every one local, halved when not."""
        self._used: set[int] = set()  # the units opened this epoch (from where the reader started)
        self._floor = 0
        """Where the first unit not opened yet is in the prefetch's sequence (`_to_hold` starts there)."""
        self._position = 0
        """The position this reader last reported (`_note_progress`)."""
        self._noter: concurrent.futures.ThreadPoolExecutor | None = None
        """The thread that sends the notes dropping released units' leases (`_release_soon`)."""
        self._release_pending = False
        self.staged_bytes = 0.0
        self.staging_seconds = 0.0

    def restart(self, produced: int) -> None:
        """Close every open unit and plan the units to read from position ``produced`` on."""
        self.close_all()
        self._prefetch.restart(self._epoch.units_from(produced))
        self._used.clear()
        self._floor = 0

    def close_all(self) -> None:
        for unit, reader in self.readers.items():
            for closing in self.runtime.opened.release(unit, reader):
                closing.close()
        self.readers.clear()
        noter, self._noter = self._noter, None
        if noter is not None:
            noter.shutdown(wait=True)  # its last note before the final one
        with self._note_lock:
            self._leased.clear()
        self._prefetch.found_local(None)
        if self._future is not None and self._prefetch.told:
            self._note_progress(None, done=True)  # holds nothing any more

    def _note_progress(self, unit: int | None, *, done: bool = False) -> list[Location]:
        """Tell the stager where this reader is and lease what it holds; return where ``unit`` is.

        Held: the open units, ``unit``, the next units not opened yet (`_to_hold`) and those
        leased before. One call notes, leases and locates ``unit`` and the next units, before any
        is mapped, so eviction cannot take one between locate and map; the next units
        found local are opened later without asking again, and no prefetch goes for them.
        Through a daemon: one round trip per few units, not two per unit. Without
        ``unit`` the position stays (a unit was closed: its lease goes), or with ``done``
        moves past this epoch.
        """
        future, runtime = self._future, self.runtime
        if future is None:
            return []
        # One note at a time, each with the holdings as they are when it is sent: a thread's
        # older note never replaces another's newer one (dropping a unit it is opening).
        with self._note_lock:
            coming = self._to_hold(unit) if unit is not None else []
            asked = [] if unit is None else [unit, *coming]
            units = {*self.readers, *self._opening, *self._leased, *asked}
            holding = tuple(key for u in sorted(units) for key in self._plan.units[u].keys)
            if unit is not None:
                self._position = self._positions.get(unit, 0)
            elif done:
                self._position = sum(map(len, self._plan_keys()))
            progress = ReaderProgress(future.reader, future.epoch, self._position, holding, runtime.owner)
            locate = tuple(dict.fromkeys(key for u in asked for key in self._plan.units[u].keys))
            located = runtime.run(runtime.access.note_progress(runtime.handle, progress, locate=locate))
            where = dict(zip(locate, located, strict=True))
            self._prefetch.found_local([key for key, loc in where.items() if loc.tier == "local"])
            local = 0
            for u in coming:
                found = [where[key] for key in self._plan.units[u].keys]
                if all(loc.tier == "local" and loc.path is not None for loc in found):
                    self._leased[u] = found
                    local += 1
            if coming:
                # All found local (a warm epoch): the next note leases twice as many, and at least what the
                # prefetch asks for (a key no note found local is prefetched), up to `_hold`. Else (cold)
                # back towards `HOLD_AHEAD`: a note locates each copy not local one by one.
                grown = max(self._holding * 2, self._prefetch.depth) if local == len(coming) else self._holding // 2
                self._holding = max(HOLD_AHEAD, min(self._hold, grown))
            return [] if unit is None else [where[key] for key in self._plan.units[unit].keys]

    def _to_hold(self, unit: int) -> list[int]:
        """The units a note for ``unit`` leases with it: the first `_holding` of the reader's sequence not opened
        yet, nor open, nor leased. From the first unit not opened, not from ``unit``: a shuffle window's
        units open in any order, so those its first opens passed are leased too. Under ``_note_lock``."""
        sequence, used, readers, leased = self._prefetch.sequence, self._used, self.readers, self._leased
        floor = self._floor
        while floor < len(sequence) and sequence[floor] in used:
            floor += 1
        self._floor = floor
        held: list[int] = []
        # A bounded look: in a cold window many units past the floor are open or read already.
        for u in itertools.islice(sequence, floor, floor + 4 * self._holding + 64):
            if u != unit and u not in used and u not in readers and u not in leased:
                held.append(u)
                if len(held) >= self._holding:
                    break
        return held

    def _plan_keys(self) -> list[tuple[str, ...]]:
        return [self._plan.units[u].keys for u in self._epoch.unit_sequence]

    def url_at(self, position: int) -> str:
        """The URL (credentials redacted) the keys of the unit ``position`` reads are relative to."""
        return self.url

    def note_retries(self) -> None:
        """Copy this worker process's origin retries into its row (the consumer's are read by `stats`)."""
        if not self._in_consumer:
            self._row[Counter.RETRIES] = self.runtime.access.origin_retries()

    def release_after(self, position: int, pool: concurrent.futures.Executor | None) -> None:
        """Close the units ``position`` reads for the last time (on ``pool`` when given)."""
        for unit in self._epoch.releases_after(position):
            self._release(unit, pool)

    def release_range(self, begin: int, stop: int, pool: concurrent.futures.Executor | None) -> None:
        """Close the units positions ``[begin, stop)`` read for the last time: one lookup per batch where
        the plan can say it for a range (``releases_between``), not one per position."""
        between = getattr(self._epoch, "releases_between", None)
        if between is None:
            for position in range(begin, stop):
                self.release_after(position, pool)
            return
        for unit in between(begin, stop):
            self._release(unit, pool)

    def _release(self, unit: int, pool: concurrent.futures.Executor | None) -> None:
        """Close ``unit``, read for the last time (on ``pool`` when given), and let its lease go."""
        reader = self.readers.pop(unit, None)
        if reader is None:
            return
        for closing in self.runtime.opened.release(unit, reader):
            if pool is not None:
                # Unmapping 64 MB takes milliseconds: not in the consumer's thread.
                pool.submit(closing.close)
            else:
                closing.close()
        if self._future is not None and self._prefetch.told:
            # Its lease goes now, not at the epoch's end: the room it leaves is what
            # brings in the shards read next (those of the next epoch, near the end).
            # While units leased ahead are still to open, the note that leases the
            # next ones drops it (at most `HOLD_AHEAD` units later): no round trip now.
            with self._note_lock:
                later = bool(self._leased)
            if later:
                self._prefetch.again(self.readers)
            else:
                self._release_soon()

    def _release_soon(self) -> None:
        """Drop released units' leases, then ask again for room, on a helper thread.

        A note is a round trip through the stager to the catalog (a write): the
        reader does not wait for it. Notes queued while one is pending are one note:
        each takes the holdings as they are when it is sent.
        """
        with self._note_lock:
            if self._release_pending:
                return
            self._release_pending = True
            if self._noter is None:
                self._noter = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="datacache-note")
            noter = self._noter
        noter.submit(self._release_now)

    def _release_now(self) -> None:
        with self._note_lock:
            self._release_pending = False
        try:
            self._note_progress(None)
            self._prefetch.again(self.readers)
        except Exception as exc:  # the next note (a unit opened, the epoch's end) drops the leases
            logger.debug("%s: dropping released leases failed: %s", self._where, exc)

    def open_ahead(self, begin: int, horizon: int, submit: Callable[..., object]) -> None:
        """Open (map and verify) on ``submit`` the units first used in ``[begin, horizon)``.

        Opening a 64 MB shard takes tens of milliseconds, several batches' worth:
        done ahead, crossing into the next shuffle window costs no wait.
        """
        prefetch = self._prefetch
        for unit in prefetch.sequence[prefetch.index :]:
            position = self._epoch.first_use[unit]
            if position >= horizon:
                break
            if position >= begin and unit not in self._preopened and unit not in self.readers:
                self._preopened.add(unit)
                submit(self._preopen, position)

    def _preopen(self, position: int) -> None:
        """Open the unit first used at ``position`` ahead of need; errors surface when it is used."""
        with contextlib.suppress(Exception):
            self.reader_at(position)

    def reader_at(self, position: int) -> UnitReader | None:
        """The open reader of the unit ``position`` reads; None if that unit was skipped as bad."""
        return self.reader_for(int(self._epoch.unit_of[position]))

    def reader_for(self, unit: int) -> UnitReader | None:
        """The open reader of ``unit`` (opened now if need be); None if it was skipped as bad."""
        reader = self.readers.get(unit)
        if reader is not None:
            return reader
        with self._lock:
            if unit in self.skipped:
                return None
            unit_lock = self._unit_locks.setdefault(unit, threading.Lock())
            self._prefetch.advance(unit, self.readers)
        try:
            return self._open_once(unit, unit_lock)
        finally:
            self._prefetch.send()  # held back for the lease; sent even if another thread opened the unit

    def _mark_skipped(self, unit: int, exc: Exception) -> bool:
        """Record ``unit`` as skipped as bad; False if it already was."""
        with self._lock:
            if unit in self.skipped:
                return False
            self.skipped.add(unit)
            self.skipped_why[unit] = str(exc)
            self._row[Counter.SKIPPED_SHARDS] += 1
        logger.warning("%s: skipping %s: %s", self._where, self._plan.units[unit].label, exc)
        return True

    def skip_damaged(self, unit: int, error: Exception) -> bool:
        """``unit`` failed mid-read (a Parquet file is opened from its footer: damaged data shows when
        read): with ``on_error="skip"`` it is skipped from now on, its reader closed, and True returned."""
        if not self._skip_bad:
            return False
        if self._mark_skipped(unit, error):
            reader = self.readers.pop(unit, None)
            if reader is not None:
                for closing in self.runtime.opened.release(unit, reader):
                    closing.close()
        return True

    def _open_once(self, unit: int, unit_lock: threading.Lock) -> UnitReader | None:
        with unit_lock:  # one thread opens a unit; the others wait for it
            reader = self.readers.get(unit)
            if reader is not None:
                return reader
            if unit in self.skipped:
                return None
            self._opening.add(unit)
            opened = self.runtime.opened
            try:
                started = time.perf_counter()
                with opened.gate(unit) as waited:  # one opening per unit in this process at a time
                    found = opened.get(unit, waited=waited)
                    if found is None:
                        reader, tier = self._open(unit)
                        opened.add(unit, reader, tier)
                    else:  # another reader of this process opened it: this one's hit all the same
                        reader, shared = found
                        self._count_shared(shared, time.perf_counter() - started)
            except (ShardReadError, ChecksumMismatchError) as exc:
                if not self._skip_bad:
                    raise
                self._mark_skipped(unit, exc)
                return None
            finally:
                self._opening.discard(unit)  # mapped by now (or failed): a later note may drop it
            self.readers[unit] = reader
            self._used.add(unit)
            return reader

    def _open(self, unit_index: int) -> tuple[UnitReader, str]:
        """The unit's reader, and the tier its shards were found on (the slowest)."""
        unit = self._plan.units[unit_index]
        runtime = self.runtime
        where = f"{self._where}: shard {unit.label!r}"
        # Three tries: a bad local copy is dropped, then a bad shared copy, then the origin's bytes.
        for attempt in range(3):
            started = time.perf_counter()
            locations, tier = self._locate(unit_index, again=attempt > 0)
            waited = time.perf_counter() - started
            buffers: dict[str, Any] = {}
            try:
                read_started = time.perf_counter()
                for location in locations:
                    buffers[location.shard.key] = load_verified(runtime, location, where)
                read_seconds = time.perf_counter() - read_started
                index_key = None
                identity = (locations[0].checksum or locations[0].shard.version) if len(locations) == 1 else None
                if self._kind.keeps_index and identity is not None:
                    index_key = (locations[0].shard.key, locations[0].shard.size, identity)
                known = runtime.spans.get(index_key) if index_key is not None else None
                reader = self._kind.open_reader(unit, where, buffers, self._plan.extra, index=known)
                if index_key is not None and known is None and reader.index is not None:
                    runtime.spans.put(index_key, reader.index)
            except BaseException as exc:
                # Unmap what was mapped before the failure now, not when the traceback is dropped.
                close_buffers(buffers)
                if isinstance(exc, ChecksumMismatchError):
                    self._row[Counter.CORRUPT] += 1
                    for location in locations:
                        if location.path is not None:
                            runtime.run(runtime.access.report_corrupt(runtime.handle, location))
                    if attempt == 2:
                        raise ChecksumMismatchError(f"{where}: {exc}") from exc
                    continue
                if isinstance(exc, FileNotFoundError) and attempt < 2:
                    continue  # evicted between locate and open: locate again
                raise
            self._count_open(tier, locations, waited, read_seconds)
            self.note_retries()
            return reader, tier
        raise DatacacheError(f"{where}: could not be read")  # pragma: no cover - loop always returns or raises

    def _locate(self, unit: int, *, again: bool) -> tuple[list[Location], str]:
        """Where the unit's shards are (staging those only the origin has), and the slowest tier.

        A unit an earlier note leased and found local is opened from there without
        asking, unless its copy failed (``again``).
        """
        runtime = self.runtime
        with self._note_lock:
            leased = self._leased.pop(unit, None)
        if leased is not None and not again:
            return leased, "local"
        if self._future is None:
            located = runtime.run(locate_keys(runtime.access, runtime.handle, self._plan.units[unit].keys))
        else:
            located = self._note_progress(unit)
        return runtime.run(stage_missing(runtime.access, runtime.handle, located))

    def _count_shared(self, tier: str, waited: float) -> None:
        """A unit another reader of this process opened, counted as this one's open (`OpenUnits.take`)."""
        self._row[Counter.TAKEN] += 1
        count_unit_open(self._row, tier, waited)

    def _count_open(self, tier: str, locations: list[Location], waited: float, read_seconds: float) -> None:
        count_unit_open(self._row, tier, waited + read_seconds)
        if tier != "local":
            self.staged_bytes += sum(loc.shard.size for loc in locations)
            self.staging_seconds += waited + read_seconds


def map_file(path: Path) -> mmap.mmap | bytes:
    """Map a copy read-only (shared with the page cache: no copy, no private memory).

    Through `tiers.files.map_regular`: the last component is not followed and the open does not
    block, so a link or a FIFO another uid put in a shared copy's place between the tier's check and
    this open raises `UnsafeFileError` at once instead of hanging the reader or reading elsewhere.
    """
    return map_regular(path)


def load_verified(runtime: Runtime, location: Location, where: str) -> Any:
    """The bytes of ``location``: the stager's buffer, a read, or a mapped copy checked against the manifest."""
    if location.buffer is not None:
        return location.buffer  # verified by this process's stager as it arrived
    if location.path is None:
        return runtime.run(runtime.access.read(runtime.handle, location.shard.key))
    try:
        buffer = map_file(location.path)
    except UnsafeFileError as exc:
        # As a bad copy: the next try reads the next tier (a link or FIFO is never the shard's bytes).
        raise ChecksumMismatchError(f"{where}: {exc}") from None
    # Others can write the shared tier's directories: a copy there is checked whatever the setting.
    hashed = runtime.settings.verify_on_read or location.tier == "shared"
    problem = copy_problem(buffer, location.shard.size, location.checksum, hashed=hashed)
    if problem:
        if hasattr(buffer, "close"):
            buffer.close()
        raise ChecksumMismatchError(f"{where}: the copy on the {location.tier} tier {problem}")
    return buffer


def close_buffers(buffers: dict[str, Any]) -> None:
    """Unmap the buffers of a unit that failed to open, now, not when the traceback is dropped."""
    for buffer in buffers.values():
        if hasattr(buffer, "close"):
            with contextlib.suppress(BufferError):
                buffer.close()
    buffers.clear()


async def locate_keys(access: ShardAccess, handle: DatasetHandle, keys: tuple[str, ...]) -> list[Location]:
    """Where each of ``keys`` is now (without staging any)."""
    return list(await asyncio.gather(*(access.locate(handle, key) for key in keys)))


async def stage_missing(
    access: ShardAccess, handle: DatasetHandle, located: list[Location]
) -> tuple[list[Location], str]:
    """Where each located shard can be read: local, else shared (its local copy goes on), else staged now.

    Also returns the slowest tier the unit was found on when asked for:
    ``"origin"`` means the reader had to wait for a transfer.
    """

    async def one(location: Location) -> Location:
        if location.tier in ("local", "shared"):
            return location
        if isinstance(access, Stager):
            # In-process: take the bytes as soon as they are verified, not after the fsync.
            return await access.ensure(handle, location.shard.key, early=True)
        return await access.ensure(handle, location.shard.key)

    locations = list(await asyncio.gather(*(one(location) for location in located)))
    found = {location.tier for location in located}
    tier = "origin" if "origin" in found else "shared" if "shared" in found else "local"
    return locations, tier
