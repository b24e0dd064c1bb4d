"""Bigger than the cache: a dataset larger than each node's local tier, 2 nodes, 2 ranks x 2 workers each.

Run by `benchmarks.run` (``make bench`` / ``make bench-quick``) or alone::

    python -m benchmarks.bigger [--quick]

WebDataset tar shards without an index in moto's S3 server on 127.0.0.1 (so
the first epoch is a cold one: whole shards dealt, counted once for the
cluster; ``--origin file`` and ``--indexed`` for a file:// origin or sample
counts beside the shards), one shared tier for the cluster, two simulated nodes (each its own local tier),
each running two ranks (processes, ``RANK``/``WORLD_SIZE`` from the
environment) with two forked DataLoader workers, 3 epochs. For each policy
(auto, nothrash, lru) and local tier size (1/2, 1/4 of the dataset), per epoch:
the share of shards read from the local tier, the readers' wait fraction (time
blocked on data over the epoch's time), the bytes fetched from the origin (the
cluster's: the shared tier grows by exactly what the origin supplies), and
shards found vanished from the local tier. The table goes into RESULTS.md
between ``<!-- bigger-than-cache -->`` markers.

With ``--mode daemon`` each simulated node runs one ``datacache serve`` on its
local tier, and its ranks (and their workers) are the daemon's clients: their
progress feeds the daemon's one order. The table then also gives each node's
origin bytes per epoch (what its daemon fetched from the origin), and goes
between ``<!-- bigger-than-cache-daemon -->`` markers.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import logging
import multiprocessing.util
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from datacache.sizes import parse_bandwidth

__all__ = ["main", "run_scenario", "saved_table", "write_table"]

REPO = Path(__file__).resolve().parent.parent
MARK = "<!-- bigger-than-cache -->"
DAEMON_MARK = "<!-- bigger-than-cache-daemon -->"
MODES = ("embedded", "daemon")
POLICIES = ("auto", "nothrash", "lru")
NODES, RANKS_PER_NODE, WORKERS, EPOCHS = 2, 2, 2, 3


def _write_dataset(origin: Path, shards: int, per_shard: int, sample_bytes: int, *, indexed: bool) -> int:
    """Tar shards of ``per_shard`` samples each (and, ``indexed``, the manifest with their counts); total bytes."""
    origin.mkdir(parents=True)
    entries = []
    for s in range(shards):
        path = origin / f"train-{s:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(per_shard):
                data = os.urandom(sample_bytes)
                info = tarfile.TarInfo(f"s{s:04d}-{i:05d}.bin")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        entries.append({"key": path.name, "size": path.stat().st_size, "samples": per_shard})
    if indexed:
        document = {"format_version": 1, "dataset": "bigger", "url": "", "format": "tar", "shards": entries}
        (origin / "datacache-manifest.json").write_text(json.dumps(document))
    return sum(entry["size"] for entry in entries)


def _upload(origin: Path, endpoint: str) -> str:
    """Put every file of ``origin`` in a bucket of the S3 server at ``endpoint``; the dataset's URL."""
    from benchmarks._common import boto_client

    client = boto_client(endpoint)
    client.create_bucket(Bucket="bigger")
    for path in sorted(origin.iterdir()):
        client.upload_file(str(path), "bigger", f"ds/{path.name}")
    return "s3://bigger/ds/"


def _rank(spec: dict[str, Any]) -> None:
    """One rank: read EPOCHS epochs at the per-rank target, print one JSON line per epoch."""
    from datacache.loaders import CachedIterableDataset
    from torch.utils.data import DataLoader

    from datacache.config import load_settings

    vanished = Path(spec["vanished"])

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "vanished" in record.getMessage():
                with vanished.open("a") as handle:
                    handle.write("1\n")

    logging.getLogger("datacache").addHandler(Count(logging.WARNING))
    _audit_to(spec.get("audit"), spec["node"])
    settings = load_settings({}, overrides=spec["settings"])
    target = float(spec["target"])
    dataset = CachedIterableDataset(spec["origin"], config=settings, seed=11, drop_last=True, target_bandwidth=target)
    for epoch in range(EPOCHS):
        dataset.set_epoch(epoch)
        track = functools.partial(_track_origin, spec["origin_log"], spec["node"], epoch)
        loader = DataLoader(
            dataset, batch_size=8, num_workers=WORKERS, multiprocessing_context="fork", worker_init_fn=track
        )
        _train(dataset.timed(loader), target)
        _write_origin_bytes(spec["origin_log"], spec["node"], epoch, dataset)
        stats = dataset.stats()
        print(
            json.dumps(
                {
                    "epoch": epoch,
                    "local": stats.hit_ratio.get("local", 0.0),
                    "wait": stats.reader_wait_fraction,
                    "stall": stats.stall_fraction or 0.0,
                    "seconds": stats.seconds,
                }
            ),
            flush=True,
        )


