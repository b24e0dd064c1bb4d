"""datacache against the loaders users would pick instead, and against the machine's limits, in one run.

Run: ``make bench`` (full, ~1 GB, 3 repeats) or ``make bench-quick`` (a few
hundred MB, 1 repeat); both create or reuse ``benchmarks/.venv-anchors`` with
the anchors installed. Directly: ``python -m benchmarks.run [--quick]`` with
any interpreter that has the project (loaders whose package is missing are
reported as not installed).

What it does, all against one local S3 server (moto, 127.0.0.1):

1. writes one synthetic dataset (50-150 KB samples with labels) in every
   tool's own format with that tool's own writer, and uploads it;
2. measures the limits: S3 GET ceiling (8 parallel GETs), ``aws s3 cp``,
   s3fs ``get``, ``datacache warm``, plain reads of the cached files
   (``readinto``, ``cat``), and a DataLoader with 2 workers doing no I/O;
3. runs every loader through a DataLoader (batch 64, 2 workers; datacache
   four ways: drop-in, per-sample dicts the DataLoader batches, with torch's
   DataLoader and with ``datacache.loaders.DataLoader``; batch mode
   with 2 workers; batch mode in-process), one cold epoch (empty cache) and one warm
   epoch, each in a fresh process, repeated; every consumer copies every
   byte and counts samples;
4. the small-files variant: raw 8 KB objects read one by one, then
   ``datacache shard`` and the loader over its output;
5. a training-like job: N rank processes, each consuming at a fixed
   bytes/s target, reporting the data-stall fraction;
5b. the cold-start curve (``benchmarks/cold_start.py``): time to the first
   batch at 1x, 4x and 16x the shards, with and without a wids index;
5c. a weighted mix of three sources (``benchmarks/mixing.py``): throughput
   beside one source, and the realised proportions;
5d. bigger than the cache (``benchmarks/bigger.py``): an un-indexed dataset in
   the S3 server, 2 simulated nodes x 2 ranks x 2 workers, per eviction policy,
   embedded and through one daemon per node;
6. writes ``benchmarks/RESULTS.md``, ``benchmarks/results.json`` and
   ``benchmarks/throughput.png`` (``RESULTS-quick.md`` etc. for ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import _data, _limits, cold_start, mixing
from benchmarks._common import (
    BATCH_SIZE,
    NUM_WORKERS,
    REPO,
    WORK,
    Sizes,
    clean_env,
    parse_result,
    s3_env,
)
from benchmarks._loaders import available


@dataclass(frozen=True)
class LoaderRun:
    """One row of the comparison: a loader and the DataLoader worker count it runs with."""

    key: str
    loader: str
    num_workers: int
    label: str
    anchor: bool
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment for the job (a datacache setting, never a benchmark shortcut)."""


def loader_runs() -> list[LoaderRun]:
    return [
        LoaderRun(
            "datacache-dataloader",
            "datacache-dataloader",
            NUM_WORKERS,
            f"datacache drop-in, one import changed: datacache.loaders.DataLoader(ds, batch_size={BATCH_SIZE}, "
            f"num_workers={NUM_WORKERS})",
            False,
        ),
        LoaderRun(
            "datacache-dropin",
            "datacache-dropin",
            NUM_WORKERS,
            f"datacache drop-in: DataLoader(ds, batch_size={BATCH_SIZE}, num_workers={NUM_WORKERS}), per-sample dicts",
            False,
        ),
        LoaderRun(
            "datacache-inprocess",
            "datacache",
            0,
            "datacache, in-process (num_workers=0, 2 reader threads) [recommended]",
            False,
        ),
        LoaderRun("datacache-workers", "datacache", NUM_WORKERS, f"datacache, {NUM_WORKERS} worker processes", False),
        LoaderRun("mosaicml-streaming", "mosaicml-streaming", NUM_WORKERS, "MosaicML Streaming (MDS)", True),
        LoaderRun("litdata", "litdata", NUM_WORKERS, "LitData (optimize chunks)", True),
        LoaderRun("webdataset", "webdataset", NUM_WORKERS, "WebDataset (curl + cache_dir)", True),
        LoaderRun("fsspec-filecache", "fsspec-filecache", NUM_WORKERS, "fsspec filecache:: + tar", True),
        LoaderRun("s3torchconnector", "s3torchconnector", NUM_WORKERS, "s3torchconnector (1 GET/sample)", True),
    ]


