"""Issue 25's cold path in one run: datacache's cold epoch beside a plain 8-thread S3 GET of the same objects.

Run alone (not part of ``make bench``)::

    python -m benchmarks.cold_path [--quick] [--rounds 3] [--variant NAME:ENV=VALUE,...]
                                    [--baseline NAME:PYTHONPATH] [--profile DIR] [--results benchmarks/RESULTS.md]

The dataset of ``benchmarks.run`` (WebDataset tar shards of 50-150 KB samples;
~1 GB in 16 shards, or ``--quick`` ~250 MB in 11) in one moto S3 server on
127.0.0.1. Each round, in turn: the S3 GET ceiling (8 boto3 threads, whole
objects), the disk's durable write rate (fsync, rename; 4 threads), then one
cold epoch (fresh process, empty cache, no shared tier) of each loader row:
``datacache.loaders.DataLoader`` (one import changed) and torch's DataLoader
unchanged, both with 2 workers and per-sample dicts; the consumer copies every
payload byte. The rows' order alternates between rounds. A ``--variant`` runs
the same rows with settings in the environment (``DATACACHE_CONCURRENCY=4``);
a ``--baseline`` runs them with another tree first on ``PYTHONPATH`` (a
``make layout``-style tree of an older commit), so before and after share a run.
With ``--profile``, py-spy records each job on CPU (``--subprocesses --threads``,
collapsed stacks) into DIR. The table goes into RESULTS.md between
``<!-- cold-path -->`` marks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import _data, _limits
from benchmarks._common import NUM_WORKERS, REPO, WORK, Sizes, clean_env, s3_env

MARK = "<!-- cold-path -->"
ROWS = {
    "dataloader": ("datacache-dataloader", "datacache.loaders.DataLoader, 2 workers (one import)"),
    "torch": ("datacache-dropin", "torch DataLoader unchanged, 2 workers"),
    "batch": ("datacache", "datacache batch mode, in-process (num_workers=0, 2 reader threads)"),
    "webdataset": ("webdataset", "WebDataset (curl + cache_dir), 2 workers [anchor]"),
    "litdata": ("litdata", "LitData (optimize chunks), 2 workers [anchor]"),
    "mosaic": ("mosaicml-streaming", "MosaicML Streaming (MDS), 2 workers [anchor]"),
}
DEFAULT_ROWS = ["dataloader", "torch"]
ANCHORS = {"webdataset", "litdata", "mosaic"}
"""The anchors run once per round with this tree's interpreter: a --variant or --baseline changes datacache only."""


def _log(message: str) -> None:
    print(f"[cold-path {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _cpu(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (``pid`` None) or of process ``pid``."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _variants(args: argparse.Namespace) -> list[tuple[str, dict[str, str]]]:
    """(name, extra environment) per variant; ``now`` is this tree with its defaults."""
    found: list[tuple[str, dict[str, str]]] = [("now", {})]
    for text in args.variant or []:
        name, _, assignments = text.partition(":")
        found.append((name, dict(item.split("=", 1) for item in assignments.split(",") if item)))
    for text in args.baseline or []:
        name, _, path = text.partition(":")
        # Before the repository's own folder, which ``-m`` would otherwise put first (PYTHONSAFEPATH).
        found.append((name, {"PYTHONPATH": f"{Path(path).resolve()}:{REPO}", "PYTHONSAFEPATH": "1"}))
    return found


def _job(
    endpoint: str, work: Path, row: str, name: str, env_extra: dict[str, str], expected: int, profile: Path | None
) -> dict[str, Any]:
    from benchmarks.run import run_job

    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    workers = 0 if row == "batch" else NUM_WORKERS
    spec = {"loader": ROWS[row][0], "endpoint": endpoint, "cache_dir": str(cache), "num_workers": workers,
            "expected": expected, "kind": "epochs", "phases": ["cold"]}  # fmt: skip
    env = {**clean_env(s3_env(endpoint)), **env_extra}
    prefix: list[str] = []
    if profile is not None:
        spy = Path(sys.executable).with_name("py-spy")
        output = profile / f"{row}-{name}-{int(time.time())}.txt"
        prefix = [str(spy), "record", "--format", "raw", "--rate", "97", "--threads", "--subprocesses",
                  "--nonblocking", "-o", str(output), "--"]  # fmt: skip
    result = run_job(sys.executable, spec, env, timeout=900, prefix=prefix)
    shutil.rmtree(cache, ignore_errors=True)
    if "error" in result:
        raise RuntimeError(f"{row}: {result['error']}\n{result.get('stderr', '')}")
    (epoch,) = result["epochs"]
    if not epoch["ok"]:
        raise RuntimeError(f"{row}: {epoch['samples']} samples, not {expected}")
    return dict(epoch)


def _server(tmp: Path | None) -> tuple[Any, str]:
    """moto's S3 server; with ``tmp``, its objects (spooled to temporary files above a few MB) go there.

    With the anchors' layouts moto holds ~3 GB: on a nearly full disk that leaves the local tier
    less than its reserve, and the cold rows read shards from the origin instead of staging them.
    """
    from benchmarks.warm_vs_awscli import start_s3_server

    if tmp is None:
        return start_s3_server()
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp)
    try:
        return start_s3_server()
    finally:
        if before is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = before


