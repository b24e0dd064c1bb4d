"""A local tier found over its capacity comes back to it; a daemon's readers keep to it while it is away.

A new user's trial: the daemon went down, each reader went on through its own stager
with the reader's settings (no capacity), and filled the daemon's directory to 258% of its
capacity. The restarted daemon left it so, and `warm` called the dataset complete.
"""

from __future__ import annotations

from pathlib import Path

from _daemon import catalog_rows, start_daemon, visible_files
from _helpers import run_cli, with_stager
from datacache.loaders import CachedIterableDataset
from test_loader import write_wds

from datacache.config import Settings, load_settings
from datacache.staging import Stager


def _fill(settings: Settings, origin: Path, *, pin: bool = False) -> list[tuple[str, int]]:
    """Stage every shard of ``origin`` in order, with no capacity; return (tier key, size) in that order."""

    async def body(stager: Stager) -> list[tuple[str, int]]:
        handle = await stager.open(str(origin))
        staged = []
        for shard in handle.manifest.shards:
            await stager.ensure(handle, shard.key)
            staged.append((handle.tier_key(shard.key), shard.size))
        if pin:
            await stager.catalog.set_pinned(handle.id, True)
        return staged

    return with_stager(settings, body, reconcile=False)


def _held(local: Path) -> int:
    return sum(path.stat().st_size for path in visible_files(local))


def test_a_tier_found_over_its_capacity_is_evicted_down_to_it_oldest_first_pinned_kept(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    write_wds(tmp_path / "a", samples=48, per_shard=8)
    write_wds(tmp_path / "b", samples=16, per_shard=8)
    local = tmp_path / "local"
    unlimited = load_settings(cache_env, overrides={"local_dir": str(local)})
    pinned = _fill(unlimited, tmp_path / "b", pin=True)  # the oldest, but pinned
    staged = _fill(unlimited, tmp_path / "a")
    capacity = sum(size for _, size in pinned) + sum(size for _, size in staged[3:])
    assert _held(local) > capacity

    limited = load_settings(cache_env, overrides={"local_dir": str(local), "local_capacity": f"{capacity}B"})
    counts = with_stager(limited, lambda stager: stager.reconcile())

    assert counts["over_capacity_evicted"] == 3
    on_disk = {str(path.relative_to(local / "data")) for path in visible_files(local)}
    assert on_disk == {key for key, _ in pinned + staged[3:]}, "the least recently used went, the pinned stayed"
    assert {f"{row[0]}/{row[1]}" for row in catalog_rows(local)} == on_disk, "the catalog says what is on disk"
    assert _held(local) <= capacity


def test_the_daemon_brings_its_tier_back_to_capacity_and_its_readers_keep_to_it_while_it_is_down(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=96, per_shard=8)
    local = tmp_path / "local"
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(local)}
    run_cli(["warm", str(origin)], env, check=True)  # no daemon, no capacity: all 12 shards
    shard = max(path.stat().st_size for path in visible_files(local))
    capacity = 4 * shard
    assert _held(local) > 2 * capacity

    daemon = start_daemon(cache_env, local, "--local-capacity", f"{capacity}B")
    try:
        tiers = {tier["tier"]: tier for tier in daemon.status()["tiers"]}
        assert tiers["local"]["used_bytes"] <= capacity, "the daemon starts within its capacity"
        assert _held(local) <= capacity
        assert "over its capacity" in daemon.log_text()

        reader = load_settings(daemon.env)  # the reader's own settings say no capacity
        assert reader.local_capacity is None
        dataset = CachedIterableDataset(str(origin), config=reader, seed=5, shuffle_buffer=8)
        samples = iter(dataset)
        head = [next(samples)["__key__"] for _ in range(10)]
        daemon.kill()  # SIGKILL: the rest of the epoch goes through the reader's own stager
        tail = [sample["__key__"] for sample in samples]
        assert "daemon unavailable" in dataset.stats().mode
    finally:
        daemon.kill()
    assert sorted(head + tail) == sorted(expected), "every sample once across the daemon's death"
    assert _held(local) <= capacity, "the fallback kept to the daemon's capacity"
