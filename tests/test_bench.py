"""``datacache bench`` (measure each tier against a target) and ``datacache plan`` (size tiers on paper)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from _daemon import REPO, make_shards

from datacache.bench import assess, format_bench, format_plan, plan_tiers, run_bench
from datacache.config import load_settings
from datacache.errors import ConfigError

GB = 1e9


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "datacache.cli", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_assess_names_the_slowest_tier_as_the_bottleneck() -> None:
    # The dataset fits locally: the local tier must give the whole 8 GB/s.
    report = assess(
        {"origin": 0.5 * GB, "shared": 3 * GB, "local": 5 * GB},
        gpus=8,
        per_gpu=1 * GB,
        dataset_bytes=10**12,
        local_room=2 * 10**12,
        shared_configured=True,
    )
    assert report.bottleneck == "local" and not report.ok
    local = next(v for v in report.tiers if v.tier == "local")
    assert (local.measured, local.need, local.meets) == (5 * GB, 8 * GB, False)
    assert "local tier delivers 5.00 GB/s" in report.verdict

    # Half of it fits: the shared tier serves the other half of every epoch.
    report = assess(
        {"origin": 0.5 * GB, "shared": 3 * GB, "local": 10 * GB},
        gpus=8,
        per_gpu=1 * GB,
        dataset_bytes=10**12,
        local_room=5 * 10**11,
        shared_configured=True,
    )
    shared = next(v for v in report.tiers if v.tier == "shared")
    assert shared.need == pytest.approx(4 * GB)
    assert report.bottleneck == "shared"

    # Everything holds once warm; a cold first epoch would not: say so.
    report = assess(
        {"origin": 0.5 * GB, "local": 10 * GB},
        gpus=8,
        per_gpu=1 * GB,
        dataset_bytes=10**12,
        local_room=None,
        shared_configured=False,
    )
    assert report.ok and report.bottleneck is None
    assert report.verdict.startswith("YES") and "datacache warm" in report.verdict
    text = format_bench(report)
    assert "bottleneck: none" in text and "origin" in text and "local" in text
    with pytest.raises(ConfigError):
        assess({}, gpus=0, per_gpu=1, dataset_bytes=1, local_room=None, shared_configured=False)


def test_plan_sizes_every_tier() -> None:
    plan = plan_tiers(gpus=8, per_gpu=1 * GB, dataset_bytes=10 * 10**12, epochs=90, nodes=4)
    assert plan.node_need == 8 * GB and plan.cluster_need == 32 * GB
    assert plan.epoch_seconds == pytest.approx(10 * 10**12 / (32 * GB))
    tiers = {tier.tier: tier for tier in plan.tiers}
    assert tiers["local"].capacity == 11 * 10**12 and tiers["local"].bandwidth == 8 * GB
    assert tiers["shared"].capacity == int(10.5 * 10**12) and tiers["shared"].bandwidth == 32 * GB
    assert tiers["origin"].capacity == 10 * 10**12
    smaller = plan_tiers(
        gpus=8,
        per_gpu=1 * GB,
        dataset_bytes=10 * 10**12,
        nodes=4,
        local_capacity=int(5.5 * 10**12),
        origin_bandwidth=5 * GB,
    )
    assert smaller.local_fraction == pytest.approx(0.5)
    assert {t.tier: t for t in smaller.tiers}["shared"].bandwidth == pytest.approx(16 * GB)
    assert smaller.warm_seconds == pytest.approx(2000)
    assert "holds 50% of the dataset" in format_plan(smaller)
    json.dumps(smaller.to_json())
    with pytest.raises(ConfigError):
        plan_tiers(gpus=8, per_gpu=1 * GB, dataset_bytes=0)


def test_run_bench_measures_origin_shared_and_local(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    make_shards(origin, 4, 2_000_000)
    settings = load_settings(
        cache_env, overrides={"local_dir": str(tmp_path / "local"), "shared_dir": str(tmp_path / "shared")}
    )
    report = asyncio.run(
        run_bench(settings, str(origin), gpus=2, per_gpu=1000.0, readers=2, seconds=2.0, sample_bytes=8_000_000)
    )
    measured = {m.tier: m for m in report.measurements}
    assert set(measured) == {"origin", "shared", "local"}
    assert all(m.bytes_read > 0 and m.bytes_per_s > 0 and m.readers == 2 for m in measured.values())
    assert report.ok and report.need == 2000.0
    json.dumps(report.to_json())


def test_bench_and_plan_commands(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    make_shards(origin, 3, 1_000_000)
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(tmp_path / "local"), "PYTHONPATH": str(REPO)}
    args = ("--seconds", "0.5", "--sample", "3MB", "--readers", "2")
    result = cli("bench", str(origin), "--gpus", "1", "--per-gpu", "1kB/s", "--json", *args, env=env)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["ok"] is True and document["bottleneck"] is None
    assert {t["tier"] for t in document["tiers"]} == {"origin", "shared", "local"}
    result = cli("bench", str(origin), "--gpus", "8", "--per-gpu", "1PB/s", *args, env=env)
    assert result.returncode == 1
    assert "bottleneck: " in result.stdout and "NO: the" in result.stdout
    # Without a dataset: the disk tiers on temporary files, removed afterwards.
    result = cli("bench", "--gpus", "1", "--per-gpu", "1kB/s", "--tiers", "local", *args, env=env)
    assert result.returncode == 0, result.stderr
    assert not list((tmp_path / "local").glob(".bench-*"))
    result = cli(
        "plan",
        "--gpus",
        "8",
        "--per-gpu",
        "1GB/s",
        "--dataset",
        "10TB",
        "--epochs",
        "90",
        "--nodes",
        "4",
        "--json",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["cluster_need_bytes_per_s"] == 32e9
    result = cli("plan", "--gpus", "0", "--per-gpu", "1GB/s", "--dataset", "1TB", env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "must be positive" in result.stderr


def test_the_readme_plan_example_plans_64_gpus_on_8_nodes(cache_env: dict[str, str]) -> None:
    """Issue 12 item 17: the README's example meant 64 GPUs in all; it planned 64 per node."""
    readme = (REPO / "README.md").read_text()
    line = next(line for line in readme.splitlines() if line.startswith("datacache plan "))
    args = line.split("#")[0].split()[1:]
    result = cli(*args, "--json", env={**cache_env, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["nodes"], plan["gpus_per_node"], plan["gpus"]) == (8, 8, 64)
    assert plan["node_need_bytes_per_s"] == 8e9 and plan["cluster_need_bytes_per_s"] == 64e9
    text = format_plan(plan_tiers(gpus=8, per_gpu=1 * GB, dataset_bytes=10**12, nodes=8))
    assert text.startswith("job: 8 nodes x 8 GPUs per node = 64 GPUs x 1.00 GB/s"), text


def test_plan_warns_when_gpus_per_node_looks_like_the_whole_job(cache_env: dict[str, str]) -> None:
    env = {**cache_env, "PYTHONPATH": str(REPO)}
    result = cli("plan", "--gpus", "64", "--per-gpu", "1GB/s", "--dataset", "40TB", "--nodes", "8", env=env)
    assert result.returncode == 0, result.stderr
    assert "--gpus is per node: 64 GPUs per node x 8 nodes = 512 GPUs" in result.stderr
    assert "for 64 GPUs in all, pass --gpus 8" in result.stderr


def test_bench_does_not_pass_a_tier_that_is_short_for_a_cold_epoch() -> None:
    """Issue 12 item 17: origin `OK yes` at 0.04 GB/s against the 8 GB/s a cold epoch needs."""
    report = assess(
        {"origin": 0.04 * GB, "shared": 20 * GB, "local": 20 * GB},
        gpus=8,
        per_gpu=1 * GB,
        dataset_bytes=10**12,
        local_room=None,
        shared_configured=True,
    )
    origin = next(v for v in report.tiers if v.tier == "origin")
    assert origin.meets is True, "nothing is read from the origin once the dataset is warm"
    assert origin.meets_cold is False
    row = next(line for line in format_bench(report).splitlines() if line.startswith("origin"))
    assert row.split()[:9] == ["origin", "0.04", "GB/s", "0.00", "GB/s", "yes", "8.00", "GB/s", "NO"], row
    assert "datacache warm" in report.verdict
    assert report.to_json()["tiers"][0]["meets_cold_epoch"] is False

