"""Scale in samples: time to the first sample and peak RSS as a dataset grows from 1e6 to 1e9 samples.

The same shape at every size: Parquet files (a fixed number of them) of one small column, as
token and row datasets are; only the rows per file grow. Each point is a fresh process with an
empty cache: it opens ``CachedIterableDataset(url, shuffle=True)`` with ``num_workers=0`` and
takes the first sample of epoch 0, then of epoch 1, and reports the seconds to each, the peak
RSS, and ``state_dict()``'s time; at world size 1 and as rank 3 of 8 (``RANK``/``WORLD_SIZE``),
and for a mix of three sources (1e6 + 1e7 + the largest). A plan that costs what the shards
cost keeps all of them flat in the number of samples.

Beside it, ``datacache warm`` of 1e3 / 1e4 / 1e5 tiny shards (seconds, per shard, and per shard
beyond the bytes: `benchmarks._warm_scale`), and the
anchors' time to the first sample on the 1e8 set where they are installed (WebDataset's and
LitData's need their own formats, so they are not run here: see RESULTS-scale.md's notes).

Run alone: ``python -m benchmarks.scale [--quick]``; writes ``benchmarks/RESULTS-scale.md`` and
``benchmarks/results-scale.json``. ``make bench`` runs it after the throughput benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import _warm_scale
from benchmarks._common import REPO, WORK, clean_env

FILES = 100
_CHILD = r"""
import json, os, resource, sys, time
started = time.perf_counter()
from datacache.config import load_settings
from datacache.loaders import CachedIterableDataset
urls = json.loads(sys.argv[1])
settings = load_settings()
ds = CachedIterableDataset(urls if len(urls) > 1 else urls[0], shuffle=True, seed=3, config=settings)
iterator = iter(ds)
next(iterator)
first = time.perf_counter() - started
t = time.perf_counter()
state = ds.state_dict()
state_seconds = time.perf_counter() - t
ds.set_epoch(1)
t = time.perf_counter()
next(iter(ds))
second = time.perf_counter() - t
print(json.dumps({
    "first_sample_s": first,
    "epoch1_first_sample_s": second,
    "state_dict_ms": state_seconds * 1000,
    "state_bytes": len(json.dumps(state)),
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
"""


def write_parquet(directory: Path, rows: int, files: int = FILES) -> Path:
    """``files`` Parquet files of ``rows`` rows in all, one int8 column (cheap at any size)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = directory / ".written"
    if done.exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    per_file = rows // files
    column = pa.array(np.zeros(per_file, dtype=np.int8))
    table = pa.table({"token": column})
    for index in range(files):
        pq.write_table(table, directory / f"part-{index:05d}.parquet", row_group_size=1 << 20)
    done.touch()
    return directory


def _point(urls: list[str], cache: Path, env: dict[str, str], timeout: float) -> dict[str, Any]:
    env = {**env, "DATACACHE_LOCAL_DIR": str(cache / "local")}
    env.pop("DATACACHE_SHARED_DIR", None)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(urls)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no first sample within {timeout:.0f} s"}
    finally:
        subprocess.run(["rm", "-rf", str(cache)], check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(work: Path, *, quick: bool) -> dict[str, Any]:
    sizes = [10**6, 10**7, 10**8] if quick else [10**6, 10**7, 10**8, 10**9]
    timeout = 300.0
    env = clean_env()
    points: list[dict[str, Any]] = []
    for rows in sizes:
        data = write_parquet(work / f"parquet-{rows}", rows)
        for rank, world in ((0, 1), (3, 8)):
            layout = {**env, "RANK": str(rank), "WORLD_SIZE": str(world)}
            result = _point([str(data)], work / "cache", layout, timeout)
            points.append({"samples": rows, "rank": rank, "world": world, **result})
            print(f"scale: {rows:>13,} samples, rank {rank} of {world}: {result}", flush=True)
    small, medium, large = (write_parquet(work / f"parquet-{n}", n) for n in (10**6, 10**7, sizes[-1]))
    mix = _point([str(small), str(medium), str(large)], work / "cache", env, timeout)
    mix_total = 10**6 + 10**7 + sizes[-1]
    print(f"scale: a mix of {mix_total:,} samples: {mix}", flush=True)
    warms = _warm_scale.measure(work, env, quick=quick)
    return {"files": FILES, "points": points, "mix": {"samples": mix_total, **mix}, "warm": warms}


def _row(point: dict[str, Any]) -> str:
    if "error" in point:
        return f"| {point['samples']:,} | {point['rank']} of {point['world']} | {point['error']} | | | |"
    return (
        f"| {point['samples']:,} | {point['rank']} of {point['world']} | {point['first_sample_s']:.2f} | "
        f"{point['epoch1_first_sample_s']:.2f} | {point['peak_rss_mb']:.0f} | {point['state_dict_ms']:.1f} |"
    )


def render(result: dict[str, Any]) -> str:
    lines = [
        "# Scale in samples",
        "",
        f"Parquet, {result['files']} files of one int8 column, `CachedIterableDataset(url, shuffle=True)`,",
        "`num_workers=0`, a fresh process and an empty cache per point (`python -m benchmarks.scale`).",
        f"Machine load at the start: {os.getloadavg()[0]:.1f} (2 cores: above 2, other work shares them).",
        "",
        "| samples | rank | first sample, epoch 0 (s) | first sample, epoch 1 (s) | peak RSS (MB) | state_dict (ms) |",
        "|---|---|---|---|---|---|",
        *(_row(point) for point in result["points"]),
    ]
    mix = result["mix"]
    lines += ["", f"A mix of three sources (1e6 + 1e7 + the largest, {mix['samples']:,} samples):", ""]
    if "error" in mix:
        lines.append(f"- {mix['error']}")
    else:
        lines.append(
            f"- first sample {mix['first_sample_s']:.2f} s, epoch 1 {mix['epoch1_first_sample_s']:.2f} s, "
            f"peak RSS {mix['peak_rss_mb']:.0f} MB"
        )
    lines += _warm_scale.render(result["warm"])
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="up to 1e8 samples and 1e4 shards")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    parser.add_argument("--warm-only", action="store_true", help="only the warm section (RESULTS-scale-warm.md)")
    args = parser.parse_args()
    work = WORK / "scale"
    suffix = "-quick" if args.quick else ""
    if args.warm_only:
        warms = _warm_scale.measure(work, clean_env(), quick=args.quick)
        (args.out / f"results-scale-warm{suffix}.json").write_text(json.dumps(warms, indent=2) + "\n")
        load = f"Machine load at the start: {os.getloadavg()[0]:.1f} (2 cores)."
        lines = ["# Warm at scale", "", load, *_warm_scale.render(warms)]
        (args.out / f"RESULTS-scale-warm{suffix}.md").write_text("\n".join(lines) + "\n")
        return
    result = measure(work, quick=args.quick)
    (args.out / f"results-scale{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"RESULTS-scale{suffix}.md").write_text(render(result))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
