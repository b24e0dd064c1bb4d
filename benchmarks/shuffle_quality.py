"""Shuffle quality: how far each batch's mix of shards and labels is from a uniform shuffle's.

The dataset is the worst case for a shuffle that works near the storage: 20,000 small samples
written **sorted by label** (10 labels) into 40 shards of 500 (shard ``s`` holds label
``s // 4``), as a class-by-class tar conversion leaves them. Every loader reads one epoch in
one process with its own writer's files of the same samples in the same order, and the
delivered keys are cut into batches of `BATCH`.

The figure, per batch: the total-variation distance between the batch's histogram (of shards,
or of labels) and the dataset's (``TV = ½ Σ |batch share - dataset share|``), averaged over the
batches. A uniform random permutation of the same samples does not reach 0 (64 draws from 40
shards leave many at zero), so each loader's mean TV is set between a uniform shuffle's (the
mean over `UNIFORM_RUNS` permutations) and no shuffle at all (reading in order):

    mixing deficit = (TV - TV_uniform) / (TV_in_order - TV_uniform)

0 is as mixed as a uniform shuffle; 1 is no better than reading the shards one after another.

Footprint: the samples a shuffle draws from at once: datacache's ``shuffle_buffer`` (its
default: two shards' worth, here 1,000), WebDataset's ``shuffle(n)`` buffer, MosaicML
Streaming's ``shuffle_block_size`` (its default, 262,144, spans this whole dataset: every
shard must be cached at once), LitData's chunk (500: it has no knob). Each loader runs at
its default and at the same footprints as the others (1,000 and 4,096 samples). datacache reads
the tars with their sample counts (``datacache-manifest.json``, as `benchmarks._data` writes it),
so its epoch is the indexed one; its first epoch over shards not yet counted (a cold epoch, whose
order is dealt as the counts arrive) is measured once too.

The anchors run where they import (``make bench``'s ``benchmarks/.venv-anchors``, or
``--anchors PYTHON``); a loader that does not import is listed as not run, never imitated.

Run: ``python -m benchmarks.shuffle_quality [--anchors PYTHON]``; writes
``benchmarks/RESULTS-shuffle.md`` and ``benchmarks/results-shuffle.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import REPO, WORK, clean_env
from benchmarks._data import DATACACHE_MANIFEST, write_datacache_manifest

SHARDS = 40
PER_SHARD = 500
LABELS = 10
BATCH = 64
SEED = 5
UNIFORM_RUNS = 20
FOOTPRINTS = (1000, 4096)
WINDOWS = (256, 1000, 4096, 16384)
"""datacache's ``shuffle_buffer`` sweep (the trade-off between window, memory and quality)."""


def key_of(shard: int, index: int) -> str:
    return f"s{shard:03d}-{index:04d}"


def shard_of(key: str) -> int:
    return int(key.rsplit("/", maxsplit=1)[-1][1:4])


# -- writing ---------------------------------------------------------------------------------------


