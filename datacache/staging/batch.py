"""A warm's shards staged onto the local tier in batches: per-shard work only where it is the bytes.

`LocalStager.stage` costs a node lock, two catalog transactions, a dozen thread round
trips and two fsyncs per shard: 4-6 ms, nothing beside a large shard, everything beside a
tiny one (1e5 of them took longer than 300 s). A batch takes the same steps for many shards
together, with the same guarantees:

- the node locks of the batch in one thread job, without waiting; a shard another process
  holds goes the one-shard way (`LocalStager.stage`), which waits for it;
- the catalog: one read of the batch's rows, one reservation transaction (`STAGING` rows
  claim the room, the eviction policy chooses victims as for one shard), one commit;
- the bytes: small shards read whole, ``concurrency`` at once, verified (`Transfer.fetch`),
  then written together (`DirectoryTier.put_many`: temporary files, fsynced by a few threads
  at once, renamed, each directory fsynced once); large ones by `Transfer.copy` as ever.

Crash safety is the one-shard way's: a file is renamed into place only whole and durable,
and catalogued ``RESIDENT`` only after that; until then its row is ``STAGING``, owned by
this process, so that recovery (`datacache.staging.recovery`) drops the row and the file of
a batch a kill interrupted (or adopts a whole file it finds without a row).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from datacache.catalog import Claim, Reservation
from datacache.errors import ChecksumMismatchError, OriginPermissionError, ShardNotFoundError, TierFullError
from datacache.locks import lock_name, release_node_locks, try_node_locks
from datacache.manifest import Shard
from datacache.sizes import format_bytes
from datacache.staging.local import LocalStager, reserve_for
from datacache.staging.types import LOCAL, ORIGIN, DatasetHandle, Location, StagingEvent
from datacache.staging.warm import displaced_for
from datacache.tiers import device_free

__all__ = ["BATCH_BYTES", "BATCH_SHARDS", "Outcome", "Turn", "WarmBatches", "make_room_for", "stage_batch"]

logger = logging.getLogger(__name__)

BATCH_SHARDS = 256
"""Shards in one batch: a catalog transaction and a round of fsyncs each (and as many open files)."""

SMALL = 256 << 10
"""The largest shard read whole and written with its batch; larger ones stream into their file as ever
(where their bookkeeping is small beside their bytes)."""

BATCH_BYTES = 64 << 20
"""Bytes of small shards held in memory by one batch until they are written."""

IN_FLIGHT = 3
"""Batches staged at once: one fetching while another is fsynced and a third committed."""

Outcome = Location | BaseException

# Answers that asking again would only repeat: reported, not retried the one-shard way.
_FINAL = (ShardNotFoundError, OriginPermissionError)


class Turn:
    """A batch's place in its warm: it reserves room only after the batches before it have reserved theirs.

    Batches run ``IN_FLIGHT`` at once, and which of them reaches the catalog first depended on thread
    scheduling: on a busy machine a warm bigger than the tier kept an arbitrary subset, not the shards
    it was asked for first (which a prestage in reading order needs, and tests relied on).
    """

    def __init__(self, before: Turn | None = None) -> None:
        self._before = before
        self._done = asyncio.Event()

    async def wait(self) -> None:
        if self._before is not None:
            await self._before._done.wait()

    def release(self) -> None:
        """This batch has reserved (or will not): the next may. Idempotent."""
        self._done.set()


async def stage_batch(
    local: LocalStager, handle: DatasetHandle, shards: Sequence[Shard], turn: Turn | None = None
) -> list[Outcome]:
    """Stage ``shards`` onto the local tier together; return where each one is (or why it is not).

    ``turn``: this batch's place among a warm's batches (`Turn`); released however this ends.
    """
    turn = turn or Turn()
    try:
        return await _stage_batch(local, handle, shards, turn)
    finally:
        turn.release()


async def _stage_batch(local: LocalStager, handle: DatasetHandle, shards: Sequence[Shard], turn: Turn) -> list[Outcome]:
    outcomes: dict[str, Outcome] = dict(await local.hits(handle, shards))
    for _ in outcomes:
        local.events.hit(LOCAL)
    missing = [shard for shard in shards if shard.key not in outcomes]
    paths = {shard.key: local.lock_path(lock_name(handle.id, shard.key)) for shard in missing}
    held = await asyncio.to_thread(try_node_locks, list(paths.values()))
    try:
        mine = [shard for shard in missing if paths[shard.key] in held]
        outcomes.update(await _under_locks(local, handle, mine, turn))
    finally:
        turn.release()
        await asyncio.shield(asyncio.to_thread(release_node_locks, held))
    # Held by another process (staging them: this waits for it), or not staged here after all.
    later = [shard for shard in shards if shard.key not in outcomes]
    for shard, outcome in zip(later, await _one_by_one(local, handle, later), strict=True):
        outcomes[shard.key] = outcome
    return [outcomes[shard.key] for shard in shards]


async def make_room_for(local: LocalStager, handle: DatasetHandle, shards: Sequence[Shard]) -> tuple[int, int]:
    """Evict the dataset's resident shards ``shards`` leaves out, when only that makes them fit (`displaced_for`).

    For a warm of some of a dataset's shards, asked for by name or range: the user's choice of
    which of its shards the tier holds. Returns the shards and bytes evicted.
    """
    wanted = {shard.key for shard in shards}
    table = handle.manifest.table
    keys = table.keys()  # each key decoded from the columns, no `Shard` made
    if len(wanted) >= len(table) and all(key in wanted for key in keys):
        return 0, 0  # the whole dataset: none of its shards was left out
    catalog = local.catalog
    used, _ = await catalog.usage()
    room: list[int] = []  # what is free of the capacity, and of the device
    if local.tier.capacity is not None:
        room.append(local.tier.capacity - used)
    if (device := device_free(local.settings.local_dir)) is not None:
        room.append(device - reserve_for(local.settings.local_dir))
    if not room or sum(shard.size for shard in shards) <= min(room):
        return 0, 0  # fits as it is: no need to read the catalog's every row
    pinned = {record.id for record in await catalog.datasets() if record.pinned}
    if handle.config.pinned:
        pinned.add(handle.id)
    free = min(room)
    chosen = displaced_for(shards, handle.id, await catalog.entries(), free=free, pinned=pinned,
                           leased=await catalog.leased())
    victims = await catalog.mark_evicting(handle.id, [entry.key for entry in chosen], local.owner) if chosen else []
    await local.delete_victims(victims)
    size = sum(victim.size for victim in victims)
    if victims:
        logger.info(
            "dataset %s: evicted %d of its shards not asked for (%s) to make room for those asked for",
            handle.id, len(victims), format_bytes(size),
        )
    return len(victims), size


async def _under_locks(
    local: LocalStager, handle: DatasetHandle, shards: Sequence[Shard], turn: Turn
) -> dict[str, Outcome]:
    """Stage the shards whose node locks this process holds; those left out go the one-shard way."""
    outcomes: dict[str, Outcome] = dict(await local.hits(handle, shards))  # staged by another just before
    missing = [shard for shard in shards if shard.key not in outcomes]
    if not missing:
        return outcomes
    local.events.count("misses", len(missing))
    claims = [Claim(shard.key, shard.size, shard.version) for shard in missing]
    await turn.wait()
    try:
        reservations = await local.catalog.reserve_many(handle.id, claims, await local.room(handle))
    except TierFullError as exc:  # the catalog itself found no room
        turn.release()
        for shard in missing:
            outcomes[shard.key] = await local.bypass(handle, shard, str(exc))
        return outcomes
    turn.release()
    await local.delete_victims([victim for reservation in reservations for victim in reservation.victims])
    granted = [shard for shard, reservation in zip(missing, reservations, strict=True) if reservation.granted]
    for shard, reservation in zip(missing, reservations, strict=True):
        # A row another live process holds: left to the one-shard way, once these locks are released.
        if not reservation.granted and not _held_elsewhere(reservation):
            outcomes[shard.key] = await local.bypass(handle, shard, reservation.reason)
    outcomes.update(await _transfer(local, handle, granted))
    return outcomes


def _held_elsewhere(reservation: Reservation) -> bool:
    return reservation.reason.startswith(("being staged by", "being evicted by"))


async def _transfer(local: LocalStager, handle: DatasetHandle, shards: Sequence[Shard]) -> dict[str, Outcome]:
    """Bring the reserved ``shards`` in: small ones read and written together, large ones one by one."""
    small_limit = min(local.transfer.keep_limit, SMALL)
    small = [shard for shard in shards if shard.size <= small_limit]
    large = [shard for shard in shards if shard.size > small_limit]
    outcomes: dict[str, Outcome] = {}
    committed: set[str] = set()
    try:
        fetched = await _fetch_all(local, handle, small)
        whole = [(shard, got) for shard, got in zip(small, fetched, strict=True) if isinstance(got, tuple)]
        for shard, got in zip(small, fetched, strict=True):
            if isinstance(got, BaseException):
                outcomes[shard.key] = got
        outcomes.update(await _write(local, handle, whole))
        committed.update(key for key, outcome in outcomes.items() if isinstance(outcome, Location))
        for shard in large:
            try:
                outcomes[shard.key] = await local.transfer_in(handle, shard)
            except Exception as exc:
                outcomes[shard.key] = exc
            committed.add(shard.key)  # committed or abandoned by `transfer_in` itself
    finally:
        # Rows of shards not committed: abandoned (a cancellation included), their room freed.
        left = [shard.key for shard in shards if shard.key not in committed]
        await asyncio.shield(local.catalog.abandon_many(handle.id, left, local.owner))
    for key, outcome in list(outcomes.items()):
        if isinstance(outcome, Exception) and not _final(outcome):
            del outcomes[key]  # a full device, a bad shared copy: the one-shard way knows what to do
    return outcomes


def _final(error: BaseException) -> bool:
    return isinstance(error, _FINAL) or (isinstance(error, ChecksumMismatchError) and "from the origin" in str(error))


async def _fetch_all(
    local: LocalStager, handle: DatasetHandle, shards: Sequence[Shard]
) -> list[tuple[bytes, str, str] | BaseException]:
    """Each small shard's verified bytes, checksum and source.

    From an origin on this machine, all in one thread job; else ``concurrency`` reads at once.
    """
    quick: list[tuple[bytes, str] | Exception | None] = (
        [None] * len(shards) if local.through_shared else await local.transfer.fetch_local(handle, shards)
    )
    rest = [shard for shard, got in zip(shards, quick, strict=True) if got is None]
    gate = asyncio.Semaphore(local.settings.concurrency)
    slow = iter(await asyncio.gather(*(_fetch(local, handle, shard, gate) for shard in rest), return_exceptions=True))
    return [
        (got[0], got[1], ORIGIN) if isinstance(got, tuple) else got if got is not None else next(slow)
        for got in quick
    ]


async def _fetch(
    local: LocalStager, handle: DatasetHandle, shard: Shard, gate: asyncio.Semaphore
) -> tuple[bytes, str, str]:
    """The shard's verified bytes, their checksum, and which tier they came from."""
    async with gate:
        source, source_key, expected, source_name = await local.source(handle, shard, learned=False)
        data, checksum = await local.transfer.fetch(handle, shard, source, source_key, expected, source_name)
    return data, checksum, source_name


