"""What every part of the benchmark shares: sizes, the S3 endpoint, the synthetic samples.

The synthetic dataset is a pure function of ``(seed, index)``: sample ``i``
has a payload of 50-150 KB of random (incompressible) bytes and a label, so
every tool's writer, running in any process, writes exactly the same samples.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
WORK = REPO / "benchmarks" / "work"
BUCKET = "bench"
ACCESS_KEY = "testing"
SECRET_KEY = "testing"
REGION = "us-east-1"
BATCH_SIZE = 64
NUM_WORKERS = 2
PAYLOAD = "bin"
LABEL = "cls"


@dataclass(frozen=True)
class Sizes:
    """How much data one run generates."""

    samples: int
    min_bytes: int
    max_bytes: int
    shard_bytes: int
    raw_samples: int
    """Samples also stored one object each (s3torchconnector reads one GET per sample)."""
    small_objects: int
    small_bytes: int
    raw_read_objects: int
    """Small objects read one by one for the small-files baseline (at ~140 objects/s)."""
    repeats: int
    train_ranks: int
    train_epochs: int
    seed: int = 20240601

    @classmethod
    def full(cls) -> Sizes:
        return cls(
            samples=10_000,
            min_bytes=50_000,
            max_bytes=150_000,
            shard_bytes=64_000_000,
            raw_samples=1_500,
            small_objects=20_000,
            small_bytes=8192,
            raw_read_objects=2_000,
            repeats=3,
            train_ranks=2,
            train_epochs=2,
        )

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            samples=2_500,
            min_bytes=50_000,
            max_bytes=150_000,
            shard_bytes=24_000_000,
            raw_samples=300,
            small_objects=2_000,
            small_bytes=8192,
            raw_read_objects=400,
            repeats=1,
            train_ranks=2,
            train_epochs=1,
        )


def sample_size(seed: int, index: int, low: int, high: int) -> int:
    rng = np.random.Generator(np.random.PCG64([seed, index, 1]))
    return int(rng.integers(low, high + 1))


def sample(seed: int, index: int, low: int, high: int) -> tuple[bytes, int]:
    """Sample ``index``: its payload (random bytes, ``low``-``high`` long) and its label."""
    rng = np.random.Generator(np.random.PCG64([seed, index]))
    size = sample_size(seed, index, low, high)
    return rng.bytes(size), (index * 7919) % 1000


def s3_env(endpoint: str) -> dict[str, str]:
    """Environment variables that point every tool (boto3, s3fs, aws, streaming, litdata) at the server."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ENDPOINT_URL_S3": endpoint,
        "S3_ENDPOINT_URL": endpoint,  # MosaicML Streaming
        "AWS_EC2_METADATA_DISABLED": "true",
        "FSSPEC_S3_ENDPOINT_URL": endpoint,
    }


def boto_client(endpoint: str, max_pool: int = 10) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        config=Config(max_pool_connections=max_pool),
    )


def peak_rss() -> dict[str, float]:
    """Peak resident memory (MB) of this process and of its largest finished child (DataLoader workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"main_mb": round(own, 1), "largest_child_mb": round(children, 1)}


@dataclass
class EpochResult:
    """One epoch as a consumer saw it."""

    phase: str
    seconds: float
    samples: int
    nbytes: int
    expected_samples: int
    first_batch_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.samples == self.expected_samples

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["mb_per_s"] = self.nbytes / self.seconds / 1e6 if self.seconds else 0.0
        data["samples_per_s"] = self.samples / self.seconds if self.seconds else 0.0
        return data


def emit(result: dict[str, Any]) -> None:
    """A job's result: one JSON line on stdout, prefixed so that library output cannot be mistaken for it."""
    sys.stdout.write("BENCH-RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()


def parse_result(stdout: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("BENCH-RESULT "):
            parsed: dict[str, Any] = json.loads(line[len("BENCH-RESULT ") :])
            return parsed
    raise RuntimeError("the job printed no result")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a job: this one, less anything that would redirect a tool, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DATACACHE_", "AWS_", "FSSPEC_", "S3_", "WDS_", "RANK", "WORLD_SIZE", "LOCAL_"))
    }
    env.update(extra or {})
    return env
