"""One warm: stage a dataset's shards onto a tier and report exactly what is resident.

`Stager.warm` runs it in the process; the daemon runs the very same, handing
its prefetch gate as ``submit`` and streaming ``progress`` to its client. What
differs between them is how a shard's transfer is admitted, never what a warm
means: the optional per-warm bandwidth cap, the re-check that a shard staged
early was not evicted by a later one, and the counts in the `WarmReport`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

from datacache._rate import TokenBucket
from datacache.catalog import CatalogEntry, ShardState
from datacache.errors import TierFullError
from datacache.manifest import Shard
from datacache.sizes import format_bytes
from datacache.staging.events import Events
from datacache.staging.types import PRIORITY_PREFETCH, WARMING, DatasetHandle, Location, StagingEvent, WarmReport

__all__ = [
    "Submit", "WarmProgress", "WarmSteps", "bypass_reason", "check_fits", "displaced_for", "run_warm"
]

Submit = Callable[[Shard, float], Awaitable[Location]]
"""Start (or join) one shard's transfer at a priority; resolve to where the shard is."""


@dataclass(frozen=True)
class WarmProgress:
    """Where a warm stands, after each shard it finished."""

    shards_done: int
    shards_total: int
    bytes_done: int
    bytes_total: int
    bytes_transferred: int
    seconds: float
    shards_not_kept: int = 0
    """Of ``shards_done``, those the tier did not keep (full, refused): a bar at 100% is not a warm cache."""

    @property
    def rate(self) -> float:
        """Bytes transferred per second so far."""
        return self.bytes_transferred / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class WarmSteps:
    """What a warm asks of whoever runs it (the `Stager`, with or without the daemon's gate)."""

    submit: Submit
    residents: Callable[[Sequence[Shard]], Awaitable[set[str]]]
    """The keys of those of the shards resident on the tier now (asked once, at the end)."""
    verify: Callable[[Shard], Awaitable[bool]] | None
    why_not_kept: Callable[[], str]
    found: Callable[[Sequence[Shard]], Awaitable[set[str]]] | None = None
    """The keys of those of the shards already on the tier, asked for all at once before any is submitted
    (`LocalStager.present`): a resident shard then costs a share of one catalog read, not a task of its own."""


class _Tally:
    """Bytes and shards this warm moved, from the stager's events (other readers' are not counted)."""

    def __init__(self, handle: DatasetHandle, tier: str, keys: set[str]) -> None:
        self._dataset, self._tier, self._keys = handle.id, tier, keys
        self.bytes = 0
        self.staged = 0
        self.bypassed: dict[str, str] = {}
        """Why the tier did not keep a shard, in its own words (a full device, a file too large)."""

    def __call__(self, event: StagingEvent) -> None:
        if event.dataset != self._dataset or event.tier != self._tier or event.key not in self._keys:
            return
        if event.kind == "bypass" and event.error:
            self.bypassed[event.key] = event.error
        elif event.kind == "bytes":
            self.bytes += event.size
        elif event.kind == "staged":
            self.staged += 1