def write_tars(out: Path) -> Path:
    """The shards as WebDataset tars (datacache and WebDataset read the same files)."""
    if (out / ".complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for shard in range(SHARDS):
        with tarfile.open(out / f"shard-{shard:03d}.tar", "w") as tar:
            for index in range(PER_SHARD):
                for ext, data in (("cls", str(shard // (SHARDS // LABELS)).encode()), ("bin", os.urandom(64))):
                    info = tarfile.TarInfo(f"{key_of(shard, index)}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    (out / ".complete").touch()
    return out


_WRITE_MDS = r"""
import sys, types
sys.modules["streaming.vision"] = types.ModuleType("streaming.vision")  # torchvision cannot import here
import streaming
out, shards, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
# One MDS shard per source shard: size_limit just over a shard's samples.
probe = len(b"s000-0000") + 4 + 8
with streaming.MDSWriter(out=out, columns={"key": "str"}, size_limit=probe * per + 64, progress_bar=False) as sink:
    for s in range(shards):
        for i in range(per):
            sink.write({"key": f"s{s:03d}-{i:04d}"})
"""

_WRITE_LITDATA = r"""
import sys
import litdata
out, shards, per = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def one(index):
    return {"key": f"s{index // per:03d}-{index % per:04d}"}
if __name__ == "__main__":
    litdata.optimize(fn=one, inputs=list(range(shards * per)), output_dir=out, chunk_size=per,
                     num_workers=1, keep_data_ordered=True, verbose=False, start_method="fork")
"""

_READ = r"""
import json, sys, types
name, path, footprint, seed, cache = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
keys = []
if name.startswith("datacache"):
    from datacache.config import load_settings
    from datacache.loaders import CachedIterableDataset
    ds = CachedIterableDataset(path, shuffle=True, seed=seed, shuffle_buffer=footprint, config=load_settings())
    keys = [s["__key__"] for s in ds]
elif name == "webdataset":
    import glob, webdataset as wds
    urls = sorted(glob.glob(path + "/*.tar"))
    ds = wds.WebDataset(urls, shardshuffle=True, seed=seed, empty_check=False).shuffle(footprint or 1000)
    keys = [s["__key__"] for s in ds]
elif name.startswith("mosaic"):
    sys.modules["streaming.vision"] = types.ModuleType("streaming.vision")
    import streaming
    from streaming.base.util import clean_stale_shared_memory
    clean_stale_shared_memory()
    extra = {} if footprint is None else {"shuffle_block_size": footprint}
    ds = streaming.StreamingDataset(local=path, remote=None, shuffle=True, shuffle_algo=name.split("-")[1],
                                    shuffle_seed=seed, batch_size=64, num_canonical_nodes=1, **extra)
    keys = [s["key"] for s in ds]
elif name == "litdata":
    import litdata
    ds = litdata.StreamingDataset(path, shuffle=True, seed=seed, cache_dir=cache)
    keys = [s["key"] for s in ds]
import resource
print(json.dumps({"keys": keys, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _child(python: str, code: str, args: list[str], env: dict[str, str], timeout: float = 900) -> dict[str, Any]:
    try:
        done = subprocess.run(
            [python, "-c", code, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False, cwd=REPO
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {"error": lines[-1][:300] if lines else f"exit {done.returncode}"}
    lines = done.stdout.strip().splitlines()
    result: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    return result


# -- the metric ------------------------------------------------------------------------------------


def mean_tv(groups: np.ndarray, kinds: int) -> float:
    """Mean over full batches of the TV distance between a batch's histogram of ``groups`` and the whole's."""
    batches = len(groups) // BATCH
    whole = np.bincount(groups, minlength=kinds) / len(groups)
    cut = groups[: batches * BATCH].reshape(batches, BATCH)
    counts = np.zeros((batches, kinds))
    np.add.at(counts, (np.repeat(np.arange(batches), BATCH), cut.reshape(-1)), 1)
    return float((0.5 * np.abs(counts / BATCH - whole).sum(axis=1)).mean())


def figures(shards: np.ndarray) -> dict[str, float]:
    """Mean TV of shards and labels, and each one's mixing deficit (0 uniform, 1 in order)."""
    total = SHARDS * PER_SHARD
    ordered = np.repeat(np.arange(SHARDS), PER_SHARD)
    rng = np.random.default_rng(SEED)
    uniform = [rng.permutation(ordered) for _ in range(UNIFORM_RUNS)]
    out: dict[str, float] = {"samples": float(len(shards)), "distinct": float(len(set(shards.tolist())))}
    for what, kinds, view in (("shard", SHARDS, lambda a: a), ("label", LABELS, lambda a: a // (SHARDS // LABELS))):
        tv = mean_tv(view(shards), kinds)
        best = float(np.mean([mean_tv(view(u), kinds) for u in uniform]))
        worst = mean_tv(view(ordered), kinds)
        out[f"{what}_tv"], out[f"{what}_tv_uniform"], out[f"{what}_tv_in_order"] = tv, best, worst
        out[f"{what}_deficit"] = (tv - best) / (worst - best)
    out["complete"] = float(len(shards) == total)
    return out


# -- the runs --------------------------------------------------------------------------------------


def _cases() -> list[tuple[str, int | None, str]]:
    """(loader, footprint or None for its default, what the footprint is)."""
    cases: list[tuple[str, int | None, str]] = [("datacache", None, "default shuffle_buffer (2 shards: 1,000)")]
    cases += [("datacache", w, f"shuffle_buffer={w}") for w in WINDOWS if w != 1000]
    cases += [("datacache-cold", None, "default, first epoch before the counts (cold)")]
    cases += [("webdataset", f, f"shardshuffle=True, shuffle({f})") for f in FOOTPRINTS]
    for algo in ("py1e", "py1br"):
        cases += [(f"mosaic-{algo}", None, f"{algo}, default shuffle_block_size (262,144)")]
        cases += [(f"mosaic-{algo}", f, f"{algo}, shuffle_block_size={f}") for f in FOOTPRINTS]
    cases += [("litdata", None, "shuffle=True (chunks of 500)")]
    return cases


def measure(work: Path, anchors: str) -> dict[str, Any]:
    env = clean_env({"PYTHONPATH": str(REPO)})
    tars = write_tars(work / "tar")
    cold = work / "tar-cold"
    if not cold.exists():
        shutil.copytree(tars, cold)  # the same tars without their counts
    if not (tars / DATACACHE_MANIFEST).exists():
        write_datacache_manifest(tars)
    paths = {"datacache": tars, "datacache-cold": cold, "webdataset": tars}
    for name, code in (("mds", _WRITE_MDS), ("litdata", _WRITE_LITDATA)):
        target = work / name
        if not (target / ".complete").exists():
            shutil.rmtree(target, ignore_errors=True)
            result = _child(anchors, code, [str(target), str(SHARDS), str(PER_SHARD)], env)
            if "error" in result:
                print(f"shuffle: writing {name} failed: {result['error']}", flush=True)
                continue
            (target / ".complete").touch()
        paths["mosaic" if name == "mds" else name] = target
    runs = []
    for loader, footprint, described in _cases():
        path = paths.get(loader if loader.startswith("datacache") else loader.split("-")[0])
        python = sys.executable if loader.startswith("datacache") else anchors
        cache = work / "cache"
        shutil.rmtree(cache, ignore_errors=True)
        if path is None:
            result: dict[str, Any] = {"error": "its files could not be written (the package does not import)"}
        else:
            run_env = {**env, "DATACACHE_LOCAL_DIR": str(cache / "local")}
            started = time.perf_counter()
            result = _child(python, _READ, [loader, str(path), json.dumps(footprint), str(SEED), str(cache)], run_env)
            result["seconds"] = time.perf_counter() - started
        if "keys" in result:
            keys = result.pop("keys")
            result.update(figures(np.asarray([shard_of(k) for k in keys], dtype=np.int64)))
        runs.append({"loader": loader, "footprint": footprint, "what": described, **result})
        print(f"shuffle: {loader} {described}: {result}", flush=True)
    return {"at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()[0], "runs": runs}


def render(result: dict[str, Any]) -> str:
    lines = [
        "# Shuffle quality",
        "",
        f"{SHARDS * PER_SHARD:,} samples sorted by label ({LABELS} labels) in {SHARDS} shards of {PER_SHARD:,};",
        f"one epoch per loader, batches of {BATCH}. *TV*: mean over batches of the total-variation distance",
        "between the batch's histogram and the dataset's; *deficit*: that TV set between a uniform",
        "shuffle's (0) and reading in order (1). Measured by `python -m benchmarks.shuffle_quality`,",
        f"{result['at']}, load {result['load']:.1f}.",
        "",
        "| loader | footprint | shard TV | shard deficit | label TV | label deficit | peak RSS (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = next((r for r in result["runs"] if "shard_tv" in r), None)
    for run in result["runs"]:
        if "shard_tv" not in run:
            lines.append(f"| {run['loader']} | {run['what']} | not run: {run.get('error', '?')} | | | | |")
            continue
        short = "" if run["complete"] else f" ({int(run['samples']):,} samples)"
        lines.append(
            f"| {run['loader']}{short} | {run['what']} | {run['shard_tv']:.3f} | {run['shard_deficit']:.2f} | "
            f"{run['label_tv']:.3f} | {run['label_deficit']:.2f} | {run['peak_rss_mb']:.0f} |"
        )
    if base is not None:
        lines += [
            "",
            f"A uniform shuffle: shard TV {base['shard_tv_uniform']:.3f}, label TV {base['label_tv_uniform']:.3f};"
            f" in order: {base['shard_tv_in_order']:.3f} and {base['label_tv_in_order']:.3f}.",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = REPO / "benchmarks" / ".venv-anchors" / "bin" / "python"
    parser.add_argument("--anchors", default=str(default) if default.exists() else sys.executable)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks")
    args = parser.parse_args()
    result = measure(WORK / "shuffle", args.anchors)
    (args.out / "results-shuffle.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "RESULTS-shuffle.md").write_text(render(result))


if __name__ == "__main__":
    main()
