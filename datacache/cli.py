"""The ``datacache`` command: warm, ls, status, evict, and the programs built on them.

Every failure ends with one line on stderr naming what is wrong, and a
non-zero exit status: 1 for a failed operation, 2 for bad usage, 130 when
interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from datacache import __version__
from datacache._logging import configure_logging
from datacache._progress import Progress
from datacache.config import Settings, load_settings, resolve_dataset
from datacache.errors import ConfigError, DatacacheError
from datacache.stager import LOCAL, SHARED, Stager, StagingEvent, WarmReport
from datacache.tiers import redact_url
from datacache.units import format_bytes, format_rate

__all__ = ["main"]

logger = logging.getLogger("datacache.cli")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit status 2
        self.exit(2, f"datacache: error: {message} (see 'datacache --help')\n")


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cache settings (override the config file and DATACACHE_* variables)")
    group.add_argument("--config", metavar="FILE", help="TOML config file (default: DATACACHE_CONFIG or ~/.config/datacache/config.toml)")
    group.add_argument("--local-dir", metavar="DIR", help="local tier directory (DATACACHE_LOCAL_DIR)")
    group.add_argument("--local-capacity", metavar="SIZE", help="local tier capacity, e.g. 500GB")
    group.add_argument("--shared-dir", metavar="DIR", help="shared tier directory on the cluster filesystem")
    group.add_argument("--shared-capacity", metavar="SIZE", help="shared tier capacity, e.g. 20TB")
    group.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    group.add_argument("--log-json", action="store_true", help="log one JSON object per line")


def _settings(args: argparse.Namespace, **extra: Any) -> Settings:
    overrides = {
        "local_dir": args.local_dir,
        "local_capacity": args.local_capacity,
        "shared_dir": args.shared_dir,
        "shared_capacity": args.shared_capacity,
        **extra,
    }
    return load_settings(config_path=args.config, overrides=overrides)


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
            report = await stager.warm(handle, shards, tier=args.tier, verify=args.verify)
        finally:
            ticking.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticking
            progress.close()
    _print_warm_report(report, redact_url(dataset.url), args.json)
    return 0 if report.complete else 1


def _print_warm_report(report: WarmReport, url: str, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(
            json.dumps(
                {
                    "event": "done",
                    "dataset": report.dataset,
                    "url": url,
                    "tier": report.tier,
                    "complete": report.complete,
                    "shards_requested": report.shards_requested,
                    "shards_resident": report.shards_resident,
                    "shards_transferred": report.shards_transferred,
                    "shards_verified": report.shards_verified,
                    "bytes_requested": report.bytes_requested,
                    "bytes_transferred": report.bytes_transferred,
                    "seconds": round(report.seconds, 3),
                    "rate_bytes_per_s": round(report.rate, 1),
                    "failures": [{"shard": k, "error": e} for k, e in report.failures],
                }
            )
            + "\n"
        )
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
        rows = []
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
    async with Stager(settings) as stager:
        records = {record.id: record for record in await stager.catalog.datasets()}
        if args.dataset in records:
            dataset_id = args.dataset
        else:
            dataset_id = resolve_dataset(args.dataset, settings).id
            if dataset_id not in records:
                raise ConfigError(f"dataset {args.dataset!r} has nothing cached on this node (see 'datacache ls')")
        keys = [k.strip() for k in args.shards.split(",") if k.strip()] if args.shards else None
        count, size = 0, 0
        if args.tier in (LOCAL, "all"):
            c, s = await stager.evict(dataset_id, keys)
            count, size = count + c, size + s
        if args.tier in (SHARED, "all"):
            if stager.shared is None:
                raise ConfigError("no shared tier is configured")
            c, s = await stager.evict_shared(dataset_id)
            count, size = count + c, size + s
        if args.forget:
            await stager.catalog.forget_dataset(dataset_id)
            await stager.manifests.delete(dataset_id)
    sys.stdout.write(f"evicted {count} shards ({format_bytes(size)}) of {dataset_id} from {args.tier}\n")
    return 0


# -- the parser -------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="datacache", description="Tiered caching of AI training data.")
    parser.add_argument("--version", action="version", version=f"datacache {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    warm = commands.add_parser("warm", help="stage a dataset onto a tier; exits 0 only when all of it is resident")
    warm.add_argument("dataset", help="a URL (s3://bucket/prefix/, /path, file://...) or a configured name")
    warm.add_argument("--tier", choices=(LOCAL, SHARED), default=LOCAL, help="where to stage to (default: local)")
    warm.add_argument("--shards", metavar="SPEC", help="only these shards: START:STOP indexes, or key,key,...")
    warm.add_argument("--concurrency", metavar="N", help="shards transferred at once (default 8)")
    warm.add_argument("--bandwidth", metavar="LIMIT", help="cap origin reads, e.g. 200MB/s")
    warm.add_argument("--verify", action="store_true", help="re-check resident shards' checksums")
    warm.add_argument("--refresh", action="store_true", help="list the origin again instead of the saved manifest")
    warm.add_argument("--policy", choices=("auto", "lru", "nothrash", "belady"), help="eviction policy for this dataset")
    warm.add_argument("--json", action="store_true", help="machine-readable progress and summary, one JSON per line")
    warm.add_argument("-q", "--quiet", action="store_true", help="no progress output, only the summary")
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
    evict.add_argument("--tier", choices=(LOCAL, SHARED, "all"), default=LOCAL)
    evict.add_argument("--shards", metavar="KEYS", help="only these shard keys, comma-separated")
    evict.add_argument("--forget", action="store_true", help="also forget the dataset and its saved manifest")
    _add_settings_flags(evict)
    evict.set_defaults(run=_evict)

    return parser


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