async def run_warm(
    handle: DatasetHandle,
    shards: Sequence[Shard],
    *,
    tier: str,
    events: Events,
    steps: WarmSteps,
    bandwidth: float | None = None,
    progress: Callable[[WarmProgress], None] | None = None,
) -> WarmReport:
    """Stage ``shards`` onto ``tier`` through ``steps``; report what is resident at the end.

    ``bandwidth`` (bytes/s) paces the start of each shard's transfer; ``progress``
    hears after each shard.
    """
    started = time.monotonic()
    tally = _Tally(handle, tier, {shard.key for shard in shards})
    verified = await _verify(shards, steps.verify)
    finished = _reporter(shards, tier, tally, started, progress)
    events.add_listener(tally)
    try:
        found = await _found(shards, steps.found, finished)
        rest = [(index, shard) for index, shard in enumerate(shards) if shard.key not in found]
        staged = iter(await _stage(rest, steps.submit, bandwidth, finished))
    finally:
        events.remove_listener(tally)
    placed, failures = _sorted_out(
        shards, found, staged, tier, lambda key: tally.bypassed.get(key) or steps.why_not_kept()
    )
    resident = resident_bytes = 0
    # Honest to the end: a shard staged early (or found) may have been evicted since, by a later one.
    # A warm that found every shard resident moved nothing and evicted nothing: no second read.
    still = await steps.residents(placed) if rest else {shard.key for shard in placed}
    for shard in placed:
        if shard.key in still:
            resident += 1
            resident_bytes += shard.size
        else:
            failures.append((shard.key, f"evicted from the {tier} tier during the warm-up: {steps.why_not_kept()}"))
    return WarmReport(
        dataset=handle.id,
        tier=tier,
        shards_requested=len(shards),
        shards_resident=resident,
        bytes_requested=sum(shard.size for shard in shards),
        bytes_transferred=tally.bytes,
        shards_transferred=tally.staged,
        shards_verified=verified,
        seconds=time.monotonic() - started,
        failures=tuple(failures),
        bytes_resident=resident_bytes,
    )


def _sorted_out(
    shards: Sequence[Shard],
    found: set[str],
    staged: Iterator[Location | BaseException],
    tier: str,
    why_not_kept: Callable[[str], str],
) -> tuple[list[Shard], list[tuple[str, str]]]:
    """The shards found or placed on ``tier``, and each other's (key, why not): ``staged`` holds the
    outcomes of those not ``found``, in order."""
    placed: list[Shard] = []
    failures: list[tuple[str, str]] = []
    for shard in shards:
        outcome = None if shard.key in found else next(staged)
        if outcome is None or (not isinstance(outcome, BaseException) and outcome.tier == tier):
            placed.append(shard)
        elif isinstance(outcome, BaseException):
            failures.append((shard.key, str(outcome) or type(outcome).__name__))
        else:
            failures.append((shard.key, f"not kept on the {tier} tier: {why_not_kept(shard.key)}"))
    return placed, failures


async def _found(
    shards: Sequence[Shard],
    found: Callable[[Sequence[Shard]], Awaitable[set[str]]] | None,
    finished: Callable[[Sequence[Shard], asyncio.Future[Location] | None], None],
) -> set[str]:
    """The keys of the shards already on the tier, in one look-up (one catalog read); progress heard once."""
    if found is None:
        return set()
    located = await found(shards)
    finished([shard for shard in shards if shard.key in located], None)
    return located


async def _verify(shards: Sequence[Shard], verify: Callable[[Shard], Awaitable[bool]] | None) -> int:
    """Re-hash resident copies (four at a time: it reads whole files); return how many were right."""
    if verify is None:
        return 0
    gate = asyncio.Semaphore(4)

    async def one(shard: Shard) -> bool:
        async with gate:
            return await verify(shard)

    results = await asyncio.gather(*(one(shard) for shard in shards), return_exceptions=True)
    return sum(1 for result in results if result is True)


def _reporter(
    shards: Sequence[Shard],
    tier: str,
    tally: _Tally,
    started: float,
    progress: Callable[[WarmProgress], None] | None,
) -> Callable[[Sequence[Shard], asyncio.Future[Location] | None], None]:
    done = [0, 0, 0]
    total = sum(shard.size for shard in shards)

    def finished(now: Sequence[Shard], outcome: asyncio.Future[Location] | None = None) -> None:
        if not now:
            return
        done[0] += len(now)
        done[1] += sum(shard.size for shard in now)
        if outcome is not None and (
            outcome.cancelled() or outcome.exception() is not None or outcome.result().tier != tier
        ):
            done[2] += len(now)
        if progress is not None:
            elapsed = time.monotonic() - started
            progress(WarmProgress(done[0], len(shards), done[1], total, tally.bytes, elapsed, done[2]))

    return finished


