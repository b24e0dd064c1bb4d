"""`datacache top`: a live view of the node's data pipeline, per client and per tier.

Each refresh reads the daemon's ``/v1/top`` when one answers (a user sees their own clients, an
operator everyone's), and otherwise the node's catalog and the report files embedded readers
write under ``LOCAL_DIR/clients/``. ``--once`` prints one plain text frame, ``--json`` one JSON
object per refresh; the live view (rich, the ``top`` extra) takes keys: q quits, letters sort.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import sqlite3
import sys
import time
from collections.abc import Iterator
from typing import Any

from datacache._outage import cannot_stage_into, outage_path
from datacache.activity import read_report_files, user_name
from datacache.cli._common import Commands, add_settings_flags, one_line, settings_from
from datacache.cli._topview import SORTS, KeptClients, View, name_datasets, rich_frame, text_frame
from datacache.client import DaemonClient
from datacache.config import Settings
from datacache.errors import ConfigError, DatacacheError
from datacache.staging import LOCAL, SHARED, Stager

TIERS = ("local", "shared", "origin")

"""Sort keys of the live view: key -> (column, value of a client row)."""

_COUNTED = {
    "bytes_in": (LOCAL, SHARED),
    "bytes_out": ("origin", SHARED),
    "evictions": (LOCAL, SHARED),
    "declines": (LOCAL, SHARED),
}
"""Which tiers each counter applies to (the origin is never written or evicted; local is read by readers)."""

_TRANSFERS_FRESH = 3.0
"""Seconds a report file's transfers are shown for (readers report every second while they read)."""

_SHARED_USAGE_EVERY = 60.0  # walking a distributed filesystem is slow: once a minute at most


# -- one refresh: the frame --------------------------------------------------------------------


