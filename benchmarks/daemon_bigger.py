"""Through the daemon or embedded, a dataset bigger than the local tier: both modes in one run (issue 25).

Run alone (not part of ``make bench``)::

    python -m benchmarks.daemon_bigger [--rounds 3] [--epochs 3]

60 tar shards of 2 MB (128 samples of 16 KB) in moto's S3 server on 127.0.0.1, a
local tier of 40 MB (a third of the dataset) and no shared tier; one node, 2 ranks
(processes with ``RANK``/``WORLD_SIZE`` and a gloo group; a barrier around each
epoch) x 2 DataLoader workers, consuming as fast as they can. Each round runs both
modes in turn (the order alternates between rounds), each on an empty cache: embedded
(each process its own stager) and through one ``datacache serve``. Per epoch: samples/s
(both ranks' samples over the slower rank's epoch), the shards and bytes fetched from
the origin (the daemon's counters, or the sum of every embedded process's stager), the
local share (units the readers opened from the local tier), and the daemon's lease
refusals. Prints per-epoch medians and the daemon/embedded ratio; ``--json`` writes every
figure to a file.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing.util
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent
MODES = ("embedded", "daemon")
RANKS, WORKERS = 2, 2
SHARDS, PER_SHARD, SAMPLE_BYTES = 60, 128, 16_000
CAPACITY = 40_000_000


def _log(message: str) -> None:
    print(f"[daemon-bigger] {message}", file=sys.stderr, flush=True)


def _counters(access: Any, origins: list[Any]) -> dict[str, int]:
    """What this process fetched from the origin: its stager's counters, or a daemon client's own reads."""
    from datacache.staging import Stager

    if isinstance(access, Stager):
        # The origin tier's own count: the stager's `bytes_from_origin` leaves out the cold epoch's
        # counting reads of shards the tier declined (streamed from the origin, ~65 MB a run here).
        read = sum(origin.stats().bytes_read for origin in origins)
        stats = access.stats()
        return {"origin_bytes": max(read, int(stats.bytes_from_origin)), "origin_shards": int(stats.shards_staged),
                "client_bytes": 0, "tier_read": read}  # fmt: skip
    client = getattr(access, "primary", access)
    read = sum(origin.stats().bytes_read for origin in getattr(client, "_origins", {}).values())
    return {"origin_bytes": read, "origin_shards": 0, "client_bytes": read, "tier_read": read}


_TOLD: dict[int, dict[str, int]] = {}


def _write_counts(path: str, epoch: int, dataset: Any = None) -> None:
    """Append what this process's embedded stager fetched from the origin since it last said."""
    from torch.utils.data import get_worker_info

    if dataset is None:
        info = get_worker_info()
        dataset = info.dataset if info is not None else None
    access = getattr(getattr(dataset, "_runtime", None), "access", None)
    if access is None:
        return
    handle = getattr(dataset._runtime, "handle", None)
    now = _counters(access, [handle.origin] if handle is not None and handle.origin is not None else [])
    before = _TOLD.get(id(access), {k: 0 for k in now})
    _TOLD[id(access)] = now
    with open(path, "a") as handle:
        handle.write(json.dumps({"epoch": epoch, **{k: now[k] - before[k] for k in now}}) + "\n")


def _track(path: str, epoch: int, worker_id: int) -> None:
    multiprocessing.util.Finalize(None, _write_counts, args=(path, epoch), exitpriority=102)


def _daemon_counts(local_dir: str) -> dict[str, int]:
    import asyncio

    from datacache.client import DaemonClient
    from datacache.config import load_settings

    async def read() -> dict[str, int]:
        client = DaemonClient(load_settings({}, overrides={"local_dir": local_dir}))
        try:
            stats = (await client.status())["stats"]
        finally:
            await client.close()
        return {"origin_bytes": int(stats["bytes_from_origin"]), "origin_shards": int(stats["shards_staged"])}

    return asyncio.run(read())


