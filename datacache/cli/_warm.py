"""`datacache warm`: in this process, or through the node's daemon when one answers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
from typing import Any

import braceexpand

from datacache._progress import Progress
from datacache._protocol import warm_report_from_wire, warm_report_to_wire
from datacache.access import ShardAccess
from datacache.cli._common import (
    Commands,
    add_settings_flags,
    bandwidth_flag,
    daemon_client,
    plural,
    progress_mode,
    settings_from,
)
from datacache.client import DaemonClient
from datacache.config import POLICIES, DatasetConfig, Settings, resolve_dataset
from datacache.errors import ConfigError, DaemonUnavailableError, DatacacheError, ShardNotFoundError
from datacache.loaders.prestage import JobLayout, prestage_keys
from datacache.sizes import format_bytes, format_rate
from datacache.staging import LOCAL, SHARED, Stager, WarmProgress, WarmReport
from datacache.tiers import redact_url


def _pattern_to_shards(args: argparse.Namespace) -> None:
    """A brace pattern (``dir/shard-{0000..0099}.tar``) warms those shards of ``dir``'s dataset.

    The same cached copies as the directory URL and as the loader's pattern: the directory
    is the dataset, the expanded names its ``--shards``.
    """
    text = args.dataset
    if "{" not in text and "}" not in text:
        return
    try:
        urls = list(braceexpand.braceexpand(text))
    except ValueError as exc:  # braceexpand's UnbalancedBracesError
        raise ConfigError(f"pattern {redact_url(text)!r}: {exc}") from None
    if any("{" in url or "}" in url for url in urls) or any("/" not in url for url in urls):
        raise ConfigError(
            f"pattern {redact_url(text)!r}: a pattern is DIR/name-{{a,b,c}} or DIR/name-{{000..099}}, "
            "expanding to shard names in one directory"
        )
    folders = {url.rsplit("/", 1)[0] for url in urls}
    if len(folders) != 1:
        raise ConfigError(f"pattern {redact_url(text)!r} names shards in {len(folders)} directories: warm each one")
    if args.shards is not None:
        raise ConfigError("give a brace pattern or --shards, not both")
    args.dataset = folders.pop() + "/"
    args.shards = ",".join(url.rsplit("/", 1)[1] for url in urls)
    args.pattern = redact_url(text)  # what errors name: the user's pattern, as the loader's do


async def _warm(args: argparse.Namespace) -> int:
    _pattern_to_shards(args)
    job = _job_of(args)
    settings = settings_from(
        args, concurrency=args.concurrency, bandwidth_limit=bandwidth_flag(args)
    )
    dataset = _dataset_of(args.dataset, settings, args.policy)
    if not args.no_daemon:
        client = await daemon_client(settings)
        if client is not None:  # the daemon writes the shared tier with its own authority
            try:
                if job is not None:
                    capacity = await _tier_capacity(client, args.tier)
                    args.shards = await _ordered(args, client, dataset, settings, job, capacity)
                return await _warm_through(client, args, dataset, settings)
            finally:
                await client.close()
    if args.tier == SHARED:
        _check_shared_writable(settings)
    async with Stager(settings) as stager:
        if job is not None:
            capacity = settings.local_capacity if args.tier == LOCAL else settings.shared_capacity
            args.shards = await _ordered(args, stager, dataset, settings, job, capacity)
        report = await _warm_here(args, stager, dataset, settings)
    tier = stager.local if args.tier == LOCAL else stager.shared
    _print_warm_report(report, redact_url(dataset.url), args, tier.capacity if tier is not None else None)
    return 0 if report.complete else 1


def _job_of(args: argparse.Namespace) -> JobLayout | None:
    """The job ``--order-for`` names (checked before anything is opened), or None."""
    if args.order_for is None:
        return None
    if args.shards is not None:
        raise ConfigError("give --order-for or --shards (or a brace pattern), not both")
    return JobLayout.parse(args.order_for)


async def _ordered(
    args: argparse.Namespace,
    access: ShardAccess,
    dataset: DatasetConfig,
    settings: Settings,
    job: JobLayout,
    capacity: int | None,
) -> str:
    """The ``--shards`` of a prestage: the job's node-first order, as much of it as the tier holds."""
    handle = await access.open(dataset, refresh=args.refresh)
    keys = await prestage_keys(access, handle, settings, job)
    sizes = {shard.key: shard.size for shard in handle.manifest.shards}
    chosen: list[str] = []
    room = capacity
    for key in keys:
        if room is not None and sizes[key] > room:
            break  # a later shard would evict the first ones the job reads
        chosen.append(key)
        room = None if room is None else room - sizes[key]
    if not args.quiet and not args.json:
        ranks = job.ranks
        sys.stderr.write(
            f"datacache: prestage for ranks {ranks.start}-{ranks.stop - 1} of {job.world_size} (seed {job.seed}): "
            f"{plural(len(chosen), 'shard')} of {len(keys)}, in the order they read them\n"
        )
    if not chosen:
        raise ConfigError(f"--order-for: the first shard the job reads does not fit the {args.tier} tier")
    return ",".join(chosen)


