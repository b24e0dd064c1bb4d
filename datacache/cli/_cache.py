"""`datacache ls`, `status` and `evict`: what this node holds, and letting go of it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from datacache import __version__
from datacache._outage import cannot_stage_into
from datacache.cli._common import (
    Commands,
    add_settings_flags,
    daemon_answer,
    daemon_client,
    daemon_tiers,
    settings_from,
)
from datacache.client import DaemonClient
from datacache.config import Settings, resolve_dataset
from datacache.daemon import dataset_rows
from datacache.errors import ConfigError, DatacacheError
from datacache.sizes import format_bytes
from datacache.staging import LOCAL, SHARED, Stager


async def _ls(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    client = await daemon_client(settings)
    if client is not None:
        # The daemon's catalog, as the daemon reads it: the daemon `status` says answers.
        try:
            rows = await client.datasets()
        finally:
            await client.close()
    elif cannot_stage_into(settings.local_dir):
        daemon = await daemon_answer(settings)
        raise DatacacheError(
            f"the node cache {settings.local_dir} is the daemon's, and no daemon this process may use answers "
            f"at {daemon['socket']}: {daemon.get('detail', 'no answer')}"
        )
    else:
        async with Stager(settings) as stager:
            await stager.reconcile()
            rows = await dataset_rows(stager, settings)
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    elif not rows:
        sys.stdout.write("no datasets yet (datacache warm URL stages one)\n")
    else:
        _print_ls_table(rows)
    return 0


def _print_ls_table(rows: list[dict[str, Any]]) -> None:
    labels = [",".join(row["names"]) or "-" for row in rows]
    width = max(len("NAME"), *map(len, labels))
    header = f"{'DATASET':<32} {'FORMAT':<8} {'SHARDS':>7} {'SIZE':>11} {'LOCAL':>22} {'SHARED':>22}  URL"
    sys.stdout.write(f"{'NAME':<{width}} {header}\n")
    for label, row in zip(labels, rows):
        total = row["bytes"] or 0

        def residency(count: int | None, size: int | None, row: dict[str, Any] = row, total: int = total) -> str:
            if count is None or size is None:
                return "-"
            share = f"{100 * size / total:.0f}%" if total else "-"
            return f"{count}/{row['shards']} {share} {format_bytes(size)}"

        sys.stdout.write(
            f"{label:<{width}} {row['dataset']:<32} {row['format'] or '?':<8} {row['shards'] or 0:>7} "
            f"{format_bytes(total):>11} {residency(row['local_shards'], row['local_bytes']):>22} "
            f"{residency(row['shared_shards'], row['shared_bytes']):>22}  {row['url']}\n"
        )


async def _status(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    daemon = await daemon_answer(settings)
    # A daemon that answers owns the node's cache: its tiers and capacities are the ones in force,
    # not this process's settings (a new user's status said "unbounded" beside a 1 GB daemon).
    tiers = await daemon_tiers(settings) if daemon["answers"] else None
    tiers_from = "daemon" if tiers is not None else "this process"
    if tiers is None and cannot_stage_into(settings.local_dir):
        # The daemon's cache, its catalog the daemon's own: nothing to show without the daemon.
        tiers, tiers_from = [], "none"
    elif tiers is None:
        async with Stager(settings, reconcile=False) as stager:
            tiers = await _tier_usage(stager, settings)
    document = {
        "version": __version__,
        "config": str(settings.config_path) if settings.config_path else None,
        "tiers_from": tiers_from,
        "tiers": tiers,
        "daemon": daemon,
    }
    if args.json:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        return 0
    sys.stdout.write(f"datacache {__version__}; config: {document['config'] or 'none (defaults)'}\n")
    if tiers_from == "daemon":
        sys.stdout.write(f"tiers as the daemon (pid {daemon['pid']}) runs them:\n")
    elif tiers_from == "none":
        sys.stdout.write(f"tiers: the node cache {settings.local_dir} is the daemon's; they show while it answers\n")
    for tier in tiers:
        capacity = tier["capacity_bytes"]
        limit = format_bytes(capacity) if capacity else "unbounded"
        percent = f" ({100 * tier['used_bytes'] / capacity:.0f}%)" if capacity else ""
        free = tier["device_free_bytes"]
        sys.stdout.write(
            f"{tier['tier']:<7} {tier['path']}: {format_bytes(tier['used_bytes'])} of {limit}{percent} in "
            f"{tier['shards']} shards; device free {format_bytes(free) if free is not None else '?'}\n"
        )
    sys.stdout.write(f"daemon  {daemon['socket']}: {_daemon_line(daemon)}\n")
    return 0


async def _tier_usage(stager: Stager, settings: Settings) -> list[dict[str, Any]]:
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
    return tiers


def _daemon_line(daemon: dict[str, Any]) -> str:
    if not daemon["answers"]:
        return f"none answers ({daemon['detail']}); commands run in this process"
    user = f" ({daemon['user']})" if daemon["user"] else ""
    return f"answers: pid {daemon['pid']}, uid {daemon['uid']}{user}, datacache {daemon['version']}"


async def _evict_through(client: DaemonClient, args: argparse.Namespace, settings: Settings) -> int:
    """``evict`` by the daemon that owns the node's cache, so that its state stays true."""
    try:
        dataset_id = args.dataset if "://" not in args.dataset and "/" not in args.dataset else None
        if dataset_id is None or dataset_id in settings.datasets:
            config = resolve_dataset(args.dataset, settings)
            dataset_id = config.id
            # The daemon lets a uid change only what it opened there, and forgets that when it
            # restarts: open it again (its read rules judge this uid anew).
            await client.open(config)
        keys = [k.strip() for k in args.shards.split(",") if k.strip()] if args.shards else None
        tiers = (LOCAL, SHARED) if args.tier == "all" else (args.tier,)
        count = size = 0
        for done, tier in enumerate(tiers):
            try:
                c, s = await client.evict(dataset_id, keys, tier=tier)
            except DatacacheError:
                if done:  # a trial's `--tier all` evicted the local copies and said only the refusal
                    sys.stdout.write(
                        f"evicted {count} shards ({format_bytes(size)}) of {dataset_id} from "
                        f"{', '.join(tiers[:done])} (daemon); not from {tier}:\n"
                    )
                raise
            count, size = count + c, size + s
    finally:
        await client.close()
    sys.stdout.write(f"evicted {count} shards ({format_bytes(size)}) of {dataset_id} from {args.tier} (daemon)\n")
    return 0


async def _evict(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    client = None if args.forget else await daemon_client(settings)
    if client is not None:
        return await _evict_through(client, args, settings)
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


def add_parsers(commands: Commands) -> None:
    """Add ``ls``, ``status`` and ``evict`` to the command's subcommands."""
    ls = commands.add_parser("ls", help="datasets this node knows, and their residency per tier")
    ls.add_argument("--json", action="store_true")
    add_settings_flags(ls)
    ls.set_defaults(run=_ls)

    status = commands.add_parser("status", help="usage and capacity of each tier")
    status.add_argument("--json", action="store_true")
    add_settings_flags(status)
    status.set_defaults(run=_status)

    evict = commands.add_parser("evict", help="remove a dataset's shards from a tier")
    evict.add_argument("dataset", help="a URL, a configured name, or a dataset id from 'datacache ls'")
    evict.add_argument("--tier", choices=(LOCAL, SHARED, "all"), default=LOCAL,
                       help="local (default), shared, or all: every tier this node has")
    evict.add_argument("--shards", metavar="KEYS", help="only these shard keys, comma-separated")
    evict.add_argument("--forget", action="store_true", help="also forget the dataset and its saved manifest")
    add_settings_flags(evict)
    evict.set_defaults(run=_evict)
