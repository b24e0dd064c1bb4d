"""`datacache shard` and `index`: turning an origin into shards, and counting their samples once."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from datacache._progress import Progress
from datacache.cli._common import (
    Commands,
    add_settings_flags,
    progress_mode,
    settings_from,
)
from datacache.config import Settings, resolve_dataset
from datacache.counting.cluster import WIDS_INDEX_NAME, index_dataset, node_plan_path
from datacache.errors import ConfigError
from datacache.formats import get_format
from datacache.shard import ShardReport, source_formats
from datacache.sizes import format_bytes, format_rate
from datacache.staging import Stager
from datacache.tiers import redact_url


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
    from datacache.sizes import parse_size

    settings = settings_from(args)
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
            mode=progress_mode(args),
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
        f"({report.written} written, {report.kept} kept after verifying{_earlier_run(report)}), "
        f"{report.samples} samples from {report.objects} objects, {format_bytes(report.output_bytes)}, "
        f"{report.seconds:.1f}s ({report.objects_per_second:.0f} objects/s, "
        f"{format_rate(report.bytes_per_second)}){skipped}\n"
    )
    if report.changed_earlier_output:
        # The README's rule: a dataset is read as the snapshot first opened, cached copies included.
        out.write(
            f"readers of a cache that holds the earlier shards of {report.dest}: "
            f"run `datacache warm --refresh {report.dest}` first\n"
        )
    return 0


def _earlier_run(report: ShardReport) -> str:
    """``; of an earlier run's shards, 2 rewritten and 3 removed``: what this run changed of the output."""
    changed = [f"{n} {what}" for n, what in ((report.rewritten, "rewritten"), (report.removed, "removed")) if n]
    return f"; of an earlier run's shards, {' and '.join(changed)}" if changed else ""


# -- index ------------------------------------------------------------------------------------


async def _index(args: argparse.Namespace) -> int:
    from datacache.tiers import open_origin

    settings = settings_from(args, concurrency=args.concurrency)
    dataset = resolve_dataset(args.dataset, settings)
    async with Stager(settings) as stager:
        handle = await stager.open(dataset, refresh=args.refresh)
        if not get_format(handle.manifest.format.value).indexed:
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


def add_parsers(commands: Commands) -> None:
    """Add ``shard`` and ``index`` to the command's subcommands."""
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
    shard.add_argument("--format", choices=("auto", *source_formats()), default="auto",
                       help="what SRC holds: small files (to tar shards), Parquet or a Zarr array (to re-chunk)")
    shard.add_argument("--chunk-size", metavar="SIZE", default="32MB",
                       help="Parquet row group / Zarr chunk target, uncompressed (default 32MB)")
    shard.add_argument("--prefix", default="shard", help="shard names: PREFIX-000000.tar (default shard)")
    shard.add_argument("--json", action="store_true", help="machine-readable progress and summary, one JSON per line")
    shard.add_argument("-q", "--quiet", action="store_true", help="no progress output, only the summary")
    add_settings_flags(shard)
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
    add_settings_flags(index)
    index.set_defaults(run=_index)