def _rank(spec: dict[str, Any]) -> None:
    """One rank: ``epochs`` epochs as fast as it can; one JSON line per epoch on stdout."""
    import torch
    import torch.distributed as dist
    from datacache.loaders import CachedIterableDataset
    from torch.utils.data import DataLoader

    from datacache.config import load_settings

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=spec["rank"],
                            world_size=RANKS)  # fmt: skip
    settings = load_settings({}, overrides={"local_dir": spec["local_dir"], "local_capacity": CAPACITY})
    dataset = CachedIterableDataset(spec["origin"], config=settings, seed=5, shuffle=True)
    daemon_before = _daemon_counts(spec["local_dir"]) if spec["daemon"] and spec["rank"] == 0 else None
    for epoch in range(int(spec["epochs"])):
        dataset.set_epoch(epoch)
        track = functools.partial(_track, spec["counts"], epoch)
        loader = DataLoader(dataset, batch_size=32, num_workers=WORKERS, worker_init_fn=track)
        dist.barrier()
        started = time.perf_counter()
        samples = nbytes = 0
        for batch in loader:
            if spec["step"]:
                time.sleep(spec["step"])  # sleep-ok: the simulated training step
            for value in batch["bin"]:
                nbytes += len(bytes(value))
                samples += 1
        seconds = time.perf_counter() - started
        del loader
        dist.barrier()  # both ranks' workers have exited: their counts are written
        row: dict[str, Any] = {"epoch": epoch, "samples": samples, "bytes": nbytes, "seconds": seconds}
        stats = dataset.stats()
        row["local_share"] = stats.hit_ratio.get("local", 0.0)
        row["mode"] = stats.mode
        if daemon_before is not None:
            now = _daemon_counts(spec["local_dir"])
            row.update({k: now[k] - daemon_before[k] for k in now})
            daemon_before = now
        _write_counts(spec["counts"], epoch, dataset)
        print(json.dumps(row), flush=True)
    dataset.close()
    dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _one(work: Path, url: str, env: dict[str, str], mode: str, epochs: int, step: float) -> list[dict[str, Any]]:
    """One mode on an empty cache: per epoch, the node's figures."""
    from benchmarks.daemon_mode import start_daemon, stop_daemon

    cache = work / mode
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    env = {**env, "DATACACHE_LOCAL_CAPACITY": f"{CAPACITY}B"}
    daemon = start_daemon(cache, env) if mode == "daemon" else None
    env["DATACACHE_SOCKET"] = str(cache / ("daemon.sock" if daemon else "no-daemon.sock"))
    counts = work / f"{mode}-counts.jsonl"
    counts.unlink(missing_ok=True)
    port = _free_port()
    ranks = []
    refusals = 0
    try:
        for rank in range(RANKS):
            spec = {"rank": rank, "port": port, "local_dir": str(cache), "origin": url, "epochs": epochs,
                    "daemon": daemon is not None, "counts": str(counts), "step": step}  # fmt: skip
            ranks.append(subprocess.Popen(
                [sys.executable, "-m", "benchmarks.daemon_bigger", "--rank", json.dumps(spec)],
                env={**env, "RANK": str(rank), "WORLD_SIZE": str(RANKS)}, cwd=REPO, stdout=subprocess.PIPE, text=True,
            ))  # fmt: skip
        outs = [p.communicate(timeout=1800)[0] for p in ranks]
        if any(p.returncode for p in ranks):
            raise RuntimeError(f"{mode}: a rank failed")
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
        if daemon is not None:
            refusals = (cache.parent / f"{cache.name}-daemon.log").read_text().count("more than one uid may lease")
            stop_daemon(daemon)
    rows = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in outs]
    return [{**_epoch_row(mode, epoch, [r[epoch] for r in rows], counts), "lease_warned": refusals}
            for epoch in range(epochs)]  # fmt: skip


