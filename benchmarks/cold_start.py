"""The cold-start curve: time to the first batch, and origin bytes read before it, as a dataset grows.

The same kind of WebDataset dataset (written by webdataset's own ShardWriter)
at 1x, 4x and 16x the number of shards, each with and without a wids shard
index beside it, in moto's S3 server. Each point is a fresh process with an
empty cache (local and shared tier): it opens ``CachedIterableDataset`` and
takes one batch (batch mode, in-process, the consumer touching every byte).
Measured inside that process: seconds from creating the dataset to holding
the first batch, and, from the server's request counts at that moment, the
shards the origin was asked for and their bytes (each GET counted as its whole
shard: an upper bound, as an index scan in flight may not have read it all).

Run alone: ``python -m benchmarks.cold_start [--quick]`` (adds its section to
``benchmarks/results.json`` and rewrites ``RESULTS.md``); ``make bench`` runs
it as part of the whole benchmark.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks._common import REPO, clean_env, s3_env
from benchmarks._section import run_section
from benchmarks._section_tables import SCALES

BUCKET = "coldstart"
BATCH = 64


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"base_shards": 4, "samples_per_shard": 50, "sample_bytes": 10_000, "repeats": 1}
    return {"base_shards": 16, "samples_per_shard": 100, "sample_bytes": 10_000, "repeats": 3}


def _shard(index: int, samples: int, size: int) -> bytes:
    import webdataset as wds

    out = io.BytesIO()
    with wds.TarWriter(out) as writer:
        for i in range(samples):
            key = f"s{index:06d}-{i:04d}"
            body = (key.encode() * (size // len(key) + 1))[:size]
            writer.write({"__key__": key, "bin": body, "cls": str(i % 10).encode()})
    return out.getvalue()


def upload(endpoint: str, sizes: dict[str, int]) -> dict[str, dict[str, int]]:
    """Every scale, with and without a wids index; return prefix -> {shards, bytes}."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=BUCKET)
    made: dict[str, dict[str, int]] = {}
    for scale in SCALES:
        shards = sizes["base_shards"] * scale
        blobs = {
            f"shard-{i:06d}.tar": _shard(i, sizes["samples_per_shard"], sizes["sample_bytes"]) for i in range(shards)
        }
        for index in ("none", "wids"):
            prefix = f"{scale}x-{index}"
            for name, blob in blobs.items():
                client.put_object(Bucket=BUCKET, Key=f"{prefix}/{name}", Body=blob)
            if index == "wids":
                document = {
                    "__kind__": "wids-shard-index-v1",
                    "wids_version": 1,
                    "name": prefix,
                    "shardlist": [
                        {"url": name, "nsamples": sizes["samples_per_shard"], "filesize": len(blob)}
                        for name, blob in blobs.items()
                    ],
                }
                client.put_object(Bucket=BUCKET, Key=f"{prefix}/train.json", Body=json.dumps(document).encode())
            made[prefix] = {"shards": shards, "bytes": sum(len(b) for b in blobs.values())}
    return made


def job(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: create the dataset, take one batch, read the server's request counts."""
    import torch

    torch.set_num_threads(1)
    from datacache.loaders import CachedIterableDataset

    from datacache.config import load_settings

    settings = load_settings(dict(os.environ), overrides={"local_dir": spec["local"], "shared_dir": spec["shared"]})
    started = time.perf_counter()
    dataset = CachedIterableDataset(spec["url"], config=settings, seed=1, batch_size=BATCH)
    batch = next(iter(dataset))
    touched = sum(int(v.data.numpy().sum(dtype="uint64") % 251) for k, v in batch.items() if k != "__key__")
    seconds = time.perf_counter() - started
    with urllib.request.urlopen(f"{spec['endpoint']}/_counts", timeout=10) as response:
        counts: dict[str, int] = json.loads(response.read())
    return {"first_batch_s": seconds, "samples": len(batch["__key__"]), "touched": touched, "counts": counts}


def _point(endpoint: str, work: Path, prefix: str, made: dict[str, int]) -> dict[str, Any]:
    request = urllib.request.Request(f"{endpoint}/_counts", method="POST", data=b"")
    urllib.request.urlopen(request, timeout=10).close()
    shutil.rmtree(work, ignore_errors=True)
    spec = {
        "url": f"s3://{BUCKET}/{prefix}",
        "local": str(work / "local"),
        "shared": str(work / "shared"),
        "endpoint": endpoint,
    }
    env = clean_env(s3_env(endpoint))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.cold_start", "--job", json.dumps(spec)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": done.stderr[-1500:]}
    result: dict[str, Any] = json.loads(lines[-1])
    shard_bytes = made["bytes"] / made["shards"]
    head = f"GET /{BUCKET}/{prefix}/"
    gets = {k: v for k, v in result.pop("counts").items() if k.startswith(head)}
    tars = [k for k in gets if k.endswith(".tar")]
    result["shards_requested"] = len(tars)
    result["origin_bytes"] = int(sum(gets[k] for k in tars) * shard_bytes)
    return result


def measure(endpoint: str, work: Path, *, quick: bool) -> dict[str, Any]:
    sizes = _sizes(quick)
    made = upload(endpoint, sizes)
    points: dict[str, Any] = {}
    # Round robin over the points, one run each per round: load that drifts on a shared machine
    # then falls on every scale alike, not on whichever ran last.
    rounds = [
        {prefix: _point(endpoint, work / prefix, prefix, info) for prefix, info in made.items()}
        for _ in range(sizes["repeats"])
    ]
    for prefix, info in made.items():
        runs = [done[prefix] for done in rounds]
        good = [r for r in runs if "error" not in r]
        entry: dict[str, Any] = {**info, "runs": runs}
        if good:
            entry["first_batch_s"] = statistics.median(r["first_batch_s"] for r in good)
            entry["origin_bytes"] = statistics.median(r["origin_bytes"] for r in good)
            entry["shards_requested"] = statistics.median(r["shards_requested"] for r in good)
        points[prefix] = entry
        print(
            f"cold start {prefix}: {entry.get('first_batch_s', float('nan')):.2f}s to the first batch, "
            f"{entry.get('shards_requested')} of {info['shards']} shards requested",
            file=sys.stderr,
        )
    shutil.rmtree(work, ignore_errors=True)
    return {"sizes": sizes, "batch": BATCH, "points": points}


def main() -> None:
    run_section("cold_start", __doc__, job, measure)


if __name__ == "__main__":
    main()
