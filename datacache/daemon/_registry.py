"""The datasets a daemon serves: their configurations, open handles, pins and manifest snapshots.

A client opens a dataset once and then names it by id (and snapshot) in every
request; `DatasetRegistry` resolves what the client sent to a configuration the
operator allows, keeps the handles of the snapshots clients hold, and writes each
snapshot's manifest under the daemon's directory so that a client can read it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from datacache._protocol import UnknownDatasetError, config_from_wire
from datacache.config import DatasetConfig, Settings, resolve_dataset
from datacache.daemon._http import BadRequest, Peer, string
from datacache.daemon._policy import OriginPolicy, canonical_url, check_form
from datacache.errors import ConfigError, DaemonUnavailableError, DatacacheError
from datacache.manifest import Manifest, Shard
from datacache.staging import DatasetHandle, Stager
from datacache.tiers import CONFINE_REDIRECTS, redact_url, validate_key
from datacache.tiers.files import apply_mode, readers_mode
from datacache.tiers.local import GROUP_READABLE

__all__ = ["DatasetRegistry"]

logger = logging.getLogger("datacache.daemon")


@dataclass
class _Shared:
    """One open that several requests wait for, and how many still do."""

    task: asyncio.Future[DatasetHandle]
    waiting: int = 0


class DatasetRegistry:
    """Dataset configurations, handles by (id, snapshot), the latest handle per id, and pins.

    Parameters
    ----------
    settings
        The daemon's settings: configured datasets and per-scheme storage options.
    policy
        What clients other than the daemon's own user may have it open.
    snapshot_dir
        Where each served snapshot's manifest is written for clients to read.
    max_handles
        Handles kept in memory, the least recently used dropped first (a client whose
        handle was dropped gets ``unknown_dataset`` and opens it again).
    keep_snapshots
        Snapshot files kept per dataset besides those of handles in memory (the newest).
    """

    def __init__(
        self,
        settings: Settings,
        policy: OriginPolicy,
        snapshot_dir: Path,
        *,
        max_handles: int = 256,
        keep_snapshots: int = 8,
    ) -> None:
        self.settings = settings
        self.policy = policy
        self.snapshot_dir = snapshot_dir
        self.max_handles = max_handles
        self.keep_snapshots = keep_snapshots
        self.handles: dict[tuple[str, str], DatasetHandle] = {}  # least recently used first
        self.latest: dict[str, DatasetHandle] = {}
        self.pins: set[str] = set()
        # Who pinned each pinned dataset (-1: pinned before this daemon started, by someone unknown).
        self.pinners: dict[str, int] = {}
        # Which datasets each uid opened: the verbs that change a dataset are scoped to them.
        self.opened: dict[int, set[str]] = {}
        self._key: bytes | None = None
        self._key_lock = threading.Lock()  # opens name snapshots from several threads
        self._opening: dict[tuple[int, str, str, bool], _Shared] = {}

    # -- what a client may open -----------------------------------------------------------

    def config(self, data: Mapping[str, Any], peer: Peer) -> DatasetConfig:
        """The configuration a request's ``dataset`` (a name, URL or wire form) stands for.

        Raise `Forbidden` if ``peer`` may not have the daemon open it (see `OriginPolicy`).
        """
        return self.admit(data, peer)[0]

    def admit(self, data: Mapping[str, Any], peer: Peer) -> tuple[DatasetConfig, bool]:
        """`config`, and whether the operator configured it (else an ``--allow-dataset`` prefix admitted it)."""
        spec = data.get("dataset")
        client_options: dict[str, Any] = {}
        if isinstance(spec, str):
            if spec not in self.settings.datasets:
                check_form(spec)
            config = resolve_dataset(spec, self.settings)
            known = self.settings.datasets.get(spec) or self._configured_at(replace(config, storage_options={}))
            if known is not None and spec not in self.settings.datasets:
                config = resolve_dataset(known.name, self.settings)
            configured = known is not None
        else:
            config = config_from_wire(spec)
            validate_key(config.name)
            client_options = dict(config.storage_options)
            known = self.settings.datasets.get(config.name)
            if known is not None and known.url.rstrip("/") != config.url.rstrip("/"):
                raise ConfigError(
                    f"dataset name {config.name!r} is configured in the daemon for another URL "
                    f"({redact_url(known.url)})"
                )
            if known is None:
                # A client without the node's config names a configured dataset by its URL.
                known = self._configured_at(config)
                if known is not None:
                    config = replace(config, name=known.name)
            configured = known is not None
            scheme = config.url.split("://", 1)[0] if "://" in config.url else "file"
            base = {**self.settings.storage_options.get(scheme, {}), **(known.storage_options if known else {})}
            if base:
                config = replace(config, storage_options={**base, **client_options})
            if known is not None:
                config = replace(config, readers=known.readers)  # the operator's word, never the client's
        self.policy.admit(config, client_options, configured=configured, operator=peer.is_operator)
        if not configured and config.url.split("://", 1)[0].lower() in ("http", "https"):
            # A redirect would lead the daemon wherever the origin's host points it (the node's
            # loopback, a metadata service): a dataset a client opened follows one only inside its URL.
            config = replace(config, storage_options={**config.storage_options, CONFINE_REDIRECTS: True})
        if config.id in self.pins and not config.pinned:
            config = replace(config, pinned=True)
        return config, configured

    def _configured_at(self, config: DatasetConfig) -> DatasetConfig | None:
        """The configured dataset whose URL is ``config``'s, canonically (names are aliases of the origin).

        Only where the client's own storage options leave the origin the configured one's (no
        other endpoint): the same identity once the configured options are merged under them.
        """
        url = canonical_url(config.url)
        for known in self.settings.datasets.values():
            if canonical_url(known.url) != url:
                continue
            merged = replace(known, storage_options={**known.storage_options, **config.storage_options})
            if merged.id == known.id:
                return known
        return None

    def opened_by(self, peer: Peer, dataset_id: str) -> bool:
        """Whether ``peer`` may act on ``dataset_id``: an operator, or a uid that opened it."""
        return peer.is_operator or dataset_id in self.opened.get(peer.uid, ())

    # -- handles --------------------------------------------------------------------------

    async def open(
        self, stager: Stager, config: DatasetConfig, peer: Peer, *, refresh: bool, snapshot: str | None
    ) -> DatasetHandle:
        """Open ``config`` for ``peer`` (at ``snapshot`` if it holds one) and remember its handle."""
        self.opened.setdefault(peer.uid, set()).add(config.id)
        if snapshot is not None and not refresh:
            known = self.handles.get((config.id, snapshot))
            if known is not None:
                return known
        handle = await self._open_once(stager, config, peer, refresh)
        if snapshot is not None and not refresh and handle.manifest.snapshot != snapshot:
            manifest = await asyncio.to_thread(self._load_snapshot, config.id, snapshot)
            if manifest is None:
                raise UnknownDatasetError(
                    f"dataset {config.id}: snapshot {snapshot} is unknown to this daemon "
                    f"(it serves {handle.manifest.snapshot}); open the dataset again"
                )
            handle = DatasetHandle(config=handle.config, manifest=manifest, origin=handle.origin)
        else:
            self.latest[config.id] = handle
        self._remember(handle)
        held = {snapshot for dataset, snapshot in self.handles if dataset == config.id}
        await asyncio.to_thread(self._save_snapshot, handle.manifest, held)
        return handle

    async def _open_once(self, stager: Stager, config: DatasetConfig, peer: Peer, refresh: bool) -> DatasetHandle:
        """`Stager.open`, once for all of a uid's requests for one dataset at a time (a job's ranks together).

        A request whose client leaves stops waiting; the listing is cancelled when the last one has left.
        """
        options = json.dumps(dict(config.storage_options), sort_keys=True, default=str)
        key = (peer.uid, config.id, options, refresh)
        entry = self._opening.get(key)
        if entry is None or entry.task.cancelled():
            entry = self._opening[key] = _Shared(asyncio.ensure_future(stager.open(config, refresh=refresh)))
            entry.task.add_done_callback(functools.partial(self._forget_open, key, entry))
        entry.waiting += 1
        try:
            return await asyncio.shield(entry.task)
        finally:
            entry.waiting -= 1
            if not entry.waiting and not entry.task.done():
                entry.task.cancel()

    def _forget_open(self, key: tuple[int, str, str, bool], entry: _Shared, _: object) -> None:
        if self._opening.get(key) is entry:
            del self._opening[key]

    def _remember(self, handle: DatasetHandle) -> None:
        """Keep ``handle`` as the most recently used; drop the least recently used beyond the bound."""
        ident = (handle.id, handle.manifest.snapshot)
        self.handles.pop(ident, None)
        self.handles[ident] = handle
        while len(self.handles) > self.max_handles:
            (dataset, snapshot), _ = next(iter(self.handles.items()))
            del self.handles[(dataset, snapshot)]
            latest = self.latest.get(dataset)
            if latest is not None and latest.manifest.snapshot == snapshot:
                del self.latest[dataset]
            if not any(held == dataset for held, _ in self.handles):
                for ids in self.opened.values():
                    ids.discard(dataset)

    def handle(self, data: Mapping[str, Any], peer: Peer) -> DatasetHandle:
        """The open handle a request's ``dataset`` and ``snapshot`` name, if ``peer`` opened it."""
        dataset = string(data, "dataset")
        snapshot = data.get("snapshot")
        if snapshot is not None and not isinstance(snapshot, str):
            raise BadRequest("'snapshot' must be a string")
        handle = None
        if self.opened_by(peer, dataset):
            handle = self.latest.get(dataset) if snapshot is None else self.handles.get((dataset, snapshot))
        if handle is None:
            which = f"dataset {dataset!r}" + (f" at snapshot {snapshot}" if snapshot else "")
            raise UnknownDatasetError(f"{which} is not open in this daemon for uid {peer.uid}; open it first")
        ident = (handle.id, handle.manifest.snapshot)
        if ident in self.handles:  # used: the last to be dropped
            self.handles[ident] = self.handles.pop(ident)
        return handle

    @staticmethod
    def shard(handle: DatasetHandle, key: str) -> Shard:
        validate_key(key)
        return handle.manifest.shard(key)

    def pinned_by(self, dataset: str) -> int | None:
        """The uid that pinned ``dataset`` (-1 if unknown: pinned before this daemon started); None if unpinned."""
        if dataset not in self.pins:
            return None
        return self.pinners.get(dataset, -1)

    def set_pinned(self, dataset: str, pinned: bool, *, uid: int | None = None) -> None:
        """Record a pin (by ``uid``) or an unpin in every handle of ``dataset``."""
        if pinned:
            self.pins.add(dataset)
            if uid is not None:
                self.pinners[dataset] = uid
        else:
            self.pins.discard(dataset)
            self.pinners.pop(dataset, None)
        for ident, handle in list(self.handles.items()):
            if ident[0] == dataset:
                self.handles[ident] = replace(handle, config=replace(handle.config, pinned=pinned))
        if dataset in self.latest:
            latest = self.latest[dataset]
            self.latest[dataset] = replace(latest, config=replace(latest.config, pinned=pinned))

    # -- snapshots ------------------------------------------------------------------------

    def snapshot_path(self, dataset_id: str, snapshot: str) -> Path:
        """Where a snapshot's manifest is: a name only the daemon can make, in a folder no client can list.

        The folder is 0710 (its group may pass, not list), the file 0640 for the clients
        of the daemon's group, named with a keyed digest of the dataset and snapshot: a
        uid reads the manifest it was handed, and cannot find another uid's datasets.
        """
        validate_key(dataset_id)
        validate_key(snapshot)
        tag = hmac.new(self._name_key(), f"{dataset_id}@{snapshot}".encode(), hashlib.sha256).hexdigest()[:24]
        return self.snapshot_dir / f"{dataset_id}@{snapshot}.{tag}.json"

    def _name_key(self) -> bytes:
        """The daemon's secret for snapshot names (made once, 0600, kept across restarts).

        Made whole before it has its name (a temporary file linked into place): opens run in
        several threads, and one that found the file another had just created, still empty,
        took it for a crash's leftover and removed it under a third (ENOENT).
        """
        with self._key_lock:
            if self._key is None:
                self._key = self._load_or_make_key(self.snapshot_dir / ".names.key")
            return self._key

    @staticmethod
    def _load_or_make_key(path: Path) -> bytes:
        for _ in range(2):
            try:
                key = path.read_bytes()
            except FileNotFoundError:
                key = b""
                fresh = path.with_name(f".names.key.{uuid.uuid4().hex}.tmp")
                fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                try:
                    with os.fdopen(fd, "wb") as out:
                        out.write(secrets.token_bytes(32))
                        out.flush()
                        os.fsync(out.fileno())
                    with contextlib.suppress(FileExistsError):
                        os.link(fresh, path)  # atomic: whole, or another's already there
                finally:
                    fresh.unlink(missing_ok=True)
                key = path.read_bytes()
            if len(key) == 32:
                return key
            path.unlink(missing_ok=True)  # an older daemon's write cut short by a crash: make a fresh one
        raise DatacacheError(f"{path}: the daemon's snapshot-name key could not be made")

    def _snapshot_mode(self, dataset_id: str) -> int:
        for dataset in self.settings.datasets.values():
            if dataset.id == dataset_id and dataset.readers:
                readers = (dataset.readers.uids, dataset.readers.gids)
                return readers_mode(GROUP_READABLE.file, readers, self.snapshot_dir)
        return GROUP_READABLE.file

    def _save_snapshot(self, manifest: Manifest, held: set[str]) -> Path:
        """Write ``manifest``'s snapshot file; prune the dataset's oldest ones but ``held``."""
        path = self.snapshot_path(manifest.dataset, manifest.snapshot)
        if not path.exists():
            temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
            try:
                fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as out:
                    # The clients of the daemon's group read it; a declared dataset's, only its readers.
                    apply_mode(fd, self._snapshot_mode(manifest.dataset))
                    out.write(json.dumps(manifest.to_json(), separators=(",", ":")).encode())
                temporary.replace(path)
            except OSError as exc:
                temporary.unlink(missing_ok=True)
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # Its clients read the manifest from this file: with none, they read through their own
                # stagers, as when the daemon is down (a trial's jobs died of the raw errno instead).
                logger.warning("cannot keep the manifest of %s for clients: %s is full", manifest.dataset, path.parent)
                raise DaemonUnavailableError(
                    f"the daemon cannot keep the manifest of {manifest.dataset}: its disk ({path.parent}) is full"
                ) from exc
        prefix = f"{manifest.dataset}@"  # ids hold no '@': no other dataset's file matches
        files = [p for p in self.snapshot_dir.iterdir() if p.name.startswith(prefix) and p.suffix == ".json"]
        files.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        for old in files[self.keep_snapshots :]:
            if old.name[len(prefix) :].split(".", 1)[0] not in held | {manifest.snapshot}:
                old.unlink(missing_ok=True)
        return path

    def _load_snapshot(self, dataset_id: str, snapshot: str) -> Manifest | None:
        path = self.snapshot_path(dataset_id, snapshot)
        try:
            manifest = Manifest.from_json(json.loads(path.read_bytes()), str(path))
        except FileNotFoundError:
            return None
        except (ValueError, DatacacheError) as exc:
            logger.warning("ignoring the unreadable manifest snapshot %s: %s", path, exc)
            return None
        return manifest if manifest.snapshot == snapshot else None