def _train(batches: Iterable[Any], target: float) -> None:
    """Consume ``batches`` as a training step that takes each batch's bytes at ``target`` bytes/s would."""
    for batch in batches:
        nbytes = sum(len(value) for values in batch.values() for value in values if isinstance(value, bytes))
        time.sleep(nbytes / target)  # sleep-ok: the simulated GPU step; the stall is what the loader adds


def _track_origin(path: str, node: int, epoch: int, worker_id: int) -> None:
    """A DataLoader worker's init: when it exits, append the bytes its stager fetched from the origin."""
    multiprocessing.util.Finalize(None, _write_origin_bytes, args=(path, node, epoch), exitpriority=100)


_TOLD: dict[int, int] = {}
"""Origin bytes each stager (by id) has already written to the log."""


def _write_origin_bytes(path: str, node: int, epoch: int, dataset: Any = None) -> None:
    """Append what this process's stager fetched from the origin since it last said (a daemon counts its own).

    Called as each DataLoader worker exits, and by the rank itself after each epoch: a cold
    epoch counts its shards in the rank's process.
    """
    from torch.utils.data import get_worker_info

    from datacache.staging import Stager

    if dataset is None:
        info = get_worker_info()
        dataset = info.dataset if info is not None else None
    access = getattr(getattr(dataset, "_runtime", None), "access", None)
    if isinstance(access, Stager):
        total = access.stats().bytes_from_origin
        told = _TOLD.get(id(access), 0)
        _TOLD[id(access)] = total
        with open(path, "a") as handle:
            handle.write(json.dumps({"node": node, "epoch": epoch, "bytes": total - told}) + "\n")


def _origin_per_node(path: Path) -> list[list[int]]:
    """Bytes fetched from the origin per epoch, per node, as the workers wrote them."""
    found = [[0] * NODES for _ in range(EPOCHS)]
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        found[row["epoch"]][row["node"]] += row["bytes"]
    return found


def _audit_to(path: str | None, node: int) -> None:
    """Log each eviction choice (victims' and incoming's next use) to ``path``, for `audit_summary`."""
    if not path:
        return
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(f"%(created)f %(process)d {node} %(message)s"))
    audit = logging.getLogger("datacache.staging.residency.audit")
    audit.setLevel(logging.DEBUG)
    audit.addHandler(handler)


def audit_summary(path: Path) -> dict[str, int]:
    """Eviction choices in an audit log: made, declined, and victims needed sooner than the shard let in."""
    made = declined = sooner = 0
    for line in path.read_text().splitlines() if path.exists() else []:
        choice = json.loads(line.split(" ", 3)[3])
        if choice["victims"] is None:
            declined += 1
            continue
        made += 1
        incoming = choice["incoming_next"]  # None: never read again
        sooner += sum(1 for _, nxt in choice["victims"] if nxt is not None and (incoming is None or nxt < incoming))
    return {"evictions": made, "declined": declined, "victim_needed_sooner": sooner}


def _shared_bytes(shared: Path) -> int:
    return sum(p.stat().st_size for p in (shared / "data").rglob("*") if p.is_file() and ".partial" not in p.name)