async def _write(
    local: LocalStager, handle: DatasetHandle, fetched: Sequence[tuple[Shard, tuple[bytes, str, str]]]
) -> dict[str, Outcome]:
    """Write the fetched shards at once, durable, then commit them in one transaction."""
    items = [
        (
            handle.tier_key(shard.key),
            data,
            {"dataset": handle.id, "key": shard.key, "version": str(shard.version), "size": str(shard.size)}
            | {"checksum": checksum},
        )
        for shard, (data, checksum, _) in fetched
    ]
    landed = await local.tier.put_many(items)
    done = [
        (shard, checksum, source_name, path)
        for (shard, (_, checksum, source_name)), path in zip(fetched, landed, strict=True)
        if isinstance(path, Path)
    ]
    staged = [(shard.key, shard.size, shard.version, checksum) for shard, checksum, _, _ in done]
    await local.catalog.commit_many(handle.id, staged)
    outcomes: dict[str, Outcome] = {
        shard.key: error for (shard, _), error in zip(fetched, landed, strict=True) if isinstance(error, Exception)
    }
    for shard, checksum, source_name, path in done:
        local.events.count("shards_staged")
        local.events.count("bytes_to_local", shard.size)
        local.events.emit(StagingEvent("staged", handle.id, shard.key, LOCAL, source_name, shard.size))
        outcomes[shard.key] = Location(LOCAL, path, shard, checksum)
    return outcomes


