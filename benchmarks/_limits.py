"""The machine's limits, measured in the same run as the loaders: what no loader can beat.

- plain sequential reads of the cached shard files: Python ``readinto`` with
  one reused buffer, and ``cat FILES > /dev/null`` (hot page cache: the files
  were just written, as they are for a warm epoch);
- the S3 server's GET ceiling: 8 threads of boto3 GETs of whole shards;
- the local disk's durable write rate: files of the shards' size written,
  fsynced and renamed one after another, as any cache that survives a crash
  must write them (a cold epoch or ``datacache warm`` that keeps its copies
  cannot fill the cache faster than this);
- staging tools: ``aws s3 cp --recursive``, an s3fs recursive ``get``, and
  ``datacache warm``, each into an empty folder;
- what ``datacache shard`` makes of the small-files variant (its one-by-one
  baseline is ``benchmarks/small_files.py``'s).

The DataLoader-with-no-I/O ceiling runs as a loader job (see
`benchmarks._loaders.PreparedBytes`).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks._common import BUCKET, REPO, boto_client, clean_env, s3_env

BIN = Path(sys.executable).parent


def _files_bytes(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files)


def readinto_rate(files: list[Path], buffer_bytes: int = 8 << 20) -> dict[str, float]:
    """Read every file sequentially into one reused buffer (the best a Python reader can do)."""
    buffer = bytearray(buffer_bytes)
    view = memoryview(buffer)
    total = 0
    started = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while n := handle.readinto(view):
                total += n
    seconds = time.perf_counter() - started
    return {"bytes": total, "seconds": seconds, "mb_per_s": total / seconds / 1e6}


def cat_rate(files: list[Path]) -> dict[str, float]:
    total = _files_bytes(files)
    started = time.perf_counter()
    with open(os.devnull, "wb") as sink:
        subprocess.run(["cat", *map(str, files)], stdout=sink, check=True)
    seconds = time.perf_counter() - started
    return {"bytes": total, "seconds": seconds, "mb_per_s": total / seconds / 1e6}


def durable_write_rate(directory: Path, sizes: list[int], threads: int = 4) -> dict[str, float]:
    """Write files of ``sizes`` bytes (8 MiB writes, fsync, rename) with a few threads; MB/s over all."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    block = os.urandom(8 << 20)

    def write(index: int) -> int:
        temporary = directory / f".{index}.partial"
        size = sizes[index]
        with open(temporary, "wb", buffering=0) as out:
            left = size
            while left:
                left -= out.write(memoryview(block)[: min(left, len(block))])
            os.fsync(out.fileno())
        os.replace(temporary, directory / f"{index}.bin")
        return size

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(write, range(len(sizes))))
    seconds = time.perf_counter() - started
    shutil.rmtree(directory, ignore_errors=True)
    return {"bytes": total, "seconds": seconds, "mb_per_s": total / seconds / 1e6, "threads": threads}


def get_ceiling(endpoint: str, keys: list[str], threads: int = 8) -> dict[str, float]:
    """Parallel GETs of whole objects, each body read in 1 MiB chunks and dropped."""
    client = boto_client(endpoint, max_pool=threads + 2)
    lock = threading.Lock()
    moved = [0]

    def fetch(key: str) -> None:
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
        n = 0
        for chunk in body.iter_chunks(1 << 20):
            n += len(chunk)
        with lock:
            moved[0] += n

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(fetch, keys))
    seconds = time.perf_counter() - started
    return {"bytes": moved[0], "seconds": seconds, "mb_per_s": moved[0] / seconds / 1e6, "threads": threads}


def _timed(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO, check=False)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({result.returncode}): {result.stderr[-1500:]}")
    return seconds, result.stdout


def aws_cp_rate(endpoint: str, prefix: str, dest: Path, expected: int) -> dict[str, float]:
    shutil.rmtree(dest, ignore_errors=True)
    command = [str(BIN / "aws"), "s3", "cp", "--recursive", "--quiet", f"s3://{BUCKET}/{prefix}", str(dest)]
    seconds, _ = _timed([*command, "--endpoint-url", endpoint], clean_env(s3_env(endpoint)))
    moved = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    if moved < expected:
        raise RuntimeError(f"aws s3 cp moved {moved} bytes, expected at least {expected}")
    return {"bytes": moved, "seconds": seconds, "mb_per_s": moved / seconds / 1e6}


def s3fs_get_rate(endpoint: str, prefix: str, dest: Path, expected: int) -> dict[str, float]:
    import s3fs

    shutil.rmtree(dest, ignore_errors=True)
    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint, skip_instance_cache=True)
    started = time.perf_counter()
    fs.get(f"{BUCKET}/{prefix}", str(dest) + "/", recursive=True)
    seconds = time.perf_counter() - started
    moved = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    if moved < expected:
        raise RuntimeError(f"s3fs get moved {moved} bytes, expected at least {expected}")
    return {"bytes": moved, "seconds": seconds, "mb_per_s": moved / seconds / 1e6}


def datacache_warm_rate(
    endpoint: str, prefix: str, local_dir: Path, expected: int, extra_env: dict[str, str] | None = None
) -> dict[str, Any]:
    """``datacache warm s3://... --json`` into an empty local tier: wall-clock rate, and the rate it reports."""
    shutil.rmtree(local_dir, ignore_errors=True)
    env = clean_env({**s3_env(endpoint), **(extra_env or {})})
    env["HOME"] = str(local_dir.parent / "home")
    command = [str(BIN / "datacache"), "warm", f"s3://{BUCKET}/{prefix}", "--json", "--local-dir", str(local_dir)]
    seconds, stdout = _timed(command, env)
    done = json.loads(stdout.strip().splitlines()[-1])
    if not done.get("complete") or done.get("bytes_transferred", 0) < expected:
        raise RuntimeError(f"datacache warm did not complete: {done}")
    moved = int(done["bytes_transferred"])
    return {
        "bytes": moved,
        "seconds": seconds,
        "mb_per_s": moved / seconds / 1e6,
        "reported_mb_per_s": float(done["rate_bytes_per_s"]) / 1e6,
    }


def datacache_shard(endpoint: str, src: str, dst: str, home: Path, shard_size: str) -> dict[str, Any]:
    """``datacache shard SRC DST --json``; returns its summary (objects/s) and wall-clock seconds."""
    env = clean_env(s3_env(endpoint))
    env["HOME"] = str(home)
    command = [str(BIN / "datacache"), "shard", src, dst, "--json", "--shard-size", shard_size]
    seconds, stdout = _timed(command, env)
    done = json.loads(stdout.strip().splitlines()[-1])
    if done.get("event") != "done":
        raise RuntimeError(f"datacache shard printed no summary: {stdout[-500:]}")
    done["wall_seconds"] = seconds
    return dict(done)
