"""The daemon's dataset registry stays bounded however long it runs (issue 12 item 22)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from _daemon import make_shards

from datacache.config import load_settings, resolve_dataset
from datacache.daemon._http import Peer
from datacache.daemon._policy import OriginPolicy
from datacache.daemon._registry import DatasetRegistry
from datacache.staging import Stager


def test_handles_and_snapshot_files_are_bounded(tmp_path: Path, cache_env: dict[str, str]) -> None:
    settings = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "cache")})
    origin = tmp_path / "origin"
    make_shards(origin, 1, 1_000)
    snapshots_dir = tmp_path / "snapshots"
    snapshots_dir.mkdir()

    async def main() -> tuple[DatasetRegistry, list[str]]:
        async with Stager(settings) as stager:
            registry = DatasetRegistry(settings, OriginPolicy(), snapshots_dir, max_handles=3, keep_snapshots=2)
            config = resolve_dataset(str(origin), settings)
            operator = Peer(1, 0, 0)
            seen = []
            for i in range(7):  # each refresh after a new shard is a new snapshot
                (origin / f"shard-extra-{i}.tar").write_bytes(b"x" * (i + 1))
                handle = await registry.open(stager, config, operator, refresh=True, snapshot=None)
                seen.append(handle.manifest.snapshot)
            return registry, seen

    registry, seen = asyncio.run(main())
    assert len(set(seen)) == 7
    assert [snapshot for _, snapshot in registry.handles] == seen[-3:]  # the most recently used
    assert next(iter(registry.latest.values())).manifest.snapshot == seen[-1]
    # <id>@<snapshot>.<keyed digest>.json
    kept = sorted(path.name.split("@", 1)[1].split(".", 1)[0] for path in snapshots_dir.glob("*.json"))
    assert kept == sorted(seen[-3:])  # the held ones (more than keep_snapshots) and nothing older


def test_snapshot_names_made_by_many_threads_at_once_share_one_key(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """Eight clients opening at once (test_eight_clients_share_one_transfer_per_shard, a fresh-clone run): one
    thread found the key file another had just created, still empty, took it for a crash's leftover and removed it
    under a third, whose open failed with ENOENT on `.names.key`. Here registries of one daemon directory race."""
    import concurrent.futures
    import threading

    settings = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "cache")})
    snapshots_dir = tmp_path / "snapshots"
    snapshots_dir.mkdir()
    start = threading.Barrier(16)

    def name(_: int) -> str:
        registry = DatasetRegistry(settings, OriginPolicy(), snapshots_dir)  # a key of its own to find or make
        start.wait()
        return registry.snapshot_path("ds-0123456789abcdef", "s1").name

    for _ in range(20):
        for leftover in snapshots_dir.iterdir():
            leftover.unlink()
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            names = set(pool.map(name, range(16)))
        assert len(names) == 1, names
        assert [p.name for p in snapshots_dir.iterdir()] == [".names.key"]
        assert (snapshots_dir / ".names.key").stat().st_mode & 0o077 == 0
