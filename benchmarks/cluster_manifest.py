"""One listing per cluster: the first sample of 2e4 S3 tar shards on a cold node, then on a second node.

2e4 one-sample WebDataset shards and a wids shard index (their counts) in moto's S3 server. Each
point is a fresh process, the time from the interpreter's start to the first sample of
``CachedIterableDataset(url, shuffle=True)`` (per-sample mode, ``num_workers=0``; *imports*: the part
spent importing datacache's loader and torch), and the listing
requests (ListObjectsV2) the server saw meanwhile. *Cold node*: empty local and shared tiers. *Second
node*: a fresh local tier beside the same shared tier, as another node of the same job (same user)
starts. With ``DATACACHE_BENCH_BASELINE_PYTHON`` (another checkout's interpreter) its second node runs
too, in the same run, turn about with this checkout's (each on a fresh local tier).

Run alone: ``python -m benchmarks.cluster_manifest [--shards N]``; prints the section's Markdown.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks._common import clean_env, s3_env

BUCKET = "cluster"
PREFIX = "wds"
BASELINE = "DATACACHE_BENCH_BASELINE_PYTHON"
_CHILD = r"""
import json, resource, sys, time
started = time.perf_counter()
from datacache.config import load_settings
from datacache.loaders import CachedIterableDataset
import torch  # what `CachedIterableDataset` imports on first use: counted in the imports
imported = time.perf_counter() - started
url, local, shared = sys.argv[1:4]
settings = load_settings(overrides={"local_dir": local, "shared_dir": shared})
sample = next(iter(CachedIterableDataset(url, config=settings, shuffle=True, seed=3)))
print(json.dumps({"first_s": time.perf_counter() - started, "imports_s": imported, "key": sample["__key__"],
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _shard(index: int) -> bytes:
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        body = f"sample {index}".encode()
        info = tarfile.TarInfo(f"s{index:06d}.txt")
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


def upload(endpoint: str, shards: int) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(max_pool_connections=16),
    )
    client.create_bucket(Bucket=BUCKET)
    blobs = {f"shard-{i:06d}.tar": _shard(i) for i in range(shards)}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/{item[0]}", Body=item[1]),
                      blobs.items()))
    document = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "name": PREFIX,
        "shardlist": [{"url": name, "nsamples": 1, "filesize": len(blob)} for name, blob in blobs.items()],
    }
    client.put_object(Bucket=BUCKET, Key=f"{PREFIX}/train.json", Body=json.dumps(document).encode())


def _counts(endpoint: str, reset: bool = False) -> dict[str, int]:
    if reset:
        request = urllib.request.Request(f"{endpoint}/_counts", method="POST", data=b"")
        urllib.request.urlopen(request, timeout=10).close()
        return {}
    with urllib.request.urlopen(f"{endpoint}/_counts", timeout=10) as response:
        found: dict[str, int] = json.loads(response.read())
    return found


def _point(python: str, endpoint: str, local: Path, shared: Path) -> dict[str, Any]:
    _counts(endpoint, reset=True)
    shutil.rmtree(local, ignore_errors=True)
    done = subprocess.run(
        [python, "-P", "-c", _CHILD, f"s3://{BUCKET}/{PREFIX}", str(local), str(shared)],
        env=clean_env(s3_env(endpoint)),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]}
    result: dict[str, Any] = json.loads(lines[-1])
    counts = _counts(endpoint)
    result["listings"] = sum(n for k, n in counts.items() if k in {f"GET /{BUCKET}", f"GET /{BUCKET}/"})
    result["requests"] = sum(counts.values())
    return result


def measure(endpoint: str, work: Path, shards: int) -> dict[str, Any]:
    started = time.perf_counter()
    upload(endpoint, shards)
    upload_s = time.perf_counter() - started
    shared = work / "shared"
    pythons = {"branch": sys.executable}
    if os.environ.get(BASELINE):
        pythons = {"baseline": os.environ[BASELINE], **pythons}
    points = [{"node": "cold", "checkout": "branch", **_point(sys.executable, endpoint, work / "cold", shared)}]
    for label, python in pythons.items():
        points.append({"node": "second", "checkout": label, **_point(python, endpoint, work / f"b-{label}", shared)})
    return {"shards": shards, "upload_s": upload_s, "load": os.getloadavg()[0], "points": points}


def render(result: dict[str, Any]) -> list[str]:
    lines = [
        f"{result['shards']:,} one-sample tar shards and a wids index in moto's S3 (uploaded in "
        f"{result['upload_s']:.0f} s), load {result['load']:.1f} at the start (2 cores).",
        "",
        "| node | checkout | first sample (s) | of it, imports (s) | listings | requests | peak RSS (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        if "error" in p:
            lines.append(f"| {p['node']} | {p['checkout']} | {p['error']} | | | | |")
            continue
        lines.append(
            f"| {p['node']} | {p['checkout']} | {p['first_s']:.2f} | {p['imports_s']:.2f} | {p['listings']} "
            f"| {p['requests']} "
            f"| {p['peak_rss_mb']:.0f} |"
        )
    return lines


def main() -> None:
    from benchmarks.warm_vs_awscli import start_s3_server

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=20_000)
    args = parser.parse_args()
    server, endpoint = start_s3_server()
    try:
        with tempfile.TemporaryDirectory(prefix="datacache-cluster-manifest-") as work:
            result = measure(endpoint, Path(work), args.shards)
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(json.dumps(result), file=sys.stderr)
    print("\n".join(render(result)))


if __name__ == "__main__":
    main()
