"""Eviction that knows the whole node's future: real ranks (gloo), real DataLoader workers, one cache.

A dataset twice the local tier, read by 2 ranks x 2 workers for 4 epochs: Belady
fed with every reader's order and progress serves at least as much locally as
no-thrash, and no reader ever finds its shard evicted under it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _daemon import start_daemon
from _ranks import process_group, spawn_ranks
from datacache.loaders import CachedIterableDataset
from datacache.loaders.order.layout import Dealing, Layout, reader_name
from datacache.loaders.plans.positions import node_unit_sequences, plan_epoch
from test_loader import keys_of, write_wds
from torch.utils.data import DataLoader

from datacache.catalog import Catalog
from datacache.client import DaemonClient
from datacache.config import Settings, load_settings
from datacache.staging import FutureOrder, ReaderProgress, Stager
from datacache.staging.residency import next_uses

EPOCHS = 4


class _Count(logging.Handler):
    """Counts the stager's "vanished" warnings in this process and its forked DataLoader workers."""

    def __init__(self, path: Path) -> None:
        super().__init__(logging.WARNING)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if "vanished" in record.getMessage():
            with self.path.open("a") as handle:
                handle.write(record.getMessage() + "\n")


def _rank_main(rank: int, world: int, init_file: str, origin: str, settings_blob: bytes, out: str) -> None:
    with process_group(rank, world, init_file):
        logging.getLogger("datacache").addHandler(_Count(Path(out) / f"vanished-{rank}.log"))
        settings = pickle.loads(settings_blob)
        dataset = CachedIterableDataset(origin, config=settings, seed=5, shuffle_buffer=8, drop_last=True)
        shares: list[float] = []
        seen: list[list[str]] = []
        for epoch in range(EPOCHS):
            dataset.set_epoch(epoch)
            # Forked workers (spawned ones would re-import torch each epoch: minutes on these 2 cores).
            loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork")
            seen.append(keys_of(loader))
            shares.append(dataset.stats().hit_ratio.get("local", 0.0))
        Path(out, f"rank-{rank}.json").write_text(json.dumps({"shares": shares, "seen": seen}))


def _run(tmp_path: Path, policy: str) -> tuple[list[float], int]:
    """Local share per epoch (both ranks' mean) and vanished shards, for one policy."""
    origin = tmp_path / "origin"
    if not origin.exists():
        write_wds(origin, samples=24 * 12, per_shard=12, with_counts=True)
    total = sum(path.stat().st_size for path in origin.glob("*.tar"))
    run = tmp_path / policy
    run.mkdir()
    settings = load_settings(
        {},
        overrides={
            "local_dir": str(run / "local"),
            "shared_dir": str(run / "shared"),
            "local_capacity": total // 2,
            "default_policy": policy,
        },
    )
    spawn_ranks(_rank_main, run / "init", str(origin), pickle.dumps(settings), str(run))
    ranks = [json.loads((run / f"rank-{rank}.json").read_text()) for rank in range(2)]
    for epoch in range(EPOCHS):
        everything = ranks[0]["seen"][epoch] + ranks[1]["seen"][epoch]
        assert len(set(everything)) == len(everything)  # exactly once, eviction or not
    shares = [(ranks[0]["shares"][e] + ranks[1]["shares"][e]) / 2 for e in range(EPOCHS)]
    vanished = sum(len(path.read_text().splitlines()) for path in run.glob("vanished-*.log"))
    return shares, vanished


@pytest.mark.slow
def test_belady_with_the_node_future_serves_locally_at_least_as_much_as_nothrash(tmp_path: Path) -> None:
    auto, auto_vanished = _run(tmp_path, "auto")
    nothrash, nothrash_vanished = _run(tmp_path, "nothrash")
    # Epoch 0 fills the tier cold; epochs 1-3 are where the policies differ. No-thrash serves
    # the resident fraction (~1/2); Belady on every reader's order with prefetch serves clearly
    # more (before the node's future was handed over it served less than no-thrash).
    assert sum(auto[1:]) / 3 >= sum(nothrash[1:]) / 3 + 0.1, (auto, nothrash)
    assert auto_vanished == 0
    assert nothrash_vanished == 0