async def _tier_capacity(client: DaemonClient, tier: str) -> int | None:
    """The capacity of the daemon's ``tier`` (None where it has none, or cannot say)."""
    try:
        status = await client.status()
    except DatacacheError:
        return None
    found = [t.get("capacity_bytes") for t in status.get("tiers", ()) if t.get("tier") == tier]
    return found[0] if found and isinstance(found[0], int) else None


async def _warm_here(
    args: argparse.Namespace, stager: Stager, dataset: DatasetConfig, settings: Settings
) -> WarmReport:
    """Warm in this process (no daemon answered, or --no-daemon)."""
    handle = await stager.open(dataset, refresh=args.refresh)
    if args.pattern is not None:
        keys = args.shards.split(",")
        shards = list(handle.manifest.named(keys, label=args.pattern, url=handle.config.url))
    else:
        shards = handle.manifest.select(args.shards)
    if not shards:
        raise ConfigError(f"--shards {args.shards!r} selects no shard of {handle.manifest.dataset}")
    display = _warm_display(args, f"warm {_shown(dataset)}", len(shards), sum(s.size for s in shards))

    def follow(progress: WarmProgress) -> None:
        display.advance_to(
            done_items=progress.shards_done,
            done_bytes=progress.bytes_done,
            moved_bytes=progress.bytes_transferred,
            not_kept=progress.shards_not_kept,
        )

    async def ticker() -> None:
        while True:
            await asyncio.sleep(1.0)
            display.tick()

    ticking = asyncio.create_task(ticker())
    try:
        return await stager.warm(
            handle, shards, tier=args.tier, verify=args.verify, bandwidth=settings.bandwidth_limit, progress=follow
        )
    finally:
        ticking.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticking
        display.close()


def _dataset_of(spec: str, settings: Settings, policy: str | None) -> DatasetConfig:
    """The dataset ``spec`` names: a URL, a path, a configured name, or an id `ls` printed (as `evict` takes)."""
    try:
        return resolve_dataset(spec, settings, policy=policy)
    except ConfigError:
        catalog = settings.local_dir / "catalog.sqlite"
        if "/" in spec or not catalog.is_file() or not os.access(catalog, os.R_OK):
            raise  # a job user's node catalog is the daemon's: the name's own error, not EACCES
        from datacache.catalog import Catalog

        records = {record.id: record for record in Catalog(catalog).run_sync(Catalog.datasets_sync)}
        record = records.get(spec)
        if record is None:
            raise
    dataset = resolve_dataset(record.url, settings, policy=policy)
    if dataset.id != spec:  # opened with options (an endpoint) the catalog does not keep
        raise ConfigError(
            f"dataset {spec}: warm it by the URL or configured name it was opened with ({redact_url(record.url)})"
        )
    return dataset


def _shown(dataset: DatasetConfig) -> str:
    """How a progress line names the dataset: by its config name, else by the URL given (not its id)."""
    return dataset.name if dataset.name != dataset.id else redact_url(dataset.url)


def _warm_display(args: argparse.Namespace, what: str, shards: int, total_bytes: int) -> Progress:
    """The progress display of a warm, in-process or through the daemon alike."""
    return Progress(
        what=what,
        total_items=shards,
        total_bytes=total_bytes,
        mode=progress_mode(args),
        stream=sys.stderr if not args.json else sys.stdout,
    )


