"""`LocalTier`: a node's local NVMe directory with a byte capacity; the modes of all that lives there."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from datacache.tiers._directory import DirectoryTier
from datacache.tiers._dirfd import UnsafeFileError
from datacache.tiers._landing import Landing, open_landing
from datacache.tiers.base import ObjectInfo

from datacache.errors import InvalidKeyError

__all__ = ["GROUP_READABLE", "PRIVATE", "LocalModes", "LocalTier", "make_local_dirs", "make_local_file"]


@dataclass(frozen=True)
class LocalModes:
    """The exact modes of the directories and files on a node's local tier, whatever the umask.

    One place decides them for everything there (the tier's data, the catalog and SQLite's
    ``-wal``/``-shm``, lock files, the daemon's manifests): `make_local_dirs` and `make_local_file`
    create with them, `LocalTier` writes with them.
    """

    dir: int
    file: int


PRIVATE = LocalModes(dir=0o700, file=0o600)
"""One user's cache (embedded, or a sidecar's): nobody else may list or read it."""

GROUP_READABLE = LocalModes(dir=0o750, file=0o640)
"""The per-node daemon's shard files and manifests: its group (the users whose jobs read through
it) opens what it hands them; nobody else. The catalog and locks stay `PRIVATE`."""


def make_local_dirs(path: str | os.PathLike[str], mode: int = PRIVATE.dir) -> Path:
    """Create ``path`` and each of its missing parents with exactly ``mode``, whatever the umask.

    ``Path.mkdir(parents=True)`` gives the parents it makes the umask's mode: with torchrun's
    processes racing to create a fresh cache under umask 022, the root came out 0755. Each
    directory is made 0700 and only then widened to ``mode``; one another process made first is
    left as it is (it made it here, the same way).
    """
    target = Path(path)
    missing: list[Path] = []
    current = target
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            continue
        if mode != 0o700:
            os.chmod(directory, mode)
    return target


def make_local_file(path: str | os.PathLike[str], mode: int = PRIVATE.file) -> Path:
    """Create ``path`` (if missing) with exactly ``mode``, before a library opens it by name.

    SQLite creates its database with 0644 less the umask, and its ``-wal``/``-shm`` with the
    database's own mode: a catalog made here first keeps all three at ``mode``.
    """
    target = Path(path)
    make_local_dirs(target.parent)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return target
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return target


class LocalTier(DirectoryTier):
    """The fastest tier: one directory on the node's local disk, bounded by ``capacity`` bytes.

    The stager keeps it under capacity by eviction and records what it holds
    in the catalog; readers open its files directly. It is one user's
    (`PRIVATE`: directories 0700, files 0600, whatever the umask), or the
    per-node daemon's (`GROUP_READABLE`: 0750/0640, for the clients of its group).
    """

    kind = "local"
    dir_mode = PRIVATE.dir
    file_mode = PRIVATE.file

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        capacity: int | None = None,
        durable: bool = True,
        modes: LocalModes = PRIVATE,
    ) -> None:
        super().__init__(root, capacity=capacity, durable=durable)
        self.dir_mode = modes.dir
        self.file_mode = modes.file
        # The daemon's group reads its files: only those of datasets declared shared with it.
        self.private_file_mode = PRIVATE.file if modes.file != PRIVATE.file else None

    async def land(self, key: str, size: int) -> Landing | None:
        """``key``'s temporary file of ``size`` bytes, allocated and mapped for writing (see `Landing`)."""
        if size <= 0:
            return None
        self._counters["requests"] += 1
        try:
            return await open_landing(self._data_place(key), size, durable=self._durable, file_mode=self.mode_for(key))
        except UnsafeFileError as exc:
            raise InvalidKeyError(f"invalid key {key!r}: {exc}") from None

    async def put_landed(
        self, key: str, landing: Landing, *, metadata: Mapping[str, str] | None = None
    ) -> ObjectInfo:
        await landing.publish()
        return await self._published(key, len(landing.buffer), metadata)
