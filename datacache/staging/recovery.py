"""Recovery: repair what killed processes left in the catalog and on disk.

Stale catalog rows, files that vanished or changed under the catalog,
abandoned partial files (local, shared, manifests), and files on the local
tier the catalog does not know (adopted when their bytes hash to the checksum their
metadata records).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path

from datacache.catalog import Catalog
from datacache.checksum import checksum_of, new_hasher
from datacache.config import Settings
from datacache.errors import DatacacheError, InvalidKeyError
from datacache.locks import NodeLock
from datacache.staging.sessions import forget_dead_sessions
from datacache.tiers import LocalTier, SharedTier
from datacache.tiers.files import Place, remove_abandoned_partials

__all__ = ["manifest_dirs", "reconcile"]

logger = logging.getLogger(__name__)


async def reconcile(
    settings: Settings,
    local: LocalTier,
    shared: SharedTier | None,
    catalog: Catalog,
    *,
    owner: str,
    shard_lock: Callable[[str, str], NodeLock],
    clean: bool = False,
) -> dict[str, int]:
    """Repair the local tier and its catalog; return what was repaired, by kind (``clean``: see below).

    Runs under a node lock taken without waiting: if another process is
    reconciling, this one leaves it the job. Staging goes on meanwhile, so a
    file missing from the catalog's snapshot is decided on only under its
    shard's node lock (`shard_lock`, the one a transfer holds), and only if
    the catalog still has no row for it. ``clean``: the tier's last user left it clean
    (`staging.sessions`): only stale rows are looked for, not every file and row (seconds at 1e5).
    """
    counts = {"stale_rows": 0, "missing_files": 0, "partials": 0, "orphans_adopted": 0, "orphans_removed": 0}
    try:
        lock = Place(settings.local_dir, ("locks",), "reconcile.lock", local.dir_mode)
        fd = await asyncio.to_thread(_open_lock, lock)
    except (OSError, InvalidKeyError) as exc:
        logger.warning("not reconciling %s: its lock file cannot be opened safely (%s)", settings.local_dir, exc)
        return counts
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return counts
        if clean:
            await _drop_stale_rows(local, catalog, {}, counts)
            return counts
        files = {info.key: info.size async for info in local.list()}  # one listing, for both passes
        known = await _repair_catalog(local, catalog, files, counts)
        # On the node's own disk the writer's flock is authoritative: no grace period.
        counts["partials"] = await local.remove_abandoned_partials(min_age=0)
        # Manifests are written atomically too; a killed save leaves its temporary file.
        for directory, min_age in manifest_dirs(settings):
            place = Place(directory.parent, (directory.name,), ".")  # its own path is not followed either
            removed = await asyncio.to_thread(remove_abandoned_partials, place, min_age=min_age)
            counts["partials"] += len(removed)
        for name in files:
            dataset, _, key = name.partition("/")
            if (dataset, key) in known or not key:
                continue
            async with shard_lock(dataset, key).hold():
                if await catalog.get(dataset, key) is not None:
                    continue  # staged (or being staged) since the snapshot: not an orphan
                adopted = await _adopt(local, catalog, owner, dataset, key)
            counts["orphans_adopted" if adopted else "orphans_removed"] += 1
        if shared is not None:
            counts["partials"] += await shared.remove_abandoned_partials()
        await asyncio.to_thread(forget_dead_sessions, settings.local_dir, local.dir_mode)
    finally:
        os.close(fd)
    if any(counts.values()):
        logger.info("reconciled the local tier: %s", counts)
    return counts


def _open_lock(place: Place) -> int:
    """Open (create) the reconcile lock file: no link followed, in its directory or on the way to it."""
    directory = place.open_parent(create=True)
    try:
        return os.open(place.name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600, dir_fd=directory)
    finally:
        os.close(directory)


async def _repair_catalog(
    local: LocalTier, catalog: Catalog, files: dict[str, int], counts: dict[str, int]
) -> set[tuple[str, str]]:
    """Drop rows of transfers whose owner died, and rows whose file vanished or changed size.

    ``files``: the size of each file of the tier, by key, from one listing taken before the
    catalog is read (a file staged since is in the catalog, not missing from it). Returns
    the (dataset, key) pairs the catalog knew after dropping stale rows: a file whose row
    was dropped for a wrong size is not an orphan to adopt.
    """
    await _drop_stale_rows(local, catalog, files, counts)
    known: set[tuple[str, str]] = set()
    suspects: list[tuple[str, str, int]] = []
    for dataset, key, size, state in await catalog.sizes():  # tuples: 1e5 entries took a second
        known.add((dataset, key))
        if state == "resident" and files.get(f"{dataset}/{key}", -1) != size:
            suspects.append((dataset, key, size))
    # Looked at again: a shard staged after the listing is in place now.
    sizes = await asyncio.to_thread(_sizes, local, [f"{dataset}/{key}" for dataset, key, _ in suspects])
    wrong = [(dataset, key) for (dataset, key, size), now in zip(suspects, sizes, strict=True) if now != size]
    await catalog.remove_many(wrong)
    counts["missing_files"] += len(wrong)
    return known


async def _drop_stale_rows(local: LocalTier, catalog: Catalog, files: dict[str, int], counts: dict[str, int]) -> None:
    """Drop the rows (and files) of transfers whose owner died."""
    stale = await catalog.stale_entries()
    for entry in stale:
        await local.delete(f"{entry.dataset}/{entry.key}")
        files.pop(f"{entry.dataset}/{entry.key}", None)
    await catalog.remove_many([(entry.dataset, entry.key) for entry in stale])
    counts["stale_rows"] += len(stale)


def _sizes(local: LocalTier, keys: list[str]) -> list[int]:
    """Each file's size now, -1 if it is not there or cannot be reached safely (blocking)."""
    sizes = []
    for key in keys:
        try:
            sizes.append(os.lstat(local.path(key)).st_size)
        except (FileNotFoundError, DatacacheError):
            sizes.append(-1)
    return sizes