def _epoch_row(mode: str, epoch: int, ranks: list[dict[str, Any]], counts: Path) -> dict[str, Any]:
    if any(r["mode"] != mode for r in ranks):
        raise RuntimeError(f"asked for {mode}, the loader ran {ranks[0]['mode']}")
    row = {
        "samples_per_s": sum(r["samples"] for r in ranks) / max(r["seconds"] for r in ranks),
        "samples": sum(r["samples"] for r in ranks),
        "local_share": statistics.mean(r["local_share"] for r in ranks),
    }
    lines = [json.loads(line) for line in counts.read_text().splitlines()] if counts.exists() else []
    for key in ("origin_bytes", "origin_shards", "client_bytes", "tier_read"):
        row[key] = sum(line[key] for line in lines if line["epoch"] == epoch)
    if mode == "daemon":  # the daemon's own fetches, and what its clients read from the origin themselves
        row["origin_shards"] = ranks[0]["origin_shards"]
        row["origin_bytes"] = ranks[0]["origin_bytes"] + row["client_bytes"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.daemon_bigger", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    parser.add_argument("--per-shard", type=int, default=PER_SHARD, help="samples per 2 MB shard (128)")
    parser.add_argument("--step", type=float, default=0.0, help="seconds of simulated training per batch (0)")
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        _rank(json.loads(args.rank))
        return 0
    from benchmarks._common import clean_env, s3_env
    from benchmarks.bigger import _upload, _write_dataset
    from benchmarks.warm_vs_awscli import start_s3_server

    work = Path(os.environ.get("DATACACHE_BENCH_WORK", "/dev/shm/datacache-bench-daemon-bigger"))
    shutil.rmtree(work, ignore_errors=True)
    _write_dataset(work / "origin", SHARDS, args.per_shard, PER_SHARD * SAMPLE_BYTES // args.per_shard, indexed=False)
    server, endpoint = start_s3_server()
    results: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in MODES}
    try:
        url = _upload(work / "origin", endpoint)
        env = {**clean_env(s3_env(endpoint)), "PYTHONPATH": str(REPO)}
        for n in range(args.rounds):
            for mode in MODES if n % 2 == 0 else MODES[::-1]:
                rows = _one(work, url, env, mode, args.epochs, args.step)
                results[mode].append(rows)
                _log(f"round {n} {mode}: " + "; ".join(_said(e, r) for e, r in enumerate(rows)))
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(table(results, args.epochs))
    print(f"load average at the end: {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps({"loadavg": os.getloadavg(), "results": results}, indent=1))
    return 0


def _said(epoch: int, row: dict[str, Any]) -> str:
    clients = f"client {row['client_bytes'] / 1e6:.0f}, tier {row['tier_read'] / 1e6:.0f}"
    return (
        f"e{epoch} {row['samples_per_s']:.0f}/s origin {row['origin_shards']} shards "
        f"{row['origin_bytes'] / 1e6:.0f} MB ({clients}) local {row['local_share']:.2f}"
    )


def table(results: dict[str, list[list[dict[str, Any]]]], epochs: int) -> str:
    """Per epoch: each mode's median samples/s, their ratio and the median of each round's own ratio;
    origin shards and MB (the daemon's clients' own origin reads in brackets), local share."""
    lines = ["| epoch | embedded samples/s | daemon samples/s | daemon / embedded | median of the rounds' ratios "
             "| rounds' ratios | origin shards (emb / daemon) | origin MB (emb / daemon (its clients')) "
             "| local share (emb / daemon) |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for epoch in range(epochs):
        med = {m: {k: statistics.median(r[epoch][k] for r in results[m]) for k in results[m][0][epoch]}
               for m in MODES}  # fmt: skip
        e, d = med["embedded"], med["daemon"]
        paired = [dr[epoch]["samples_per_s"] / er[epoch]["samples_per_s"]
                  for dr, er in zip(results["daemon"], results["embedded"], strict=True)]  # fmt: skip
        lines.append(
            f"| {epoch} | {e['samples_per_s']:,.0f} | {d['samples_per_s']:,.0f} | "
            f"{d['samples_per_s'] / e['samples_per_s']:.2f}x | {statistics.median(paired):.2f}x | "
            f"{min(paired):.2f}-{max(paired):.2f} | {e['origin_shards']:.0f} / {d['origin_shards']:.0f} | "
            f"{e['origin_bytes'] / 1e6:.0f} / {d['origin_bytes'] / 1e6:.0f} ({d['client_bytes'] / 1e6:.0f}) | "
            f"{e['local_share']:.2f} / {d['local_share']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
