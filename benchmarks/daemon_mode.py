"""Through the daemon or embedded: the same epochs, both ways, in one run (issue 15).

Run alone (not part of ``make bench``; ``benchmarks/run.py`` belongs to the
loader-speed benchmark)::

    python -m benchmarks.daemon_mode [--quick] [--repeats N]

The dataset of ``benchmarks.run`` (WebDataset tar shards of 50-150 KB
samples) in the local S3 server. For each repeat, four configurations in
turn (the order alternates between repeats): batch mode and drop-in
(per-sample dicts collated by the DataLoader, batch 64), each embedded (the
reader's own stager) and as a client of one ``datacache serve`` started on an
empty cache for it. Each runs one cold epoch (empty cache) then one warm
epoch in a fresh process with 2 DataLoader workers; the consumer copies every
payload byte (`benchmarks._job.Toucher`). Prints a table of medians and the
daemon/embedded ratio per row, and writes ``benchmarks/daemon-mode.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import _data
from benchmarks._common import (
    BATCH_SIZE,
    BUCKET,
    NUM_WORKERS,
    REPO,
    WORK,
    Sizes,
    clean_env,
    emit,
    parse_result,
    s3_env,
)

__all__ = ["main", "start_daemon", "stop_daemon"]

MODES = ("embedded", "daemon")
FORMS = ("batch", "dropin")


def _log(message: str) -> None:
    print(f"[daemon-mode] {message}", file=sys.stderr, flush=True)


def _job(spec: dict[str, Any]) -> None:
    """One process: a cold epoch, then a warm one; the result on stdout."""
    import torch
    from datacache.loaders import CachedIterableDataset
    from torch.utils.data import DataLoader

    from benchmarks._job import Toucher, run_epoch
    from datacache.config import load_settings

    torch.set_num_threads(1)
    settings = load_settings(overrides={"local_dir": spec["cache_dir"]})
    batch = spec["form"] == "batch"
    dataset = CachedIterableDataset(
        spec["dataset"], batch_size=BATCH_SIZE if batch else None, config=settings, shuffle=True, seed=17
    )
    loader = DataLoader(dataset, batch_size=None if batch else BATCH_SIZE, num_workers=int(spec["workers"]))
    toucher = Toucher()
    epochs = []
    try:
        for n, phase in enumerate(("cold", "warm")):
            dataset.set_epoch(n)
            epochs.append(run_epoch(loader, toucher, phase, int(spec["expected"])).to_json())
        mode = dataset.stats().mode
    finally:
        dataset.close()
    emit({"epochs": epochs, "mode": mode})


def start_daemon(local_dir: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``datacache serve`` on ``local_dir`` (socket ``<local_dir>/daemon.sock``), once it is ready.

    ``env`` carries the rest of its settings (``DATACACHE_SHARED_DIR``, ...); its log
    goes to ``<local_dir>-daemon.log``.
    """
    socket_path = local_dir / "daemon.sock"
    log_path = local_dir.parent / f"{local_dir.name}-daemon.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "datacache.cli", "serve", "--local-dir", str(local_dir),
             "--socket", str(socket_path), "--metrics-address", "127.0.0.1:0"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip
    deadline = time.monotonic() + 60
    while not _ready(local_dir):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the daemon did not start; see {log_path}")
        time.sleep(0.05)  # sleep-ok: spaces the polls; readiness ends the wait
    return process


def stop_daemon(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, and wait for it to drain and exit."""
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=60)


def _ready(local_dir: Path) -> bool:
    """Whether the daemon on ``<local_dir>/daemon.sock`` answers (it refuses every verb until it is ready)."""
    from datacache.client import DaemonClient
    from datacache.config import load_settings
    from datacache.errors import DaemonUnavailableError

    async def ask() -> bool:
        client = DaemonClient(load_settings({}, overrides={"local_dir": str(local_dir)}))
        try:
            await client.status()
        except DaemonUnavailableError:
            return False
        finally:
            await client.close()
        return True

    return asyncio.run(ask())


def _one(work: Path, endpoint: str, mode: str, form: str, expected: int, name: str) -> dict[str, Any]:
    cache = work / name
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    env = clean_env(s3_env(endpoint))
    daemon = start_daemon(cache, env) if mode == "daemon" else None
    env["DATACACHE_SOCKET"] = str(cache / ("daemon.sock" if daemon else "no-daemon.sock"))
    spec = {"cache_dir": str(cache), "form": form, "workers": NUM_WORKERS, "expected": expected,
            "dataset": f"s3://{BUCKET}/wds/"}  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.daemon_mode", "--job", json.dumps(spec)],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
    finally:
        if daemon is not None:
            stop_daemon(daemon)
    if done.returncode != 0:
        raise RuntimeError(f"{mode} {form} failed:\n{done.stderr[-3000:]}")
    result = parse_result(done.stdout)
    if result["mode"] != mode:
        raise RuntimeError(f"asked for {mode}, the loader ran {result['mode']}")
    return result


def measure(work: Path, endpoint: str, sizes: Sizes, repeats: int) -> dict[str, Any]:
    """``repeats`` rounds of the four configurations; every epoch's MB/s, by configuration and phase."""
    runs: dict[str, dict[str, list[float]]] = {f"{m} {f}": {"cold": [], "warm": []} for f in FORMS for m in MODES}
    order = [(m, f) for f in FORMS for m in MODES]
    for repeat in range(repeats):
        for mode, form in order if repeat % 2 == 0 else order[::-1]:
            result = _one(work, endpoint, mode, form, sizes.samples, f"{mode}-{form}")
            for epoch in result["epochs"]:
                if not epoch["ok"]:
                    raise RuntimeError(
                        f"{mode} {form} {epoch['phase']}: {epoch['samples']} samples, not {sizes.samples}"
                    )
                runs[f"{mode} {form}"][epoch["phase"]].append(epoch["mb_per_s"])
            _log(f"{mode} {form}: " + ", ".join(f"{e['phase']} {e['mb_per_s']:.0f} MB/s" for e in result["epochs"]))
    return runs


def table(runs: dict[str, dict[str, list[float]]]) -> str:
    lines = ["| form | phase | embedded MB/s | daemon MB/s | daemon / embedded |", "|---|---|---|---|---|"]
    for form in FORMS:
        for phase in ("warm", "cold"):
            embedded = statistics.median(runs[f"embedded {form}"][phase])
            daemon = statistics.median(runs[f"daemon {form}"][phase])
            lines.append(f"| {form} | {phase} | {embedded:,.0f} | {daemon:,.0f} | {daemon / embedded:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.daemon_mode", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick dataset (a few hundred MB)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the four configurations (default 3)")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        _job(json.loads(args.job))
        return 0
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    from benchmarks.warm_vs_awscli import start_s3_server

    sizes = Sizes.quick() if args.quick else Sizes.full()
    work = WORK / "daemon-mode"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root = _data.prepare_local(sizes, with_anchors=False)
    server, endpoint = start_s3_server()
    try:
        _data.upload_all(endpoint, sizes, root, with_anchors=False)
        runs = measure(work, endpoint, sizes, args.repeats)
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
    out = REPO / "benchmarks" / ("daemon-mode-quick.json" if args.quick else "daemon-mode.json")
    record = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg": os.getloadavg(), "repeats": args.repeats,
              "samples": sizes.samples, "runs": runs}  # fmt: skip
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