def measure(args: argparse.Namespace) -> dict[str, Any]:
    sizes = Sizes.quick() if args.quick else Sizes.full()
    rows = args.rows or DEFAULT_ROWS
    with_anchors = bool(ANCHORS & set(rows))
    root = _data.prepare_local(sizes, with_anchors=with_anchors)
    shards = _data.wds_shards(root)
    keys = [f"wds/{p.name}" for p in shards]
    work = WORK / "cold-path"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    variants = _variants(args)
    runs: dict[str, list[float]] = {"get": [], "durable": []}
    server, endpoint = _server(args.server_tmp)
    try:
        _data.upload_all(endpoint, sizes, root, with_anchors=with_anchors)
        loads = [os.getloadavg()]
        gb = sum(p.stat().st_size for p in shards) / 1e9
        for number in range(args.rounds):
            cpu, served = _cpu(), _cpu(server.pid)
            runs["get"].append(_limits.get_ceiling(endpoint, keys)["mb_per_s"])
            runs.setdefault("get/cpu", []).append((_cpu() - cpu) / gb)
            runs.setdefault("get/server", []).append((_cpu(server.pid) - served) / gb)
            durable = _limits.durable_write_rate(work / "durable", [p.stat().st_size for p in shards])
            runs["durable"].append(durable["mb_per_s"])
            _log(f"round {number + 1}: GET {runs['get'][-1]:.0f} MB/s, durable write {runs['durable'][-1]:.0f} MB/s")
            order = [(row, name, env) for name, env in variants for row in rows if name == "now" or row not in ANCHORS]
            for row, name, env in order if number % 2 == 0 else order[::-1]:
                served = _cpu(server.pid)
                epoch = _job(endpoint, work, row, name, env, sizes.samples, args.profile)
                runs.setdefault(f"{row}/{name}/server", []).append((_cpu(server.pid) - served) / gb)
                runs.setdefault(f"{row}/{name}", []).append(epoch["mb_per_s"])
                runs.setdefault(f"{row}/{name}/cpu", []).append(epoch["extra"]["cpu_s_per_gb"])
                runs.setdefault(f"{row}/{name}/first", []).append(epoch["first_batch_seconds"])
                _log(f"  {row} {name}: {epoch['mb_per_s']:.0f} MB/s, {epoch['extra']['cpu_s_per_gb']:.2f} CPU s/GB, "
                     f"first batch {epoch['first_batch_seconds']:.2f} s")  # fmt: skip
            loads.append(os.getloadavg())
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(work, ignore_errors=True)
    bytes_ = sum(p.stat().st_size for p in shards)
    return {"runs": runs, "rows": rows, "variants": [v[0] for v in variants], "loads": loads, "bytes": bytes_,
            "shards": len(shards)}  # fmt: skip


def table(measured: dict[str, Any]) -> str:
    runs = measured["runs"]
    get, durable = statistics.median(runs["get"]), statistics.median(runs["durable"])
    bound = min(get, durable)
    loads = measured["loads"]
    lines = [
        f"{measured['bytes'] / 1e9:.2f} GB in {measured['shards']} WebDataset shards in moto's S3 on 127.0.0.1; "
        f"one cold epoch per fresh process and empty cache, consumer copying every payload byte; medians of "
        f"{len(runs['get'])} round(s); load average (1 min) {loads[0][0]:.1f} at the start, "
        f"{max(load[0] for load in loads):.1f} at most, {loads[-1][0]:.1f} at the end, on {os.cpu_count()} cores",
        "",
        f"S3 GET ceiling, 8 threads: {get:,.0f} MB/s (rounds {', '.join(f'{v:.0f}' for v in runs['get'])}); "
        f"durable write, 4 threads: {durable:,.0f} MB/s (rounds {', '.join(f'{v:.0f}' for v in runs['durable'])}); "
        f"CPU s per GB of the GET ceiling: client {statistics.median(runs['get/cpu']):.2f}, "
        f"S3 server {statistics.median(runs['get/server']):.2f}",
        "",
        "| row | variant | cold MB/s | / min(GET, durable) | / best anchor | CPU s per GB (loader) "
        "| CPU s per GB (S3 server) | first batch s | rounds, MB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    anchors = [statistics.median(runs[f"{row}/now"]) for row in measured["rows"] if row in ANCHORS]
    best = max(anchors, default=0.0)
    for row in measured["rows"]:
        label = ROWS[row][1]
        for name in measured["variants"]:
            if f"{row}/{name}" not in runs:
                continue
            rates = runs[f"{row}/{name}"]
            rate = statistics.median(rates)
            cpu, first = statistics.median(runs[f"{row}/{name}/cpu"]), statistics.median(runs[f"{row}/{name}/first"])
            served = statistics.median(runs[f"{row}/{name}/server"])
            lines.append(
                f"| {label} | {name} | {rate:,.0f} | {rate / bound:.2f}x | {f'{rate / best:.2f}x' if best else '-'} "
                f"| {cpu:.2f} | {served:.2f} | {first:.2f} | "
                f"{', '.join(f'{v:.0f}' for v in rates)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cold_path", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="~250 MB in 11 shards instead of ~1 GB in 16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--rows", nargs="*", choices=sorted(ROWS), help="default: dataloader torch (anchors: make bench venv)"
    )
    parser.add_argument("--server-tmp", type=Path, help="moto's temporary files there (/dev/shm: spare the disk)")
    parser.add_argument("--variant", action="append", help="NAME:ENV=VALUE,... (datacache settings)")
    parser.add_argument("--baseline", action="append", help="NAME:PATH, a tree put first on PYTHONPATH")
    parser.add_argument("--profile", type=Path, help="record py-spy profiles (collapsed stacks) into this folder")
    parser.add_argument("--results", type=Path, help="put the table into this RESULTS.md, between its marks")
    args = parser.parse_args(argv)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    shown = table(measure(args))
    print(shown)
    if args.results:
        from benchmarks.eviction_sweep import write_table

        heading = "### Issue 25's cold path beside the S3 GET ceiling (`benchmarks/cold_path.py`)\n\n"
        write_table(f"{MARK}\n{heading}{shown}\n{MARK}\n", args.results, mark=MARK)
    return 0


if __name__ == "__main__":
    sys.exit(main())
