"""The ``datacache`` command: warm, ls, status, evict, and the programs built on them.

Every failure ends with one line on stderr naming what is wrong, and a
non-zero exit status: 1 for a failed operation, 2 for bad usage, 130 when
interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import grp
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from datacache import __version__
from datacache._logging import configure_logging
from datacache._progress import Progress
from datacache._protocol import warm_report_from_wire, warm_report_to_wire
from datacache.client import DaemonClient
from datacache.config import DatasetConfig, Settings, load_settings, resolve_dataset
from datacache.errors import ConfigError, DaemonUnavailableError, DatacacheError
from datacache.indexing import WIDS_INDEX_NAME, index_dataset, node_plan_path
from datacache.stager import LOCAL, SHARED, Stager, StagingEvent, WarmReport
from datacache.tiers import redact_url
from datacache.units import format_bytes, format_rate

__all__ = ["main", "parse_args", "serve_settings"]

logger = logging.getLogger("datacache.cli")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit status 2
        # Arguments are echoed in usage errors: a URL among them may carry credentials.
        self.exit(2, f"datacache: error: {redact_url(message)} (see 'datacache --help')\n")


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cache settings (override the config file and DATACACHE_* variables)")
    group.add_argument(
        "--config", metavar="FILE", help="TOML config file (default: DATACACHE_CONFIG, else the user's config dir)"
    )
    group.add_argument("--local-dir", metavar="DIR", help="local tier directory (DATACACHE_LOCAL_DIR)")
    group.add_argument("--local-capacity", metavar="SIZE", help="local tier capacity, e.g. 500GB")
    group.add_argument("--shared-dir", metavar="DIR", help="shared tier directory on the cluster filesystem")
    group.add_argument("--shared-capacity", metavar="SIZE", help="shared tier capacity, e.g. 20TB")
    group.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    group.add_argument("--log-json", action="store_true", help="log one JSON object per line")


def _settings(args: argparse.Namespace, env: Mapping[str, str] | None = None, **extra: Any) -> Settings:
    overrides = {
        "local_dir": args.local_dir,
        "local_capacity": args.local_capacity,
        "shared_dir": args.shared_dir,
        "shared_capacity": args.shared_capacity,
        **extra,
    }
    return load_settings(env, config_path=args.config, overrides=overrides)


def _progress_mode(args: argparse.Namespace) -> str:
    if getattr(args, "json", False):
        return "json"
    if getattr(args, "quiet", False):
        return "quiet"
    return "bar" if sys.stderr.isatty() else "lines"


# -- warm -------------------------------------------------------------------------------------


async def _warm(args: argparse.Namespace) -> int:
    settings = _settings(
        args, concurrency=args.concurrency, bandwidth_limit=args.bandwidth
    )
    dataset = resolve_dataset(args.dataset, settings, policy=args.policy)
    if args.tier == SHARED and settings.shared_dir is None:
        raise ConfigError("--tier shared needs a shared tier (--shared-dir, DATACACHE_SHARED_DIR or cache.shared_dir)")
    if not args.no_daemon:
        client = await _daemon_client(settings)
        if client is not None:
            try:
                return await _warm_through(client, args, dataset, settings)
            finally:
                await client.close()
    out = sys.stdout
    async with Stager(settings) as stager:
        handle = await stager.open(dataset, refresh=args.refresh)
        shards = handle.manifest.select(args.shards)
        if not shards:
            raise ConfigError(f"--shards {args.shards!r} selects no shard of {handle.manifest.dataset}")
        progress = Progress(
            what=f"warm {dataset.name}",
            total_items=len(shards),
            total_bytes=sum(s.size for s in shards),
            mode=_progress_mode(args),
            stream=sys.stderr if not args.json else out,
        )
        wanted = {s.key for s in shards}

        def listen(event: StagingEvent) -> None:
            if event.dataset != handle.id or event.key not in wanted or event.tier != args.tier:
                return
            if event.kind == "bytes":
                progress.moved(event.size)
            elif event.kind == "hit":
                progress.item_done(event.size, transferred=0)
            elif event.kind == "staged":
                progress.item_done(event.size, transferred=event.size)

        async def ticker() -> None:
            while True:
                await asyncio.sleep(1.0)
                progress.tick()

        stager.add_listener(listen)
        ticking = asyncio.create_task(ticker())
        try:
            report = await stager.warm(
                handle, shards, tier=args.tier, verify=args.verify, bandwidth=settings.bandwidth_limit
            )
        finally:
            ticking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticking
            progress.close()
    _print_warm_report(report, redact_url(dataset.url), args.json)
    return 0 if report.complete else 1


async def _daemon_client(settings: Settings) -> DaemonClient | None:
    """A client of the node's daemon if one answers on its socket, else None (work in-process)."""
    if not settings.daemon_socket.exists():
        return None
    client = DaemonClient(settings)
    try:
        await client.health()
    except DaemonUnavailableError as exc:
        await client.close()
        logger.info("%s; working in this process", exc)
        return None
    return client


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
                progress = Progress(
                    what=f"warm {dataset.name} (daemon)",
                    total_items=int(event.get("shards", 0)),
                    total_bytes=int(event.get("bytes", 0)),
                    mode=_progress_mode(args),
                    stream=sys.stderr if not args.json else sys.stdout,
                )
            elif kind == "progress" and progress is not None:
                progress.advance_to(
                    done_items=int(event.get("shards_done", 0)),
                    done_bytes=int(event.get("bytes_done", 0)),
                    moved_bytes=int(event.get("bytes_transferred", 0)),
                )
            elif kind == "done":
                done = event
    finally:
        if progress is not None:
            progress.close()
    if not done:
        raise DaemonUnavailableError("the daemon ended the warm without a summary")
    report = warm_report_from_wire(done)
    _print_warm_report(report, redact_url(dataset.url), args.json)
    return 0 if report.complete else 1


