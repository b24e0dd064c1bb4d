"""Scale in samples: time to the first sample and peak RSS as a dataset grows from 1e6 to 1e9 samples.

The same shape at every size: Parquet files (a fixed number of them) of one small column, as
token and row datasets are; only the rows per file grow. Each point is a fresh process with an
empty cache: it opens ``CachedIterableDataset(url, shuffle=True)`` with ``num_workers=0`` and
takes the first sample of epoch 0, then of epoch 1, and reports the seconds to each, the peak
RSS, and ``state_dict()``'s time; at world size 1 and as rank 3 of 8 (``RANK``/``WORLD_SIZE``).
A mix of three sources (half, three tenths and a fifth of the samples, in 50 + 30 + 20 files, each
read once an epoch) is measured the same way at 1e6 samples and at the largest size, world size 1
and rank 3 of 8. A plan that costs what the shards cost keeps all of them flat in the number of
samples: the target is the largest size within 1.5x the time and +100 MB of 1e6.

Beside it: shuffled Parquet read at full rate in batch and per-sample mode beside plain pyarrow
and a plain Python loop over the same files (`benchmarks._rows_scale`), a plan for 1e6 shards from
a synthetic manifest (peak RSS per rank and the time to the first planned sample:
`benchmarks._plan_scale`), WebDataset's time to the first sample beside datacache's on the same
tar shards (`benchmarks._wds_scale`), and ``datacache warm`` of 1e3 / 1e4 / 1e5 tiny shards
(seconds, per shard, and per shard beyond the bytes: `benchmarks._warm_scale`).

A warm epoch of 1e3 / 1e4 two-sample tar shards beside a plain ``tarfile`` loop (`benchmarks._tiny_scale`).

Run alone: ``python -m benchmarks.scale [--quick] [--only mix|warm|plan|manifest|wds|rows|tiny]``; writes
``benchmarks/RESULTS-scale.md`` and ``benchmarks/results-scale.json`` (``--only`` measures that part
again and keeps the other parts of the last run's results). ``make bench`` runs it after the
throughput benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import _manifest_scale, _plan_scale, _rows_scale, _tiny_scale, _warm_scale, _wds_scale
from benchmarks._common import REPO, WORK, clean_env

FILES = 100
MIX_FILES = ((0.5, 50), (0.3, 30), (0.2, 20))
"""Each source of the benchmark's mix: its share of the samples, and its files (100 in all, as one dataset)."""
LAYOUTS = ((0, 1), (3, 8))
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


def _sizes(quick: bool) -> list[int]:
    return [10**6, 10**7, 10**8] if quick else [10**6, 10**7, 10**8, 10**9]