def _check_shared_writable(settings: Settings) -> None:
    """Refuse `--tier shared` in this process (no daemon answered) when it has no shared tier it may write."""
    daemon = "start the node's daemon (datacache serve), which writes its shared tier, or "
    if settings.shared_dir is None:
        raise ConfigError(
            f"--tier shared needs a shared tier: {daemon}give --shared-dir (DATACACHE_SHARED_DIR, cache.shared_dir)"
        )
    if settings.shared_dir.exists() and not os.access(settings.shared_dir, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--tier shared: {settings.shared_dir} is not writable by this user: {daemon}ask its owner for write access"
        )


async def _warm_through(
    client: DaemonClient, args: argparse.Namespace, dataset: DatasetConfig, settings: Settings
) -> int:
    """Have the node's daemon warm the dataset (one transfer per shard for every process of the node)."""
    progress: Progress | None = None
    done: dict[str, Any] = {}
    try:
        async for event in client.warm(
            dataset,
            tier=args.tier,
            shards=args.shards,
            verify=args.verify,
            refresh=args.refresh,
            bandwidth=settings.bandwidth_limit,
        ):
            kind = event.get("event")
            if kind == "start":
                shards, total = event.get("shards_total", 0), event.get("bytes_total", 0)
                progress = _warm_display(args, f"warm {_shown(dataset)} (daemon)", int(shards), int(total))
            elif kind == "progress" and progress is not None:
                progress.advance_to(
                    done_items=int(event.get("shards_done", 0)),
                    done_bytes=int(event.get("bytes_done", 0)),
                    moved_bytes=int(event.get("bytes_transferred", 0)),
                    not_kept=int(event.get("shards_not_kept", 0)),
                )
            elif kind == "done":
                done = event
    except ShardNotFoundError as exc:
        if args.pattern is None:
            raise
        # The daemon names the first missing shard; the user wrote a pattern (the loader's words).
        raise ShardNotFoundError(f"{args.pattern} matches no shard: {exc}") from None
    finally:
        if progress is not None:
            progress.close()
    if not done:
        raise DaemonUnavailableError("the daemon ended the warm without a summary")
    report = warm_report_from_wire(done)
    # The daemon's capacity is its own configuration's, which this process may not share: ask it.
    no_room = any(failure[1].startswith(_NO_ROOM) for failure in report.failures)
    capacity = await _daemon_capacity(client, report) if no_room else None
    _print_warm_report(report, redact_url(dataset.url), args, capacity)
    return 0 if report.complete else 1


async def _daemon_capacity(client: DaemonClient, report: WarmReport) -> int | None:
    """The capacity of the daemon's tier ``report`` warmed (None where it has none, or cannot say)."""
    return await _tier_capacity(client, report.tier)


_NO_ROOM = ("not kept on the ", "evicted from the ")
"""How the stager's warm says a shard found no room on the tier (``staging/warm.py``), not that it failed."""


def _print_warm_report(report: WarmReport, url: str, args: argparse.Namespace, capacity: int | None) -> None:
    """The summary on stdout; on stderr, why shards are not resident: lack of room in one line, errors each."""
    if args.json:
        sys.stdout.write(json.dumps(warm_report_to_wire(report, url)) + "\n")
        return
    if report.bytes_transferred == 0 and report.complete:
        moved = "transferred 0 bytes: everything was already resident"
    else:
        moved = (
            f"transferred {format_bytes(report.bytes_transferred)} in {plural(report.shards_transferred, 'shard')}, "
            f"{report.seconds:.1f}s ({format_rate(report.rate)})"
        )
    verified = f", {report.shards_verified} re-verified" if report.shards_verified else ""
    held = format_bytes(report.bytes_resident)
    if report.bytes_resident != report.bytes_requested:
        held += f" of {format_bytes(report.bytes_requested)}"
    displaced = ""
    if report.shards_displaced:
        displaced = (
            f"; made room by evicting {plural(report.shards_displaced, 'other shard')} of the dataset "
            f"({format_bytes(report.bytes_displaced)})"
        )
    sys.stdout.write(
        f"warm {url} -> {report.tier}: {report.shards_resident}/{report.shards_requested} shards resident "
        f"({held}){verified}; {moved}{displaced}\n"
    )
    no_room = [failure for failure in report.failures if failure[1].startswith(_NO_ROOM)]
    if no_room:
        # A dataset bigger than the tier is a size to state, not one error per shard.
        sys.stderr.write(f"datacache: {_no_room_line(report, capacity, whole=args.shards is None)}\n")
    shown = report.failures if args.verbose else [f for f in report.failures if f not in no_room]
    limit = len(shown) if args.verbose else 10
    for key, error in shown[:limit]:
        sys.stderr.write(f"datacache: shard {key}: {error}\n")
    if len(shown) > limit:
        sys.stderr.write(f"datacache: ... and {len(shown) - limit} more failed shards\n")
    if not report.complete:
        sys.stderr.write(
            f"datacache: error: warm incomplete: {report.shards_requested - report.shards_resident} of "
            f"{report.shards_requested} shards are not resident on the {report.tier} tier\n"
        )