def _print_warm_report(report: WarmReport, url: str, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(warm_report_to_wire(report, url)) + "\n")
        return
    if report.bytes_transferred == 0 and report.complete:
        moved = "transferred 0 bytes: everything was already resident"
    else:
        moved = (
            f"transferred {format_bytes(report.bytes_transferred)} in {report.shards_transferred} shards, "
            f"{report.seconds:.1f}s ({format_rate(report.rate)})"
        )
    verified = f", {report.shards_verified} re-verified" if report.shards_verified else ""
    sys.stdout.write(
        f"warm {url} -> {report.tier}: {report.shards_resident}/{report.shards_requested} shards resident "
        f"({format_bytes(report.bytes_requested)}){verified}; {moved}\n"
    )
    for key, error in report.failures[:10]:
        sys.stderr.write(f"datacache: shard {key}: {error}\n")
    if len(report.failures) > 10:
        sys.stderr.write(f"datacache: ... and {len(report.failures) - 10} more failed shards\n")
    if not report.complete:
        sys.stderr.write(
            f"datacache: error: warm incomplete: {report.shards_requested - report.shards_resident} of "
            f"{report.shards_requested} shards are not resident on the {report.tier} tier\n"
        )


# -- ls, status, evict ------------------------------------------------------------------------


async def _ls(args: argparse.Namespace) -> int:
    settings = _settings(args)
    async with Stager(settings) as stager:
        await stager.reconcile()
        records = await stager.catalog.datasets()
        entries = await stager.catalog.entries()
        rows: list[dict[str, Any]] = []
        for record in records:
            local = [e for e in entries if e.dataset == record.id and e.state == "resident"]
            shared_count = shared_bytes = 0
            if stager.shared is not None:
                async for info in stager.shared.list(f"{record.id}/"):
                    shared_count += 1
                    shared_bytes += info.size
            rows.append(
                {
                    "dataset": record.id,
                    "url": redact_url(record.url),
                    "format": record.format,
                    "policy": record.policy,
                    "pinned": record.pinned,
                    "shards": record.shard_count,
                    "bytes": record.total_bytes,
                    "local_shards": len(local),
                    "local_bytes": sum(e.size for e in local),
                    "shared_shards": shared_count if stager.shared is not None else None,
                    "shared_bytes": shared_bytes if stager.shared is not None else None,
                }
            )
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
        return 0
    if not rows:
        sys.stdout.write("no datasets yet (datacache warm URL stages one)\n")
        return 0
    header = f"{'DATASET':<32} {'FORMAT':<8} {'SHARDS':>7} {'SIZE':>11} {'LOCAL':>22} {'SHARED':>22}  URL"
    sys.stdout.write(header + "\n")
    for row in rows:
        total = row["bytes"] or 0

        def residency(count: int | None, size: int | None, row: dict[str, Any] = row, total: int = total) -> str:
            if count is None or size is None:
                return "-"
            share = f"{100 * size / total:.0f}%" if total else "-"
            return f"{count}/{row['shards']} {share} {format_bytes(size)}"

        sys.stdout.write(
            f"{row['dataset']:<32} {row['format'] or '?':<8} {row['shards'] or 0:>7} {format_bytes(total):>11} "
            f"{residency(row['local_shards'], row['local_bytes']):>22} "
            f"{residency(row['shared_shards'], row['shared_bytes']):>22}  {row['url']}\n"
        )
    return 0


