"""Helpers shared by the test modules: datasets, the CLI as a subprocess, stagers."""

from __future__ import annotations

import asyncio
import io
import random
import subprocess
import sys
import tarfile
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from datacache.config import Settings
from datacache.staging import Stager

T = TypeVar("T")

REPO = Path(__file__).resolve().parent.parent
DATACACHE = [sys.executable, "-m", "datacache.cli"]


def make_shards(
    count: int, size: int, *, seed: int = 0, prefix: str = "shard", suffix: str = ".tar"
) -> dict[str, bytes]:
    """``count`` shards of ``size`` random bytes each, the same for the same seed."""
    rng = random.Random(seed)
    return {f"{prefix}-{i:04d}{suffix}": rng.randbytes(size) for i in range(count)}


def tar_of(members: Mapping[str, bytes]) -> bytes:
    """A USTAR tar holding ``members`` (name -> bytes), in order: a WebDataset shard."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def checksum(data: bytes) -> str:
    return f"xxh3_64:{xxhash.xxh3_64(data).hexdigest()}"


def fill_dir(directory: Path, shards: Mapping[str, bytes]) -> Path:
    for key, data in shards.items():
        path = directory / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return directory


def fill_bucket(client: Any, bucket: str, prefix: str, shards: Mapping[str, bytes]) -> None:
    for key, data in shards.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=data)


def run_cli(
    args: list[str], env: Mapping[str, str], *, timeout: float = 120, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``datacache ARGS`` in a fresh process; return its exit status and output."""
    result = subprocess.run(
        [*DATACACHE, *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"datacache {' '.join(args)} exited {result.returncode}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


def with_stager(settings: Settings, body: Callable[[Stager], Awaitable[T]], **kwargs: Any) -> T:
    """Run ``body(stager)`` in a fresh event loop and close the stager afterwards."""

    async def main() -> T:
        async with Stager(settings, **kwargs) as stager:
            return await body(stager)

    return asyncio.run(main())


def wait_for(
    condition: Callable[[], bool], *, timeout: float = 60.0, what: str = "a condition"
) -> None:
    """Poll ``condition`` until it holds, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        # A short pause between polls of another process's state; the condition, not the
        # pause, decides when the wait ends.
        time.sleep(delay)  # sleep-ok: spaces the polls; the condition ends the wait
        delay = min(delay * 2, 0.02)


def partial_files(*roots: Path) -> list[Path]:
    found: list[Path] = []
    for root in roots:
        if root.exists():
            found.extend(p for p in root.rglob("*") if p.name.endswith(".partial"))
    return sorted(found)
