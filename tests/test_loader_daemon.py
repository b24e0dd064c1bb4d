"""The loader through the node's daemon, and on without it when the daemon dies mid-epoch."""

from __future__ import annotations

from pathlib import Path

from _daemon import start_daemon
from datacache.loaders import CachedIterableDataset
from test_loader import keys_of, write_wds
from torch.utils.data import DataLoader

from datacache.config import load_settings


def test_loader_uses_the_daemon_and_survives_its_death(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=96, per_shard=8, with_counts=True)
    local = tmp_path / "local"
    daemon = start_daemon(cache_env, local)
    try:
        settings = load_settings(daemon.env)
        dataset = CachedIterableDataset(str(origin), config=settings, seed=3, shuffle_buffer=16)
        iterator = iter(dataset)
        head = [next(iterator)["__key__"] for _ in range(30)]
        assert dataset.stats().mode == "daemon"
        staged_by_daemon = daemon.status()
        assert staged_by_daemon, "the daemon answered status"
        daemon.kill()  # SIGKILL mid-epoch
        tail = [sample["__key__"] for sample in iterator]
        assert sorted(head + tail) == sorted(expected), "no sample lost or repeated across the daemon's death"
        assert "daemon unavailable" in dataset.stats().mode
    finally:
        daemon.kill()


def test_worker_processes_report_the_daemon_mode(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=40, per_shard=10, with_counts=True)
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        settings = load_settings(daemon.env)
        dataset = CachedIterableDataset(str(origin), config=settings, batch_size=5)
        keys = keys_of(DataLoader(dataset, batch_size=None, num_workers=2))
        assert sorted(keys) == sorted(expected)
        assert dataset.stats().mode == "daemon"
    finally:
        daemon.stop()