async def _status(args: argparse.Namespace) -> int:
    settings = _settings(args)
    async with Stager(settings, reconcile=False) as stager:
        used, count = await stager.catalog.usage()
        local_usage = await stager.local.usage()
        tiers: list[dict[str, Any]] = [
            {
                "tier": LOCAL,
                "path": str(settings.local_dir),
                "used_bytes": used,
                "shards": count,
                "capacity_bytes": settings.local_capacity,
                "device_free_bytes": local_usage.device_free_bytes,
            }
        ]
        if stager.shared is not None:
            shared_usage = await stager.shared.usage()
            tiers.append(
                {
                    "tier": SHARED,
                    "path": str(settings.shared_dir),
                    "used_bytes": shared_usage.used_bytes,
                    "shards": shared_usage.object_count,
                    "capacity_bytes": settings.shared_capacity,
                    "device_free_bytes": shared_usage.device_free_bytes,
                }
            )
    socket_path = settings.daemon_socket
    document = {
        "version": __version__,
        "config": str(settings.config_path) if settings.config_path else None,
        "tiers": tiers,
        "daemon_socket": str(socket_path),
        "daemon_socket_present": socket_path.exists(),
    }
    if args.json:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return 0
    sys.stdout.write(f"datacache {__version__}; config: {document['config'] or 'none (defaults)'}\n")
    for tier in tiers:
        capacity = tier["capacity_bytes"]
        limit = format_bytes(capacity) if capacity else "unbounded"
        percent = f" ({100 * tier['used_bytes'] / capacity:.0f}%)" if capacity else ""
        free = tier["device_free_bytes"]
        sys.stdout.write(
            f"{tier['tier']:<7} {tier['path']}: {format_bytes(tier['used_bytes'])} of {limit}{percent} in "
            f"{tier['shards']} shards; device free {format_bytes(free) if free is not None else '?'}\n"
        )
    daemon = "present" if document["daemon_socket_present"] else "absent"
    sys.stdout.write(f"daemon  socket {socket_path}: {daemon}\n")
    return 0


async def _evict(args: argparse.Namespace) -> int:
    settings = _settings(args)
    client = None if args.forget else await _daemon_client(settings)
    if client is not None:
        # The daemon owns the node's cache: let it evict, so its state stays true.
        try:
            dataset_id = args.dataset if "://" not in args.dataset and "/" not in args.dataset else None
            if dataset_id is None or dataset_id in settings.datasets:
                dataset_id = resolve_dataset(args.dataset, settings).id
            keys = [k.strip() for k in args.shards.split(",") if k.strip()] if args.shards else None
            tiers = (LOCAL, SHARED) if args.tier == "all" else (args.tier,)
            count = size = 0
            for tier in tiers:
                c, s = await client.evict(dataset_id, keys, tier=tier)
                count, size = count + c, size + s
        finally:
            await client.close()
        sys.stdout.write(f"evicted {count} shards ({format_bytes(size)}) of {dataset_id} from {args.tier} (daemon)\n")
        return 0
    async with Stager(settings) as stager:
        records = {record.id: record for record in await stager.catalog.datasets()}
        if args.dataset in records:
            dataset_id = args.dataset
        else:
            dataset_id = resolve_dataset(args.dataset, settings).id
            if dataset_id not in records:
                raise ConfigError(f"dataset {args.dataset!r} has nothing cached on this node (see 'datacache ls')")
        keys = [k.strip() for k in args.shards.split(",") if k.strip()] if args.shards else None
        if args.tier == SHARED and stager.shared is None:
            raise ConfigError(
                "--tier shared: no shared tier is configured (--shared-dir, DATACACHE_SHARED_DIR or cache.shared_dir)"
            )
        count, size = 0, 0
        if args.tier in (LOCAL, "all"):
            c, s = await stager.evict(dataset_id, keys)
            count, size = count + c, size + s
        # "all" means every tier this node has; without a shared tier that is the local one.
        if args.tier in (SHARED, "all") and stager.shared is not None:
            c, s = await stager.evict_shared(dataset_id)
            count, size = count + c, size + s
        if args.forget:
            await stager.catalog.forget_dataset(dataset_id)
            await stager.manifests.delete(dataset_id)
    sys.stdout.write(f"evicted {count} shards ({format_bytes(size)}) of {dataset_id} from {args.tier}\n")
    return 0