CEILING = LoaderRun(
    "dataloader-ceiling", "dataloader-ceiling", NUM_WORKERS, "DataLoader, 2 workers, lists of bytes, no I/O", False
)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


# -- processes and their memory ----------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    pids, stack = [], [pid]
    while stack:
        current = stack.pop()
        pids.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as handle:
                    stack.extend(int(c) for c in handle.read().split())
        except OSError:
            continue
    return pids


def tree_memory(pid: int) -> tuple[float, float]:
    """RSS and PSS (MB) summed over ``pid`` and its descendants (PSS counts shared pages once)."""
    rss = pss = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as handle:
                for line in handle:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        except OSError:
            continue
    return rss / 1024, pss / 1024


def run_job(
    python: str, spec: dict[str, Any], env: dict[str, str], timeout: float, prefix: Sequence[str] = ()
) -> dict[str, Any]:
    """Run one `benchmarks._job` (after ``prefix``: a profiler's command), sampling its process tree's
    memory; return its result."""
    process = subprocess.Popen(
        [*prefix, python, "-m", "benchmarks._job", json.dumps(spec)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = [0.0, 0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.25):
            rss, pss = tree_memory(process.pid)
            peak[0] = max(peak[0], rss)
            peak[1] = max(peak[1], pss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        stdout, stderr = process.communicate()
        stop.set()
        return {"error": f"timed out after {timeout:.0f}s", "stderr": stderr[-2000:]}
    finally:
        stop.set()
        sampler.join()
    for line in stderr.splitlines():
        if line.startswith("[job]"):
            print("   ", line, flush=True)
    if process.returncode != 0:
        return {"error": f"exit status {process.returncode}", "stderr": stderr[-3000:]}
    try:
        result = parse_result(stdout)
    except RuntimeError as exc:
        return {"error": str(exc), "stderr": stderr[-3000:]}
    result["memory"] = {"peak_rss_mb": round(peak[0], 1), "peak_pss_mb": round(peak[1], 1)}
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_ranks(
    python: str, spec: dict[str, Any], env: dict[str, str], ranks: int, timeout: float
) -> list[dict[str, Any]]:
    """Start ``ranks`` rank processes of one training-like job (torch.distributed on gloo, 127.0.0.1)."""
    port = free_port()
    processes = []
    for rank in range(ranks):
        rank_env = {
            **env,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        processes.append(
            subprocess.Popen(
                [python, "-m", "benchmarks._job", json.dumps(spec)],
                cwd=REPO,
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            stdout, stderr = process.communicate()
            results.append({"error": f"timed out after {timeout:.0f}s", "stderr": stderr[-2000:]})
            continue
        if process.returncode != 0:
            results.append({"error": f"exit status {process.returncode}", "stderr": stderr[-3000:]})
            continue
        try:
            results.append(parse_result(stdout))
        except RuntimeError as exc:
            results.append({"error": str(exc), "stderr": stderr[-3000:]})
    return results


# -- summaries ---------------------------------------------------------------------------------------


def summarize(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": values,
    }


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "platform": platform.platform(),
    }
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as handle:
            info["memory_gb"] = round(int(handle.readline().split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    usage = shutil.disk_usage(WORK if WORK.exists() else REPO)
    info["disk_free_gb"] = round(usage.free / 1e9, 1)
    try:
        source = subprocess.run(
            ["df", "--output=source,fstype", str(REPO)], capture_output=True, text=True, check=False
        ).stdout.splitlines()[-1]
        info["filesystem"] = " ".join(source.split())
    except (OSError, IndexError):
        pass
    return info


def versions() -> dict[str, str]:
    from importlib import metadata

    names = [
        "datacache",
        "torch",
        "numpy",
        "mosaicml-streaming",
        "litdata",
        "obstore",
        "webdataset",
        "s3torchconnector",
        "s3torchconnectorclient",
        "fsspec",
        "s3fs",
        "boto3",
        "awscli",
        "moto",
    ]
    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


# -- the run ------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sizes = Sizes.quick() if args.quick else Sizes.full()
        if args.repeats:
            self.sizes = Sizes(**{**asdict(self.sizes), "repeats": args.repeats})
        self.python = sys.executable
        self.runs = [r for r in loader_runs() if not args.only or r.key in args.only]
        self.missing = [r.key for r in self.runs if not available(r.loader)]
        self.runs = [r for r in self.runs if r.key not in self.missing]
        self.with_anchors = any(r.anchor for r in self.runs)
        self.work = WORK / ("quick" if args.quick else "full")
        self.results: dict[str, Any] = {
            "mode": "quick" if args.quick else "full",
            "sizes": asdict(self.sizes),
            "batch_size": BATCH_SIZE,
            "num_workers": NUM_WORKERS,
            "machine": machine(),
            "versions": versions(),
            "missing": self.missing,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "loadavg_start": os.getloadavg(),
        }
        self.endpoint = ""
        self.payload = 0

    def env(self) -> dict[str, str]:
        return clean_env(s3_env(self.endpoint))

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        if self.missing:
            log(f"not installed here, skipped: {', '.join(self.missing)} (make bench installs them)")
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        t = time.perf_counter()
        root = _data.prepare_local(self.sizes, self.with_anchors)
        self.payload = _data.payload_bytes(self.sizes)
        self.results["dataset"] = {
            "samples": self.sizes.samples,
            "payload_bytes": self.payload,
            "shards": len(_data.wds_shards(root)),
            "wds_bytes": sum(p.stat().st_size for p in _data.wds_shards(root)),
            "prepare_seconds": time.perf_counter() - t,
        }
        log(f"dataset: {self.sizes.samples} samples, {self.payload / 1e6:.0f} MB payload")
        from benchmarks.warm_vs_awscli import start_s3_server  # the other engineers' server helper

        server, self.endpoint = start_s3_server()
        try:
            self.results["upload"] = _data.upload_all(self.endpoint, self.sizes, root, self.with_anchors)
            self.limits()
            self.loaders()
            self.small_files()
            self.training()
            cold = cold_start.measure(self.endpoint, self.work / "cold-start", quick=self.args.quick)
            self.results["cold_start"] = cold
            self.results["mixing"] = mixing.measure(self.endpoint, self.work / "mixing", quick=self.args.quick)
        finally:
            server.terminate()
            server.wait(timeout=10)
            if server.stdout is not None:
                server.stdout.close()
        self.results["loadavg_end"] = os.getloadavg()
        self.results["seconds"] = time.perf_counter() - started
        if not self.args.keep_work:
            shutil.rmtree(self.work, ignore_errors=True)
        return self.results

    # -- limits ---------------------------------------------------------------------------------------

    def limits(self) -> None:
        keys = [f"wds/{p.name}" for p in _data.wds_shards(_data.data_dir(self.sizes))]
        wds_bytes = self.results["dataset"]["wds_bytes"]
        repeats = self.sizes.repeats
        get, aws, s3fs_get, warm, readinto, cat, durable = [], [], [], [], [], [], []
        local = self.work / "warm-local"
        shard_sizes = [p.stat().st_size for p in _data.wds_shards(_data.data_dir(self.sizes))]
        for _ in range(repeats):
            get.append(_limits.get_ceiling(self.endpoint, keys))
            log(f"S3 GET ceiling (8 threads): {get[-1]['mb_per_s']:.0f} MB/s")
            durable.append(_limits.durable_write_rate(self.work / "durable-write", shard_sizes))
            log(f"local disk durable write (fsync, rename): {durable[-1]['mb_per_s']:.0f} MB/s")
            aws.append(_limits.aws_cp_rate(self.endpoint, "wds", self.work / "aws-cp", wds_bytes))
            log(f"aws s3 cp --recursive: {aws[-1]['mb_per_s']:.0f} MB/s")
            s3fs_get.append(_limits.s3fs_get_rate(self.endpoint, "wds", self.work / "s3fs-get", wds_bytes))
            log(f"s3fs get recursive: {s3fs_get[-1]['mb_per_s']:.0f} MB/s")
            warm.append(_limits.datacache_warm_rate(self.endpoint, "wds", local, wds_bytes))
            log(f"datacache warm: {warm[-1]['mb_per_s']:.0f} MB/s (reports {warm[-1]['reported_mb_per_s']:.0f})")
        shutil.rmtree(self.work / "aws-cp", ignore_errors=True)
        shutil.rmtree(self.work / "s3fs-get", ignore_errors=True)
        cached = sorted(p for p in local.rglob("*.tar") if p.is_file())
        if not cached:
            raise RuntimeError(f"datacache warm left no .tar files under {local}")
        _limits.readinto_rate(cached)  # make sure the page cache holds them, as for a warm epoch
        for _ in range(max(3, repeats)):
            readinto.append(_limits.readinto_rate(cached))
            cat.append(_limits.cat_rate(cached))
        log(
            f"plain read of the cached files: readinto {statistics.median(r['mb_per_s'] for r in readinto):.0f} MB/s,"
            f" cat {statistics.median(r['mb_per_s'] for r in cat):.0f} MB/s"
        )
        self.results["limits"] = {
            "s3_get_ceiling": {"runs": get, **summarize([r["mb_per_s"] for r in get])},
            "durable_write": {"runs": durable, **summarize([r["mb_per_s"] for r in durable])},
            "aws_s3_cp": {"runs": aws, **summarize([r["mb_per_s"] for r in aws])},
            "s3fs_get": {"runs": s3fs_get, **summarize([r["mb_per_s"] for r in s3fs_get])},
            "datacache_warm": {
                "runs": warm,
                **summarize([r["mb_per_s"] for r in warm]),
                "reported": summarize([r["reported_mb_per_s"] for r in warm]),
            },
            "readinto": {"runs": readinto, **summarize([r["mb_per_s"] for r in readinto])},
            "cat": {"runs": cat, **summarize([r["mb_per_s"] for r in cat])},
        }
        shutil.rmtree(local, ignore_errors=True)

    # -- loaders ---------------------------------------------------------------------------------------

    def _spec(self, run: LoaderRun, cache: Path, **extra: Any) -> dict[str, Any]:
        expected = self.sizes.raw_samples if run.loader == "s3torchconnector" else self.sizes.samples
        return {
            "loader": run.loader,
            "endpoint": self.endpoint,
            "cache_dir": str(cache),
            "num_workers": run.num_workers,
            "expected": expected,
            "kind": "epochs",
            **extra,
        }

    def loaders(self) -> None:
        raw: dict[str, list[dict[str, Any]]] = {r.key: [] for r in [*self.runs, CEILING]}
        timeout = 900 if not self.args.quick else 300
        for repeat in range(self.sizes.repeats):
            for run in [*self.runs, CEILING]:
                cache = self.work / "cache" / run.key
                shutil.rmtree(cache, ignore_errors=True)
                log(f"repeat {repeat + 1}/{self.sizes.repeats}: {run.label}")
                phases = ["warm"] if run is CEILING else ["cold", "warm"]
                env = {**self.env(), **dict(run.env)}
                result = run_job(self.python, self._spec(run, cache, phases=phases), env, timeout)
                if "error" in result:
                    log(f"  {run.key} failed: {result['error']}\n{result.get('stderr', '')}")
                raw[run.key].append(result)
        summary: dict[str, Any] = {}
        for run in [*self.runs, CEILING]:
            results = [r for r in raw[run.key] if "error" not in r]
            entry: dict[str, Any] = {
                "label": run.label,
                "loader": run.loader,
                "num_workers": run.num_workers,
                "anchor": run.anchor,
                "errors": [r["error"] + ": " + r.get("stderr", "")[-600:] for r in raw[run.key] if "error" in r],
                "runs": raw[run.key],
            }
            for phase in ("cold", "warm"):
                epochs = [e for r in results for e in r["epochs"] if e["phase"] == phase]
                if not epochs:
                    continue
                entry[phase] = {
                    "mb_per_s": summarize([e["mb_per_s"] for e in epochs]),
                    "samples_per_s": summarize([e["samples_per_s"] for e in epochs]),
                    "samples": [e["samples"] for e in epochs],
                    "expected": epochs[0]["expected_samples"],
                    "counts_ok": all(e["ok"] for e in epochs),
                    "first_batch_s": summarize([e["first_batch_seconds"] for e in epochs]),
                }
                cpu = [e["extra"]["cpu_s_per_gb"] for e in epochs if "cpu_s_per_gb" in e.get("extra", {})]
                if cpu:
                    entry[phase]["cpu_s_per_gb"] = summarize(cpu)
            entry["peak_rss_mb"] = max((r["memory"]["peak_rss_mb"] for r in results), default=None)
            entry["peak_pss_mb"] = max((r["memory"]["peak_pss_mb"] for r in results), default=None)
            summary[run.key] = entry
        self.results["loaders"] = summary

    # -- small files -----------------------------------------------------------------------------------

    def small_files(self) -> None:
        """Raw small objects one by one vs `datacache shard` and the loader over its output.

        The objects' upload and the one-by-one baseline are ``benchmarks/small_files.py``'s.
        """
        from benchmarks import small_files

        sizes = self.sizes
        started = time.perf_counter()
        bucket = small_files.BUCKET
        keys = small_files.upload(self.endpoint, sizes.small_objects, sizes.small_bytes)
        uploaded = time.perf_counter() - started
        raw = small_files.read_raw(self.endpoint, keys[: sizes.raw_read_objects])
        raw["objects_per_s"] = raw["per_s"]
        how = "benchmarks/small_files.py (s3fs cat_file, one object after another)"
        log(f"small files ({len(keys)} uploaded in {uploaded:.0f}s), raw one by one: {raw['objects_per_s']:.0f}/s")
        entry: dict[str, Any] = {
            "objects": sizes.small_objects,
            "object_bytes": sizes.small_bytes,
            "raw": raw,
            "raw_how": how,
            "upload_seconds": uploaded,
        }
        try:
            sharded = _limits.datacache_shard(
                self.endpoint,
                f"s3://{bucket}/raw",
                f"s3://{bucket}/sharded",
                self.work / "shard-home",
                "32MB" if not self.args.quick else "4MB",
            )
            entry["shard"] = sharded
            log(f"datacache shard: {sharded['objects_per_s']:.0f} objects/s, {sharded['shards']} shards")
        except RuntimeError as exc:
            entry["shard_error"] = str(exc)
            log(f"datacache shard failed: {exc}")
            self.results["small_files"] = entry
            return
        run = LoaderRun("datacache-inprocess", "datacache", 0, "", False)
        reads = []
        for _ in range(sizes.repeats):
            cache = self.work / "cache" / "small"
            shutil.rmtree(cache, ignore_errors=True)
            spec = self._spec(run, cache, dataset=f"s3://{bucket}/sharded/")
            spec["expected"] = sizes.small_objects
            result = run_job(self.python, spec, self.env(), 600)
            if "error" in result:
                entry["read_error"] = result["error"] + ": " + result.get("stderr", "")[-1500:]
                log(f"reading the sharded small files failed: {entry['read_error']}")
                break
            reads.append(result)
        for phase in ("cold", "warm"):
            epochs = [e for r in reads for e in r["epochs"] if e["phase"] == phase]
            if epochs:
                entry[phase] = {
                    "samples_per_s": summarize([e["samples_per_s"] for e in epochs]),
                    "mb_per_s": summarize([e["mb_per_s"] for e in epochs]),
                    "counts_ok": all(e["ok"] for e in epochs),
                    "samples": [e["samples"] for e in epochs],
                }
        self.results["small_files"] = entry

    # -- training-like consumer -------------------------------------------------------------------------

    def training(self) -> None:
        target = self.args.target * 1e6
        ranks = self.sizes.train_ranks
        out: dict[str, Any] = {"ranks": ranks, "target_bytes_per_s": target, "epochs": self.sizes.train_epochs}
        for run in self.runs:
            cache = self.work / "cache" / run.key  # left warm by the last repeat
            spec = self._spec(run, cache, kind="train", epochs=self.sizes.train_epochs, target=target)
            log(f"training-like, {ranks} ranks at {target / 1e6:.0f} MB/s each: {run.label}")
            results = run_ranks(self.python, spec, {**self.env(), **dict(run.env)}, ranks, 900)
            errors = [r["error"] + ": " + r.get("stderr", "")[-800:] for r in results if "error" in r]
            good = [r["train"] for r in results if "error" not in r]
            entry: dict[str, Any] = {"label": run.label, "errors": errors, "ranks": good}
            if good and not errors:
                stall = max(r["stall_fraction"] for r in good)
                delivered = min(r["delivered_bytes_per_s"] for r in good)
                last_epoch = max(r["per_epoch"][-1]["stall_fraction"] for r in good)
                within = max(r["per_epoch"][-1]["within_stall_fraction"] for r in good)
                entry.update(
                    {
                        "worst_stall_fraction": stall,
                        "worst_last_epoch_stall_fraction": last_epoch,
                        "worst_within_epoch_stall_fraction": within,
                        "slowest_rank_bytes_per_s": delivered,
                        "held": delivered >= 0.99 * target,
                        "samples_total": sum(r["samples"] for r in good),
                    }
                )
                log(f"  stall {stall:.1%}, slowest rank {delivered / 1e6:.0f} MB/s")
            else:
                log(f"  failed: {errors}")
            out[run.key] = entry
        self.results["training"] = out


_MARK = re.compile(r"^<!-- [a-z0-9-]+ -->$", re.MULTILINE)


def marked_blocks(path: Path) -> dict[str, str]:
    """Every ``<!-- name -->`` ... ``<!-- name -->`` block of ``path``, marks included, by mark."""
    text = path.read_text() if path.exists() else ""
    blocks: dict[str, str] = {}
    for mark in dict.fromkeys(m.group(0) for m in _MARK.finditer(text)):
        if text.count(mark) >= 2:
            _, _, rest = text.partition(mark)
            blocks[mark] = mark + rest.partition(mark)[0] + mark + "\n"
    return blocks


def restore_blocks(blocks: dict[str, str], path: Path) -> None:
    """Append each block whose mark ``path`` no longer holds (the report was rewritten without it)."""
    text = path.read_text()
    missing = [block for mark, block in blocks.items() if mark not in text]
    if missing:
        path.write_text(text.rstrip("\n") + "\n\n" + "\n".join(missing))


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few hundred MB, 1 repeat (under 3 minutes)")
    parser.add_argument("--repeats", type=int, help="override the number of repeats")
    parser.add_argument("--only", nargs="*", help="only these loader keys (datacache-inprocess, litdata, ...)")
    parser.add_argument(
        "--target", type=float, default=300.0, help="per-rank MB/s of the training-like consumer (default 300)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks", help="where RESULTS.md etc. go")
    parser.add_argument("--keep-work", action="store_true", help="keep benchmarks/work/<mode> (caches) afterwards")
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite RESULTS.md and the plot from the saved results.json"
    )
    args = parser.parse_args()
    from benchmarks import bigger, eviction_sweep
    from benchmarks._report import write_report

    report = args.out / ("RESULTS-quick.md" if args.quick else "RESULTS.md")
    kept = bigger.saved_table(report)  # write_report rewrites the file; the scenario's table stays
    kept_sweep = eviction_sweep.saved_table(report)
    others = marked_blocks(report)  # and so do the tables the separately run benchmarks put there
    if args.report_only:
        saved = args.out / ("results-quick.json" if args.quick else "results.json")
        written = write_report(json.loads(saved.read_text()), args.out)
        bigger.write_table(kept, report)
        eviction_sweep.write_table(kept_sweep, report)
        restore_blocks(others, report)
        log(f"rewrote {', '.join(_shown(p) for p in written)} from {saved.name}")
        return

    results = Bench(args).run()
    written = write_report(results, args.out)
    bigger.write_table(kept, report)
    eviction_sweep.write_table(kept_sweep, report)
    restore_blocks(others, report)
    log(f"done in {results['seconds']:.0f}s; wrote {', '.join(_shown(p) for p in written)}")
    for mode in bigger.MODES:
        log(f"the bigger-than-the-cache scenario (benchmarks/bigger.py --mode {mode})")
        bigger.main([*(["--quick"] if args.quick else []), "--mode", mode, "--results", str(report)])
    log("the eviction sweep (benchmarks/eviction_sweep.py)")
    eviction_sweep.main([*(["--quick"] if args.quick else []), "--results", str(report)])


if __name__ == "__main__":
    main()
