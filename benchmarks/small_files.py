"""Small files: raw objects read one by one against ``datacache shard`` + ``warm`` + tar reads.

Run: ``python -m benchmarks.small_files`` (5000 objects of 8 KB) or
``--quick`` (1000). It starts its own S3 server (moto, as ``tests/s3server.py``
does) on 127.0.0.1, uploads the objects (not timed), then measures:

(a) every raw object read one by one through s3fs (``cat_file``), the way a
    dataset of one object per sample is read;
(b) ``datacache shard`` of the tree to tar shards in the same bucket
    (objects/s of sharding), then ``datacache warm`` of the shards to a local
    cache and a read of every sample from the local copy through
    `datacache.counting.tarindex` (scan, group, hash every byte).

It prints a markdown table with the rates and the ratio of (b)'s sample
rate to (a)'s: once with the warm (the cold epoch) and once reading the
local copy alone (every later epoch).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "small-files"
KEY = SECRET = "bench"
REGION = "us-east-1"


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    """Start moto's S3 server on a free port; return the process and its endpoint."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "s3server.py")], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert process.stdout is not None
    port = process.stdout.readline().decode().strip()
    if not port.isdigit():
        process.kill()
        raise RuntimeError(f"the S3 server did not start (printed {port!r})")
    return process, f"http://127.0.0.1:{port}"


def environment(endpoint: str, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATACACHE_", "AWS_"))}
    env.update(
        {
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_EC2_METADATA_DISABLED": "true",
            "HOME": str(home),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "DATACACHE_LOCAL_DIR": str(home / "cache"),
        }
    )
    return env


def upload(endpoint: str, objects: int, size: int) -> list[str]:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=KEY,
        aws_secret_access_key=SECRET,
        config=Config(max_pool_connections=16),
    )
    client.create_bucket(Bucket=BUCKET)
    keys = [f"raw/class{i % 10}/{i:06d}.bin" for i in range(objects)]

    def put(index_key: tuple[int, str]) -> None:
        index, key = index_key
        client.put_object(Bucket=BUCKET, Key=key, Body=index.to_bytes(8, "little") * (size // 8))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, enumerate(keys)))
    return keys


def read_raw(endpoint: str, keys: list[str]) -> dict[str, float]:
    """(a): every object, one GET after another, through s3fs."""
    import s3fs

    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, endpoint_url=endpoint, skip_instance_cache=True)
    total = 0
    started = time.perf_counter()
    for key in keys:
        total += len(fs.cat_file(f"{BUCKET}/{key}"))
    seconds = time.perf_counter() - started
    return {
        "objects": len(keys),
        "bytes": total,
        "seconds": seconds,
        "per_s": len(keys) / seconds,
        "mb_per_s": total / seconds / 1e6,
    }


def _cli(args: list[str], env: dict[str, str]) -> tuple[dict[str, Any], float]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "datacache.cli", *args, "--json"], env=env, capture_output=True, check=False
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"datacache {args[0]} failed: {done.stderr.decode()[-1000:]}")
    summary: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return summary, seconds


def read_shards(cache: Path) -> dict[str, float]:
    """Every sample of every cached shard, through `datacache.counting.tarindex`, hashing every byte."""
    from datacache.checksum import new_hasher
    from datacache.counting.tarindex import group_samples, scan_tar

    shards = sorted(cache.rglob("*.tar"))
    if not shards:
        raise RuntimeError(f"no cached shards under {cache}")
    hasher = new_hasher()
    samples = 0
    total = 0
    started = time.perf_counter()
    for path in shards:
        data = path.read_bytes()
        view = memoryview(data)
        for span in group_samples(scan_tar(data, where=str(path))):
            for _, offset, size in span.fields:
                hasher.update(view[offset : offset + size])
                total += size
            samples += 1
    seconds = time.perf_counter() - started
    return {
        "samples": samples,
        "bytes": total,
        "seconds": seconds,
        "per_s": samples / seconds,
        "mb_per_s": total / seconds / 1e6,
        "shards": len(shards),
    }


def run_small_files(objects: int = 5000, size: int = 8192, shard_size: str = "8MB") -> dict[str, Any]:
    """Run the comparison; return every measurement."""
    process, endpoint = start_server()
    try:
        with tempfile.TemporaryDirectory(prefix="datacache-small-files-") as work:
            home = Path(work)
            env = environment(endpoint, home)
            keys = upload(endpoint, objects, size)
            raw = read_raw(endpoint, keys)
            shard, shard_seconds = _cli(
                ["shard", f"s3://{BUCKET}/raw", f"s3://{BUCKET}/shards", "--shard-size", shard_size], env
            )
            warm, warm_seconds = _cli(["warm", f"s3://{BUCKET}/shards"], env)
            local = read_shards(home / "cache")
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()
    if local["samples"] != objects:
        raise RuntimeError(f"read {local['samples']} samples back, expected {objects}")
    cold_seconds = warm_seconds + local["seconds"]
    return {
        "objects": objects,
        "object_bytes": size,
        "raw": raw,
        "shard": {**shard, "wall_seconds": shard_seconds},
        "warm": {**warm, "wall_seconds": warm_seconds},
        "local_read": local,
        "cold_epoch": {"seconds": cold_seconds, "per_s": objects / cold_seconds},
        "ratio_cold": (objects / cold_seconds) / raw["per_s"],
        "ratio_local": local["per_s"] / raw["per_s"],
    }


def table(result: dict[str, Any]) -> str:
    raw, shard, local, cold = result["raw"], result["shard"], result["local_read"], result["cold_epoch"]
    lines = [
        f"Small files: {result['objects']} objects of {result['object_bytes'] // 1024} KB, S3 = moto on 127.0.0.1",
        "",
        "| what | time | samples/s | MB/s | vs raw |",
        "|---|---:|---:|---:|---:|",
        f"| (a) raw objects one by one (s3fs `cat_file`) | {raw['seconds']:.1f} s | {raw['per_s']:.0f} "
        f"| {raw['mb_per_s']:.2f} | 1.0x |",
        f"| `datacache shard` to S3 ({shard['shards']} shards) | {shard['wall_seconds']:.1f} s "
        f"(in-run {shard['seconds']:.1f} s) | {shard['objects_per_s']:.0f} objects/s "
        f"| {shard['rate_bytes_per_s'] / 1e6:.2f} | |",
        f"| (b) `datacache warm` + read every sample via tarindex | {cold['seconds']:.1f} s "
        f"| {cold['per_s']:.0f} | {result['objects'] * result['object_bytes'] / cold['seconds'] / 1e6:.2f} "
        f"| {result['ratio_cold']:.1f}x |",
        f"| (b) read every sample from the local copy only | {local['seconds']:.2f} s | {local['per_s']:.0f} "
        f"| {local['mb_per_s']:.1f} | {result['ratio_local']:.0f}x |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--objects", type=int, default=None, help="number of objects (default 5000)")
    parser.add_argument("--quick", action="store_true", help="1000 objects")
    parser.add_argument("--size", type=int, default=8192, help="bytes per object (default 8192)")
    parser.add_argument("--shard-size", default="8MB", help="datacache shard --shard-size (default 8MB)")
    parser.add_argument("--json", metavar="FILE", help="also write the measurements as JSON")
    args = parser.parse_args(argv)
    objects = args.objects or (1000 if args.quick else 5000)
    result = run_small_files(objects, args.size, args.shard_size)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