# -- shard ------------------------------------------------------------------------------------


def _endpoint_for(spec: str, settings: Settings, *, source: bool) -> Any:
    from datacache.shard import Endpoint
    from datacache.tiers import split_scheme

    if source and spec in settings.datasets:
        dataset = settings.datasets[spec]
        return Endpoint(dataset.url, dict(dataset.storage_options))
    scheme, _ = split_scheme(spec)
    url = spec if "://" in spec else os.path.abspath(os.path.expanduser(spec))
    return Endpoint(url, dict(settings.storage_options.get(scheme, {})))


async def _shard(args: argparse.Namespace) -> int:
    from datacache.shard import ShardOptions, ShardPlan, shard_dataset
    from datacache.units import parse_size

    settings = _settings(args)
    options = ShardOptions(
        shard_size=parse_size(args.shard_size, what="--shard-size"),
        chunk_size=parse_size(args.chunk_size, what="--chunk-size"),
        group_by=args.group_by,
        label=args.label,
        prefix=args.prefix,
        workers=args.workers,
        concurrency=args.concurrency,
    )
    if args.scheduler and args.engine == "local":
        raise ConfigError("--scheduler needs --engine dask or --engine ray")
    source = _endpoint_for(args.src, settings, source=True)
    dest = _endpoint_for(args.dst, settings, source=False)
    out = sys.stdout

    def progress(plan: ShardPlan) -> Progress:
        return Progress(
            what=f"shard {redact_url(source.url)}",
            total_items=plan.objects,
            total_bytes=plan.input_bytes,
            mode=_progress_mode(args),
            stream=sys.stderr if not args.json else out,
            item_name="objects",
        )

    report = await shard_dataset(
        source,
        dest,
        options,
        engine=args.engine,
        scheduler=args.scheduler,
        source_format=args.format,
        progress=progress,
    )
    if args.json:
        out.write(json.dumps(report.to_json()) + "\n")
        return 0
    skipped = f"; skipped {report.skipped} objects without an extension" if report.skipped else ""
    out.write(
        f"shard {report.source} -> {report.dest}: {report.units} {report.kind} shards "
        f"({report.written} written, {report.kept} kept after verifying), {report.samples} samples from "
        f"{report.objects} objects, {format_bytes(report.output_bytes)}, {report.seconds:.1f}s "
        f"({report.objects_per_second:.0f} objects/s, {format_rate(report.bytes_per_second)}){skipped}\n"
    )
    return 0


# -- index ------------------------------------------------------------------------------------


