"""`DaemonBase`: the daemon's parts and the checks every verb makes (who calls, may they, is it up).

`Daemon` (`_server`) starts, stops and routes; the verbs a reader's client sends are in `_reads`;
both build on this, so that the parts are made in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import web

from datacache._protocol import location_to_wire
from datacache.config import DatasetConfig, Settings
from datacache.daemon import _http as http
from datacache.daemon._grants import Grants
from datacache.daemon._leases import LeaseBook, lease_limit, owner_of
from datacache.daemon._lifecycle import Lifecycle
from datacache.daemon._limits import OpenGate
from datacache.daemon._options import DaemonOptions
from datacache.daemon._policy import OriginPolicy, own_endpoints
from datacache.daemon._registry import DatasetRegistry
from datacache.daemon._scheduler import PrefetchScheduler
from datacache.daemon._status import StatusBoard
from datacache.daemon.metrics import DaemonMetrics
from datacache.errors import DaemonUnavailableError
from datacache.staging import DatasetHandle, Location, Stager
from datacache.tiers import ByteRange

__all__ = ["DaemonBase"]


class DaemonBase:
    """The daemon's parts, made once, and the checks its verbs share.

    Parameters
    ----------
    settings
        The cache: tiers, capacities, concurrency, the socket path and the metrics address.
    options
        Serving options (prefetch pacing, drain time, who may connect).
    """

    def __init__(self, settings: Settings, options: DaemonOptions | None = None) -> None:
        self.settings = settings
        self.options = options or DaemonOptions()
        self.stager: Stager | None = None
        self.metrics = DaemonMetrics(self._stats)
        self.scheduler: PrefetchScheduler | None = None
        self.lifecycle = Lifecycle(
            settings,
            self.options.drain_timeout,
            socket_group=self.options.socket_group,
            request_timeout=self.options.request_timeout,
            connections_per_client=self.options.connections_per_client,
        )
        self.peers = http.PeerPolicy(self.options.allow_uids, self.options.allow_gids)
        policy = OriginPolicy(
            prefixes=self.options.allow_datasets,
            endpoints=self.options.allow_endpoints,
            client_credentials=self.options.allow_client_credentials,
            own_endpoints=own_endpoints(settings),
        )
        self.registry = DatasetRegistry(settings, policy, self.lifecycle.snapshot_dir)
        self.grants = Grants({dataset.id: dataset.readers for dataset in settings.datasets.values()})
        self._modes_checked: set[str] = set()
        """Datasets whose copies' modes were checked against their readers in this daemon's life."""
        self.leases = LeaseBook(lease_limit(settings.local_dir, settings.local_capacity))
        self.lease_lock = asyncio.Lock()
        """Held while leases are admitted or cut and written: the catalog gets them in the book's order."""
        self.status = StatusBoard(settings, self.metrics, self.options.client_ttl)
        self.open_gate = OpenGate(self.options.opens_per_client)
        """Opens in flight per uid: each may list an origin, within the listing bounds."""

    @property
    def socket_path(self) -> Path:
        return self.lifecycle.socket_path

    @property
    def metrics_address(self) -> str | None:
        return self.lifecycle.metrics_address

    def _stats(self) -> Any:
        return self.stager.stats() if self.stager is not None else None


    async def _arrive(self, peer: http.Peer) -> None:
        """``peer`` asks for room on the tier: if another uid already uses it, cut what that uid holds past its share.

        Call with `lease_lock` held.
        """
        if peer.pid <= 0:
            return  # no process to tie the presence to (the verbs that lease refuse such a peer)
        for lease in self.leases.arrive(peer.uid, owner_of(peer.pid)):
            await self._stager().catalog.note_reader(
                lease.dataset, lease.reader, owner=lease.owner, epoch=lease.epoch, position=lease.position,
                holding=[key for key, _ in lease.keys],
            )

    @staticmethod
    def _peer(request: web.Request) -> http.Peer:
        who = request.get("peer")
        if not isinstance(who, http.Peer):
            raise http.Forbidden("cannot tell which user is calling (no SO_PEERCRED on this connection)")
        return who

    def _may_change(self, request: web.Request, dataset_id: str, verb: str) -> None:
        """Only an operator, or a uid that opened ``dataset_id``, may change it."""
        peer = self._peer(request)
        if not self.registry.opened_by(peer, dataset_id):
            raise http.Forbidden(f"uid {peer.uid} may {verb} only datasets it opened in this daemon")

    def _pin_holder_only(self, request: web.Request, dataset_id: str, verb: str) -> None:
        """A pinned dataset is its pinner's: only that uid (or an operator) may unpin, re-pin or evict it."""
        peer = self._peer(request)
        holder = self.registry.pinned_by(dataset_id)
        if holder is None or peer.is_operator or holder == peer.uid:
            return
        what = "pinned by another uid" if holder >= 0 else "pinned (before this daemon started)"
        raise http.Forbidden(f"uid {peer.uid} may not {verb} {dataset_id}: it is {what}; ask its owner or an operator")

    async def _granted(self, data: Mapping[str, Any], peer: http.Peer) -> DatasetConfig:
        """The dataset a request names, once ``peer`` may be served it: a declared reader, or proved.

        docs/SECURITY.md, "Who may read what"; `datacache.daemon._grants`.
        """
        config, configured = await asyncio.to_thread(self.registry.admit, data, peer)
        prove = self.grants.needs_proof(config, peer, configured=configured)
        stager = self._stager()
        for tier in (stager.local, stager.shared):
            if tier is not None:
                tier.shared_datasets |= self.grants.shared
        if config.id not in self._modes_checked:
            # Readers declared or taken away since its copies were written (a restart with a new config).
            self._modes_checked.add(config.id)
            await stager.drop_misfit_copies(config.id)
        if prove:
            handle = await self.lifecycle.tracked(stager.open(config))
            if not self.grants.proven(peer, handle):

                async def read(key: str, start: int, end: int) -> bytes:
                    return await stager.read(handle, key, ByteRange(start, end))

                await self.grants.verify(peer, handle, data.get("proof"), read)
        return config

    def _location_wire(self, peer: http.Peer, handle: DatasetHandle, location: Location) -> dict[str, Any]:
        """``location`` as sent to ``peer``: no path to a copy that is the daemon's own (0600)."""
        wire = location_to_wire(location)
        if not peer.is_operator and handle.id not in self.grants.shared:
            wire["path"] = None  # a dataset not declared shared: the client reads the origin itself
        return wire

    def _stager(self) -> Stager:
        if self.stager is None:
            raise DaemonUnavailableError("the daemon is starting")
        return self.stager

    def _scheduler(self) -> PrefetchScheduler:
        if self.scheduler is None:
            raise DaemonUnavailableError("the daemon is starting")
        return self.scheduler