async def _one_by_one(local: LocalStager, handle: DatasetHandle, shards: Sequence[Shard]) -> list[Outcome]:
    gate = asyncio.Semaphore(local.settings.concurrency)

    async def one(shard: Shard) -> Outcome:
        async with gate:
            return await _one_by_one_shard(local, handle, shard)

    return list(await asyncio.gather(*(one(shard) for shard in shards)))


async def _one_by_one_shard(local: LocalStager, handle: DatasetHandle, shard: Shard) -> Outcome:
    try:
        return await local.stage(handle, shard)
    except Exception as exc:
        return exc


class WarmBatches:
    """A warm's ``submit``: shards gathered into batches as they are submitted, `IN_FLIGHT` batches at a time.

    Used as an async context: leaving it cancels the batches still running (their rows are
    abandoned, their temporary files removed, their locks released).
    """

    def __init__(self, stage: Callable[[Sequence[Shard], Turn], Awaitable[list[Outcome]]]) -> None:
        self._stage = stage
        self._last: Turn | None = None  # the latest batch's: the next one reserves after it
        self._pending: deque[tuple[Shard, asyncio.Future[Location]]] = deque()
        self._running: set[asyncio.Task[None]] = set()

    async def submit(self, shard: Shard, priority: float) -> Location:
        future: asyncio.Future[Location] = asyncio.get_running_loop().create_future()
        self._pending.append((shard, future))
        self._start()
        return await future

    def _start(self) -> None:
        while self._pending and len(self._running) < IN_FLIGHT:
            batch: list[tuple[Shard, asyncio.Future[Location]]] = []
            size = 0
            while self._pending and len(batch) < BATCH_SHARDS and (not batch or size < BATCH_BYTES):
                shard, future = self._pending.popleft()
                if not future.done():  # its warm was cancelled meanwhile
                    batch.append((shard, future))
                    size += shard.size
            if not batch:
                return
            self._last = turn = Turn(self._last)
            task = asyncio.get_running_loop().create_task(self._run(batch, turn))
            self._running.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        if not task.cancelled():
            self._start()

    async def _run(self, batch: list[tuple[Shard, asyncio.Future[Location]]], turn: Turn) -> None:
        try:
            outcomes = await self._stage([shard for shard, _ in batch], turn)
        except Exception as exc:
            outcomes = [exc] * len(batch)
        finally:
            turn.release()
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():
                continue
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    async def __aenter__(self) -> WarmBatches:
        return self

    async def __aexit__(self, *exc: object) -> None:
        running = set(self._running)
        for task in running:
            task.cancel()
        for task in running:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()