async def _index(args: argparse.Namespace) -> int:
    from datacache.tiers import open_origin

    settings = _settings(args, concurrency=args.concurrency)
    dataset = resolve_dataset(args.dataset, settings)
    async with Stager(settings) as stager:
        handle = await stager.open(dataset, refresh=args.refresh)
        if handle.manifest.format.value != "tar":
            raise ConfigError(
                f"dataset {dataset.name} is {handle.manifest.format.value}: its counts need no index (tar shards only)"
            )
        writable = None
        if not args.no_write:
            writable = open_origin(dataset.url, storage_options=dataset.storage_options, writable=True)
        try:
            engine = None
            if args.engine != "local":
                engine = (args.engine, args.scheduler, dataset.url, dict(dataset.storage_options))
            elif args.scheduler:
                raise ConfigError("--scheduler needs --engine dask or --engine ray")
            outcome = await index_dataset(
                handle.origin, writable, handle.manifest, settings, rescan=args.rescan, engine=engine
            )
        finally:
            if writable is not None:
                await writable.close()
        if args.rescan:
            node_plan_path(settings.local_dir, handle.manifest).unlink(missing_ok=True)
    report = outcome.report
    total = sum(count.samples for count in outcome.counts.values())
    if args.json:
        sys.stdout.write(json.dumps({
            "dataset": dataset.name, "shards": report.shards, "samples": total, "scanned": report.scanned,
            "scanned_bytes": report.scanned_bytes, "sources": report.sources, "seconds": round(report.seconds, 3),
            "shared": str(outcome.shared) if outcome.shared else None, "beside_origin": outcome.beside_origin,
        }) + "\n")
        return 0
    known = ", ".join(f"{n} from {source}" for source, n in sorted(report.sources.items()))
    sys.stdout.write(
        f"index {redact_url(dataset.url)}: {report.shards} shards, {total} samples; "
        f"{report.scanned} scanned here ({format_bytes(report.scanned_bytes)}) in {report.seconds:.1f}s"
        f"{'; ' + known if known else ''}\n"
    )
    if outcome.beside_origin:
        sys.stdout.write(f"wrote {redact_url(outcome.beside_origin)}\n")
    elif not args.no_write:
        sys.stdout.write(f"not written beside the shards ({outcome.not_beside_origin}); kept on the shared tier\n")
    return 0


# -- serve, bench, plan -----------------------------------------------------------------------


def serve_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Settings:
    """The settings `datacache serve` runs with: its flags over ``env`` over the config file.

    ``env`` defaults to ``os.environ``; the deployment tests pass a container's environment.
    """
    return _settings(
        args,
        env,
        socket=args.socket,
        metrics_address=args.metrics_address,
        concurrency=args.concurrency,
        bandwidth_limit=args.bandwidth,
    )


async def _serve(args: argparse.Namespace) -> int:
    from datacache.daemon import DaemonOptions, serve
    from datacache.units import parse_bandwidth, parse_size

    # A daemon logs each event at info level: one line each, JSON with --log-json.
    configure_logging(
        max(1, args.verbose),
        json_format=args.log_json or os.environ.get("DATACACHE_LOG_FORMAT") == "json",
        rate_limited=("asyncio",),  # an EMFILE storm is a few lines, not megabytes of tracebacks
    )
    settings = serve_settings(args)
    if args.prefetch_slots is not None and args.prefetch_slots < 1:
        raise ConfigError(f"--prefetch-slots: must be at least 1, got {args.prefetch_slots}")
    if args.drain_timeout <= 0:
        raise ConfigError(f"--drain-timeout: must be positive, got {args.drain_timeout}")
    prefetch_bandwidth = None
    if args.prefetch_bandwidth:
        prefetch_bandwidth = parse_bandwidth(args.prefetch_bandwidth, what="--prefetch-bandwidth")
    options = DaemonOptions(
        prefetch_slots=args.prefetch_slots,
        prefetch_bandwidth=prefetch_bandwidth,
        drain_timeout=args.drain_timeout,
        allow_uids=frozenset(args.allow_uid or ()),
        allow_gids=frozenset(args.allow_gid or ()),
        allow_datasets=tuple(args.allow_dataset or ()),
        allow_endpoints=tuple(args.allow_endpoint or ()),
        allow_client_credentials=args.allow_client_credentials,
        socket_group=_group_id(args.socket_group) if args.socket_group else None,
        request_timeout=args.request_timeout,
        body_memory=parse_size(args.body_memory, what="--body-memory"),
        connections_per_client=args.connections_per_client,
    )
    if args.request_timeout <= 0 or (args.connections_per_client is not None and args.connections_per_client < 1):
        raise ConfigError("--request-timeout and --connections-per-client must be positive")
    return await serve(settings, options)


def _group_id(group: str) -> int:
    """A group given by name or number, as a gid; a clear error if there is no such group."""
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"--socket-group: no group named {group!r} on this machine") from None


async def _bench(args: argparse.Namespace) -> int:
    from datacache.bench import TIERS, format_bench, run_bench
    from datacache.units import parse_bandwidth, parse_size

    settings = _settings(args)
    dataset = resolve_dataset(args.dataset, settings) if args.dataset else None
    tiers = tuple(t.strip() for t in args.tiers.split(",") if t.strip()) if args.tiers else TIERS
    report = await run_bench(
        settings,
        dataset,
        gpus=args.gpus,
        per_gpu=parse_bandwidth(args.per_gpu, what="--per-gpu"),
        readers=args.readers,
        seconds=args.seconds,
        sample_bytes=parse_size(args.sample, what="--sample"),
        stage=not args.no_stage,
        tiers=tiers,
    )
    if args.json:
        sys.stdout.write(json.dumps(report.to_json(), indent=2) + "\n")
    else:
        sys.stdout.write(format_bench(report))
    return 0 if report.ok else 1