def _node_daemons(run: Path, settings: dict[str, Any]) -> list[Any]:
    """One ``datacache serve`` per simulated node, on its local tier, with the scenario's settings."""
    from benchmarks.daemon_mode import start_daemon

    env = {k: v for k, v in os.environ.items() if not k.startswith("DATACACHE_")}
    # A size in the environment needs its unit, as a user's would.
    for name, value in settings.items():
        env[f"DATACACHE_{name.upper()}"] = f"{value}B" if name.endswith("_capacity") else str(value)
    env["PYTHONPATH"] = str(REPO)
    daemons: list[Any] = []
    try:
        for node in range(NODES):
            local = run / f"node{node}"
            local.mkdir(parents=True)
            daemons.append(start_daemon(local, env))
    except BaseException:
        _stop(daemons)
        raise
    return daemons


def _stop(daemons: list[Any]) -> None:
    from benchmarks.daemon_mode import stop_daemon

    for daemon in daemons:
        stop_daemon(daemon)


def _origin_bytes_by_node(run: Path) -> list[int]:
    """What each node's daemon has fetched from the origin so far (its stager's counter)."""
    import asyncio

    from datacache.client import DaemonClient
    from datacache.config import load_settings

    async def read(node: int) -> int:
        client = DaemonClient(load_settings({}, overrides={"local_dir": str(run / f"node{node}")}))
        try:
            return int((await client.status())["stats"]["bytes_from_origin"])
        finally:
            await client.close()

    return [asyncio.run(read(node)) for node in range(NODES)]


def run_scenario(
    work: Path,
    *,
    policy: str,
    fraction: float,
    total: int,
    origin: str,
    mode: str = "embedded",
    target: float = 4e6,
    audit: bool = False,
) -> dict[str, Any]:
    """One policy at one local tier size: every node's ranks run at once; return the per-epoch figures.

    ``target`` is each rank's bandwidth target (bytes/s): ranks consume at that rate,
    and the stall is the share of their time spent waiting for a batch beyond it.
    """
    run = work / f"{policy}-{fraction:g}-{mode}"
    shared = run / "shared"
    vanished = run / "vanished.log"
    run.mkdir(parents=True)
    scenario = {"shared_dir": str(shared), "local_capacity": int(total * fraction), "default_policy": policy}
    daemons = _node_daemons(run, scenario) if mode == "daemon" else []
    extra = {"target": target, "origin_log": str(run / "origin-bytes.jsonl")}
    extra["audit"] = str(run / "audit.log") if audit else None
    try:
        result = _run_ranks(run, origin, scenario, vanished, daemons=bool(daemons), extra=extra)
    finally:
        _stop(daemons)
    if audit:
        result["audit"] = audit_summary(run / "audit.log")
    return {"policy": policy, "fraction": fraction, "mode": mode, **result}


def _run_ranks(
    run: Path, origin: str, scenario: dict[str, Any], vanished: Path, *, daemons: bool, extra: dict[str, Any]
) -> dict[str, Any]:
    """Every node's ranks at once (clients of their node's daemon when ``daemons``); per-epoch figures.

    ``extra`` goes to every rank: its target, where its workers log origin bytes, where to audit.
    """
    shared = Path(scenario["shared_dir"])
    world = NODES * RANKS_PER_NODE
    processes = []
    for node in range(NODES):
        for local_rank in range(RANKS_PER_NODE):
            rank = node * RANKS_PER_NODE + local_rank
            spec = {
                "origin": origin,
                "vanished": str(vanished),
                "node": node,
                **extra,
                # The node's daemon, when it runs one, answers on <local_dir>/daemon.sock.
                "settings": {"local_dir": str(run / f"node{node}"), **scenario},
            }
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "PYTHONPATH": str(REPO)}
            env = {k: v for k, v in env.items() if not k.startswith("DATACACHE_")}
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "benchmarks.bigger", "--rank", json.dumps(spec)],
                    env=env,
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
    # The shared tier's growth per epoch is what the origin supplied: read it as the ranks go.
    origin_bytes: list[int] = []
    by_node: list[list[int]] = []
    lines: list[list[dict[str, Any]]] = [[] for _ in processes]
    for epoch in range(EPOCHS):
        for index, process in enumerate(processes):
            assert process.stdout is not None
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"rank {index} stopped before epoch {epoch} ended (exit {process.wait()})")
            lines[index].append(json.loads(line))
        origin_bytes.append(_shared_bytes(shared) - sum(origin_bytes))
        if daemons:
            so_far = _origin_bytes_by_node(run)
            by_node.append([now - sum(e[n] for e in by_node) for n, now in enumerate(so_far)])
    for process in processes:
        if process.wait() != 0:
            raise RuntimeError(f"a rank failed with exit {process.returncode}")
    per_rank = lines
    return {
        # A daemon counts its node's origin reads; embedded, each worker's stager wrote its own.
        "origin_bytes_by_node": by_node if daemons else _origin_per_node(Path(extra["origin_log"])),
        "local_share": [sum(r[e]["local"] for r in per_rank) / world for e in range(EPOCHS)],
        "wait_fraction": [sum(r[e]["wait"] for r in per_rank) / world for e in range(EPOCHS)],
        "stall_fraction": [sum(r[e]["stall"] for r in per_rank) / world for e in range(EPOCHS)],
        "origin_bytes": origin_bytes,
        "vanished": len(vanished.read_text().splitlines()) if vanished.exists() else 0,
    }