def test_the_node_future_is_every_readers_plan_and_the_same_from_every_reader() -> None:
    counts = [12] * 10 + [5]
    common = {"dealing": Dealing(3, True, False), "epoch": 2, "window": 8, "cursors": ()}
    futures = [
        {
            name: tuple(units.tolist())
            for name, units in node_unit_sequences(
                counts, layout=Layout(2, rank, 2, worker, 4), **common  # type: ignore[arg-type]
            ).items()
        }
        for rank in range(2)
        for worker in range(2)
    ]
    assert all(future == futures[0] for future in futures)
    for rank in range(2):
        # A rank's workers share its sequence: the units its whole stream reads, in the order first read.
        stream = Layout(2, rank, 1, 0, 4)
        plan = plan_epoch(counts, layout=stream, **common)  # type: ignore[arg-type]
        nxt = plan_epoch(counts, layout=stream, **{**common, "epoch": 3})  # type: ignore[arg-type]
        for worker in range(2):
            mine = futures[0][reader_name(rank, worker)]
            # This epoch's units first, then the next epoch's.
            assert mine == (*plan.unit_sequence, *nxt.unit_sequence)
            own = plan_epoch(counts, layout=Layout(2, rank, 2, worker, 4), **common)  # type: ignore[arg-type]
            assert set(own.unit_sequence) <= set(plan.unit_sequence)


def test_next_use_counts_from_each_readers_position() -> None:
    uses = {"0.0": {"a": [0, 5], "b": [1]}, "0.1": {"b": [4], "c": [2]}}
    # Reader 0.0 has read past "b" (position 2): its next "b" is never; reader 0.1 reads "b" in 4 - 1 = 3.
    assert next_uses(uses, {"0.0": 2, "0.1": 1}) == {"a": 3, "b": 3, "c": 1}
    # A reader absent from the node counts for nothing.
    assert next_uses(uses, {"0.1": 3}) == {"b": 1}


_HOLDER = r"""
import asyncio, json, sys
from datacache.catalog import Catalog
from datacache.config import Settings, load_settings
from datacache.client import DaemonClient
from datacache.staging import FutureOrder, ReaderProgress, Stager
from datacache.staging import ReaderProgress, Stager

async def main():
    settings = load_settings({}, overrides=json.loads(sys.argv[1]))
    stager = Stager(settings, reconcile=False)
    handle = await stager.open(sys.argv[2])
    key = sys.argv[3]
    # Lease first, then locate: from here until the lease ends, eviction cannot take it.
    await stager.note_progress(handle, ReaderProgress("0.0", 0, 0, (key,)))
    location = await stager.ensure(handle, key)
    print(json.dumps({"tier": location.tier, "path": str(location.path)}), flush=True)
    sys.stdin.readline()
    await stager.note_progress(handle, ReaderProgress("0.0", 0, 1, ()))
    print("released", flush=True)
    sys.stdin.readline()
    await stager.close()

asyncio.run(main())
"""


def _storm(settings: Settings, origin: Path, keys: list[str]) -> int:
    """Stage every shard of ``keys`` through a tier that holds two: an eviction per shard, LRU."""

    async def body() -> int:
        async with Stager(settings, reconcile=False) as stager:
            handle = await stager.open(str(origin))
            for _ in range(2):
                for key in keys:
                    await stager.ensure(handle, key)
            return stager.stats().evictions

    return asyncio.run(body())