def _when() -> dict[str, Any]:
    return {"at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()[0]}


def measure(work: Path, *, quick: bool) -> dict[str, Any]:
    sizes = _sizes(quick)
    timeout = 300.0
    env = clean_env()
    started = _when()
    points: list[dict[str, Any]] = []
    for rows in sizes:
        data = write_parquet(work / f"parquet-{rows}", rows)
        for rank, world in LAYOUTS:
            layout = {**env, "RANK": str(rank), "WORLD_SIZE": str(world)}
            result = _point([str(data)], work / "cache", layout, timeout)
            points.append({"samples": rows, "rank": rank, "world": world, **result})
            print(f"scale: {rows:>13,} samples, rank {rank} of {world}: {result}", flush=True)
    mix = measure_mix(work, quick=quick)
    result = {"files": FILES, "when": started, "points": points, "mix": mix, **_beside(work, env, quick=quick)}
    return {**result, "finished": {"at": _when()["at"], "loads": os.getloadavg()}}


def _beside(work: Path, env: dict[str, str], *, quick: bool, only: str | None = None) -> dict[str, Any]:
    """The parts measured beside the Parquet points (all, or ``only`` one): each with its start and load."""
    parts = {
        "plan": lambda: {"when": _when(), "points": _plan_scale.measure(env)},
        "manifest": lambda: {"when": _when(), **_manifest_scale.measure(work, env)},
        "wds": lambda: {
            "when": _when(),
            **_wds_scale.measure(work, env, lambda urls: _point(urls, work / "cache", env, 300.0)),
        },
        "warm": lambda: _warm_scale.measure(work, env, quick=quick),
        "tiny": lambda: _tiny_scale.measure(work, env),
        "rows": lambda: {
            "when": _when(),
            "points": _rows_scale.measure(
                {rows: write_parquet(work / f"parquet-{rows}", rows) for rows in _sizes(quick)}, work / "cache", env
            ),
        },
    }
    return {name: measure_part() for name, measure_part in parts.items() if only in (None, name)}


def measure_mix(work: Path, *, quick: bool) -> dict[str, Any]:
    """The three-source mix at 1e6 samples and at the largest size, at each layout of `LAYOUTS`."""
    env, timeout, started = clean_env(), 300.0, _when()
    points: list[dict[str, Any]] = []
    for total in (10**6, _sizes(quick)[-1]):
        urls = [
            str(write_parquet(work / f"mix-{total}-{index}", round(total * share), files))
            for index, (share, files) in enumerate(MIX_FILES)
        ]
        for rank, world in LAYOUTS:
            layout = {**env, "RANK": str(rank), "WORLD_SIZE": str(world)}
            result = _point(urls, work / "cache", layout, timeout)
            points.append({"samples": total, "rank": rank, "world": world, **result})
            print(f"scale: a mix of {total:>13,} samples, rank {rank} of {world}: {result}", flush=True)
    return {"files": [files for _, files in MIX_FILES], "when": started, "points": points}


_HEADER = (
    "| samples | rank | first sample, epoch 0 (s) | first sample, epoch 1 (s) | peak RSS (MB) | state_dict (ms) |",
    "|---|---|---|---|---|---|",
)


def _row(point: dict[str, Any]) -> str:
    if "error" in point:
        return f"| {point['samples']:,} | {point['rank']} of {point['world']} | {point['error']} | | | |"
    return (
        f"| {point['samples']:,} | {point['rank']} of {point['world']} | {point['first_sample_s']:.2f} | "
        f"{point['epoch1_first_sample_s']:.2f} | {point['peak_rss_mb']:.0f} | {point['state_dict_ms']:.1f} |"
    )


def _growth(points: list[dict[str, Any]]) -> list[str]:
    """Per layout: the largest size's first sample and peak RSS against 1e6's (the targets: 1.5x, +100 MB)."""
    lines = []
    for rank, world in LAYOUTS:
        mine = [p for p in points if (p["rank"], p["world"]) == (rank, world) and "error" not in p]
        if len(mine) < 2:
            continue
        small, large = min(mine, key=lambda p: p["samples"]), max(mine, key=lambda p: p["samples"])
        ratio = large["first_sample_s"] / small["first_sample_s"]
        grown = large["peak_rss_mb"] - small["peak_rss_mb"]
        met = "met" if ratio <= 1.5 and grown <= 100 else "missed"
        lines.append(
            f"- rank {rank} of {world}: {large['samples']:,} against {small['samples']:,} samples: first sample "
            f"{ratio:.2f}x, peak RSS {grown:+.0f} MB (target 1.5x and +100 MB: {met})"
        )
    return lines


def _measured(part: dict[str, Any]) -> str:
    when = part.get("when")
    if not when:
        return "Measured in an earlier run (time and load not recorded)."
    if "note" in when:
        return f"Measured in {when['note']}."
    return f"Measured {when['at']}, machine load {when['load']:.1f} at the start (2 cores: above 2, others share them)."


def _finished(result: dict[str, Any]) -> list[str]:
    """When the whole run ended, and the load averages then (1, 5, 15 minutes: the 15 spans most of a run)."""
    end = result.get("finished")
    if not end:
        return []
    loads = ", ".join(f"{load:.1f}" for load in end["loads"])
    return [f"Every section below is this one run, ended {end['at']}; load averages then (1, 5, 15 min): {loads}."]


def render(result: dict[str, Any]) -> str:
    lines = [
        "# Scale in samples",
        "",
        f"Parquet, {result['files']} files of one int8 column, `CachedIterableDataset(url, shuffle=True)`,",
        "`num_workers=0`, a fresh process and an empty cache per point (`python -m benchmarks.scale`).",
        "The first sample's seconds are start-up (imports, listing, footers) and move with the machine's",
        "load; what is flat is what the plan costs. Before the O(shards) plan: 1e7 samples ~50 s and 1.3 GB,",
        "1e8 no first sample in 400 s, 1e9 refused.",
        "",
        _measured(result),
        *_finished(result),
        "",
        *_HEADER,
        *(_row(point) for point in result["points"]),
        "",
        *_growth(result["points"]),
    ]
    mix = result["mix"]
    lines += ["", "## A mix of three sources", ""]
    if "points" not in mix:
        lines.append(f"- {mix.get('error', 'not measured')}")
    else:
        lines += [
            f"Half, three tenths and a fifth of the samples in {' + '.join(map(str, mix['files']))} Parquet files,",
            "each source read once an epoch (`CachedIterableDataset([a, b, c], shuffle=True)`). Before the",
            "O(shards + sources) mix plan, a mix of 1e9 samples was refused (`DatasetTooLargeError`: ~144 GB",
            "to plan at 72 bytes a sample). Epoch 1's column is what planning an epoch costs once the process",
            "is up: it grows with the epoch's blocks of positions (samples / shuffle window) that the reader's",
            "plan and the node's future (this epoch's and the next's, every rank's) go through.",
            "",
            _measured(mix),
            "",
            *_HEADER,
            *(_row(point) for point in mix["points"]),
            "",
            *_growth(mix["points"]),
        ]
    if "plan" in result:
        lines += [
            "",
            "## A plan for 1e6 shards",
            "",
            _measured(result["plan"]),
            *_plan_scale.render(result["plan"]["points"]),
        ]
    if "manifest" in result:
        lines += ["", "## A node's manifest of 1e6 shards, mapped", "", _measured(result["manifest"])]
        lines += _manifest_scale.render(result["manifest"])
    if "wds" in result:
        lines += ["", "## WebDataset beside datacache: time to the first sample", "", _measured(result["wds"])]
        lines += _wds_scale.render(result["wds"])
    if "rows" in result:
        lines += ["", "## Shuffled Parquet read at full rate", "", _measured(result["rows"])]
        lines += _rows_scale.render(result["rows"]["points"])
    lines += ["", "## `datacache warm` of tiny shards", *_warm_scale.render(result["warm"])]
    lines += [
        "",
        "Before the batch path (one catalog transaction and one directory fsync per batch, 2026-12-01):",
        "1e3 shards 4.2 s, 1e4 62 s, 1e5 not done in 300 s. `--only warm` reruns this section alone.",
    ]
    if "tiny" in result:
        lines += ["", "## tiny: a warm read of many 2-sample tar shards", "", _measured(result["tiny"])]
        lines += _tiny_scale.render(result["tiny"])
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="up to 1e8 samples and 1e4 shards")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    parser.add_argument(
        "--only",
        choices=["mix", "warm", "plan", "manifest", "wds", "rows", "tiny"],
        help="measure only this part; keep the other results",
    )
    args = parser.parse_args()
    work = WORK / "scale"
    suffix = "-quick" if args.quick else ""
    if args.only:
        result = json.loads((args.out / f"results-scale{suffix}.json").read_text())
        if args.only == "mix":
            result["mix"] = measure_mix(work, quick=args.quick)
        else:
            result.update(_beside(work, clean_env(), quick=args.quick, only=args.only))
    else:
        result = measure(work, quick=args.quick)
    (args.out / f"results-scale{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"RESULTS-scale{suffix}.md").write_text(render(result))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
