"""WebDataset's time to the first sample beside datacache's, on the same tar shards.

Tar costs at least a 512-byte header and a 512-byte block a sample, so the 1e8-sample set the
issue names would be ~100 GB of headers: this writes 1e6 samples in 100 shards (~1 GB; a sample
is one ``.cls`` member of one byte, as small as the Parquet sets' int8 column), plus the
``datacache-manifest.json`` (sizes, checksums, counts) that datacache's tar sets carry. Each
point is a fresh process; datacache's has an empty cache (``shuffle=True``: an exact shuffle),
WebDataset's reads the same local files (``shardshuffle``, ``shuffle(1000)``: a buffer, an
approximate shuffle, ``resampled=False``).
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SAMPLES = 10**6
SHARDS = 100
BUFFER = 1000
"""WebDataset's usual shuffle buffer (the anchors' `_loaders.WDS_SHUFFLE_BUFFER`)."""
_CHILD = r"""
import json, resource, sys, time
started = time.perf_counter()
import webdataset as wds
urls = json.loads(sys.argv[1])
dataset = wds.WebDataset(urls, shardshuffle=len(urls), resampled=False, seed=3, nodesplitter=wds.split_by_node)
next(iter(dataset.shuffle(int(sys.argv[2]))))
print(json.dumps({"first_sample_s": time.perf_counter() - started,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_tars(directory: Path, samples: int = SAMPLES, shards: int = SHARDS) -> tuple[Path, float]:
    """``shards`` tar files of ``samples`` one-byte samples and their manifest; the seconds writing took."""
    from datacache.checksum import checksum_of, new_hasher
    from datacache.manifest import Manifest, Shard, ShardFormat

    done = directory / ".written"
    if done.exists():
        return directory, float(done.read_text() or 0)
    started = time.perf_counter()
    directory.mkdir(parents=True, exist_ok=True)
    per_shard, entries = samples // shards, []
    for index in range(shards):
        path = directory / f"shard-{index:05d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for key in range(index * per_shard, (index + 1) * per_shard):
                member = tarfile.TarInfo(f"{key:010d}.cls")
                member.size = 1
                tar.addfile(member, io.BytesIO(b"0"))
        hasher = new_hasher()
        hasher.update(path.read_bytes())
        entries.append(Shard(path.name, path.stat().st_size, None, checksum_of(hasher), per_shard))
    manifest = Manifest(dataset="scale-wds", url=str(directory), format=ShardFormat.TAR, shards=tuple(entries))
    (directory / "datacache-manifest.json").write_text(json.dumps(manifest.to_json()))
    seconds = time.perf_counter() - started
    done.write_text(f"{seconds:.1f}")
    return directory, seconds


def _webdataset(urls: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(urls), str(BUFFER)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no first sample within {timeout:.0f} s"}
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def measure(work: Path, env: dict[str, str], datacache: Callable[[list[str]], dict[str, Any]]) -> dict[str, Any]:
    """Both loaders' first sample on the tar set; ``datacache`` measures one point in a fresh process."""
    directory, wrote = write_tars(work / f"tar-{SAMPLES}")
    urls = [str(path) for path in sorted(directory.glob("*.tar"))]
    ours = datacache([str(directory)])
    theirs = _webdataset(urls, env, 300.0)
    result = {"samples": SAMPLES, "shards": SHARDS, "write_s": wrote, "datacache": ours, "webdataset": theirs}
    print(f"scale: tar of {SAMPLES:,} samples: {result}", flush=True)
    return result


def render(result: dict[str, Any]) -> list[str]:
    ours, theirs = result["datacache"], result["webdataset"]
    lines = [
        "",
        f"{result['samples']:,} one-byte samples in {result['shards']} tar shards (`benchmarks._wds_scale`), a fresh",
        "process each; datacache with an empty cache and `shuffle=True` (exact), WebDataset with",
        f"`shardshuffle`, `shuffle({BUFFER})` (a buffer: approximate) and `resampled=False`, on the same local files.",
        "Tar costs >= 1 KiB a sample (header and block), so the issue's 1e8 set would be ~100 GB: too big",
        "for this disk and hours to write. 1e6 is the largest set written here within the ~3 minutes allowed",
        "(it took under a minute; 1e7 would be ~10 GB and, at the same rate, ~8 minutes).",
        "",
        "| loader | first sample (s) | peak RSS (MB) |",
        "|---|---|---|",
    ]
    for name, point in (("datacache (exact shuffle)", ours), ("WebDataset (buffer of 1000)", theirs)):
        if "error" in point:
            lines.append(f"| {name} | {point['error']} | |")
        else:
            lines.append(f"| {name} | {point['first_sample_s']:.2f} | {point['peak_rss_mb']:.0f} |")
    if "error" not in ours and "error" not in theirs:
        ratio = ours["first_sample_s"] / theirs["first_sample_s"]
        verdict = "met" if ratio <= 1.0 else "missed"
        lines += [
            "",
            f"- datacache / WebDataset: {ratio:.2f}x the time to the first sample "
            f"(target: no slower than WebDataset's approximate shuffle: {verdict}).",
        ]
    if result.get("write_s"):
        lines.append(f"- Writing the set took {result['write_s']:.0f} s (when it was first written; it is reused).")
    return lines