def test_a_reader_holding_a_shard_survives_an_eviction_storm(tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    origin.mkdir()
    for i in range(8):
        (origin / f"shard-{i}.bin").write_bytes(bytes([i]) * 10_000)
    overrides = {
        "local_dir": str(tmp_path / "local"),
        "local_capacity": 25_000,  # two shards
        "default_policy": "lru",  # the policy that evicts the least recently used first: the held one
    }
    settings = load_settings({}, overrides=overrides)
    with _holder(overrides, origin) as holder:
        assert holder.stdout is not None and holder.stdin is not None
        held = json.loads(holder.stdout.readline())
        assert held["tier"] == "local"
        others = [f"shard-{i}.bin" for i in range(1, 8)]
        assert _storm(settings, origin, others) >= 7
        # Every other shard came and went; the held one stayed, whole, and its row with it.
        assert Path(held["path"]).read_bytes() == bytes([0]) * 10_000
        assert _resident_keys(settings) >= {"shard-0.bin"}
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        _storm(settings, origin, others)
        assert "shard-0.bin" not in _resident_keys(settings)  # released: evictable again


def test_a_dead_readers_lease_does_not_pin_a_shard_forever(tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    origin.mkdir()
    for i in range(6):
        (origin / f"shard-{i}.bin").write_bytes(bytes([i]) * 10_000)
    overrides = {"local_dir": str(tmp_path / "local"), "local_capacity": 25_000, "default_policy": "lru"}
    settings = load_settings({}, overrides=overrides)
    with _holder(overrides, origin) as holder:
        assert holder.stdout is not None
        assert json.loads(holder.stdout.readline())["tier"] == "local"
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    _storm(settings, origin, [f"shard-{i}.bin" for i in range(1, 6)])
    assert "shard-0.bin" not in _resident_keys(settings)


@contextlib.contextmanager
def _holder(overrides: dict[str, object], origin: Path) -> Iterator[subprocess.Popen[str]]:
    """A reader process that leases and holds ``shard-0.bin`` until told (or killed)."""
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER, json.dumps(overrides), str(origin), "shard-0.bin"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as holder:
        try:
            yield holder
        finally:
            holder.kill()


def _resident_keys(settings: Settings) -> set[str]:
    async def body() -> set[str]:
        catalog = Catalog(settings.local_dir / "catalog.sqlite")
        try:
            return {entry.key for entry in await catalog.entries() if entry.state == "resident"}
        finally:
            await catalog.close()

    return asyncio.run(body())


def test_many_tiny_shards_walk_the_shared_tier_once_and_leave_no_lock_files(tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    origin.mkdir()
    for i in range(300):
        (origin / f"tiny-{i:04d}.bin").write_bytes(i.to_bytes(4, "big") * 25)
    settings = load_settings(
        {},
        overrides={
            "local_dir": str(tmp_path / "local"),
            "shared_dir": str(tmp_path / "shared"),
            "shared_capacity": 10_000_000,  # a capacity makes every shard ask how full the tier is
        },
    )

    async def body() -> tuple[int, int]:
        async with Stager(settings) as stager:
            handle = await stager.open(str(origin))
            report = await stager.warm(handle)
            assert report.complete
            stats = stager.stats()
            return stats.shards_to_shared, stats.shared_scans

    staged, scans = asyncio.run(body())
    assert staged == 300
    # Usage is kept as shards come and go: one walk of the shared tree, not one per shard.
    assert scans == 1
    leftover = [p for p in (tmp_path / "local" / "locks").rglob("*.lock") if p.name != "reconcile.lock"]
    assert leftover == []
    assert [p for p in (tmp_path / "shared").rglob("*.lock") if p.is_file()] == []


def test_through_the_daemon_a_clients_progress_leases_its_shard_and_bad_input_is_refused(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    origin = tmp_path / "origin"
    origin.mkdir()
    for i in range(6):
        (origin / f"shard-{i}.bin").write_bytes(bytes([i]) * 10_000)
    env = {**cache_env, "DATACACHE_LOCAL_CAPACITY": "25000B", "DATACACHE_DEFAULT_POLICY": "lru"}
    daemon = start_daemon(env, tmp_path / "cache")
    try:
        settings = load_settings(env, overrides={"local_dir": str(daemon.local_dir), "socket": str(daemon.socket)})

        async def main() -> None:
            client = DaemonClient(settings, client_name="rank0-worker0")
            try:
                handle = await client.open(str(origin))
                keys = [f"shard-{i}.bin" for i in range(6)]
                order = FutureOrder(0, {"0.0": tuple(keys), "0.1": tuple(reversed(keys))})
                await client.set_future_order(handle, order)
                await client.note_progress(handle, ReaderProgress("0.0", 0, 0, ("shard-0.bin",)))
                held = await client.ensure(handle, "shard-0.bin")
                assert held.tier == "local" and held.path is not None
                for _ in range(2):
                    for key in keys[1:]:
                        await client.ensure(handle, key)
                assert held.path.read_bytes() == bytes([0]) * 10_000
                assert (await client.locate(handle, "shard-0.bin")).tier == "local"
            finally:
                await client.close()

        asyncio.run(main())
        code, opened = daemon.request("POST", "/v1/open", {"dataset": str(origin)})
        assert code == 200
        negative = {"reader": "0.0", "epoch": -1, "position": 0, "owner": "x:1"}
        bad = {"dataset": opened["dataset_id"], "progress": negative}
        code, answer = daemon.request("POST", "/v1/progress", bad)
        assert code == 400 and "epoch" in json.dumps(answer)
        # Another host's name is a pod's own (a label: the lease is the caller's by SO_PEERCRED,
        # tests/test_daemon_lease_identity.py), not bad input.
        far = {"reader": "0.0", "epoch": 0, "position": 0, "holding": [], "owner": "train-pod-0:1"}
        code, answer = daemon.request("POST", "/v1/progress", {"dataset": opened["dataset_id"], "progress": far})
        assert code == 200, answer
        code, answer = daemon.request(
            "POST", "/v1/future_order", {"dataset": opened["dataset_id"], "order": {"epoch": 0, "readers": []}}
        )
        assert code == 400 and "readers" in json.dumps(answer)
    finally:
        daemon.kill()


def test_a_note_locates_a_window_of_shards_local_and_not_in_the_order_asked(tmp_path: Path) -> None:
    """One note locates many shards (the local ones in one catalog read): each where it is, in order.

    A prefetch of shards already resident stages nothing: no staging job, no copy, no hit counted.
    """
    origin = tmp_path / "origin"
    origin.mkdir()
    keys = [f"shard-{i}.bin" for i in range(6)]
    for key in keys:
        (origin / key).write_bytes(key.encode() * 100)
    settings = load_settings({}, overrides={"local_dir": str(tmp_path / "local")})

    async def body() -> tuple[list[str], list[str], int, int]:
        async with Stager(settings, reconcile=False) as stager:
            handle = await stager.open(str(origin))
            for key in keys[::2]:
                await stager.ensure(handle, key)
            before = stager.stats()
            asked = [keys[5], keys[0], keys[3], keys[2], keys[1], keys[4]]
            located = await stager.note_progress(handle, ReaderProgress("0.0", 0, 0, tuple(asked)), locate=asked)
            await stager.prefetch(handle, keys[::2])
            deadline = time.monotonic() + 30
            while stager.stats().queue_depth or stager.stats().in_flight:  # what a prefetch queued, done
                assert time.monotonic() < deadline, "the prefetch's jobs did not finish in 30 s"
                await asyncio.sleep(0.01)  # sleep-ok: polling the stager's queue, with a deadline
            after = stager.stats()
            return (
                [loc.shard.key for loc in located],
                [loc.tier for loc in located],
                after.shards_staged - before.shards_staged,
                after.hits.get("local", 0) - before.hits.get("local", 0),
            )

    located, tiers, staged, hits = asyncio.run(body())
    assert located == [keys[5], keys[0], keys[3], keys[2], keys[1], keys[4]]
    assert tiers == ["origin", "local", "origin", "local", "origin", "local"]
    assert (staged, hits) == (0, 0)
