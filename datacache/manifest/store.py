"""Persisted manifests: this node's own, read back only from trusted files; the shared tier's, written for others."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

from datacache.errors import DatacacheError, InvalidKeyError
from datacache.manifest.mapped import COLUMNS_SUFFIX, columns_body, map_manifest
from datacache.manifest.model import Manifest
from datacache.ownership import shared_metadata_mode
from datacache.tiers import LocalTier, SharedTier, validate_key
from datacache.tiers.files import Place, ReadersIds, atomic_write, read_bounded_stat

__all__ = [
    "MAX_MANIFEST_BYTES",
    "ManifestStore",
    "default_trusted_uids",
]

logger = logging.getLogger(__name__)


MAX_MANIFEST_BYTES = 1 << 30
"""A persisted manifest larger than this is not read (about ten million shards)."""


def default_trusted_uids() -> frozenset[int]:
    """Whose files a process trusts without checking them against the origin: itself and root."""
    return frozenset({os.geteuid(), 0})


class ManifestStore:
    """Persisted manifests, one JSON file per dataset in each given directory.

    The first directory is this node's own (the local tier, private: 0700/0600):
    only it is read back, and only a regular file owned by a trusted uid, of at
    most `MAX_MANIFEST_BYTES`, reached from the tier's root without following a
    link (a FIFO or a link to ``/dev/zero`` must not hang or exhaust a reader).
    The others (on the shared tier, the group's: 2770/0640) are written for
    tools and other nodes to inspect. `load_shared` takes one as a snapshot
    only where it is this user's own listing (its columnar file owned by this
    euid, writable by no one else, digest intact) made at most
    ``shared_max_age`` seconds ago: whoever else can write there could name any
    shards and versions, so another user's, root's or the daemon's is never
    taken (docs/SECURITY.md).
    """

    def __init__(
        self,
        *directories: Path,
        trusted_uids: frozenset[int] | None = None,
        readers: Mapping[str, ReadersIds] | None = None,
        group_copies: bool = True,
        shared_max_age: float = 0.0,
    ) -> None:
        if not directories:
            raise ValueError("ManifestStore needs at least one directory")
        self._directories = directories
        # A declared dataset's manifest names its URL and shards: its readers' alone, as its files are.
        self._readers: Mapping[str, ReadersIds] = readers if readers is not None else {}
        # Else an undeclared dataset's shared copy is the writer's own (`ownership.operator_writes`).
        self._group_copies = group_copies
        self._trusted = default_trusted_uids() if trusted_uids is None else trusted_uids
        self._shared_max_age = shared_max_age

    def _place(self, position: int, dataset_id: str) -> Place:
        validate_key(dataset_id)
        directory = self._directories[position]
        dir_mode = LocalTier.dir_mode if position == 0 else SharedTier.dir_mode
        return Place(directory.parent, (directory.name,), f"{dataset_id}.json", dir_mode)

    def _file_mode(self, position: int, dataset_id: str) -> int | None:
        if position == 0:
            return LocalTier.file_mode
        root = self._directories[position].parent
        return shared_metadata_mode(self._readers.get(dataset_id), root, operator=self._group_copies)

    def _read_trusted(self, place: Place) -> bytes | None:
        """The bytes of ``place`` if it is a regular file of a trusted owner, not too large; else None."""
        try:
            st, raw = read_bounded_stat(place, MAX_MANIFEST_BYTES)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (OSError, InvalidKeyError) as exc:
            logger.warning("ignoring manifest %s: %s", place.path, exc)
            return None
        if st.st_uid not in self._trusted:
            logger.warning("ignoring manifest %s: not a file of this user, root or the daemon", place.path)
            return None
        return raw

    def _load_sync(self, dataset_id: str) -> Manifest | None:
        place = self._place(0, dataset_id)
        mapped = map_manifest(place.sibling(dataset_id + COLUMNS_SUFFIX), self._trusted, MAX_MANIFEST_BYTES)
        if mapped is not None and mapped.dataset == dataset_id:
            return mapped
        raw = self._read_trusted(place)
        if raw is None:
            return None
        try:
            manifest = Manifest.from_json(json.loads(raw), str(place.path))
        except (ValueError, DatacacheError) as exc:
            logger.warning("ignoring unreadable manifest %s: %s", place.path, exc)
            return None
        if manifest.dataset != dataset_id:
            logger.warning("ignoring manifest %s: it describes dataset %r", place.path, manifest.dataset)
            return None
        return manifest

    async def load(self, dataset_id: str) -> Manifest | None:
        """Return the manifest of ``dataset_id`` this node persisted, or ``None``."""
        return await asyncio.to_thread(self._load_sync, dataset_id)

    def _load_shared_sync(self, dataset_id: str) -> Manifest | None:
        own = frozenset({os.geteuid()})  # another node's listing by this user: nobody else's, not even root's
        for position in range(1, len(self._directories)):
            place = self._place(position, dataset_id).sibling(dataset_id + COLUMNS_SUFFIX)
            found = map_manifest(place, own, MAX_MANIFEST_BYTES, others_expected=True)
            if found is None or found.dataset != dataset_id:
                continue
            age = time.time() - found.created
            if not 0 <= age <= self._shared_max_age:
                logger.info("not taking %s: listed %.0f s ago (shared_manifest_age %.0f s)", place.path, age,
                            self._shared_max_age)
                continue
            return found
        return None

    async def load_shared(self, dataset_id: str) -> Manifest | None:
        """This user's own listing of ``dataset_id`` saved on the shared tier by another node, if young enough."""
        if self._shared_max_age <= 0 or len(self._directories) < 2:
            return None
        return await asyncio.to_thread(self._load_shared_sync, dataset_id)

    async def save(self, manifest: Manifest, *, shared: bool = True) -> None:
        """Persist ``manifest`` atomically in this node's directory and (``shared``) the others.

        Each directory gets the JSON (for tools) and the columnar file (this node's processes map
        it; another node of this user takes the shared one by `load_shared`).
        """
        encoded = json.dumps(manifest.to_json(), separators=(",", ":")).encode()

        async def body() -> AsyncIterator[bytes]:
            yield encoded

        for position, directory in enumerate(self._directories[: None if shared else 1]):
            place = self._place(position, manifest.dataset)
            mode = self._file_mode(position, manifest.dataset)
            columns = place.sibling(manifest.dataset + COLUMNS_SUFFIX)
            try:
                await atomic_write(columns, columns_body(manifest), durable=False, file_mode=mode)
            except (OSError, InvalidKeyError) as exc:
                logger.warning("could not persist the columns of %s in %s: %s", manifest.dataset, directory, exc)
            try:
                await atomic_write(place, body(), durable=False, file_mode=mode)
            except (OSError, InvalidKeyError) as exc:
                logger.warning("could not persist the manifest of %s in %s: %s", manifest.dataset, directory, exc)

    async def delete(self, dataset_id: str) -> None:
        def unlink(place: Place) -> None:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError, InvalidKeyError):
                fd = place.open_parent()
                try:
                    os.unlink(place.name, dir_fd=fd)
                finally:
                    os.close(fd)

        for position in range(len(self._directories)):
            place = self._place(position, dataset_id)
            await asyncio.to_thread(unlink, place)
            await asyncio.to_thread(unlink, place.sibling(dataset_id + COLUMNS_SUFFIX))
