"""Load: many processes and workers through one daemon, and several daemons sharing one shared tier.

Every sample is delivered exactly once across the ranks, with the right bytes;
every shard is fetched from the origin once for the whole node (or cluster);
peak memory is recorded and stays bounded.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _daemon import DaemonProcess, start_daemon
from _faultdata import Samples, check_cache, make_dataset, peak_rss_kib, record, upload
from _helpers import DATACACHE, REPO

from datacache.config import dataset_id_for

if TYPE_CHECKING:
    from conftest import S3Bucket

READER = Path(__file__).with_name("_reader.py")
MiB = 1024  # ru_maxrss and VmHWM are in KiB


def run_ranks(envs: list[dict[str, str]], spec: dict[str, Any], *, warm: dict[str, str] | None) -> list[dict[str, Any]]:
    """Start one reader per environment (rank i of len(envs)), and optionally a ``datacache warm`` beside them."""
    processes = []
    for rank, env in enumerate(envs):
        ranked = {**env, "RANK": str(rank), "WORLD_SIZE": str(len(envs))}
        processes.append(
            subprocess.Popen(
                [sys.executable, str(READER), json.dumps(spec)],
                env=ranked,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    warmer = None
    if warm is not None:
        warmer = subprocess.Popen(
            [*DATACACHE, "warm", spec["url"], "-q"],
            env=warm,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results = []
    for process in processes:
        out, err = process.communicate(timeout=400)
        assert process.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    if warmer is not None:
        _, err = warmer.communicate(timeout=400)
        assert warmer.returncode == 0, err
    return results


def check_ranks(results: list[dict[str, Any]], expected: Samples) -> tuple[int, int]:
    """Every sample once across the ranks, with the right bytes; returns (lost, corrupt)."""
    delivered: dict[str, list[str]] = {}
    for result in results:
        for key, digests in result["seen"].items():
            delivered.setdefault(key, []).extend(digests)
    repeated = {key: len(d) for key, d in delivered.items() if len(d) > 1}
    assert not repeated, f"delivered more than once: {list(repeated.items())[:5]}"
    corrupt = sum(
        1
        for key, digests in delivered.items()
        if key not in expected or digests[0] != hashlib.sha256(expected[key]["bin"]).hexdigest()
    )
    lost = len(set(expected) - set(delivered))
    return lost, corrupt


def origin_gets(s3: S3Bucket, prefix: str) -> dict[str, int]:
    head = f"GET /{s3.name}/{prefix}/"
    return {k.removeprefix(head): v for k, v in s3.server.request_counts().items() if k.startswith(head)}


def base_env(cache_env: dict[str, str], s3: S3Bucket) -> dict[str, str]:
    env = {k: v for k, v in cache_env.items() if not k.startswith(("AWS_", "DATACACHE_"))}
    return {**env, **s3.server.env(), "AWS_EC2_METADATA_DISABLED": "true"}


def stop(daemon: DaemonProcess) -> int | None:
    peak = peak_rss_kib(daemon.process.pid)
    daemon.kill()
    return peak


# -- one node: P processes x W workers through one daemon ------------------------------------


def one_daemon(s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path, *, processes: int, workers: int) -> None:
    files, expected = make_dataset(16, 64, seed=31, size=(1000, 6000))
    upload(s3.client, s3.name, "load", files)
    env = base_env(cache_env, s3)
    daemon = start_daemon(env, tmp_path / "cache", "--concurrency", "4", "--shared-dir", str(tmp_path / "shared"))
    peak = None
    try:
        s3.server.reset_counts()
        # The name `datacache warm URL` gives the dataset, so that both read the same cache entries.
        spec = {"name": dataset_id_for(s3.url("load")), "url": s3.url("load"), "seed": 5, "workers": workers}
        results = run_ranks([daemon.env] * processes, spec, warm=daemon.env)
        assert {result["mode"] for result in results} == {"daemon"}
        lost, corrupt = check_ranks(results, expected)
        assert (lost, corrupt) == (0, 0)
        gets = origin_gets(s3, "load")
        # The shards carry no sample index: the cold epoch counts each from the copy it stages
        # through the stager (coldplan's CountBook), so the origin serves each shard once, for
        # counting and reading alike; never more, however many readers ask.
        assert gets == dict.fromkeys(files, 1), "each shard fetched once for the node, and counted from that copy"
        check_cache(tmp_path / "cache", tmp_path / "shared", files)
        assert daemon.status()["stats"]["shards_staged"] == len(files)
    finally:
        peak = stop(daemon)
    readers = max(r["peak_rss_kib"] for r in results)
    worker_peak = max(r["worker_peak_rss_kib"] for r in results)
    assert peak is not None and peak < 512 * MiB, f"the daemon peaked at {peak} KiB"
    assert readers < 2048 * MiB and worker_peak < 2048 * MiB
    record(
        "one_daemon",
        processes=processes,
        workers=workers,
        samples=len(expected),
        lost=lost,
        corrupt=corrupt,
        origin_gets=sum(gets.values()),
        shards=len(files),
        daemon_peak_rss_mib=round(peak / 1024, 1),
        reader_peak_rss_mib=round(readers / 1024, 1),
        worker_peak_rss_mib=round(worker_peak / 1024, 1),
    )


def test_two_processes_by_two_workers_through_one_daemon(
    s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path
) -> None:
    one_daemon(s3, cache_env, tmp_path, processes=2, workers=2)


@pytest.mark.faults
def test_eight_processes_by_four_workers_through_one_daemon(
    s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path
) -> None:
    one_daemon(s3, cache_env, tmp_path, processes=8, workers=4)


# -- a cluster: N daemons (nodes), one shared tier -------------------------------------------


def many_daemons(s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path, *, nodes: int, workers: int) -> None:
    files, expected = make_dataset(16, 48, seed=32, size=(1000, 6000))
    upload(s3.client, s3.name, "cluster", files)
    env = base_env(cache_env, s3)
    shared = ("--shared-dir", str(tmp_path / "shared"))
    daemons = []
    peaks: list[int] = []
    try:
        for node in range(nodes):
            daemons.append(start_daemon(env, tmp_path / f"node-{node}", "--concurrency", "4", *shared))
        s3.server.reset_counts()
        spec = {"name": "cluster", "url": s3.url("cluster"), "seed": 9, "workers": workers}
        # Readers see the node's config as the daemon does (one config file per cluster), so they
        # find the cluster's sample-count index on the shared tier.
        readers = [{**daemon.env, "DATACACHE_SHARED_DIR": str(tmp_path / "shared")} for daemon in daemons]
        results = run_ranks(readers, spec, warm=None)
        assert {result["mode"] for result in results} == {"daemon"}
        lost, corrupt = check_ranks(results, expected)
        assert (lost, corrupt) == (0, 0)
        gets = origin_gets(s3, "cluster")
        # Each shard from the origin once for the whole cluster: the shared tier's lease locks.
        # One transfer into the shared tier, for both daemons together, which the count (once per
        # cluster, through the stager) reads too.
        assert gets == dict.fromkeys(files, 1), gets
        for node in range(nodes):
            check_cache(tmp_path / f"node-{node}", tmp_path / "shared", files)
        assert not list((tmp_path / "shared" / "locks").rglob("*.lock"))
    finally:
        for daemon in daemons:
            peak = stop(daemon)
            if peak is not None:
                peaks.append(peak)
    assert peaks and max(peaks) < 512 * MiB, peaks
    record(
        "many_daemons",
        nodes=nodes,
        workers=workers,
        samples=len(expected),
        lost=lost,
        corrupt=corrupt,
        origin_gets=sum(gets.values()),
        shards=len(files),
        daemon_peak_rss_mib=round(max(peaks) / 1024, 1),
        reader_peak_rss_mib=round(max(r["peak_rss_kib"] for r in results) / 1024, 1),
    )


def test_two_daemons_share_one_shared_tier(s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path) -> None:
    many_daemons(s3, cache_env, tmp_path, nodes=2, workers=2)


@pytest.mark.faults
def test_four_daemons_share_one_shared_tier(s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path) -> None:
    many_daemons(s3, cache_env, tmp_path, nodes=4, workers=4)