_MOST_GPUS_PER_NODE = 16
"""More GPUs per node than any common server holds: `plan --gpus` was likely the whole job's count."""


async def _plan(args: argparse.Namespace) -> int:
    from datacache.bench import format_plan, plan_tiers
    from datacache.units import parse_bandwidth, parse_size

    if args.nodes > 1 and args.gpus > _MOST_GPUS_PER_NODE:
        logger.warning(
            "--gpus is per node: %d GPUs per node x %d nodes = %d GPUs (for %d GPUs in all, pass --gpus %d)",
            args.gpus,
            args.nodes,
            args.gpus * args.nodes,
            args.gpus,
            max(1, args.gpus // args.nodes),
        )
    local_capacity = origin_bandwidth = None
    if args.local_capacity:
        local_capacity = parse_size(args.local_capacity, what="--local-capacity")
    if args.origin_bandwidth:
        origin_bandwidth = parse_bandwidth(args.origin_bandwidth, what="--origin-bandwidth")
    plan = plan_tiers(
        gpus=args.gpus,
        per_gpu=parse_bandwidth(args.per_gpu, what="--per-gpu"),
        dataset_bytes=parse_size(args.dataset, what="--dataset"),
        epochs=args.epochs,
        nodes=args.nodes,
        local_capacity=local_capacity,
        origin_bandwidth=origin_bandwidth,
    )
    if args.json:
        sys.stdout.write(json.dumps(plan.to_json(), indent=2) + "\n")
    else:
        sys.stdout.write(format_plan(plan))
    return 0


# -- the parser -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="datacache", description="Tiered caching of AI training data.")
    parser.add_argument("--version", action="version", version=f"datacache {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    warm = commands.add_parser("warm", help="stage a dataset onto a tier; exits 0 only when all of it is resident")
    warm.add_argument("dataset", help="a URL (s3://bucket/prefix/, /path, file://...) or a configured name")
    warm.add_argument("--tier", choices=(LOCAL, SHARED), default=LOCAL, help="where to stage to (default: local)")
    warm.add_argument("--shards", metavar="SPEC", help="only these shards: START:STOP or N indexes, or key,key,...")
    warm.add_argument("--concurrency", metavar="N", help="shards transferred at once (default 8)")
    warm.add_argument("--bandwidth", metavar="LIMIT", help="cap origin reads, e.g. 200MB/s")
    warm.add_argument("--verify", action="store_true", help="re-check resident shards' checksums")
    warm.add_argument("--refresh", action="store_true", help="list the origin again instead of the saved manifest")
    warm.add_argument(
        "--policy", choices=("auto", "lru", "nothrash", "belady"), help="eviction policy for this dataset"
    )
    warm.add_argument("--json", action="store_true", help="machine-readable progress and summary, one JSON per line")
    warm.add_argument("-q", "--quiet", action="store_true", help="no progress output, only the summary")
    warm.add_argument(
        "--no-daemon", action="store_true", help="stage in this process even if the node's daemon is running"
    )
    _add_settings_flags(warm)
    warm.set_defaults(run=_warm)

    ls = commands.add_parser("ls", help="datasets this node knows, and their residency per tier")
    ls.add_argument("--json", action="store_true")
    _add_settings_flags(ls)
    ls.set_defaults(run=_ls)

    status = commands.add_parser("status", help="usage and capacity of each tier")
    status.add_argument("--json", action="store_true")
    _add_settings_flags(status)
    status.set_defaults(run=_status)

    evict = commands.add_parser("evict", help="remove a dataset's shards from a tier")
    evict.add_argument("dataset", help="a URL, a configured name, or a dataset id from 'datacache ls'")
    evict.add_argument("--tier", choices=(LOCAL, SHARED, "all"), default=LOCAL,
                       help="local (default), shared, or all: every tier this node has")
    evict.add_argument("--shards", metavar="KEYS", help="only these shard keys, comma-separated")
    evict.add_argument("--forget", action="store_true", help="also forget the dataset and its saved manifest")
    _add_settings_flags(evict)
    evict.set_defaults(run=_evict)

    shard = commands.add_parser(
        "shard", help="pack a tree of small files into tar shards with an index (or re-chunk Parquet/Zarr)"
    )
    shard.add_argument("src", help="the tree to pack: any fsspec URL (s3://bucket/raw/, /path) or a configured name")
    shard.add_argument("dst", help="where the shards, their indexes and datacache-manifest.json go (any fsspec URL)")
    shard.add_argument("--shard-size", metavar="SIZE", default="256MB", help="target shard size (default 256MB)")
    shard.add_argument("--group-by", metavar="REGEX", help="regex whose first group is a file's sample key "
                       "(default: the path up to the first dot of the file name, as webdataset)")
    shard.add_argument("--label", metavar="REGEX", help="regex whose first group in a sample's path is its class, "
                       "stored as an index in a 'cls' field (e.g. '^([^/]+)/')")
    shard.add_argument("--workers", metavar="N", type=int, default=4, help="shards packed at once (default 4)")
    shard.add_argument("--concurrency", metavar="N", type=int, default=16,
                       help="GETs in flight per worker (default 16)")
    shard.add_argument("--engine", choices=("local", "dask", "ray"), default="local",
                       help="where shards are packed: this process, a Dask or a Ray cluster (default local)")
    shard.add_argument("--scheduler", metavar="ADDRESS",
                       help="the cluster: tcp://host:8786 (dask) or ray://host:10001 (ray); local when omitted")
    shard.add_argument("--format", choices=("auto", "files", "parquet", "zarr"), default="auto",
                       help="what SRC holds: small files (to tar shards), Parquet or a Zarr array (to re-chunk)")
    shard.add_argument("--chunk-size", metavar="SIZE", default="32MB",
                       help="Parquet row group / Zarr chunk target, uncompressed (default 32MB)")
    shard.add_argument("--prefix", default="shard", help="shard names: PREFIX-000000.tar (default shard)")
    shard.add_argument("--json", action="store_true", help="machine-readable progress and summary, one JSON per line")
    shard.add_argument("-q", "--quiet", action="store_true", help="no progress output, only the summary")
    _add_settings_flags(shard)
    shard.set_defaults(run=_shard)

    index = commands.add_parser(
        "index", help="count the samples of every tar shard once for the whole cluster; keep a wids index"
    )
    index.add_argument("dataset", help="a URL (s3://bucket/prefix/, /path) or a configured dataset name")
    index.add_argument("--concurrency", metavar="N", help="shards scanned at once on this node (default 8)")
    index.add_argument("--rescan", action="store_true",
                       help="forget the cluster's counts and the sidecar indexes; scan every shard again")
    index.add_argument("--no-write", action="store_true", help=f"do not write {WIDS_INDEX_NAME} beside the shards")
    index.add_argument("--refresh", action="store_true", help="list the origin again before indexing")
    index.add_argument("--engine", choices=("local", "dask", "ray"), default="local",
                       help="where shards are scanned: this node with the others (leases), or a Dask or Ray cluster")
    index.add_argument("--scheduler", metavar="ADDRESS",
                       help="the cluster: tcp://host:8786 (dask) or ray://host:10001 (ray); local when omitted")
    index.add_argument("--json", action="store_true", help="one JSON summary line")
    _add_settings_flags(index)
    index.set_defaults(run=_index)

    serve = commands.add_parser(
        "serve", help="run the per-node daemon: one cache and stager for every process of the node"
    )
    add = serve.add_argument
    add("--socket", metavar="PATH", help="the Unix socket (default LOCAL_DIR/daemon.sock)")
    add("--metrics-address", metavar="HOST:PORT",
        help="where /metrics, /healthz and /readyz listen (default 127.0.0.1:9464)")
    add("--concurrency", metavar="N", help="transfers at once (default 8)")
    add("--bandwidth", metavar="LIMIT", help="cap all origin reads, e.g. 2GB/s")
    add("--prefetch-slots", metavar="N", type=int,
        help="transfers prefetching may hold at once (default: 3/4 of --concurrency)")
    add("--prefetch-bandwidth", metavar="LIMIT", help="cap prefetch and warm traffic, e.g. 1GB/s")
    add("--drain-timeout", metavar="SECONDS", type=float, default=10.0,
        help="on SIGTERM, time running transfers get to finish (default 10)")
    add("--allow-uid", metavar="UID", type=int, action="append",
        help="also accept clients with this uid (root and the daemon's uid always are)")
    add("--allow-gid", metavar="GID", type=int, action="append",
        help="also accept clients with this gid (the daemon's gid always is)")
    add("--allow-dataset", metavar="PREFIX", action="append",
        help="origins other users' clients may open besides configured datasets (repeatable); "
        "also limits the daemon's own user")
    add("--allow-endpoint", metavar="URL", action="append",
        help="an endpoint other users' clients may name in storage_options (repeatable)")
    add("--allow-client-credentials", action="store_true",
        help="let other users' clients send credentials; the daemon then reads with theirs")
    add("--socket-group", metavar="GROUP",
        help="the group that owns the socket (mode 0660): its members can connect")
    add("--request-timeout", metavar="SECONDS", type=float, default=10.0,
        help="time a connection gets to send a request's headers, and again its body (default 10)")
    add("--body-memory", metavar="SIZE", default="256MB",
        help="request bodies held at once, all connections together (default 256MB)")
    add("--connections-per-client", metavar="N", type=int,
        help="connections one uid may hold (default: a quarter of what the open-file limit allows)")
    _add_settings_flags(serve)
    serve.set_defaults(run=_serve)

    bench = commands.add_parser(
        "bench", help="measure this node's read bandwidth per tier against a target (exit 1: short)"
    )
    add = bench.add_argument
    add("dataset", nargs="?",
        help="a URL or configured name (without one: disk tiers only, on temporary files)")
    add("--gpus", metavar="N", type=int, required=True, help="GPUs on this node")
    add("--per-gpu", metavar="BW", required=True, help="bandwidth each GPU needs, e.g. 1GB/s")
    add("--readers", metavar="N", type=int, help="parallel readers per tier (default max(4, GPUs))")
    add("--seconds", metavar="S", type=float, default=10.0, help="time per tier (default 10)")
    add("--sample", metavar="SIZE", default="2GB", help="bytes read per tier at most (default 2GB)")
    add("--tiers", metavar="LIST", help="which tiers: origin,shared,local (default all)")
    add("--no-stage", action="store_true",
        help="read only what is cached (default: stage the sample onto each tier first)")
    add("--json", action="store_true")
    _add_settings_flags(bench)
    bench.set_defaults(run=_bench)

    plan = commands.add_parser("plan", help="size the tiers for a job on paper")
    add = plan.add_argument
    add("--gpus", metavar="N", type=int, required=True,
        help="GPUs per node (the job has N x --nodes GPUs)")
    add("--per-gpu", metavar="BW", required=True, help="bandwidth each GPU needs, e.g. 1GB/s")
    add("--dataset", metavar="SIZE", required=True, help="dataset size, e.g. 12TB")
    add("--epochs", metavar="E", type=int, default=1)
    add("--nodes", metavar="K", type=int, default=1)
    add("--local-capacity", metavar="SIZE", help="NVMe per node the cache may use")
    add("--origin-bandwidth", metavar="BW", help="what the origin delivers (times the warm-up)")
    add("--json", action="store_true")
    add("-v", "--verbose", action="count", default=0, help=argparse.SUPPRESS)
    add("--log-json", action="store_true", help=argparse.SUPPRESS)
    plan.set_defaults(run=_plan)

    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a command line (without the program name) as `main` does."""
    return _parser().parse_args(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``datacache`` command; return its exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    configure_logging(args.verbose, json_format=args.log_json or os.environ.get("DATACACHE_LOG_FORMAT") == "json")
    try:
        result: int = asyncio.run(args.run(args))
    except KeyboardInterrupt:
        sys.stderr.write("datacache: interrupted; no partial file was left visible\n")
        return 130
    except DatacacheError as exc:
        sys.stderr.write(f"datacache: error: {_one_line(exc)}\n")
        return 2 if isinstance(exc, ConfigError) else 1
    except OSError as exc:
        sys.stderr.write(f"datacache: error: {_one_line(exc)}\n")
        return 1
    return result


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return redact_url(text[0]) if text else type(exc).__name__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