def manifest_dirs(settings: Settings) -> list[tuple[Path, float]]:
    """The manifest directories, each with the grace period its partial files get."""
    found = [(settings.local_dir / "manifests", 0.0)]
    if settings.shared_dir is not None:
        found.append((settings.shared_dir / "manifests", 30.0))
    return found


async def _adopt(local: LocalTier, catalog: Catalog, owner: str, dataset: str, key: str) -> bool:
    """Catalog an unknown local file whose bytes hash to the checksum its metadata records; delete it otherwise.

    The metadata alone proves nothing: a file half-rewritten, or planted with a copied
    meta file, would be served as whole. Hashing costs one read of a file a killed
    process left, once.
    """
    full = await local.stat(f"{dataset}/{key}")
    metadata = full.metadata if full is not None else {}
    if (
        full is not None
        and metadata.get("checksum")
        and metadata.get("size") == str(full.size)
        and await _hashes_to(local, f"{dataset}/{key}", metadata["checksum"])
    ):
        reservation = await catalog.reserve(
            dataset,
            key,
            size=full.size,
            version=metadata.get("version"),
            owner=owner,
            capacity=None,
            device_free=lambda: None,
            reserve_free=0,
            choose=lambda *_: [],
        )
        if reservation.granted:
            version = metadata.get("version")
            await catalog.commit(
                dataset, key, size=full.size, version=None if version == "None" else version,
                checksum=metadata["checksum"],
            )
            return True
    await local.delete(f"{dataset}/{key}")
    return False


async def _hashes_to(local: LocalTier, key: str, checksum: str) -> bool:
    """Whether the local file ``key`` hashes to ``checksum`` (read through a descriptor: no link followed)."""
    hasher = new_hasher()
    try:
        async for chunk in local.stream(key):
            hasher.update(chunk)
    except (OSError, DatacacheError) as exc:
        logger.info("orphan %s cannot be hashed: %s", key, exc)
        return False
    return checksum_of(hasher) == checksum
