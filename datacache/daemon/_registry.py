"""The datasets a daemon serves: their configurations, open handles, pins and manifest snapshots.

A client opens a dataset once and then names it by id (and snapshot) in every
request; `DatasetRegistry` resolves what the client sent to a configuration the
operator allows, keeps the handles of the snapshots clients hold, and writes each
snapshot's manifest under the daemon's directory so that a client can read it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from datacache._protocol import UnknownDatasetError, config_from_wire
from datacache.config import DatasetConfig, Settings, resolve_dataset
from datacache.daemon._http import BadRequest, Forbidden, string
from datacache.errors import ConfigError, DatacacheError
from datacache.manifest import Manifest, Shard
from datacache.stager import DatasetHandle, Stager
from datacache.tiers import redact_url, validate_key

__all__ = ["DatasetRegistry"]

logger = logging.getLogger("datacache.daemon")


class DatasetRegistry:
    """Dataset configurations, handles by (id, snapshot), the latest handle per id, and pins.

    Parameters
    ----------
    settings
        The daemon's settings: configured datasets and per-scheme storage options.
    allow_datasets
        If not empty, only configured datasets and URLs starting with one of these may be opened.
    snapshot_dir
        Where each served snapshot's manifest is written for clients to read.
    """

    def __init__(self, settings: Settings, allow_datasets: tuple[str, ...], snapshot_dir: Path) -> None:
        self.settings = settings
        self.allow_datasets = allow_datasets
        self.snapshot_dir = snapshot_dir
        self.handles: dict[tuple[str, str], DatasetHandle] = {}
        self.latest: dict[str, DatasetHandle] = {}
        self.pins: set[str] = set()

    # -- what a client may open -----------------------------------------------------------

    def allowed(self, config: DatasetConfig) -> None:
        prefixes = self.allow_datasets
        if not prefixes:
            return
        configured = self.settings.datasets.get(config.name)
        if configured is not None and configured.url == config.url:
            return
        url = redact_url(config.url)
        if any(url.startswith(prefix) or config.url.startswith(prefix) for prefix in prefixes):
            return
        raise Forbidden(f"dataset {url} is not in this daemon's allowlist (--allow-dataset)")

    def config(self, data: Mapping[str, Any]) -> DatasetConfig:
        """The configuration a request's ``dataset`` (a name, URL or wire form) stands for."""
        spec = data.get("dataset")
        if isinstance(spec, str):
            config = resolve_dataset(spec, self.settings)
        else:
            config = config_from_wire(spec)
            validate_key(config.name)
            configured = self.settings.datasets.get(config.name)
            if configured is not None and configured.url.rstrip("/") != config.url.rstrip("/"):
                raise ConfigError(
                    f"dataset name {config.name!r} is configured in the daemon for another URL "
                    f"({redact_url(configured.url)})"
                )
            scheme = config.url.split("://", 1)[0] if "://" in config.url else "file"
            defaults = self.settings.storage_options.get(scheme, {})
            if defaults:
                config = replace(config, storage_options={**defaults, **config.storage_options})
        self.allowed(config)
        if config.id in self.pins and not config.pinned:
            config = replace(config, pinned=True)
        return config

    # -- handles --------------------------------------------------------------------------

    async def open(
        self, stager: Stager, config: DatasetConfig, *, refresh: bool, snapshot: str | None
    ) -> DatasetHandle:
        """Open ``config`` (at ``snapshot`` if a client holds one) and remember its handle."""
        if snapshot is not None and not refresh:
            known = self.handles.get((config.id, snapshot))
            if known is not None:
                return known
        handle = await stager.open(config, refresh=refresh)
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
        self.handles[(config.id, handle.manifest.snapshot)] = handle
        await asyncio.to_thread(self._save_snapshot, handle.manifest)
        return handle

    def handle(self, data: Mapping[str, Any]) -> DatasetHandle:
        """The open handle a request's ``dataset`` and ``snapshot`` name."""
        dataset = string(data, "dataset")
        snapshot = data.get("snapshot")
        if snapshot is None:
            handle = self.latest.get(dataset)
        elif isinstance(snapshot, str):
            handle = self.handles.get((dataset, snapshot))
        else:
            raise BadRequest("'snapshot' must be a string")
        if handle is None:
            which = f"dataset {dataset!r}" + (f" at snapshot {snapshot}" if snapshot else "")
            raise UnknownDatasetError(f"{which} is not open in this daemon; open it first")
        return handle

    @staticmethod
    def shard(handle: DatasetHandle, key: str) -> Shard:
        validate_key(key)
        return handle.manifest.shard(key)

    def set_pinned(self, dataset: str, pinned: bool) -> None:
        """Record a pin (or unpin) in every handle of ``dataset``."""
        if pinned:
            self.pins.add(dataset)
        else:
            self.pins.discard(dataset)
        for ident, handle in list(self.handles.items()):
            if ident[0] == dataset:
                self.handles[ident] = replace(handle, config=replace(handle.config, pinned=pinned))
        if dataset in self.latest:
            latest = self.latest[dataset]
            self.latest[dataset] = replace(latest, config=replace(latest.config, pinned=pinned))

    # -- snapshots ------------------------------------------------------------------------

    def snapshot_path(self, dataset_id: str, snapshot: str) -> Path:
        validate_key(dataset_id)
        validate_key(snapshot)
        return self.snapshot_dir / f"{dataset_id}@{snapshot}.json"

    def _save_snapshot(self, manifest: Manifest) -> Path:
        path = self.snapshot_path(manifest.dataset, manifest.snapshot)
        if not path.exists():
            temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
            temporary.write_bytes(json.dumps(manifest.to_json(), separators=(",", ":")).encode())
            temporary.chmod(0o644)
            temporary.replace(path)
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