class Sampler:
    """Reads the node once per refresh and turns cumulative counters into rates."""

    def __init__(self, settings: Settings, interval: float) -> None:
        self.settings = settings
        self.interval = interval
        self._client: DaemonClient | None = None
        self._stager: Stager | None = None
        self._shared: tuple[float, dict[str, Any]] | None = None
        self._previous: tuple[float, dict[str, dict[str, int]]] | None = None
        self._kept = KeptClients()
        self.daemon_seen = False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
        if self._stager is not None:
            await self._stager.close()

    async def frame(self) -> dict[str, Any]:
        """One frame: clients, rank totals, tiers with rates, transfers, policies."""
        now = time.time()  # the frame's time: when its reading began
        socket_path = self.settings.daemon_socket
        daemon: dict[str, Any] = {"socket": str(socket_path), "answers": False, "error": None}
        document: dict[str, Any] | None = None
        if socket_path.exists() or self.daemon_seen:
            if self._client is None:
                self._client = DaemonClient(self.settings, connect_timeout=2.0, request_timeout=5.0)
            try:
                document = await self._client.top()
            except (DatacacheError, OSError) as exc:
                daemon["error"] = one_line(exc) if socket_path.exists() else f"no socket at {socket_path}"
        if document is not None:
            self.daemon_seen = True
            daemon.update(answers=True, pid=document.get("pid"), version=document.get("version"))
            frame = self._from_daemon(document)
        else:
            try:
                frame = await self._embedded(now)
            except (DatacacheError, OSError, sqlite3.Error) as exc:
                frame = _empty_frame(f"cannot read this node's catalog: {one_line(exc)}")
        frame["daemon"] = daemon
        frame["time"] = now
        frame["host"] = socket.gethostname()
        frame["interval_s"] = self.interval
        names = {config.id: name for name, config in self.settings.datasets.items()}
        names.update(frame.pop("names", {}))
        name_datasets(frame["clients"], names)
        frame["clients"] = current_epoch(self._kept.merged(frame["clients"], now))
        frame["ranks"] = _ranks(frame["clients"])
        self._rates(frame, time.monotonic())
        return frame

    def _from_daemon(self, document: dict[str, Any]) -> dict[str, Any]:
        clients = [_client_row(dict(c)) for c in document.get("clients", []) if isinstance(c, dict)]
        datasets = [d for d in document.get("datasets", []) if isinstance(d, dict)]
        return {
            "source": "daemon",
            "operator": bool(document.get("operator")),
            "clients": clients,
            "tiers": [dict(t) for t in document.get("tiers", [])],
            "counters": document.get("activity", {}),
            "transfers": [_transfer_row(t) for t in document.get("transfers", [])],
            "policies": {d["id"]: d.get("policy") for d in datasets},
            "names": {d["id"]: d["name"] for d in datasets if isinstance(d.get("name"), str) and d["name"] != d["id"]},
        }

    async def _embedded(self, now: float) -> dict[str, Any]:
        settings = self.settings
        tiers: list[dict[str, Any]] = []
        policies: dict[str, str] = {}
        note = None
        if cannot_stage_into(settings.local_dir):
            # The daemon's cache, its catalog not this user's to open: only this user's readers are shown.
            note = f"the node cache {settings.local_dir} is the daemon's: its tiers are shown through the daemon only"
        else:
            if self._stager is None:
                self._stager = Stager(settings, reconcile=False, inspect=True)  # shows, never serves
            tiers = await self._embedded_tiers(self._stager)
            policies = {record.id: record.policy for record in await self._stager.catalog.datasets()}
        files = await asyncio.to_thread(read_report_files, settings.local_dir, now=now)
        # A reader of a daemon that is away, and may not write its cache, reports into its own directory.
        for kind in ("outage", "own"):
            files += await asyncio.to_thread(read_report_files, outage_path(settings.local_dir, kind), now=now)
        clients, processes = _clients_of(files, now, policies)
        counters, transfers = _activity_of(processes, now)
        readers = {c.get("dataset") for c in clients}
        return {
            "source": "embedded",
            "operator": os.geteuid() == 0,
            "clients": clients,
            "tiers": tiers,
            "counters": counters,
            "transfers": transfers,
            "policies": {k: v for k, v in policies.items() if k in readers},
            **({"error": note} if note else {}),
        }

    async def _embedded_tiers(self, stager: Stager) -> list[dict[str, Any]]:
        """The local tier from the catalog; the shared tier's usage, read at most every few seconds (a walk)."""
        settings = self.settings
        used, count = await stager.catalog.usage()
        tiers: list[dict[str, Any]] = [
            {
                "tier": LOCAL,
                "path": str(settings.local_dir),
                "used_bytes": used,
                "shards": count,
                "capacity_bytes": settings.local_capacity,
            }
        ]
        if stager.shared is not None:
            if self._shared is None or time.monotonic() - self._shared[0] > _SHARED_USAGE_EVERY:
                usage = await stager.shared.usage()
                self._shared = (
                    time.monotonic(),
                    {
                        "tier": SHARED,
                        "path": str(settings.shared_dir),
                        "used_bytes": usage.used_bytes,
                        "shards": usage.object_count,
                        "capacity_bytes": settings.shared_capacity,
                    },
                )
            tiers.append(dict(self._shared[1]))
        return tiers

    def _rates(self, frame: dict[str, Any], now: float) -> None:
        """Per tier: usage, and bytes in / out, evictions and declines per second since the last frame."""
        counters: dict[str, dict[str, int]] = frame.pop("counters", {}) or {}
        previous = self._previous
        self._previous = (now, counters)
        elapsed = now - previous[0] if previous is not None else 0.0

        def rate(name: str, tier: str) -> float | None:
            if previous is None or elapsed <= 0 or tier not in _COUNTED[name]:
                return None
            before = previous[1].get(name, {}).get(tier, 0)
            after = counters.get(name, {}).get(tier, 0)
            return max(0, after - before) / elapsed  # a process that left takes its counters along

        known = {t["tier"]: t for t in frame["tiers"]}
        rows = []
        for tier in TIERS:
            row = known.get(tier, {"tier": tier}) if tier != "origin" else {"tier": "origin"}
            if tier not in known and tier == SHARED:
                continue
            row.update(
                bytes_in_per_s=rate("bytes_in", tier),
                bytes_out_per_s=rate("bytes_out", tier),
                evictions_per_s=rate("evictions", tier),
                declines_per_s=rate("declines", tier),
            )
            rows.append(row)
        frame["tiers"] = rows
        frame["totals"] = counters


def _empty_frame(error: str) -> dict[str, Any]:
    return {
        "source": "embedded",
        "error": error,
        "operator": os.geteuid() == 0,
        "clients": [],
        "tiers": [],
        "counters": {},
        "transfers": [],
        "policies": {},
    }


