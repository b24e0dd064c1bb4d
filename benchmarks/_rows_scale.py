"""Shuffled Parquet read at full rate, 1e6 to 1e9 rows, beside plain pyarrow on the same files.

The files are `scale.write_parquet`'s (100 files of one int8 column, row groups of 2**20 rows).
Each run is a fresh process that reads for `SECONDS` after its first sample (or to the end of
the epoch, whichever comes first), its consumer touching every value, and reports rows a second;
a cell is the best of `REPEATS` runs, the modes taking turns:

- *batch*: ``CachedIterableDataset(url, shuffle=True, batch_size=BATCH)`` (the default shuffle
  window), each Arrow record batch summed; beside it, *pyarrow*: the same files read in order with
  ``ParquetFile.iter_batches(batch_size=BATCH)``, each batch summed: what a sequential read costs.
- *per sample*: ``CachedIterableDataset(url, shuffle=True)`` iterated row by row, each row's value
  added up; beside it, *Python loop*: the same files' rows as dicts (``to_pylist`` per batch, in
  order) in a plain ``for`` loop adding the same value up.

The targets (issue 35): batch >= 0.25x pyarrow, per sample >= 0.5x the Python loop, at every size.
With ``DATACACHE_BENCH_BASELINE_PYTHON`` (another checkout's interpreter), its batch and per-sample
modes take their turns in the same runs (*before* columns).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BATCH = 1024
SECONDS = 5.0
REPEATS = 2
"""Each cell is the best of this many runs, the four modes taking turns (the machine's load moves)."""
_CHILD = r"""
import json, resource, sys, time
def cpu():
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime
mode, path, batch, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
import numpy as np
rows, total = 0, 0
if mode in ("pyarrow", "loop"):
    import pathlib
    import pyarrow.parquet as pq
    files = sorted(pathlib.Path(path).glob("*.parquet"))
    def batches():
        for name in files:
            yield from pq.ParquetFile(name).iter_batches(batch_size=batch)
    if mode == "pyarrow":
        source = batches()
    else:
        source = (row for b in batches() for row in b.to_pylist())
else:
    from datacache.config import load_settings
    from datacache.loaders import CachedIterableDataset
    ds = CachedIterableDataset(path, shuffle=True, seed=3, config=load_settings(),
                               batch_size=batch if mode == "batch" else None)
    source = iter(ds)
first = next(source)
started, cpu_started = time.perf_counter(), cpu()
deadline = started + seconds
if mode in ("pyarrow", "batch"):
    for b in source:
        total += int(np.asarray(b.column(0)).sum())
        rows += b.num_rows
        if rows % (64 * batch) < batch and time.perf_counter() > deadline:
            break
else:
    for row in source:
        total += row["token"]
        rows += 1
        if not rows & 0x3FFF and time.perf_counter() > deadline:
            break
elapsed, cpu_used = time.perf_counter() - started, cpu() - cpu_started
print(json.dumps({"rows": rows, "seconds": elapsed, "rows_per_s": rows / elapsed,
                  "cpu_ns_per_row": cpu_used / max(rows, 1) * 1e9, "checksum": total}))
"""
MODES = ("batch", "pyarrow", "sample", "loop")
BASELINE = "DATACACHE_BENCH_BASELINE_PYTHON"


def _modes() -> tuple[str, ...]:
    return (*MODES, "batch@before", "sample@before") if os.environ.get(BASELINE) else MODES


def _run(mode: str, data: Path, cache: Path, env: dict[str, str]) -> dict[str, Any]:
    env = {**env, "DATACACHE_LOCAL_DIR": str(cache / "local")}
    env.pop("DATACACHE_SHARED_DIR", None)
    mode, _, before = mode.partition("@")
    python = os.environ[BASELINE] if before else sys.executable
    try:
        done = subprocess.run(
            [python, "-c", _CHILD, mode, str(data), str(BATCH), str(SECONDS)],
            env=env,
            cwd=data,  # not a checkout: each interpreter imports its own datacache
            capture_output=True,
            text=True,
            timeout=SECONDS + 240,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}
    finally:
        subprocess.run(["rm", "-rf", str(cache)], check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(directories: dict[int, Path], cache: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    """Every mode at every size (``directories``: rows -> the files), one process each, sizes interleaved."""
    points = []
    for rows, data in directories.items():
        point: dict[str, Any] = {"samples": rows}
        for _ in range(REPEATS):
            for mode in _modes():
                result = _run(mode, data, cache, env)
                print(f"rows: {rows:>13,} {mode}: {result}", flush=True)
                if point.get(mode, {}).get("rows_per_s", -1.0) < result.get("rows_per_s", 0.0) or mode not in point:
                    point[mode] = result
                if "cpu_ns_per_row" in result:
                    least = point.setdefault("cpu", {})
                    least[mode] = min(least.get(mode, float("inf")), result["cpu_ns_per_row"])
        points.append(point)
    return points


def _rate(result: dict[str, Any]) -> str:
    return f"{result['rows_per_s'] / 1e3:,.0f}k" if "rows_per_s" in result else result.get("error", "?")


def _ratio(ours: dict[str, Any], base: dict[str, Any], target: float) -> str:
    if "rows_per_s" not in ours or "rows_per_s" not in base:
        return "-"
    ratio = ours["rows_per_s"] / base["rows_per_s"]
    return f"{ratio:.2f}x ({'met' if ratio >= target else 'missed'})"


def render(points: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        f"Rows a second, read for {SECONDS:.0f} s after the first sample (or to the epoch's end), batches of {BATCH};",
        f"a fresh process per run, the best of {REPEATS} runs per cell (the modes taking turns), the consumer",
        "adding every value up. Targets: batch >= 0.25x pyarrow,",
        "per sample >= 0.5x the Python loop.",
        "",
        "| rows | batch | pyarrow (sequential) | batch / pyarrow | per sample | Python loop | per sample / loop |",
        "|---|---|---|---|---|---|---|",
    ]
    before = any("batch@before" in p for p in points)
    if before:
        lines[-2] += " batch, before | before / pyarrow | per sample, before | before / loop |"
        lines[-1] += "---|---|---|---|"
    for p in points:
        line = (
            f"| {p['samples']:,} | {_rate(p['batch'])} | {_rate(p['pyarrow'])} | "
            f"{_ratio(p['batch'], p['pyarrow'], 0.25)} | {_rate(p['sample'])} | {_rate(p['loop'])} | "
            f"{_ratio(p['sample'], p['loop'], 0.5)} |"
        )
        if before:
            old_batch, old_sample = p.get("batch@before", {}), p.get("sample@before", {})
            line += (
                f" {_rate(old_batch)} | {_ratio(old_batch, p['pyarrow'], 0.25)} | "
                f"{_rate(old_sample)} | {_ratio(old_sample, p['loop'], 0.5)} |"
            )
        lines.append(line)
    return lines + _cpu_table(points)


def _cpu_table(points: list[dict[str, Any]]) -> list[str]:
    """CPU time a row (every thread of the process), the least of the runs: less moved by the machine's load."""
    if not any("cpu" in p for p in points):
        return []
    modes = [m for m in _modes() if any(m in p.get("cpu", {}) for p in points)]
    lines = [
        "",
        "CPU time a row (user + system, every thread of the reading process, ns), the least of the runs, same runs;",
        "ratio: the plain read's CPU time over datacache's (1.0x = as cheap as the plain read).",
        "",
        "| rows | " + " | ".join(modes) + " | batch: pyarrow / batch | per sample: loop / sample |",
        "|---|" + "---|" * (len(modes) + 2),
    ]
    for p in points:
        cpu = p.get("cpu", {})
        cells = [f"{cpu[m]:,.0f}" if m in cpu else "-" for m in modes]
        ratios = []
        for ours, plain in (("batch", "pyarrow"), ("sample", "loop")):
            mine = [f"{cpu[plain] / cpu[ours]:.2f}x"] if ours in cpu and plain in cpu else ["-"]
            if f"{ours}@before" in cpu and plain in cpu:
                mine.append(f"before {cpu[plain] / cpu[ours + '@before']:.2f}x")
            ratios.append(", ".join(mine))
        lines.append(f"| {p['samples']:,} | " + " | ".join(cells + ratios) + " |")
    return lines