def _table(results: list[dict[str, Any]], shape: dict[str, Any]) -> str:
    daemon = bool(results) and results[0].get("mode") == "daemon"
    mark = DAEMON_MARK if daemon else MARK
    about = (
        f"{shape['shards']} tar shards of {shape['per_shard']} samples, {shape['total'] / 1e6:.0f} MB, "
        f"{shape['origin']}; one shared tier; {NODES} simulated nodes (own local tiers) x {RANKS_PER_NODE} ranks x "
        f"{WORKERS} workers; {EPOCHS} epochs; each rank trains at {shape['target'] / 1e6:.0f} MB/s (a sleep per "
        "batch). Local share = shards read from the local tier at open. Stall = the ranks' time waiting for a "
        "batch over their epoch's time (first batch of each epoch, the workers' start, not counted); reader "
        "wait = the readers' time blocked on shards. Origin MB = the cluster's origin reads (the shared "
        "tier's growth), and per node (node 0 + node 1, as each node's stagers counted them). Re-read = "
        "shards a reader found vanished from the local tier and read again from below. The shared tier is a "
        "directory on the same disk here, so reading it costs what a local read costs: the stall shows this "
        "machine's CPU contention, not the tiers' speeds (on a cluster the shared tier is a network file system)."
    )
    if daemon:
        about += " Each node runs one `datacache serve`; its ranks and their workers are its clients."
    title = (
        "Bigger than the cache, through the daemon (`benchmarks/bigger.py --mode daemon`)"
        if daemon
        else "Bigger than the cache (`benchmarks/bigger.py`)"
    )
    rows = [
        mark,
        f"## {title}",
        "",
        about,
        "",
        "| local tier | policy | local share per epoch | stall per epoch | reader wait per epoch "
        "| origin MB per epoch (cluster; node 0 + node 1) | re-read |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        share, stall, wait = (
            " / ".join(f"{x:.2f}" for x in r[k]) for k in ("local_share", "stall_fraction", "wait_fraction")
        )
        origin = " / ".join(
            f"{x / 1e6:.0f} ({' + '.join(f'{n / 1e6:.0f}' for n in nodes)})"
            for x, nodes in zip(r["origin_bytes"], r["origin_bytes_by_node"], strict=True)
        )
        rows.append(
            f"| 1/{round(1 / r['fraction'])} | {r['policy']} | {share} | {stall} | {wait} | {origin} "
            f"| {r['vanished']} |"
        )
    audited = [r for r in results if "audit" in r]
    if audited:
        rows += [
            "",
            "Every eviction choice, audited (`--audit`): choices made / declined / victims needed sooner "
            "than the shard they made room for (Belady never does that; LRU does): "
            + "; ".join(
                f"1/{round(1 / r['fraction'])} {r['policy']} {r['audit']['evictions']} / "
                f"{r['audit']['declined']} / {r['audit']['victim_needed_sooner']}"
                for r in audited
            )
            + ".",
        ]
    rows.append(mark)
    return "\n".join(rows) + "\n"


def _marked(text: str, mark: str) -> str:
    """The block of ``text`` between two ``mark`` lines, the marks included (empty if none)."""
    if text.count(mark) < 2:
        return ""
    _, _, rest = text.partition(mark)
    body, _, _ = rest.partition(mark)
    return mark + body + mark + "\n"


