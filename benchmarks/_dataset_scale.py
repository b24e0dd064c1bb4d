"""What a user gets at 1e6 shards: a real `CachedIterableDataset`'s first sample, 1e3 against 1e6 shards.

The same synthetic manifest as `benchmarks._manifest_scale` (shards of 1,000 samples, this node's
own, saved by `ManifestStore.save` in a process of its own), but the point goes on to the first
sample of ``CachedIterableDataset(url, shuffle=True)`` at rank 3 of 8 (``RANK``/``WORLD_SIZE``,
``num_workers=0``): the unit plan, the catalog, the stager, the node's future handed to it, and
reading the first shard. The origin is a local folder whose shards are hard links to Parquet files
of 1,000 rows (one per 60,000 shards) (writing 1e6 distinct files is too slow here): each is a real file the stager
stats, stages and verifies. With ``DATACACHE_BENCH_BASELINE_PYTHON`` the same points by that checkout
run in the same run, turn about, each on a fresh local tier.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from benchmarks._manifest_scale import BASELINE, PER_SHARD, RANK, SIZES, WORLD, _checkout, _run, verdicts

_WRITE = r"""
import asyncio, os, sys
from pathlib import Path
import pyarrow as pa, pyarrow.parquet as pq
from datacache.config import load_settings, resolve_dataset
from datacache.manifest import Manifest, ManifestStore, Shard, ShardFormat
shards, per_shard, origin, local = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
origin.mkdir(parents=True, exist_ok=True)
names = [f"part-{i:07d}.parquet" for i in range(shards)]
LINKS = 60_000  # a file takes at most 65,000 links here (ext4): one Parquet file per 60,000 shards
versions = []
for base in range(0, shards, LINKS):
    first = origin / names[base]
    if not first.exists():
        pq.write_table(pa.table({"x": pa.array(range(per_shard), pa.int16())}), first)
    for name in names[base + 1 : base + LINKS]:
        if not (origin / name).exists():
            os.link(first, origin / name)
    st = first.stat()
    versions.append((st.st_size, f"{int(st.st_mtime * 1e9)}:{st.st_size}"))  # as the origin tier names it (fsspec)
url = origin.as_uri() + "/"
settings = load_settings(overrides={"local_dir": str(local)})
dataset = resolve_dataset(url, settings)
manifest = Manifest(dataset.id, url, ShardFormat.PARQUET,
                    tuple(Shard(name, *versions[i // LINKS], None, per_shard) for i, name in enumerate(names)))
asyncio.run(ManifestStore(local / "manifests").save(manifest))
print('{"url": "%s"}' % url)
"""
_CHILD = r"""
import json, resource, sys, time
started = time.perf_counter()
from datacache.config import load_settings
from datacache.loaders import CachedIterableDataset
url, local = sys.argv[1], sys.argv[2]
settings = load_settings(overrides={"local_dir": local})
sample = next(iter(CachedIterableDataset(url, config=settings, shuffle=True, seed=3)))
print(json.dumps({"first_s": time.perf_counter() - started,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def measure(work: Path, env: dict[str, str], timeout: float = 900.0) -> dict[str, Any]:
    """Each size, by this checkout and (if given) the baseline's, turn about; a fresh local tier per point."""
    pythons = {"branch": sys.executable}
    if os.environ.get(BASELINE):
        pythons = {"baseline": os.environ[BASELINE], **pythons}
    ranked = {**env, "RANK": str(RANK), "WORLD_SIZE": str(WORLD), "LOCAL_RANK": "0"}
    points: list[dict[str, Any]] = []
    for shards in SIZES:
        origin = work / f"origin-{shards}"
        for label, python in pythons.items():
            local = work / f"local-{label}-{shards}"
            shutil.rmtree(local, ignore_errors=True)
            written = _run(python, _WRITE, [str(shards), str(PER_SHARD), str(origin), str(local)], env, timeout)
            point: dict[str, Any] = {"checkout": label, "shards": shards, "rank": RANK, "world": WORLD}
            if "error" in written:
                point.update(written)
            else:
                point.update(_run(python, _CHILD, [origin.as_uri() + "/", str(local)], ranked, timeout))
            points.append(point)
            shutil.rmtree(local, ignore_errors=True)
            print(f"scale: a dataset of {shards:,} shards, {label}: {point}", flush=True)
    return {"checkouts": {label: _checkout(python) for label, python in pythons.items()}, "points": points}


def render(result: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"A real `CachedIterableDataset`'s first sample over a node's saved manifest of 1e3 and 1e6 shards of "
        f"{PER_SHARD:,} samples, rank {RANK} of {WORLD}, a fresh process each (`benchmarks._dataset_scale`): "
        "seconds from the interpreter's start, peak RSS in MB. Checkouts: "
        + ", ".join(f"{k} {v}" for k, v in result["checkouts"].items())
        + ".",
        "",
        "| checkout | shards | first sample (s) | peak RSS |",
        "|---|---|---|---|",
    ]
    for p in result["points"]:
        where = f"| {p['checkout']} | {p['shards']:,} |"
        done = f"{p['error']} | |" if "error" in p else f"{p['first_s']:.2f} | {p['peak_rss_mb']:.0f} |"
        lines.append(f"{where} {done}")
    return [*lines, *verdicts(result, "first sample")]


if __name__ == "__main__":
    import json
    import tempfile

    from benchmarks._common import clean_env

    with tempfile.TemporaryDirectory(prefix="datacache-dataset-scale-") as tmp:
        found = measure(Path(os.environ.get("DATACACHE_BENCH_WORK", tmp)), clean_env())
    print(json.dumps(found), file=sys.stderr)
    print("\n".join(render(found)))
