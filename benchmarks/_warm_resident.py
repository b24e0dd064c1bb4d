"""``datacache warm`` of 1e5 resident tiny shards: this checkout beside a baseline's, taking turns.

`benchmarks._warm_scale.tiny_origin`'s 64-byte files. Each interpreter stages them once into a
cache of its own (a fresh ``warm --quiet --no-daemon`` process), then warms them again `TURNS`
times with every shard resident, the two interpreters alternating (``os.sync()`` before each).
Target (issue 35): <= 5 s. ``DATACACHE_BENCH_BASELINE_PYTHON=... python -m benchmarks._warm_resident [shards]``
prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks._common import WORK, clean_env
from benchmarks._warm_scale import tiny_origin

TURNS = 3


def _warm(python: str, origin: Path, cache: Path, env: dict[str, str]) -> float:
    os.sync()
    started = time.perf_counter()
    done = subprocess.run(
        [python, "-m", "datacache.cli", "warm", str(origin), "--quiet", "--no-daemon"],
        env={**env, "DATACACHE_LOCAL_DIR": str(cache)},
        capture_output=True,
        text=True,
        cwd=cache.parent,  # not a checkout: each interpreter imports its own datacache
        timeout=900,
        check=False,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{python}: warm failed: {done.stderr.strip().splitlines()[-1:]}")
    return seconds


def main() -> None:
    work = WORK / "warm-resident"
    work.mkdir(parents=True, exist_ok=True)
    origin = tiny_origin(work, int(sys.argv[1]) if len(sys.argv) > 1 else 100_001)
    pythons = {"this": sys.executable}
    if os.environ.get("DATACACHE_BENCH_BASELINE_PYTHON"):
        pythons["baseline"] = os.environ["DATACACHE_BENCH_BASELINE_PYTHON"]
    env = clean_env()
    result: dict[str, dict[str, object]] = {}
    for name, python in pythons.items():
        subprocess.run(["rm", "-rf", str(work / f"cache-{name}")], check=False)
        result[name] = {"staging_s": _warm(python, origin, work / f"cache-{name}", env), "resident_s": []}
    for _ in range(TURNS):
        for name, python in pythons.items():
            seconds = _warm(python, origin, work / f"cache-{name}", env)
            result[name]["resident_s"].append(seconds)  # type: ignore[union-attr]
            print(f"{name}: resident {seconds:.1f} s, load {os.getloadavg()[0]:.1f}", flush=True)
    print(json.dumps({"shards": len(list(origin.glob("*.bin"))), "load_at_end": os.getloadavg(), **result}))


if __name__ == "__main__":
    main()
