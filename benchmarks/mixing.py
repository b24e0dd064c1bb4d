"""A weighted mix of three sources: throughput beside one source, and the proportions as delivered.

Three WebDataset sources in moto's S3 server, ``a`` and ``b`` of the same
size and ``c`` ten times smaller, mixed 0.5 / 0.3 / 0.2 with an epoch as long as
the three together (``c`` cycles, ``a`` and ``b`` do not finish). The
single-source figure reads the same shards under one prefix (``all/``). Each
loader runs in a fresh process with an empty cache: epoch 0 is cold (from
S3), epoch 1 warm (from the local cache); ``DataLoader`` with 2 workers,
batches of 64, the consumer touching every byte. The source of every delivered
sample (its key's first letter) gives the realised proportions per 1,000
samples, and the worst deviation from the weights in any window of 10,000
(sliding by 100).

MosaicML Streaming (``Stream(proportion=)``) and LitData
(``CombinedStreamingDataset(weights=)``) run on the same samples, written by
their own writers, where they are installed (``make bench``'s anchors venv).

Run alone: ``python -m benchmarks.mixing [--quick]`` (adds its section to
``benchmarks/results.json`` and rewrites ``RESULTS.md``); ``make bench`` runs
it as part of the whole benchmark.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import REPO, boto_client, clean_env, s3_env
from benchmarks._section import run_section
from benchmarks._section_tables import LOADERS

BUCKET = "mixing"
WEIGHTS = {"a": 0.5, "b": 0.3, "c": 0.2}
BATCH = 64
WORKERS = 2


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"big": 6_000, "small": 600, "sample_bytes": 4_000, "per_shard": 500, "repeats": 2}
    return {"big": 20_000, "small": 2_000, "sample_bytes": 16_000, "per_shard": 1_000, "repeats": 3}


def _samples(source: str, count: int, size: int) -> list[tuple[str, bytes]]:
    rng = np.random.default_rng(ord(source))
    return [(f"{source}{i:07d}", rng.bytes(size - 200 + i % 400)) for i in range(count)]


def _tar(samples: list[tuple[str, bytes]]) -> bytes:
    import webdataset as wds

    out = io.BytesIO()
    with wds.TarWriter(out) as writer:
        for key, body in samples:
            writer.write({"__key__": key, "bin": body, "cls": str(len(body) % 10).encode()})
    return out.getvalue()


def upload(endpoint: str, sizes: dict[str, int]) -> dict[str, int]:
    """Sources a, b and c (and all three under ``all/``); return samples per source."""
    client = boto_client(endpoint)
    client.create_bucket(Bucket=BUCKET)
    counts = {"a": sizes["big"], "b": sizes["big"], "c": sizes["small"]}
    per = sizes["per_shard"]
    for source, count in counts.items():
        samples = _samples(source, count, sizes["sample_bytes"])
        for start in range(0, count, per):
            blob = _tar(samples[start : start + per])
            name = f"{source}-{start // per:05d}.tar"
            client.put_object(Bucket=BUCKET, Key=f"{source}/{name}", Body=blob)
            client.put_object(Bucket=BUCKET, Key=f"all/{name}", Body=blob)
    return counts


def _touch(batch: dict[str, Any]) -> tuple[int, list[str]]:
    """Every payload byte read (summed), and the batch's keys."""
    touched = 0
    for name, value in batch.items():
        if name != "__key__":
            data = value.data if hasattr(value, "data") else value
            touched += int(data.numpy().size)
            int(data.numpy().sum(dtype="uint64"))
    return touched, list(batch["__key__"])


