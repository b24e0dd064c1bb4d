"""`datacache serve`, `bench` and `plan`: the per-node daemon, and sizing a node."""

from __future__ import annotations

import argparse
import grp
import json
import logging
import os
import sys
from collections.abc import Mapping

from datacache._logging import configure_logging
from datacache.cli._common import (
    Commands,
    add_settings_flags,
    bandwidth_flag,
    settings_from,
)
from datacache.config import Settings, resolve_dataset
from datacache.errors import ConfigError

logger = logging.getLogger(__name__)


def serve_settings(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> Settings:
    """The settings `datacache serve` runs with: its flags over ``env`` over the config file.

    ``env`` defaults to ``os.environ``; the deployment tests pass a container's environment.
    """
    return settings_from(
        args,
        env,
        socket=args.socket,
        metrics_address=args.metrics_address,
        concurrency=args.concurrency,
        bandwidth_limit=bandwidth_flag(args),
    )


async def _serve(args: argparse.Namespace) -> int:
    from datacache.daemon import DaemonOptions, serve
    from datacache.sizes import parse_bandwidth, parse_size

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
        opens_per_client=args.opens_per_client,
    )
    if args.request_timeout <= 0 or (args.connections_per_client is not None and args.connections_per_client < 1):
        raise ConfigError("--request-timeout and --connections-per-client must be positive")
    if args.opens_per_client < 1:
        raise ConfigError(f"--opens-per-client: must be at least 1, got {args.opens_per_client}")
    return await serve(settings, options)


def _group_id(group: str) -> int:
    """A group given by name or number, as a gid; a clear error if there is no such group."""
    try:
        return int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"--socket-group: no group named {group!r} on this machine") from None


async def _bench(args: argparse.Namespace) -> int:
    from datacache.bench import TIERS, format_bench, run_bench
    from datacache.sizes import parse_bandwidth, parse_size

    settings = settings_from(args)
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
    from datacache.sizes import parse_bandwidth, parse_size

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


def add_parsers(commands: Commands) -> None:
    """Add ``serve``, ``bench`` and ``plan`` to the command's subcommands."""
    _add_serve_parser(commands)
    _add_sizing_parsers(commands)


def _add_serve_parser(commands: Commands) -> None:
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
        help="origin URL prefixes other users' clients may open besides configured datasets (repeatable); once "
        "one is given, root and the daemon's own user are held to configured datasets and these prefixes too")
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
    add("--opens-per-client", metavar="N", type=int, default=16,
        help="datasets one uid may be opening at once, each perhaps listing its origin (default 16)")
    add_settings_flags(serve)
    serve.set_defaults(run=_serve)



def _add_sizing_parsers(commands: Commands) -> None:
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
    add_settings_flags(bench)
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