_DEVICE_FULL = re.compile(r"the \w+ device is nearly full \([^)]*\)")
"""How a shard's reason names a full disk (`catalog.room`), whatever the capacity says."""


def _no_room_line(report: WarmReport, capacity: int | None, *, whole: bool) -> str:
    """``dataset 122.00 MB > local capacity 40.00 MB: 13 of 40 shards kept (-v lists the others)``."""
    what = f"{'dataset' if whole else 'the requested shards'} {format_bytes(report.bytes_requested)}"
    device = next((found for _, why in report.failures if (found := _DEVICE_FULL.search(why))), None)
    if device is not None:  # the disk ran out before the capacity did (a trial's 200 MB tier on 5.7 MB free)
        what += f" {'does' if whole else 'do'} not fit: {device.group(0)}"
    elif capacity is not None and report.bytes_requested > capacity:
        what += f" > {report.tier} capacity {format_bytes(capacity)}"
    else:  # the tier's room, not its capacity, ran out: other data, or a full device
        evict = "datacache evict DATASET" + (" --tier shared" if report.tier == SHARED else "")
        what += (
            f" {'does' if whole else 'do'} not fit in the room left on the {report.tier} tier "
            f"(`datacache ls` shows what holds it, `{evict}` frees it)"
        )
    return f"{what}: {report.shards_resident} of {report.shards_requested} shards kept (-v lists the others)"


def add_parsers(commands: Commands) -> None:
    """Add ``warm`` to the command's subcommands."""
    warm = commands.add_parser("warm", help="stage a dataset onto a tier; exits 0 only when all of it is resident")
    warm.add_argument(
        "dataset",
        help="a URL (s3://bucket/prefix/, /path, file://...), a configured name, or a brace pattern of shards "
        "in one directory (quoted: 's3://bucket/prefix/shard-{0000..0099}.tar')",
    )
    warm.add_argument("--tier", choices=(LOCAL, SHARED), default=LOCAL, help="where to stage to (default: local)")
    warm.add_argument("--shards", metavar="SPEC", help="only these shards: START:STOP or N indexes, or key,key,...")
    warm.add_argument("--concurrency", metavar="N", help="shards transferred at once (default 8)")
    warm.add_argument("--bandwidth", metavar="LIMIT", help="cap origin reads, with a unit: 200MB/s")
    warm.add_argument(
        "--verify",
        action="store_true",
        help="re-hash resident shards against the checksums recorded when they were staged (bytes, not format)",
    )
    warm.add_argument("--refresh", action="store_true", help="list the origin again instead of the saved manifest")
    warm.add_argument(
        "--policy", choices=POLICIES, help="eviction policy for this dataset"
    )
    warm.add_argument(
        "--order-for",
        metavar="JOB",
        help="prestage for a queued job, the shards this node's ranks read first in epoch 0 first: "
        "seed=N,world_size=N,node_rank=N,ranks_per_node=N (and shuffle=, shuffle_buffer=, drop_last= "
        "as the loader was given); as many as the tier holds",
    )
    warm.add_argument("--json", action="store_true", help="machine-readable progress and summary, one JSON per line")
    warm.add_argument("-q", "--quiet", action="store_true", help="no progress output, only the summary")
    warm.add_argument(
        "--no-daemon", action="store_true", help="stage in this process even if the node's daemon is running"
    )
    add_settings_flags(warm)
    warm.set_defaults(run=_warm, pattern=None)
