"""`datacache warm` of many tiny shards: what a shard costs beyond its bytes (part of `benchmarks.scale`).

Each point is a fresh ``datacache warm --no-daemon`` process into an empty cache, from a local
directory of 64-byte files (and from the moto S3 server where uploading them is quick enough).
Beside it, in the same run: the same process warming 10 shards (its fixed cost: start-up,
listing, recovery) and a plain copy of the same files by Python (``shutil.copyfile`` per file,
no fsync: the bytes' own cost). The overhead per shard is what is left:
``(warm - fixed - copy) / shards``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._common import BUCKET, s3_env
from benchmarks._data import _put_many
from benchmarks.warm_vs_awscli import start_s3_server

TINY = 64


def tiny_origin(work: Path, shards: int) -> Path:
    origin = work / f"tiny-{shards}"
    if not (origin / ".written").exists():
        origin.mkdir(parents=True, exist_ok=True)
        for index in range(shards):
            (origin / f"{index:07d}.bin").write_bytes(index.to_bytes(8, "big") * (TINY // 8))
        (origin / ".written").touch()
    return origin


def _warm(
    url: str, cache: Path, env: dict[str, str], timeout: float, *, python: str = sys.executable, again: bool = False
) -> dict[str, Any]:
    """One warm into an empty ``cache``; with ``again``, a second one with every shard resident beside it."""
    env = {**env, "DATACACHE_LOCAL_DIR": str(cache)}
    env.pop("DATACACHE_SHARED_DIR", None)
    result: dict[str, Any] = {}
    for name in ("seconds", "resident_seconds") if again else ("seconds",):
        # The last point's removed cache and copy are metadata the disk has not written yet: each
        # fsync of this warm would pay for them. Written now, outside the time measured.
        os.sync()
        started = time.perf_counter()
        try:
            done = subprocess.run(
                [python, "-m", "datacache.cli", "warm", url, "--quiet", "--no-daemon"],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
                cwd=cache.parent,  # not a checkout: ``-m`` would import that directory's datacache first
            )
        except subprocess.TimeoutExpired:
            shutil.rmtree(cache, ignore_errors=True)
            return {"error": f"not done within {timeout:.0f} s"}
        result[name] = time.perf_counter() - started
        if done.returncode != 0:
            shutil.rmtree(cache, ignore_errors=True)
            return {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    # Removing the cache is the benchmark's cleanup, not the warm's: outside the time measured.
    shutil.rmtree(cache, ignore_errors=True)
    return result


def _copy_seconds(origin: Path, destination: Path) -> float:
    """A plain copy of every file: the bytes' cost with no bookkeeping at all."""
    destination.mkdir(parents=True, exist_ok=True)
    os.sync()
    started = time.perf_counter()
    for path in origin.iterdir():
        if path.suffix == ".bin":
            shutil.copyfile(path, destination / path.name)
    seconds = time.perf_counter() - started
    shutil.rmtree(destination, ignore_errors=True)
    return seconds


def _point(
    origin: str, shards: int, url: str, work: Path, env: dict[str, str], timeout: float, fixed: float, copy: float
) -> dict[str, Any]:
    local = origin == "directory"
    result = {"origin": origin, "shards": shards, **_warm(url, work / "cache-warm", env, timeout, again=local)}
    if "seconds" in result:
        seconds = result["seconds"]
        result["ms_per_shard"] = seconds / shards * 1000
        result["overhead_ms_per_shard"] = max(0.0, seconds - fixed - copy) / shards * 1000
        result["copy_ms_per_shard"] = copy / shards * 1000
    baseline = os.environ.get(BASELINE)
    if local and baseline:  # the same point warmed by another tree's code (main's), in this run
        before = _warm(url, work / "cache-warm", env, timeout, python=baseline, again=True)
        result["baseline"] = before
    print(f"scale: warm {result}", flush=True)
    return result


BASELINE = "DATACACHE_BENCH_BASELINE_PYTHON"
"""The interpreter of another checkout (``main``'s .venv/bin/python): its warms are timed beside this one's."""


