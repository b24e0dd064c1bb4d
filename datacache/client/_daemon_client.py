"""`DaemonClient`: the `ShardAccess` verbs answered by the node's daemon over its Unix socket.

Every process of a node that uses a client shares the daemon's single cache:
one transfer per shard from the origin, one copy on the local disk. The client
reads resident shards straight from the files the daemon names, and reads
from the origin itself when a shard is not cached (so a reader never waits
on the daemon to move bytes it only reads once).

The client holds configuration only; its HTTP session is created lazily in
the process and event loop that use it and is never pickled.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from datacache._proof import Challenge, answer_challenge
from datacache._protocol import (
    API,
    UnknownDatasetError,
    config_to_wire,
)
from datacache.client._http import (
    BASE,
    VerifiedUnixConnector,
    decode_reply,
    read_file,
    read_manifest_file,
    same_dataset,
    say_notices,
    streamed_events,
)
from datacache.config import DatasetConfig, Settings, resolve_dataset
from datacache.errors import DaemonUnavailableError, DatacacheError, OriginChangedError, ProofRequiredError
from datacache.manifest import Manifest, listing_notices, reading_url
from datacache.staging import PRIORITY_PREFETCH, PRIORITY_URGENT, DatasetHandle, FutureOrder, Location, ReaderProgress
from datacache.staging.reading import read_verified
from datacache.tiers import ByteRange, Tier, open_origin

__all__ = ["DaemonClient"]

logger = logging.getLogger("datacache.client")  # the name it had as one module

class DaemonClient:
    """Reach shards through the node's daemon (``datacache serve``).

    Parameters
    ----------
    settings
        This process's settings: the socket path, and what it needs to open
        a dataset's origin itself (for reads of shards not cached).
    client_name
        How this client appears in the daemon's metrics (default ``host:pid``).
    connect_timeout
        Seconds to wait for the socket to accept a connection.
    request_timeout
        Seconds to wait for a reply to anything but ``ensure`` and ``warm``
        (those wait for transfers and are bounded by the daemon).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        client_name: str | None = None,
        connect_timeout: float = 5.0,
        request_timeout: float = 120.0,
    ) -> None:
        self.settings = settings
        self.socket_path = settings.daemon_socket
        self.client_name = client_name
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._connector: VerifiedUnixConnector | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._closed_loop: asyncio.AbstractEventLoop | None = None
        """The loop `close` ran on: requests there after it are refused, never given a new session."""
        self._pid = os.getpid()
        self._manifests: dict[tuple[str, str], Manifest] = {}
        self._origins: dict[str, Tier] = {}

    @property
    def server_uid(self) -> int | None:
        """The uid the daemon runs as (by ``SO_PEERCRED``), once a request has reached it."""
        return None if self._connector is None else self._connector.server_uid

    def __getstate__(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "client_name": self.client_name,
            "connect_timeout": self.connect_timeout,
            "request_timeout": self.request_timeout,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        settings = state.pop("settings")
        self.__init__(settings, **state)  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"DaemonClient(socket={str(self.socket_path)!r})"

    @property
    def mode(self) -> str:
        """The daemon answers this client's requests."""
        return "daemon"

    # -- transport ------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._closed_loop is loop and self._pid == os.getpid():
            # A request still in flight when this process closed its client (a prefetch at
            # exit): a new session now would never be closed, and its finalizer would print a
            # traceback at the very end of the user's log.
            raise DaemonUnavailableError(f"the client of the datacache daemon on {self.socket_path} is closed")
        session = self._session
        if session is not None and (self._session_loop is not loop or self._pid != os.getpid()):
            # Bound to another loop or to the parent process: let it go without touching it.
            session.detach()
            session = None
        if session is None or session.closed:
            # One connection per request: nothing to go stale when the daemon restarts.
            daemon_uid = self.settings.daemon_uid
            trusted = frozenset({0, os.getuid()} | ({daemon_uid} if daemon_uid is not None else set()))
            connector = VerifiedUnixConnector(str(self.socket_path), trusted)
            self._connector = connector
            session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout),
                headers={"X-Datacache-Client": self._name()},
            )
            self._session, self._session_loop, self._pid = session, loop, os.getpid()
        return session

    def _name(self) -> str:
        return self.client_name or f"{socket.gethostname()}:{os.getpid()}"

    def _unavailable(self, exc: BaseException) -> DaemonUnavailableError:
        cause: BaseException | None = exc
        while cause is not None:
            if isinstance(cause, DaemonUnavailableError):
                return cause  # already says why (an impostor on the socket), under aiohttp's wrapper
            cause = cause.__cause__ or cause.__context__
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        return DaemonUnavailableError(
            f"the datacache daemon on {self.socket_path} is unreachable ({reason})"
        )

    async def _call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        within: float | None = None,
    ) -> dict[str, Any]:
        session = self._http()
        limit = aiohttp.ClientTimeout(total=within, sock_connect=self.connect_timeout)
        try:
            async with session.request(method, BASE + path, json=body, timeout=limit) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            raise self._unavailable(exc) from exc
        except TimeoutError as exc:
            raise DaemonUnavailableError(
                f"the datacache daemon on {self.socket_path} did not answer {path} within {within}s"
            ) from exc
        return decode_reply(status, raw, path)

    async def _call_for(
        self, handle: DatasetHandle, verb: str, body: dict[str, Any], **kw: Any
    ) -> dict[str, Any]:
        """A request about ``handle``; if the daemon restarted and forgot it, open it again once."""
        body = {"dataset": handle.id, "snapshot": handle.manifest.snapshot, **body}
        try:
            return await self._call("POST", f"{API}/{verb}", body, **kw)
        except UnknownDatasetError:
            await self._open_remote(handle.config, snapshot=handle.manifest.snapshot)
            return await self._call("POST", f"{API}/{verb}", body, **kw)

    # -- the ShardAccess verbs ------------------------------------------------------------

    async def health(self, *, within: float = 2.0) -> dict[str, Any]:
        """The daemon's ``/healthz`` reply; raise `DaemonUnavailableError` if it does not answer."""
        return await self._call("GET", "/healthz", within=within)

    async def open(self, dataset: DatasetConfig | str, *, refresh: bool = False) -> DatasetHandle:
        """Open ``dataset`` in the daemon and return a handle on the snapshot it serves."""
        config = dataset if isinstance(dataset, DatasetConfig) else resolve_dataset(dataset, self.settings)
        reply = await self._open_remote(config, refresh=refresh)
        manifest = await self._manifest(reply)
        origin = self._origins.get(config.id)
        if origin is None:
            # Reads of shards not cached go to the origin directly, and a failing-over
            # reader's own stager fetches through it.
            url = reading_url(config.url, manifest)
            origin = open_origin(url, storage_options=config.storage_options, retry=self.settings.retry)
            self._origins[config.id] = origin
        return DatasetHandle(config=config, manifest=manifest, origin=origin)

    async def _open_remote(
        self, config: DatasetConfig, *, refresh: bool = False, snapshot: str | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"dataset": await self._wire(config), "refresh": refresh}
        if snapshot is not None:
            body["snapshot"] = snapshot
        try:
            reply = await self._call("POST", f"{API}/open", body)
        except ProofRequiredError:
            body["proof"] = await self._prove(config, body["dataset"])
            reply = await self._call("POST", f"{API}/open", body)
        same_dataset(config, reply.get("dataset_id"))
        return reply

    async def _prove(self, config: DatasetConfig, wire: dict[str, Any]) -> dict[str, str]:
        """Show the daemon that the origin answers this user, with this process's own credentials."""
        body = {"dataset": wire}
        reply = await self._call("POST", f"{API}/challenge", body, within=self.request_timeout)
        try:
            return await answer_challenge(config, Challenge.from_wire(reply), self.settings.retry)
        except OriginChangedError:
            # Its object changed since the daemon's snapshot (an owner's `warm --refresh` failed every time).
            reply = await self._call("POST", f"{API}/challenge", {**body, "refresh": True}, within=self.request_timeout)
            return await answer_challenge(config, Challenge.from_wire(reply), self.settings.retry)

    async def _wire(self, config: DatasetConfig) -> dict[str, Any]:
        """``config`` as sent: with credentials only to a daemon running as this very user."""
        if self._connector is None or self._connector.server_uid is None:
            await self.health(within=self.request_timeout)  # learns (and checks) who serves the socket
        same_user = self._connector is not None and self._connector.server_uid == os.getuid()
        return config_to_wire(config, credentials=same_user)

    async def _manifest(self, reply: dict[str, Any]) -> Manifest:
        dataset, snapshot, path = reply.get("dataset_id"), reply.get("snapshot"), reply.get("manifest_path")
        if not isinstance(dataset, str) or not isinstance(snapshot, str) or not isinstance(path, str):
            raise DatacacheError("daemon: the open reply lacks dataset_id, snapshot or manifest_path")
        cached = self._manifests.get((dataset, snapshot))
        if cached is not None:
            return cached
        manifest = await asyncio.to_thread(read_manifest_file, Path(path), snapshot)
        self._manifests[(dataset, snapshot)] = manifest
        say_notices(listing_notices(manifest), self.settings.local_dir / "notices")
        return manifest

    def _location(self, handle: DatasetHandle, reply: dict[str, Any]) -> Location:
        key, tier = reply.get("key"), reply.get("tier")
        if not isinstance(key, str) or tier not in ("local", "shared", "origin"):
            raise DatacacheError("daemon: a location reply lacks its key or tier")
        path = reply.get("path")
        checksum = reply.get("checksum")
        return Location(
            tier=str(tier),
            path=Path(path) if isinstance(path, str) else None,
            shard=handle.manifest.shard(key),
            checksum=checksum if isinstance(checksum, str) else None,
        )

    async def ensure(
        self,
        handle: DatasetHandle,
        key: str,
        *,
        tier: str = "local",
        priority: float = PRIORITY_URGENT,
        early: bool = False,
    ) -> Location:
        """Have the daemon make shard ``key`` resident and say where it is.

        ``early`` is not sent: the daemon's answer is a path, so it comes once the copy is durable.
        """
        reply = await self._call_for(
            handle, "ensure", {"key": key, "tier": tier, "priority": priority}
        )
        return self._location(handle, reply)

    async def prefetch(
        self, handle: DatasetHandle, keys: Sequence[str], *, priority: float = PRIORITY_PREFETCH
    ) -> None:
        """Queue ``keys`` in the daemon's prefetch backlog, the first ones soonest."""
        if keys:
            await self._call_for(
                handle,
                "prefetch",
                {"keys": list(keys), "priority": priority},
                within=self.request_timeout,
            )

    async def set_future_order(self, handle: DatasetHandle, keys: Iterable[str] | FutureOrder) -> None:
        """Tell the daemon's eviction the node's future reads (or one order of keys)."""
        body = {"order": keys.to_json()} if isinstance(keys, FutureOrder) else {"keys": list(keys)}
        await self._call_for(handle, "future_order", body, within=self.request_timeout)

    async def note_progress(
        self, handle: DatasetHandle, progress: ReaderProgress, *, locate: Sequence[str] = ()
    ) -> list[Location]:
        """Tell the daemon where a reader of this process is and which shards it holds.

        With ``locate``, the same request says where each can be read now: the reader's
        one round trip for the shards it opens (and prefetches) next.
        """
        body: dict[str, Any] = {"progress": progress.to_json()}
        if locate:
            body["locate"] = list(locate)
        reply = await self._call_for(handle, "progress", body, within=self.request_timeout)
        if not locate:
            return []
        found = reply.get("locations")
        if not isinstance(found, list) or len(found) != len(locate):
            raise DatacacheError("daemon: the progress reply lacks the locations asked for")
        locations = [self._location(handle, item) if isinstance(item, dict) else None for item in found]
        if any(loc is None or loc.shard.key != key for loc, key in zip(locations, locate, strict=True)):
            raise DatacacheError("daemon: the progress reply's locations do not match the keys asked for")
        return [loc for loc in locations if loc is not None]

    async def locate(self, handle: DatasetHandle, key: str) -> Location:
        """Where shard ``key`` can be read now, moving nothing."""
        return self._location(
            handle,
            await self._call_for(handle, "locate", {"key": key}, within=self.request_timeout),
        )

    async def read(
        self, handle: DatasetHandle, key: str, byte_range: ByteRange | None = None
    ) -> bytes:
        """Read a shard (or a range) from the fastest tier holding it; whole reads are verified.

        A cached copy found wrong is reported to the daemon (which drops it)
        and the shard read again from below, as `Stager.read` does.
        """
        shard = handle.manifest.shard(key)

        async def fetch(location: Location) -> bytes:
            if location.path is not None:
                try:
                    return await asyncio.to_thread(read_file, location.path, byte_range)
                except FileNotFoundError:
                    pass  # evicted meanwhile: the origin has it
            return await handle.origin.get(key, byte_range, version=shard.version)

        return await read_verified(
            handle.id,
            byte_range,
            locate=lambda: self.locate(handle, key),
            fetch=fetch,
            report_corrupt=lambda location: self.report_corrupt(handle, location),
        )

    async def report_corrupt(self, handle: DatasetHandle, location: Location) -> None:
        """Tell the daemon a copy's bytes were wrong, so it drops it and stages it again."""
        if location.tier in ("local", "shared"):
            await self._call_for(
                handle,
                "report_corrupt",
                {"key": location.shard.key, "tier": location.tier},
                within=self.request_timeout,
            )

    def origin_retries(self) -> int:
        """Retries of the origin reads this client made itself (shards not cached); the daemon counts its own."""
        return sum(origin.stats().retries for origin in list(self._origins.values()))

    async def close(self) -> None:
        """Close this process's session with the daemon and the origins it opened."""
        origins, self._origins = list(self._origins.values()), {}
        for origin in origins:
            try:
                await origin.close()
            except Exception as exc:  # closing must not fail a reader's shutdown
                logger.debug("closing an origin failed: %s", exc)
        session, self._session = self._session, None
        if self._pid == os.getpid():
            self._closed_loop = asyncio.get_running_loop()
        if session is None:
            return
        if self._session_loop is asyncio.get_running_loop() and self._pid == os.getpid():
            await session.close()
        else:
            session.detach()

    # -- beyond ShardAccess: the daemon's own verbs ---------------------------------------

    async def top(self) -> dict[str, Any]:
        """What ``datacache top`` shows: tiers, transfers, and the clients this user may see."""
        return await self._call("GET", f"{API}/top", within=self.request_timeout)

    async def datasets(self) -> list[dict[str, Any]]:
        """What ``datacache ls`` shows: the datasets of the daemon's catalog this user may see, with residency."""
        reply = await self._call("GET", f"{API}/datasets", within=self.request_timeout)
        rows = reply.get("datasets")
        if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
            raise DatacacheError("daemon: the datasets reply lacks its rows")
        return rows

    async def status(self) -> dict[str, Any]:
        """The daemon's status: tiers, queue, datasets, clients (never a credential)."""
        return await self._call("GET", f"{API}/status", within=self.request_timeout)

    async def report(
        self,
        *,
        delivered_bytes_per_s: float,
        stall_fraction: float,
        delivered_bytes: int = 0,
        dataset: str | None = None,
        **figures: Any,
    ) -> None:
        """Report what this client delivered to training and the fraction of time it stalled.

        ``figures`` are the optional `datacache.activity.READER_FIELDS`; a reader that gives its
        rank and worker is named ``host:pid:rRwW`` (one process may hold several readers).
        """
        name = self._name()
        if self.client_name is None and "rank" in figures and "worker" in figures:
            name = f"{name}:r{figures['rank']}w{figures['worker']}"
        body: dict[str, Any] = {
            **figures,
            "client": name,
            "delivered_bytes_per_s": delivered_bytes_per_s,
            "stall_fraction": stall_fraction,
            "delivered_bytes": delivered_bytes,
        }
        if dataset is not None:
            body["dataset"] = dataset
        await self._call("POST", f"{API}/report", body, within=self.request_timeout)

    async def evict(
        self, dataset: str, keys: Sequence[str] | None = None, *, tier: str = "local"
    ) -> tuple[int, int]:
        """Evict a dataset's shards (all, or ``keys``) from ``tier``; return (shards, bytes)."""
        body: dict[str, Any] = {"dataset": dataset, "tier": tier}
        if keys is not None:
            body["keys"] = list(keys)
        reply = await self._call("POST", f"{API}/evict", body, within=self.request_timeout)
        return int(reply.get("shards", 0)), int(reply.get("bytes", 0))

    async def pin(self, dataset_id: str) -> None:
        """Keep a dataset's shards out of eviction."""
        await self._call("POST", f"{API}/pin", {"dataset": dataset_id}, within=self.request_timeout)

    async def unpin(self, dataset_id: str) -> None:
        """Let eviction choose a dataset's shards again."""
        await self._call("POST", f"{API}/unpin", {"dataset": dataset_id}, within=self.request_timeout)

    async def warm(
        self,
        dataset: DatasetConfig | str,
        *,
        tier: str = "local",
        shards: str | None = None,
        verify: bool = False,
        refresh: bool = False,
        bandwidth: float | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """Have the daemon stage a dataset (``bandwidth``: bytes/s for this warm); yield its lines.

        The last line is the summary, ``warm_report_to_wire``'s form (``{"event": "done", ...}``).
        """
        config = dataset if isinstance(dataset, DatasetConfig) else resolve_dataset(dataset, self.settings)
        body = {
            "dataset": await self._wire(config),
            "tier": tier,
            "shards": shards,
            "verify": verify,
            "refresh": refresh,
            "bandwidth": bandwidth,
        }
        try:
            async for event in self._warm_events(config, body):
                yield event
        except ProofRequiredError:  # raised before the first line: nothing was yielded
            body["proof"] = await self._prove(config, await self._wire(config))
            async for event in self._warm_events(config, body):
                yield event

    async def _warm_events(self, config: DatasetConfig, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        session = self._http()
        try:
            async with session.post(f"{BASE}{API}/warm", json=body) as response:
                async for event in streamed_events(response, f"{API}/warm"):
                    if event.get("event") == "start":
                        same_dataset(config, event.get("dataset"))  # before a byte is counted as ours
                        say_notices(event.get("notices"), self.settings.local_dir / "notices")
                    yield event
        except DatacacheError:
            raise  # the daemon's own answer (a missing bucket, say), not a lost connection
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            raise self._unavailable(exc) from exc
