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
epoch (``--warm-epochs N``: N, their median counted) in a fresh process with
2 DataLoader workers; the consumer copies every
payload byte (`benchmarks._job.Toucher`). Prints a table of medians and the
daemon/embedded ratio per row, and writes it to ``benchmarks/RESULTS-daemon.md``
(every epoch's figure to ``benchmarks/daemon-mode.json``; ``-quick`` files with
``--quick``).
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
        for n, phase in enumerate(("cold", *["warm"] * int(spec["warm_epochs"]))):
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


def _one(work: Path, endpoint: str, mode: str, form: str, expected: int, warm_epochs: int) -> dict[str, Any]:
    name = f"{mode}-{form}"
    cache = work / name
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    env = clean_env(s3_env(endpoint))
    daemon = start_daemon(cache, env) if mode == "daemon" else None
    env["DATACACHE_SOCKET"] = str(cache / ("daemon.sock" if daemon else "no-daemon.sock"))
    spec = {"cache_dir": str(cache), "form": form, "workers": NUM_WORKERS, "expected": expected,
            "dataset": f"s3://{BUCKET}/wds/", "warm_epochs": warm_epochs}  # fmt: skip
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


def measure(work: Path, endpoint: str, sizes: Sizes, repeats: int, warm_epochs: int = 1) -> dict[str, Any]:
    """``repeats`` rounds of the four configurations; MB/s by configuration and phase, one figure per round.

    A round's warm figure is the median of its process's ``warm_epochs`` warm epochs.
    """
    runs: dict[str, dict[str, list[float]]] = {f"{m} {f}": {"cold": [], "warm": []} for f in FORMS for m in MODES}
    order = [(m, f) for f in FORMS for m in MODES]
    for repeat in range(repeats):
        for mode, form in order if repeat % 2 == 0 else order[::-1]:
            result = _one(work, endpoint, mode, form, sizes.samples, warm_epochs)
            for epoch in result["epochs"]:
                if not epoch["ok"]:
                    raise RuntimeError(
                        f"{mode} {form} {epoch['phase']}: {epoch['samples']} samples, not {sizes.samples}"
                    )
            for phase in ("cold", "warm"):
                rates = [e["mb_per_s"] for e in result["epochs"] if e["phase"] == phase]
                runs[f"{mode} {form}"][phase].append(statistics.median(rates))
            _log(f"{mode} {form}: " + ", ".join(f"{e['phase']} {e['mb_per_s']:.0f} MB/s" for e in result["epochs"]))
    return runs


def table(runs: dict[str, dict[str, list[float]]]) -> str:
    """Medians per configuration, their ratio, and the median of each round's own daemon/embedded ratio."""
    lines = [
        "| form | phase | embedded MB/s | daemon MB/s | daemon / embedded | median of the rounds' ratios |",
        "|---|---|---|---|---|---|",
    ]
    for form in FORMS:
        for phase in ("warm", "cold"):
            embedded, daemon = runs[f"embedded {form}"][phase], runs[f"daemon {form}"][phase]
            ratio = statistics.median(embedded) and statistics.median(daemon) / statistics.median(embedded)
            paired = statistics.median(d / e for d, e in zip(daemon, embedded, strict=True) if e)
            lines.append(
                f"| {form} | {phase} | {statistics.median(embedded):,.0f} | {statistics.median(daemon):,.0f} "
                f"| {ratio:.2f}x | {paired:.2f}x |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.daemon_mode", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the quick dataset (a few hundred MB)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the four configurations (default 3)")
    parser.add_argument(
        "--warm-epochs", type=int, default=1, help="warm epochs per process; a round counts their median (default 1)"
    )
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        _job(json.loads(args.job))
        return 0
    if args.repeats < 1 or args.warm_epochs < 1:
        parser.error("--repeats and --warm-epochs must be at least 1")
    from benchmarks.warm_vs_awscli import start_s3_server

    sizes = Sizes.quick() if args.quick else Sizes.full()
    work = WORK / "daemon-mode"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    root = _data.prepare_local(sizes, with_anchors=False)
    server, endpoint = start_s3_server()
    try:
        _data.upload_all(endpoint, sizes, root, with_anchors=False)
        runs = measure(work, endpoint, sizes, args.repeats, args.warm_epochs)
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
    out = REPO / "benchmarks" / ("daemon-mode-quick.json" if args.quick else "daemon-mode.json")
    record = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg": os.getloadavg(), "repeats": args.repeats,
              "warm_epochs": args.warm_epochs, "samples": sizes.samples, "runs": runs}  # fmt: skip
    out.write_text(json.dumps(record, indent=1) + "\n")
    note = (
        f"# Daemon vs embedded (`python -m benchmarks.daemon_mode{' --quick' if args.quick else ''}`)\n\n"
        f"{sizes.samples:,} samples of {sizes.min_bytes // 1000}-{sizes.max_bytes // 1000} KB in tar shards in the "
        f"local S3 server; DataLoader with {NUM_WORKERS} workers, batch {BATCH_SIZE}; the consumer copies every "
        f"payload byte. Medians of {args.repeats} rounds (a round's warm figure: the median of its process's "
        f"{args.warm_epochs} warm epochs), MB/s; run {record['started']}, load average "
        f"{record['loadavg'][0]:.1f} at the end (2 cores shared: compare within the run).\n\n{table(runs)}\n"
    )
    (REPO / "benchmarks" / ("RESULTS-daemon-quick.md" if args.quick else "RESULTS-daemon.md")).write_text(note)
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
