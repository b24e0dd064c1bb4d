"""A warm local read of many 2-sample tar shards beside a plain ``tarfile`` loop over the same files.

The set: `SHARDS` un-indexed tar files of two samples each (a ``.cls`` and a 100-byte ``.bin``), no
manifest, in one local directory. Each run is a fresh process:

- *datacache*: ``CachedIterableDataset(dir, shuffle=True, seed=3)`` iterated in the process
  (``num_workers=0``); epoch 0 reads every shard (the first run of an interpreter stages them into
  its own cache, kept for its later runs), then epoch 1 is timed: every shard local, each still
  leased while read and checked against its size (a checksum where `verify_on_read` asks).
- *tarfile*: ``tarfile.open`` of each file in sorted order and every member read, nothing cached.

Both consumers touch every byte they get (a CRC of each payload). A cell is the best of `REPEATS`
runs, the modes taking turns; with ``DATACACHE_BENCH_BASELINE_PYTHON`` (another checkout's
interpreter) its datacache takes its turn in the same runs (*before*). Target (issue 35): datacache
>= 0.8x the ``tarfile`` loop. ``python -m benchmarks.scale --only tiny``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

SHARDS = (1_000, 10_000)
REPEATS = 3
BASELINE = "DATACACHE_BENCH_BASELINE_PYTHON"
TARGET = 0.8
_CHILD = r"""
import json, os, sys, time, zlib
mode, path = sys.argv[1], sys.argv[2]
def crc(sample):  # the default decoding gives some fields as str or int
    return sum(zlib.crc32(value if isinstance(value, (bytes, memoryview)) else str(value).encode())
               for name, value in sample.items() if name != "__key__")
total = samples = 0
if mode == "tarfile":
    import pathlib, tarfile
    files = sorted(str(p) for p in pathlib.Path(path).glob("*.tar"))
    started = time.perf_counter()
    for name in files:
        with tarfile.open(name) as tar:
            for member in tar:
                if member.isfile():
                    total += zlib.crc32(tar.extractfile(member).read())
    samples, epoch0 = len(files) * 2, 0.0
else:
    from datacache.config import load_settings
    from datacache.loaders import CachedIterableDataset
    ds = CachedIterableDataset(path, shuffle=True, seed=3, config=load_settings())
    t = time.perf_counter()
    for sample in ds:
        crc(sample)
    epoch0 = time.perf_counter() - t
    ds.set_epoch(1)
    started = time.perf_counter()
    for sample in ds:
        total += crc(sample)
        samples += 1
elapsed = time.perf_counter() - started
print(json.dumps({"samples": samples, "seconds": elapsed, "samples_per_s": samples / elapsed,
                  "epoch0_s": epoch0, "checksum": total, "load": os.getloadavg()[0]}))
"""


def write_tiny_tars(directory: Path, shards: int) -> Path:
    """``shards`` tar files of two samples (``.cls``, 100-byte ``.bin``), once (a marker says it is whole)."""
    done = directory / ".written"
    if done.exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(shards):
        with tarfile.open(directory / f"tiny-{index:06d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for sample in range(2):
                key = f"{index:06d}{sample}"
                for extension, data in (("cls", str(sample).encode()), ("bin", bytes([index % 251]) * 100)):
                    member = tarfile.TarInfo(f"{key}.{extension}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
    done.write_text("")
    return directory


def _modes() -> tuple[str, ...]:
    return ("datacache", "tarfile", "datacache@before") if os.environ.get(BASELINE) else ("datacache", "tarfile")


def _run(mode: str, data: Path, cache: Path, env: dict[str, str]) -> dict[str, Any]:
    name, _, before = mode.partition("@")
    env = {**env, "DATACACHE_LOCAL_DIR": str(cache / (before or "this"))}
    env.pop("DATACACHE_SHARED_DIR", None)
    python = os.environ[BASELINE] if before else sys.executable
    try:
        done = subprocess.run(
            [python, "-c", _CHILD, name, str(data)],
            env=env,
            cwd=data,  # not a checkout: each interpreter imports its own datacache
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(work: Path, env: dict[str, str]) -> dict[str, Any]:
    """Every mode at every size of `SHARDS`, a fresh process each, the best of `REPEATS` turns."""
    points = []
    for shards in SHARDS:
        data, cache = write_tiny_tars(work / f"tiny-tar-{shards}", shards), work / f"tiny-cache-{shards}"
        subprocess.run(["rm", "-rf", str(cache)], check=False)
        point: dict[str, Any] = {"shards": shards, "runs": {}}
        for _ in range(REPEATS):
            for mode in _modes():
                result = _run(mode, data, cache, env)
                print(f"tiny: {shards:>7,} shards {mode}: {result}", flush=True)
                point["runs"].setdefault(mode, []).append(result)
                if result.get("samples_per_s", 0.0) >= point.get(mode, {}).get("samples_per_s", -1.0):
                    point[mode] = result
        subprocess.run(["rm", "-rf", str(cache)], check=False)
        points.append(point)
    return {
        "when": {"at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()[0]},
        "points": points,
    }


def _rate(result: dict[str, Any] | None) -> str:
    if not result:
        return "-"
    return f"{result['samples_per_s']:,.0f}" if "samples_per_s" in result else str(result.get("error", "?"))


def _turns(point: dict[str, Any], mode: str) -> str:
    runs = point["runs"].get(mode, [])
    return ", ".join(_rate(run) for run in runs) or "-"


def _ratio(ours: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
    if not ours or not base or "samples_per_s" not in ours or "samples_per_s" not in base:
        return "-"
    ratio = ours["samples_per_s"] / base["samples_per_s"]
    return f"{ratio:.2f}x ({'met' if ratio >= TARGET else 'missed'})"


def render(result: dict[str, Any]) -> list[str]:
    before = any("datacache@before" in point for point in result["points"])
    lines = [
        "",
        "Samples a second of a warm epoch (epoch 1, every shard local) of 2-sample un-indexed tar shards,",
        "`CachedIterableDataset(dir, shuffle=True, seed=3)`, `num_workers=0`, beside a plain `tarfile` loop",
        f"over the same files; a fresh process per run, {REPEATS} turns each, the modes taking turns (all listed;",
        f"the ratio is the best against the best), the consumer taking a CRC of every payload. Target: >= {TARGET}x.",
        "",
        "| shards | tarfile loop | datacache | datacache / loop |"
        + (" datacache before | before / loop |" if before else ""),
        "|---|---|---|---|" + ("---|---|" if before else ""),
    ]
    for point in result["points"]:
        row = (
            f"| {point['shards']:,} | {_turns(point, 'tarfile')} | {_turns(point, 'datacache')} | "
            f"{_ratio(point.get('datacache'), point.get('tarfile'))} |"
        )
        if before:
            earlier = point.get("datacache@before")
            row += f" {_turns(point, 'datacache@before')} | {_ratio(earlier, point.get('tarfile'))} |"
        lines.append(row)
    loads = [run.get("load") for point in result["points"] for runs in point["runs"].values() for run in runs]
    loads = [load for load in loads if load is not None]
    if loads:
        lines += ["", f"- The 1-minute load at the end of each run: {min(loads):.1f}-{max(loads):.1f} (2 cores)."]
    return lines