def _clients_of(
    files: list[dict[str, Any]], now: float, policies: dict[str, str]
) -> tuple[list[dict[str, Any]], dict[tuple[str, int], dict[str, Any]]]:
    """Each report file's reader as a client row, and each process's newest file (``policies`` updated)."""
    clients: list[dict[str, Any]] = []
    processes: dict[tuple[str, int], dict[str, Any]] = {}
    for document in files:
        reader = document.get("reader")
        if not isinstance(reader, dict):
            continue
        row = {
            **reader,
            "client": str(document.get("client")),
            "uid": document["uid"],
            "user": user_name(document["uid"]),
            "pid": document.get("pid"),
            "seconds_since_report": round(now - float(document["written"]), 3),
        }
        clients.append(_client_row(row))
        if isinstance(reader.get("dataset"), str) and isinstance(document.get("policy"), str):
            policies[reader["dataset"]] = document["policy"]
        # One stager per process: its counters once, from its newest file.
        ident = (str(document.get("host")), int(document.get("pid") or 0))
        if ident not in processes or processes[ident]["written"] < document["written"]:
            processes[ident] = document
    return clients, processes


def _activity_of(
    processes: dict[tuple[str, int], dict[str, Any]], now: float
) -> tuple[dict[str, dict[str, int]], list[dict[str, Any]]]:
    """The processes' counters summed per tier, and the transfers of those that reported lately."""
    counters: dict[str, dict[str, int]] = {}
    transfers: list[dict[str, Any]] = []
    for document in processes.values():
        for name, per_tier in (document.get("activity") or {}).items():
            into = counters.setdefault(name, {})
            for tier, value in per_tier.items():
                into[tier] = into.get(tier, 0) + int(value)
        if now - float(document["written"]) <= _TRANSFERS_FRESH:
            # A process writes its file when a reader reports: after its epoch, its transfers are history.
            transfers.extend(_transfer_row(t) for t in document.get("transfers", []))
    return counters, transfers


def _client_row(row: dict[str, Any]) -> dict[str, Any]:
    units = {tier: int(row.get(f"units_{tier}", 0) or 0) for tier in TIERS}
    opened = sum(units.values())
    row["hit_share"] = {tier: (count / opened if opened else 0.0) for tier, count in units.items()}
    target = row.get("target_bytes_per_s")
    workers = max(1, int(row.get("num_workers", 1) or 1))
    # A rank's target is shared by its readers.
    row["target_share_bytes_per_s"] = target / workers if target else None
    return row


def _transfer_row(transfer: dict[str, Any]) -> dict[str, Any]:
    size = transfer.get("size")
    done = int(transfer.get("bytes", 0))
    return {**transfer, "progress": min(1.0, done / size) if size else None}