def job(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: a cold epoch then a warm one; MB/s of each and the sources in delivered order."""
    import torch
    from datacache.loaders import CachedIterableDataset
    from torch.utils.data import DataLoader

    from datacache.config import load_settings

    torch.set_num_threads(1)
    settings = load_settings(dict(os.environ), overrides={"local_dir": spec["local"]})
    total = sum(spec["counts"].values())
    if spec["mix"]:
        urls = [f"s3://{BUCKET}/{source}/" for source in WEIGHTS]
        dataset = CachedIterableDataset(
            urls, weights=list(WEIGHTS.values()), epoch_size=total, config=settings, seed=1, batch_size=BATCH
        )
    else:
        dataset = CachedIterableDataset(f"s3://{BUCKET}/all/", config=settings, seed=1, batch_size=BATCH)
    loader = DataLoader(dataset, batch_size=None, num_workers=WORKERS)
    result: dict[str, Any] = {}
    for epoch, name in ((0, "cold"), (1, "warm")):
        dataset.set_epoch(epoch)
        started = time.perf_counter()
        nbytes, order = 0, []
        for batch in loader:
            touched, keys = _touch(batch)
            nbytes += touched
            order.extend(key[0] for key in keys)
        seconds = time.perf_counter() - started
        result[name] = {"mb_per_s": nbytes / seconds / 1e6, "samples": len(order), "seconds": seconds}
        result[f"{name}_order"] = "".join(order)
    dataset.close()
    return result


def proportions(order: str) -> dict[str, Any]:
    """Shares per block of 1,000 and the worst deviation from the weights per 1,000 and per window of 10,000."""
    labels = np.frombuffer(order.encode(), dtype=np.uint8)
    weights = np.array(list(WEIGHTS.values()))
    codes = [ord(source) for source in WEIGHTS]

    def shares(part: np.ndarray) -> np.ndarray:
        return np.array([(part == code).mean() for code in codes])

    blocks = [shares(labels[i : i + 1000]) for i in range(0, len(labels) - 999, 1000)]
    windows = [shares(labels[i : i + 10_000]) for i in range(0, len(labels) - 9_999, 100)]
    return {
        "overall": shares(labels).round(4).tolist(),
        "per_1000_worst": float(max((np.abs(b - weights).max() for b in blocks), default=float("nan"))),
        "per_10000_worst": float(max((np.abs(w - weights).max() for w in windows), default=float("nan"))),
        "first_blocks": [b.round(3).tolist() for b in blocks[:5]],
    }


def _run(endpoint: str, work: Path, spec: dict[str, Any]) -> dict[str, Any]:
    shutil.rmtree(work, ignore_errors=True)
    spec = {**spec, "local": str(work / "local")}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.mixing", "--job", json.dumps(spec)],
        env=clean_env(s3_env(endpoint)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("cold", "warm"):
        order = result.pop(f"{name}_order")
        if spec["mix"]:
            result[name]["proportions"] = proportions(order)
    return result


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose warm epoch is the median (its cold epoch and proportions with it), and every figure."""
    good = [run for run in runs if "error" not in run]
    if not good:
        return runs[0]
    good.sort(key=lambda run: float(run["warm"]["mb_per_s"]))
    chosen = dict(good[len(good) // 2])
    for name in ("cold", "warm"):
        figures = sorted(float(run[name]["mb_per_s"]) for run in good)
        chosen[name] = {**chosen[name], "mb_per_s": figures[len(figures) // 2], "all_mb_per_s": figures}
    return chosen


def measure(endpoint: str, work: Path, *, quick: bool) -> dict[str, Any]:
    sizes = _sizes(quick)
    counts = upload(endpoint, sizes)
    found: dict[str, list[dict[str, Any]]] = {LOADERS[0]: [], LOADERS[1]: []}
    for _ in range(sizes["repeats"]):  # alternated, so that a busy moment of the machine hits both
        for name, mix in ((LOADERS[0], False), (LOADERS[1], True)):
            found[name].append(_run(endpoint, work, {"mix": mix, "counts": counts}))
            print(f"mixing: {name}: {found[name][-1]}", file=sys.stderr)
    runs: dict[str, Any] = {name: _median(results) for name, results in found.items()}
    for name in LOADERS[2:]:
        runs[name] = {"error": "not measured: this benchmark has no runner for it yet"}
    shutil.rmtree(work, ignore_errors=True)
    return {"sizes": sizes, "counts": counts, "weights": WEIGHTS, "runs": runs}


def main() -> None:
    run_section("mixing", __doc__, job, measure)


if __name__ == "__main__":
    main()