async def _stage(
    shards: Sequence[tuple[int, Shard]],
    submit: Submit,
    bandwidth: float | None,
    finished: Callable[[Sequence[Shard], asyncio.Future[Location] | None], None],
) -> list[Location | BaseException]:
    """Submit every shard (paced by ``bandwidth``), the first ones soonest; gather the outcomes.

    ``shards``: each with its place in the warm (the first ones are the most urgent).
    """
    bucket = TokenBucket(bandwidth) if bandwidth else None
    tasks: list[asyncio.Future[Location]] = []
    try:
        for index, shard in shards:
            if bucket is not None:
                await bucket.take(shard.size)
            warming = WARMING.set(True)  # copied into the task made here, and only there
            try:
                future = asyncio.ensure_future(submit(shard, PRIORITY_PREFETCH + index * 1e-6))
            finally:
                WARMING.reset(warming)
            future.add_done_callback(lambda done, shard=shard: finished((shard,), done))  # type: ignore[misc]
            tasks.append(future)
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    except asyncio.CancelledError:
        for pending in tasks:
            pending.cancel()
        raise
    for outcome in outcomes:
        if isinstance(outcome, asyncio.CancelledError):
            raise outcome
    return list(outcomes)


def check_fits(handle: DatasetHandle, chosen: Sequence[Shard], tier: str, capacity: int | None) -> None:
    """Refuse, before a byte moves, shards that no capacity could ever hold."""
    too_big = [shard for shard in chosen if capacity is not None and shard.size > capacity]
    if too_big and capacity is not None:
        largest = max(too_big, key=lambda shard: shard.size)
        raise TierFullError(
            f"dataset {handle.id}: the {tier} tier's capacity ({format_bytes(capacity)}) is smaller than "
            f"{len(too_big)} of the requested shards "
            f"(the largest, {largest.key!r}, is {format_bytes(largest.size)})"
        )


def bypass_reason(tier: str, capacity: int | None) -> str:
    """Why a warmed shard was not kept on ``tier``."""
    if capacity is not None:
        return f"the {tier} tier (capacity {format_bytes(capacity)}) holds less than the warm-up asked for"
    return f"the {tier} tier's device holds less than the warm-up asked for"


def displaced_for(
    chosen: Sequence[Shard],
    dataset: str,
    entries: Sequence[CatalogEntry],
    *,
    free: int,
    pinned: set[str],
    leased: set[tuple[str, str]],
) -> list[CatalogEntry]:
    """The dataset's resident shards that ``chosen`` leaves out and that must leave for ``chosen`` to fit.

    A warm of some of a dataset's shards (``--shards``) met a tier its other shards filled: no-thrash
    (and Belady, for shards read later) never evicts a dataset's own shards for more of it, so the
    shards asked for were refused. None are displaced when ``chosen`` fits in the ``free`` bytes and
    those eviction may take from other datasets (not pinned, not held by a reader), nor when it would
    not fit even then; else the least recently used first, only as many as it takes.
    ``entries``: the tier's catalog rows.
    """
    if dataset in pinned:
        return []
    wanted = {shard.key for shard in chosen}
    resident = [e for e in entries if e.state == ShardState.RESIDENT]
    held = {e.key for e in resident if e.dataset == dataset}
    missing = sum(shard.size for shard in chosen if shard.key not in held)
    resident = [e for e in resident if (e.dataset, e.key) not in leased]  # what eviction may take
    elsewhere = sum(e.size for e in resident if e.dataset != dataset and e.dataset not in pinned)
    short = missing - free - elsewhere  # free < 0: over capacity, as the reservation counts it too
    unasked = sorted((e for e in resident if e.dataset == dataset and e.key not in wanted), key=lambda e: e.last_access)
    if short <= 0 or sum(e.size for e in unasked) < short:
        return []
    victims: list[CatalogEntry] = []
    for entry in unasked:
        if short <= 0:
            break
        victims.append(entry)
        short -= entry.size
    return victims