def current_epoch(clients: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The clients less readers of an epoch their rank has left (a DataLoader starts new workers each
    epoch; the daemon keeps the old ones' last reports until they expire): not listed, not summed."""
    newest: dict[tuple[Any, ...], int] = {}
    for client in clients:
        if "rank" in client:
            key = (client.get("uid"), client.get("dataset"), client["rank"])
            newest[key] = max(newest.get(key, 0), int(client.get("epoch", 0)))
    return [
        client
        for client in clients
        if "rank" not in client
        or int(client.get("epoch", 0)) >= newest[(client.get("uid"), client.get("dataset"), client["rank"])]
    ]


def _ranks(clients: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rank's readers summed as ``ds.stats()`` sums them."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for client in clients:
        if "rank" in client:
            groups.setdefault((client.get("uid"), client.get("dataset"), client["rank"]), []).append(client)
    ranks = []
    for (uid, dataset, rank), readers in sorted(groups.items(), key=lambda item: str(item[0])):
        samples = sum(int(r.get("samples", 0)) for r in readers)
        nbytes = sum(int(r.get("delivered_bytes", 0)) for r in readers)
        started = min(float(r.get("started", 0.0)) for r in readers)
        ended = max(float(r.get("updated", 0.0)) for r in readers)
        seconds = max(ended - started, 1e-9)
        reader_time = sum(max(float(r.get("updated", 0)) - float(r.get("started", 0)), 1e-9) for r in readers)
        wait = sum(float(r.get("wait_seconds", 0.0)) for r in readers)
        units = {tier: sum(int(r.get(f"units_{tier}", 0)) for r in readers) for tier in TIERS}
        opened = sum(units.values())
        target = readers[0].get("target_bytes_per_s")
        rate = nbytes / seconds
        ranks.append(
            {
                "uid": uid,
                "user": readers[0].get("user"),
                "dataset": dataset,
                "dataset_name": readers[0].get("dataset_name"),
                "between_epochs": all(r.get("between_epochs") for r in readers),
                "rank": rank,
                "epoch": max(int(r.get("epoch", 0)) for r in readers),
                "readers": len(readers),
                "samples": samples,
                "bytes": nbytes,
                "bytes_per_second": rate,
                "samples_per_second": samples / seconds,
                "reader_wait_fraction": min(1.0, wait / reader_time) if reader_time > 0 else 0.0,
                "prefetch_depth": max(int(r.get("prefetch_depth", 0)) for r in readers),
                "hit_ratio": {tier: (count / opened if opened else 0.0) for tier, count in units.items()},
                "target_bandwidth": target,
                "meets_target": None if not target or samples == 0 else rate >= target,
            }
        )
    return ranks


async def _top(args: argparse.Namespace) -> int:
    if not 0.05 <= args.interval <= 3600:
        raise ConfigError(f"--interval: must be between 0.05 and 3600 seconds, got {args.interval:g}")
    if args.sort not in SORTS:
        raise ConfigError(f"--sort: unknown key {args.sort!r} (choose from {', '.join(SORTS)})")
    settings = settings_from(args)
    sampler = Sampler(settings, args.interval)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        if args.once:
            # Rates need two readings: the frame is the second, one interval after the first.
            await sampler.frame()
            await _pause(stop, args.interval)
            frame = await sampler.frame()
            _write(json.dumps(frame) + "\n" if args.json else text_frame(frame, sort=args.sort))
            return 0
        if args.json:
            while not stop.is_set():
                _write(json.dumps(await sampler.frame()) + "\n")
                await _pause(stop, args.interval)
            return 0
        if not sys.stdout.isatty():
            while not stop.is_set():
                _write(text_frame(await sampler.frame(), sort=args.sort) + "\n")
                await _pause(stop, args.interval)
            return 0
        return await _live(sampler, args.interval, View(args.sort, args.reverse), stop)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await sampler.close()


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds`` (the refresh interval), or less if asked to stop."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


@contextlib.contextmanager
def _keys(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[str]) -> Iterator[None]:
    """Keys typed on the terminal, one character at a time, into ``queue`` (no echo, no Enter)."""
    import termios
    import tty

    fd = sys.stdin.fileno()
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def readable() -> None:
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        for char in data.decode(errors="replace"):
            queue.put_nowait(char)

    loop.add_reader(fd, readable)
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _live(sampler: Sampler, interval: float, view: View, stop: asyncio.Event) -> int:
    try:
        from rich.console import Console
        from rich.live import Live
    except ImportError:
        raise ConfigError(
            "the live view of datacache top needs rich: pip install 'datacache[top]' (or use --once / --json)"
        ) from None
    loop = asyncio.get_running_loop()
    keys: asyncio.Queue[str] = asyncio.Queue()
    console = Console()
    frame = await sampler.frame()
    with _keys(loop, keys), Live(console=console, screen=True, auto_refresh=False) as live:
        due = time.monotonic() + interval
        while not stop.is_set():
            live.update(rich_frame(frame, view), refresh=True)
            waiter = asyncio.ensure_future(keys.get())
            stopper = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait(
                {waiter, stopper}, timeout=max(0.0, due - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
            )
            for task in (waiter, stopper):
                if task not in done:
                    task.cancel()
            if waiter in done:
                key = waiter.result()
                if key in ("q", "Q", "\x1b"):
                    break
                if key in SORTS:
                    view.reverse = not view.reverse if key == view.sort else key in "bpsfh"
                    view.sort = key
                elif key == "r":
                    view.reverse = not view.reverse
                if time.monotonic() < due:
                    continue  # re-sort the frame shown; the next reading stays on time
            if time.monotonic() >= due:
                frame = await sampler.frame()
                due = time.monotonic() + interval
    return 0


def add_parsers(commands: Commands) -> None:
    """Add ``top`` to the command's subcommands."""
    top = commands.add_parser("top", help="a live view of this node's data pipeline: per client and per tier (q quits)")
    add = top.add_argument
    add("--once", action="store_true", help="print one frame as plain text (or one JSON object with --json) and exit")
    add("--json", action="store_true", help="one JSON object per refresh, for scripts")
    add("--interval", metavar="SECONDS", type=float, default=1.0, help="seconds between refreshes (default 1)")
    add(
        "--sort",
        metavar="KEY",
        default="c",
        help="sort clients by: " + ", ".join(f"{key} {name}" for key, (name, _) in SORTS.items()) + " (default c)",
    )
    add("--reverse", action="store_true", help="sort in descending order")
    add_settings_flags(top)
    top.set_defaults(run=_top)
