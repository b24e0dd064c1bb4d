"""Ensuring one planned unit: keep a verified copy from an earlier run, or pack and record it.

Once a unit and its index are stored, a small record (size, checksum, plan
digest) is written under ``.datacache-shard-done/``: the commit point a rerun
trusts, after re-reading the unit and checking its checksum. The packers
know nothing of records or of each other; this module finds the run's one
through its source format (`datacache.shard.rechunk.rechunker_for`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from datacache.checksum import checksum_of, new_hasher
from datacache.counting.tarindex import INDEX_SUFFIX
from datacache.errors import ShardNotFoundError
from datacache.shard.job import Endpoint, ObjectCallback, PackIO, ShardJob, UnitResult, put_bytes, record_key
from datacache.shard.plan import UnitSpec
from datacache.shard.rechunk import Rechunker, rechunker_for
from datacache.tiers import Tier

__all__ = ["ensure_unit", "remove_stale_units", "run_unit_sync"]

logger = logging.getLogger("datacache.shard")


async def _hash_object(tier: Tier, key: str) -> tuple[int, str]:
    hasher = new_hasher()
    size = 0
    async for chunk in tier.stream(key):
        hasher.update(chunk)
        size += len(chunk)
    return size, checksum_of(hasher)


async def _record_of(spec: UnitSpec, dest: Tier) -> dict[str, Any] | None:
    """The record an earlier run wrote for ``spec.key``: None when there is none; ``{}`` when unreadable."""
    try:
        record = json.loads(await dest.get(record_key(spec.key)))
    except ShardNotFoundError:
        return None
    except ValueError:
        logger.warning("shard %s: unreadable record, packing it again", spec.key)
        return {}
    return record if isinstance(record, dict) else {}


async def _kept(spec: UnitSpec, dest: Tier, rechunker: Rechunker, record: dict[str, Any]) -> UnitResult | None:
    """Return the unit as recorded if its record matches the plan and its bytes verify."""
    if record.get("digest") != spec.digest:
        logger.info("shard %s: planned differently last time, packing it again", spec.key)
        return None
    size, checksum = record.get("size"), record.get("checksum")
    if not isinstance(size, int) or not isinstance(checksum, str):
        return None
    info = await dest.stat(spec.key)
    if info is None or info.size != size or (spec.size is not None and spec.size != size):
        logger.warning("shard %s: missing or of the wrong size, packing it again", spec.key)
        return None
    found_size, found = await _hash_object(dest, spec.key)
    if found_size != size or found != checksum:
        logger.warning(
            "shard %s: checksum mismatch (%s, recorded %s), packing it again",
            spec.key,
            found,
            checksum,
        )
        return None
    await rechunker.kept(spec, dest, size)
    return UnitResult(
        spec.key, size, checksum, spec.samples, spec.objects, spec.input_bytes, written=False
    )


async def ensure_unit(
    spec: UnitSpec,
    job: ShardJob,
    source: Tier,
    dest: Tier,
    *,
    has_record: bool,
    limiter: asyncio.Semaphore | None = None,
    on_object: ObjectCallback | None = None,
) -> UnitResult:
    """Make sure ``spec`` is stored and recorded at ``dest``; return what the manifest needs.

    A unit with a record from an earlier run (``has_record``) is kept when
    its record carries the same plan digest and its bytes match the recorded
    size and checksum; anything else is packed again (atomically replacing
    what was there).
    """
    rechunker = rechunker_for(job.source_format)
    replaced = False
    record = await _record_of(spec, dest) if has_record else None
    if record is not None:
        kept = await _kept(spec, dest, rechunker, record)
        if kept is not None:
            return kept
        # Another plan's unit (or one no record describes) is overwritten: not the same bytes again.
        replaced = record.get("digest") != spec.digest
    io = PackIO(source, dest, limiter or asyncio.Semaphore(job.options.concurrency), on_object or _ignore)
    size, checksum = await rechunker.pack(spec, job, io)
    record = {
        "key": spec.key,
        "digest": spec.digest,
        "size": size,
        "checksum": checksum,
        "samples": spec.samples,
    }
    await put_bytes(dest, record_key(spec.key), json.dumps(record, sort_keys=True).encode())
    logger.debug("shard %s: %d bytes, %d samples, %s", spec.key, size, spec.samples, checksum)
    return UnitResult(
        spec.key, size, checksum, spec.samples, spec.objects, spec.input_bytes, written=True, replaced=replaced
    )


def _ignore(objects: int, nbytes: int) -> None:
    return None


async def _run_alone(spec: UnitSpec, has_record: bool, job: ShardJob) -> UnitResult:
    source = job.source.open(writable=False)
    dest = job.dest.open(writable=True)
    try:
        return await ensure_unit(spec, job, source, dest, has_record=has_record)
    finally:
        await source.close()
        await dest.close()


def run_unit_sync(spec: UnitSpec, has_record: bool, job: ShardJob) -> UnitResult:
    """Ensure one unit from synchronous code (a Dask or Ray task), on an event loop of its own."""
    return asyncio.run(_run_alone(spec, has_record, job))


async def remove_stale_units(dest: Endpoint, keys: set[str]) -> int:
    """Delete what an earlier run wrote for units this run did not: each one's file, index and record.

    Called once the new manifest is written (it names none of them), so a reader that lists the
    output sees this run's shards only. Only units a record names are touched, never another file;
    a unit whose size is not the recorded one was written by someone else since, and is kept.
    """
    removed = 0
    tier = dest.open(writable=True)
    try:
        for key in sorted(keys):
            try:
                record = json.loads(await tier.get(record_key(key)))
            except (ShardNotFoundError, ValueError):
                continue
            info = await tier.stat(key)
            if info is not None and (not isinstance(record, dict) or info.size != record.get("size")):
                logger.warning("%s: not the shard an earlier run recorded; kept", key)
                continue
            for name in (key, key + INDEX_SUFFIX, record_key(key)):  # the record last: it names the rest
                await tier.delete(name)
            removed += 1
    finally:
        await tier.close()
    if removed:
        logger.info("removed %d shards of an earlier run that this run's manifest does not name", removed)
    return removed