def saved_table(path: Path) -> str:
    """The scenario's tables (embedded, and through the daemon) as ``path`` holds them now (empty if none)."""
    text = path.read_text() if path.exists() else ""
    return "".join(_marked(text, mark) for mark in (MARK, DAEMON_MARK))


def write_table(block: str, path: Path) -> None:
    """Put the scenario's tables in ``block`` into ``path``, replacing those there (nothing to do for an empty one)."""
    parts = [(mark, _marked(block, mark)) for mark in (MARK, DAEMON_MARK)]
    if not any(part for _, part in parts):
        return
    text = path.read_text() if path.exists() else ""
    for mark, part in parts:
        if not part:
            continue
        if mark in text:
            head, _, rest = text.partition(mark)
            _, _, tail = rest.partition(mark)
            text = head + part.rstrip("\n") + tail
        else:
            text = text.rstrip("\n") + "\n\n" + part
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, smaller shards and one tier size")
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    parser.add_argument("--results", type=Path, default=None, help="the RESULTS file to write the table into")
    parser.add_argument(
        "--mode", choices=MODES, default="embedded", help="readers stage themselves, or through one daemon per node"
    )
    parser.add_argument(
        "--target", type=parse_bandwidth, default=parse_bandwidth("4MB/s"), help="per-rank target (4MB/s)"
    )
    parser.add_argument(
        "--samples-per-shard",
        type=int,
        default=128,
        help="128: the default shuffle window (256 samples) spans 2 shards, as with real WebDataset shards",
    )
    parser.add_argument("--audit", action="store_true", help="log and summarise every eviction choice")
    parser.add_argument(
        "--origin", choices=("s3", "file"), default="s3", help="moto's S3 server on 127.0.0.1 (default), or file://"
    )
    parser.add_argument("--indexed", action="store_true", help="sample counts beside the shards (no cold epoch)")
    args = parser.parse_args(argv)
    if args.rank:
        _rank(json.loads(args.rank))
        return 0
    shards = 16 if args.quick else 32
    per_shard = args.samples_per_shard
    size = 1_000_000 // per_shard  # ~1 MB shards whatever the count: 8 KB samples at 128
    fractions = (0.5,) if args.quick else (0.5, 0.25)
    work = Path(os.environ.get("DATACACHE_BENCH_WORK", "/tmp/datacache-bench-bigger"))
    shutil.rmtree(work, ignore_errors=True)
    total = _write_dataset(work / "origin", shards, per_shard, size, indexed=args.indexed)
    server = None
    url = str(work / "origin")
    if args.origin == "s3":
        from benchmarks._common import s3_env
        from benchmarks.warm_vs_awscli import start_s3_server

        server, endpoint = start_s3_server()
        os.environ.update(s3_env(endpoint))  # the ranks and the daemons inherit it
        url = _upload(work / "origin", endpoint)
    try:
        results = _run_all(work, url, total, fractions, args)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
            if server.stdout is not None:
                server.stdout.close()
    default = REPO / "benchmarks" / ("RESULTS-quick.md" if args.quick else "RESULTS.md")
    about = "un-indexed" if not args.indexed else "indexed"
    where = "moto's S3 server" if args.origin == "s3" else "a file:// origin"
    shape = {"shards": shards, "per_shard": per_shard, "total": total, "target": args.target}
    shape["origin"] = f"{about}, in {where}"
    write_table(_table(results, shape), args.results or default)
    (work / "results.json").write_text(json.dumps(results, indent=1))
    return 0


def _run_all(work: Path, url: str, total: int, fractions: tuple[float, ...], args: argparse.Namespace) -> list[Any]:
    """Every policy at every local tier size, one after another; their figures."""
    results = []
    for fraction in fractions:
        for policy in POLICIES:
            started = time.monotonic()
            result = run_scenario(
                work,
                policy=policy,
                fraction=fraction,
                total=total,
                origin=url,
                mode=args.mode,
                target=args.target,
                audit=args.audit,
            )
            result["seconds"] = time.monotonic() - started
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


if __name__ == "__main__":
    sys.exit(main())
