"""Reading on while the node's daemon is away, for a reader who may not write the daemon's cache.

On a node whose cache belongs to the daemon's account (deploy/slurm), a job user's process
cannot stage into it: the fallback of `datacache.access.FailoverAccess` is then an
`OutageAccess`. Shards the daemon left resident are read where they are, read-only, once a
trusted uid's metadata beside them vouches for this manifest's version (and their bytes are
checked against its checksum, as every local copy is); every other shard is staged by an
in-process `Stager` into a directory of this uid's own, ``$TMPDIR/datacache-<uid>/outage-...``
(0700, checked to be this user's), within a bound: the daemon's capacity, and at most half of
that filesystem's free space. The manifests are the daemon's own snapshots, so that a DataLoader
worker started while the daemon is away plans the same epoch as the ranks that opened through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from datacache.checksum import checksum_of, hash_file, new_hasher
from datacache.config import DatasetConfig, Settings, resolve_dataset
from datacache.errors import DatacacheError, InvalidKeyError
from datacache.manifest import MAX_MANIFEST_BYTES, Manifest
from datacache.sizes import format_bytes
from datacache.staging import (
    PRIORITY_PREFETCH,
    PRIORITY_URGENT,
    DatasetHandle,
    FutureOrder,
    Location,
    ReaderProgress,
    Stager,
)
from datacache.staging.shared import shared_copy_matches
from datacache.tiers import ByteRange, LocalTier
from datacache.tiers.local import GROUP_READABLE

__all__ = ["OutageAccess", "OutageNotice", "cannot_stage_into", "outage_dir", "outage_path", "remove_outage_copies"]

logger = logging.getLogger(__name__)

OUTAGE_MODE = "embedded (daemon unavailable)"


def cannot_stage_into(local_dir: Path) -> bool:
    """Whether ``local_dir`` exists and this process may not write it (it is the node daemon's)."""
    return local_dir.exists() and not os.access(local_dir, os.W_OK | os.X_OK)


def _own_private_dir(path: Path) -> None:
    """Make ``path`` (0700), or check the one there is this uid's, a real directory, closed to others."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    else:
        os.chmod(path, 0o700)
        return
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise DatacacheError(
            f"{path} is not a private directory of uid {os.getuid()} (owner uid {info.st_uid}, mode "
            f"{stat.S_IMODE(info.st_mode):04o}): remove it, or set TMPDIR to a directory of your own"
        )


def outage_path(node_cache: Path, kind: str = "outage") -> Path:
    """Where this uid's own directory for the daemon of ``node_cache`` is (made by `outage_dir`).

    ``kind`` ``"outage"``: what it stages while the daemon is away (removed once it is back);
    ``"own"``: datasets the daemon does not serve this uid, its own cache of them (kept).
    """
    tag = hashlib.sha256(str(node_cache.absolute()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"datacache-{os.getuid()}" / f"{kind}-{tag}"


def outage_dir(node_cache: Path, kind: str = "outage") -> Path:
    """This uid's own directory for what it stages while the daemon of ``node_cache`` is away (or ``kind``)."""
    path = outage_path(node_cache, kind)
    _own_private_dir(path.parent)
    return path


def _lock_of(place: Path) -> Path:
    """Beside the outage directory, never removed with it: each `OutageAccess` holds it shared."""
    return place.with_name(f"{place.name}.lock")


def _hold(place: Path, how: int) -> int | None:
    """A descriptor of ``place``'s lock, flocked ``how``; None where it is taken the other way (non-blocking)."""
    fd = os.open(_lock_of(place), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_outage_copies(node_cache: Path) -> bool:
    """Remove what this uid staged while the daemon of ``node_cache`` was away, once no process of it uses it.

    Called where the daemon answers again (a reader's access opened or closed then). Every
    `OutageAccess` holds the directory's lock shared while it lives (its reads, its leases, its
    DataLoader workers' copies mapped): the directory goes only when the lock is had exclusively.
    Until then it stays, bounded, and the next outage reuses it.
    """
    place = outage_path(node_cache)
    if not place.exists():
        return False
    try:
        _own_private_dir(place.parent)
        fd = _hold(place, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (OSError, DatacacheError) as exc:
        logger.debug("cannot take the lock of %s: %s", place, exc)
        return False
    if fd is None:
        return False  # a process of this uid still reads through it
    try:
        shutil.rmtree(place)
    except OSError as exc:
        logger.debug("cannot remove %s: %s", place, exc)
        return False
    finally:
        os.close(fd)
    logger.info("the daemon of %s is back: removed this user's copies of its outage, %s", node_cache, place)
    return True


def _started(pid: int) -> str:
    """When ``pid`` started (clock ticks since boot, Linux), so that a reused pid is another owner."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            return stat_file.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return "0"


def _prune_notices(directory: Path) -> None:
    """Remove the markers of training processes that have ended (killed in an outage: none said it was over)."""
    for marker in directory.glob("outage-*.notice-*"):
        owner, _, started = marker.name.rsplit(".notice-", 1)[1].partition("-")
        if owner.isdigit() and _started(int(owner)) != started:
            with contextlib.suppress(OSError):
                marker.unlink()


class OutageNotice:
    """Says that the daemon is away once per training process and outage, however many workers it starts.

    torch's DataLoader starts new worker processes every epoch, each with an access of its own: each
    would say the same again. The first to notice an outage makes a marker in this uid's private
    directory, named for the node's cache and the ``owner`` (the worker's training process, else
    this one), and says it; the others log it at debug level. The first to find the daemon back
    removes the marker and says so, and a new outage is said again.
    """

    def __init__(self, node_cache: Path, owner: int | None = None) -> None:
        self.node_cache = node_cache
        self.owner = os.getpid() if owner is None else owner

    def __getstate__(self) -> dict[str, object]:
        return {"node_cache": self.node_cache, "owner": self.owner}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["node_cache"], state["owner"])  # type: ignore[misc]

    def _marker(self, kind: str) -> Path:
        place = outage_path(self.node_cache)
        return place.with_name(f"{place.name}.{kind}.notice-{self.owner}-{_started(self.owner)}")

    def say(self, message: str, *args: object, kind: str = "outage") -> None:
        """Log a notice of the outage (``kind``: which), unless a process of this owner said it in this outage."""
        try:
            marker = self._marker(kind)
            _own_private_dir(marker.parent)
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        except FileExistsError:
            logger.debug(message, *args)
            return
        except (OSError, DatacacheError):
            pass  # no private directory to mark it in: said by each process, as before
        logger.warning(message, *args)
        if kind == "outage":
            _prune_notices(marker.parent)

    def over(self, message: str, *args: object) -> None:
        """The daemon answers again: said by the one process that ends the outage's marker."""
        with contextlib.suppress(OSError):
            os.unlink(self._marker("where"))
        try:
            os.unlink(self._marker("outage"))
        except OSError:
            logger.debug(message, *args)
            return
        logger.warning(message, *args)


def outage_capacity(settings: Settings, directory: Path) -> int:
    """The bound of the private directory: the daemon's capacity, and half the free space where it is."""
    probe = directory if directory.exists() else directory.parent
    bound = max(shutil.disk_usage(probe).free // 2, 1)
    if settings.local_capacity is not None:
        bound = min(bound, settings.local_capacity)
    return bound


def _read_snapshot(directory: Path, dataset_id: str, trusted: frozenset[int]) -> Manifest | None:
    """The newest snapshot of ``dataset_id`` the daemon wrote for its clients, if a trusted uid wrote it."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        newest: tuple[int, str] | None = None
        for name in os.listdir(fd):
            if not (name.startswith(f"{dataset_id}@") and name.endswith(".json")):
                continue
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISREG(info.st_mode) and info.st_uid in trusted and info.st_size <= MAX_MANIFEST_BYTES:
                newest = max(newest or (info.st_mtime_ns, name), (info.st_mtime_ns, name))
        if newest is None:
            return None
        file = os.open(newest[1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        with os.fdopen(file, "rb") as handle:
            raw = handle.read(MAX_MANIFEST_BYTES + 1)
        manifest = Manifest.from_json(json.loads(raw), str(directory / newest[1]))
    except (OSError, ValueError, DatacacheError) as exc:
        logger.debug("no usable snapshot of %s under %s: %s", dataset_id, directory, exc)
        return None
    finally:
        os.close(fd)
    return manifest if manifest.dataset == dataset_id else None


class OutageAccess:
    """A `ShardAccess` over the daemon's resident copies (read-only) and a private `Stager` for the rest.

    Parameters
    ----------
    settings
        The reader's settings (``local_dir`` is the daemon's cache; ``local_capacity`` its capacity).
    """

    def __init__(self, settings: Settings, notice: OutageNotice | None = None, *, kind: str = "outage") -> None:
        self.settings = settings
        self.notice = notice
        self.kind = kind
        self.node = LocalTier(settings.local_dir, modes=GROUP_READABLE)
        self._trusted = settings.trusted_uids
        private = outage_dir(settings.local_dir, kind)
        # Held until `close`: the directory is not removed under this process (`remove_outage_copies`).
        self._in_use = _hold(private, fcntl.LOCK_SH)
        self.private_settings = settings.with_overrides(
            local_dir=private, local_capacity=outage_capacity(settings, private)
        )
        # Readers of a daemon never reconcile its catalog; this private one is theirs alone, as an
        # embedded worker's: the next stager of this uid that reconciles repairs what a kill left.
        self.private = Stager(self.private_settings, reconcile=False)
        self._verified: dict[str, tuple[int, int, int]] = {}
        self._bad: set[str] = set()
        where = (
            "the node cache %s is the daemon's: reading its resident shards there and staging the rest "
            "in %s (at most %s) until the daemon is back"
        )
        capacity = self.private_settings.local_capacity
        where_args = (settings.local_dir, private, format_bytes(capacity) if capacity is not None else "no bound")
        if kind != "outage":
            logger.debug(where, *where_args)  # a dataset the daemon does not serve: said as such (FailoverAccess)
        elif notice is None:
            logger.warning(where, *where_args)
        else:
            notice.say(where, *where_args, kind="where")

    def __getstate__(self) -> dict[str, object]:
        return {"settings": self.settings, "notice": self.notice, "kind": self.kind}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"], state["notice"], kind=state["kind"])  # type: ignore[misc]

    @property
    def mode(self) -> str:
        return OUTAGE_MODE

    # -- the daemon's resident copies -----------------------------------------------------

    async def _resident(self, handle: DatasetHandle, key: str) -> Location | None:
        """The daemon's copy of ``key`` where this user may read it, vouched for this version; else None."""
        shard = handle.manifest.shard(key)
        tier_key = handle.tier_key(key)
        if tier_key in self._bad:
            return None
        try:
            info = await self.node.stat(tier_key)
        except (InvalidKeyError, OSError):
            return None
        if info is None or not shared_copy_matches(info, handle.id, shard, self._trusted):
            return None
        checksum = info.metadata.get("checksum")
        path = self.node.path(tier_key)
        if not os.access(path, os.R_OK):
            return None
        if not self.settings.verify_on_read and not await asyncio.to_thread(self._verify, tier_key, path, checksum):
            return None
        return Location("local", path, shard, checksum)

    def _verify(self, tier_key: str, path: Path, checksum: str | None) -> bool:
        """Hash the copy once per file this process sees (the loader hashes it itself when it verifies)."""
        try:
            info = os.stat(path)
        except OSError:
            return False
        identity = (info.st_ino, info.st_size, info.st_mtime_ns)
        if self._verified.get(tier_key) == identity:
            return True
        if checksum is None or hash_file(path) != checksum:
            self._bad.add(tier_key)
            return False
        self._verified[tier_key] = identity
        return True

    # -- the ShardAccess verbs ------------------------------------------------------------

    async def open(self, dataset: DatasetConfig | str, *, refresh: bool = False) -> DatasetHandle:
        """The daemon's latest snapshot of ``dataset`` when it left one this user may read; else listed now."""
        config = dataset if isinstance(dataset, DatasetConfig) else resolve_dataset(dataset, self.settings)
        if not refresh:
            snapshots = self.settings.local_dir / "daemon" / "manifests"
            manifest = await asyncio.to_thread(_read_snapshot, snapshots, config.id, self._trusted)
            if manifest is not None:
                await self.private.manifests.save(manifest)
        return await self.private.open(config, refresh=refresh)

    async def ensure(
        self,
        handle: DatasetHandle,
        key: str,
        *,
        tier: str = "local",
        priority: float = PRIORITY_URGENT,
        early: bool = False,
    ) -> Location:
        if tier == "local":
            found = await self._resident(handle, key)
            if found is not None:
                return found
        return await self.private.ensure(handle, key, tier=tier, priority=priority, early=early)

    async def prefetch(
        self, handle: DatasetHandle, keys: Sequence[str], *, priority: float = PRIORITY_PREFETCH
    ) -> None:
        missing = [key for key in keys if await self._resident(handle, key) is None]
        if missing:
            await self.private.prefetch(handle, missing, priority=priority)

    async def set_future_order(self, handle: DatasetHandle, keys: Iterable[str] | FutureOrder) -> None:
        await self.private.set_future_order(handle, keys)

    async def note_progress(
        self, handle: DatasetHandle, progress: ReaderProgress, *, locate: Sequence[str] = ()
    ) -> list[Location]:
        found = {key: await self._resident(handle, key) for key in locate}
        rest = [key for key, location in found.items() if location is None]
        located = dict(zip(rest, await self.private.note_progress(handle, progress, locate=rest), strict=True))
        return [found[key] or located[key] for key in locate]

    async def locate(self, handle: DatasetHandle, key: str) -> Location:
        return await self._resident(handle, key) or await self.private.locate(handle, key)

    async def read(self, handle: DatasetHandle, key: str, byte_range: ByteRange | None = None) -> bytes:
        found = await self._resident(handle, key)
        if found is not None:
            try:
                data = await self.node.get(handle.tier_key(key), byte_range)
            except (OSError, DatacacheError):
                data = None
            whole = byte_range is None or byte_range == ByteRange()
            if data is not None and not whole:
                return data
            if data is not None and len(data) == found.shard.size and (
                found.checksum is None or _checksum_of(data) == found.checksum
            ):
                return data
            self._bad.add(handle.tier_key(key))
        return await self.private.read(handle, key, byte_range)

    async def report_corrupt(self, handle: DatasetHandle, location: Location) -> None:
        """A copy of the daemon's is never dropped here (it is not this user's): it is not read again."""
        if location.path is not None and location.path == self.node.path(handle.tier_key(location.shard.key)):
            logger.warning(
                "dataset %s: the daemon's copy of %r is corrupt; reading around it", handle.id, location.shard.key
            )
            self._bad.add(handle.tier_key(location.shard.key))
            return
        await self.private.report_corrupt(handle, location)

    def origin_retries(self) -> int:
        return self.private.origin_retries()

    async def close(self) -> None:
        try:
            await self.private.close()
        finally:
            if self._in_use is not None:
                in_use, self._in_use = self._in_use, None
                os.close(in_use)


def _checksum_of(data: bytes) -> str:
    hasher = new_hasher()
    hasher.update(data)
    return checksum_of(hasher)