def measure(work: Path, env: dict[str, str], *, quick: bool, timeout: float = 300.0) -> dict[str, Any]:
    sizes = (10**3, 10**4) if quick else (10**3, 10**4, 10**5)
    fixed_origin = tiny_origin(work, 10)
    # The least of three: one slow start (a cold page cache, a busy moment) is not a cost per shard.
    fixed = min(_warm(str(fixed_origin), work / "cache-warm", env, timeout).get("seconds", 0.0) for _ in range(3))
    points = []
    for shards in sizes:
        origin = tiny_origin(work, shards)
        copy = _copy_seconds(origin, work / "copy")
        points.append(_point("directory", shards, str(origin), work, env, timeout, fixed, copy))
    points += _s3_points(work, env, (10**3,) if quick else (10**3, 10**4), timeout, fixed)
    return {"fixed_seconds": fixed, "tiny_bytes": TINY, "points": points}


def _s3_points(
    work: Path, env: dict[str, str], sizes: tuple[int, ...], timeout: float, fixed: float
) -> list[dict[str, Any]]:
    server, endpoint = start_s3_server()
    points = []
    try:
        from benchmarks._common import boto_client

        boto_client(endpoint).create_bucket(Bucket=BUCKET)
        for shards in sizes:
            origin = tiny_origin(work, shards)
            files = sorted(path for path in origin.iterdir() if path.suffix == ".bin")
            started = time.perf_counter()
            _put_many(endpoint, ((f"tiny-{shards}/{path.name}", path.read_bytes) for path in files))
            upload = time.perf_counter() - started
            # The server's own rate bounds this origin: its upload of the same objects is beside it.
            point = _point(
                "moto S3",
                shards,
                f"s3://{BUCKET}/tiny-{shards}/",
                work,
                {**env, **s3_env(endpoint)},
                timeout,
                fixed,
                0.0,
            )
            point["upload_seconds"] = upload
            points.append(point)
    finally:
        server.kill()
        server.wait()
    return points


def render(result: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"`datacache warm` of tiny shards ({result['tiny_bytes']} bytes each; a fresh process, an empty cache).",
        "Its fixed cost (start-up, listing, recovery: the least of three warms of 10 shards) was "
        f"{result['fixed_seconds']:.1f} s;",
        "the overhead per shard is (warm - fixed - a plain Python copy of the same files) / shards.",
        "",
        "| origin | shards | seconds | ms per shard | overhead ms per shard | plain copy ms per shard |",
        "|---|---|---|---|---|---|",
    ]
    for point in result["points"]:
        if "error" in point:
            lines.append(f"| {point['origin']} | {point['shards']:,} | {point['error']} | | | |")
            continue
        lines.append(
            f"| {point['origin']} | {point['shards']:,} | {point['seconds']:.1f} | {point['ms_per_shard']:.2f} | "
            f"{point['overhead_ms_per_shard']:.2f} | {point.get('copy_ms_per_shard', 0):.3f} |"
        )
    lines += _resident_lines(result["points"])
    s3 = [point for point in result["points"] if "upload_seconds" in point]
    if s3:
        uploads = ", ".join(f"{p['shards']:,} in {p['upload_seconds']:.0f} s" for p in s3)
        lines += ["", f"moto's server bounds the S3 rows (~140 small objects/s here): putting them took {uploads}."]
    return lines


def _resident_lines(points: list[dict[str, Any]]) -> list[str]:
    """The second warm of each directory point (every shard resident), and the baseline's beside it."""
    rows = [p for p in points if "resident_seconds" in p]
    if not rows:
        return []
    lines = [
        "",
        "The same warms again, every shard resident (target: 1e5 in <= 5 s), and, where a baseline was",
        f"given (`{BASELINE}`), the same two warms by that checkout in the same run:",
        "",
        "| shards | empty cache (s) | ms per shard | resident (s) | baseline empty (s) | baseline resident (s) |",
        "|---|---|---|---|---|---|",
    ]
    for p in rows:
        before = p.get("baseline", {})
        old = (
            f"{before['seconds']:.1f} | {before['resident_seconds']:.1f}"
            if "resident_seconds" in before
            else f"{before.get('error', '')} |"
        )
        lines.append(
            f"| {p['shards']:,} | {p['seconds']:.1f} | {p['ms_per_shard']:.2f} | {p['resident_seconds']:.1f} | {old} |"
        )
    return lines
