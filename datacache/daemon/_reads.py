"""The verbs a reader's client sends: open a dataset, ensure, locate and prefetch shards, its order and progress."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from aiohttp import web

from datacache.daemon import _http as http
from datacache.daemon._base import DaemonBase
from datacache.daemon._leases import Lease, owner_of
from datacache.errors import DatacacheError
from datacache.sizes import format_bytes
from datacache.staging import LOCAL, PRIORITY_PREFETCH, PRIORITY_URGENT, FutureOrder, Location, ReaderProgress
from datacache.tiers import validate_key

__all__ = ["ReadVerbs"]

logger = logging.getLogger("datacache.daemon")


class ReadVerbs(DaemonBase):
    """The reading verbs' handlers; `Daemon` routes ``/v1/<verb>`` to them."""

    async def _open(self, request: web.Request) -> web.Response:
        data = await http.body(request)
        peer = self._peer(request)
        config = await self._granted(data, peer)
        snapshot = data.get("snapshot")
        if snapshot is not None and not isinstance(snapshot, str):
            raise http.BadRequest("'snapshot' must be a string")
        refresh = bool(data.get("refresh", False))
        with self.open_gate.hold(peer.uid, config.id):
            handle = await self.lifecycle.tracked(
                self.registry.open(self._stager(), config, peer, refresh=refresh, snapshot=snapshot), with_caller=True
            )
        manifest = handle.manifest
        return web.json_response(
            {
                "dataset_id": handle.id,
                "snapshot": manifest.snapshot,
                "manifest_path": str(self.registry.snapshot_path(handle.id, manifest.snapshot)),
                "format": manifest.format.value,
                "shards": len(manifest.shards),
                "total_bytes": manifest.total_bytes,
                "policy": handle.config.policy,
                "pinned": handle.config.pinned,
            }
        )

    async def _challenge(self, request: web.Request) -> web.Response:
        """An access challenge for a dataset not declared shared (`datacache._proof`)."""
        data = await http.body(request)
        peer = self._peer(request)
        config, configured = await asyncio.to_thread(self.registry.admit, data, peer)
        if not self.grants.needs_proof(config, peer, configured=configured):
            raise http.BadRequest(f"dataset {config.name}: uid {peer.uid} needs no access proof for it")
        # Its objects changed at the origin: a challenge on a new snapshot (not `registry.open`: a uid
        # that opened a dataset may change it, and this one has proved nothing yet).
        if data.get("refresh") is True:
            self.grants.count_refresh(peer, config.id)
            with self.open_gate.hold(peer.uid, config.id):  # a listing, bounded as an open's
                handle = await self.lifecycle.tracked(self._stager().open(config, refresh=True), with_caller=True)
        else:
            handle = await self.lifecycle.tracked(self._stager().open(config))
        return web.json_response(self.grants.challenge(peer, handle).to_wire())

    async def _ensure(self, request: web.Request) -> web.Response:
        data = await http.body(request)
        peer = self._peer(request)
        handle = self.registry.handle(data, peer)
        key = http.string(data, "key")
        self.registry.shard(handle, key)
        tier = http.tier(data)
        async with self.lease_lock:
            await self._arrive(peer)
        priority = http.number(data, "priority", PRIORITY_URGENT)
        if priority < PRIORITY_PREFETCH:
            # A reader waits on this shard: straight to the stager, whose queue puts it first.
            location = await self.lifecycle.tracked(
                self._stager().ensure(handle, key, tier=tier, priority=priority)
            )
        else:
            future = self._scheduler().submit(handle, key, tier=tier, priority=priority, wait=True)
            if future is None:  # pragma: no cover - waited submissions are never dropped
                raise DatacacheError("the prefetch backlog is full")
            location = await self.lifecycle.tracked(future)
        return web.json_response(self._location_wire(peer, handle, location))

    async def _locate(self, request: web.Request) -> web.Response:
        data = await http.body(request)
        peer = self._peer(request)
        handle = self.registry.handle(data, peer)
        key = http.string(data, "key")
        self.registry.shard(handle, key)
        location = await self._stager().locate(handle, key)
        return web.json_response(self._location_wire(peer, handle, location))

    async def _prefetch(self, request: web.Request) -> web.Response:
        data = await http.body(request)
        peer = self._peer(request)
        handle = self.registry.handle(data, peer)
        keys = http.keys(data)
        for key in keys:
            self.registry.shard(handle, key)
        tier = http.tier(data)
        async with self.lease_lock:
            await self._arrive(peer)
        priority = max(http.number(data, "priority", PRIORITY_PREFETCH), PRIORITY_PREFETCH)
        scheduler = self._scheduler()
        for position, key in enumerate(keys):
            scheduler.submit(handle, key, tier=tier, priority=priority + position * 1e-6)
        return web.json_response({"queued": len(keys), "pending": scheduler.pending})

    async def _future_order(self, request: web.Request) -> web.Response:
        data = await http.body(request)
        handle = self.registry.handle(data, self._peer(request))
        if "order" not in data:
            keys = http.keys(data)
            await self._stager().set_future_order(handle, keys)
            return web.json_response({"keys": len(keys)})
        try:
            order = FutureOrder.from_json(data["order"])
        except ValueError as exc:
            raise http.BadRequest(str(exc)) from None
        for key in order.used_keys():
            validate_key(key)
        await self._stager().set_future_order(handle, order)
        return web.json_response({"readers": len(order.reads)})

    async def _progress(self, request: web.Request) -> web.Response:
        """A client's reader moved on: its position feeds the node's one order, its held shards are leased."""
        data = await http.body(request)
        peer = self._peer(request)
        handle = self.registry.handle(data, peer)
        try:
            progress = ReaderProgress.from_json(data.get("progress"))
        except ValueError as exc:
            raise http.BadRequest(str(exc)) from None
        if peer.pid <= 0:
            raise http.Forbidden("cannot tell which process is calling (no pid in SO_PEERCRED)")
        sizes = []
        for key in progress.holding:
            validate_key(key)
            if key not in handle.manifest:
                raise http.BadRequest(f"reader progress holds {key!r}, which is not a shard of {handle.id}")
            sizes.append((key, handle.manifest.shard(key).size))
        wanted = http.keys(data, "locate") if "locate" in data else []
        for key in wanted:
            self.registry.shard(handle, key)
        # The lease is the calling process's (the kernel's word, not the client's: a container's host name
        # and pids are its own, two pods' first processes both claim "pod:1"), held only while it lives,
        # and while other uids use the tier one uid holds at most its share of it. The claim is not used.
        owner = owner_of(peer.pid)
        async with self.lease_lock:
            await self._arrive(peer)
            lease = Lease(handle.id, progress.reader, owner, peer.uid, progress.epoch, progress.position)
            held = self.leases.admit(lease, sizes)
            progress = dataclasses.replace(progress, owner=owner, holding=tuple(held))
            await self._stager().note_progress(handle, progress)
        # Leased before located (so a reader maps them later without asking again); located outside the lock.
        located = await self._stager().locate_many(handle, wanted)
        if len(held) < len(sizes) and self.leases.first_refusal(peer.uid, handle.id):
            logger.warning(
                "dataset %s: uid %d's readers hold more than one uid may lease while other uids use the tier "
                "(%s, half the local tier): the shards past it are read as usual but may be evicted while held; "
                "said once per dataset",
                handle.id,
                peer.uid,
                format_bytes(self.leases.limit),
            )
        reply: dict[str, Any] = {"holding": len(progress.holding)}
        if wanted:
            reply["locations"] = [self._location_wire(peer, handle, location) for location in located]
        return web.json_response(reply)

    async def _report_corrupt(self, request: web.Request) -> web.Response:
        data = await http.body(request)
        handle = self.registry.handle(data, self._peer(request))
        key = http.string(data, "key")
        shard = self.registry.shard(handle, key)
        tier = http.tier(data)
        stager = self._stager()
        # A client's word is not enough to drop a copy others read (and pinned): the copy is hashed
        # again, and only one whose bytes are wrong (or unreadable) is dropped.
        try:
            intact = await stager.verify_resident(handle, shard, tier=tier)
        except OSError:
            path = stager.local.path(handle.tier_key(key)) if tier == LOCAL else None
            await stager.report_corrupt(handle, Location(tier, path, shard, None))
            intact = False
        logger.warning(
            "uid %d reported shard %s/%s corrupt on the %s tier; %s",
            self._peer(request).uid,
            handle.id,
            key,
            tier,
            "its bytes hash to their checksum: kept" if intact else "dropped it",
            extra={"event": "corrupt", "dataset": handle.id, "key": key, "tier": tier},
        )
        return web.json_response({"dropped": not intact})
