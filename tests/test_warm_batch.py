"""Warm in batches: many tiny shards, killed mid-batch, under capacity, from two processes at once.

`datacache warm` stages onto the local tier in batches (one reservation, one write round and
one commit per batch). These tests hold it to the one-shard way's guarantees: after a SIGKILL
at any moment the catalog and the files agree once recovered, and a re-run completes; a tier
smaller than the dataset is never overfilled; two processes (one node, or two nodes sharing a
directory) each end with every shard, each byte checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from _helpers import DATACACHE, REPO, fill_dir, partial_files, wait_for, with_stager
from datacache.tiers import LocalTier

from datacache.catalog import Catalog, Claim, Room, ShardState
from datacache.catalog.rows import SCHEMA
from datacache.config import load_settings, resolve_dataset
from datacache.errors import InvalidKeyError
from datacache.manifest import Shard
from datacache.staging import LOCAL, Location, Stager
from datacache.staging.batch import Outcome, Turn, WarmBatches, stage_batch

TINY = 1_000


def tiny_shards(count: int) -> dict[str, bytes]:
    """``count`` shards of `TINY` bytes, each different (a shard swapped for another is caught)."""
    return {f"{index:06d}.bin": index.to_bytes(4, "big") * (TINY // 4) for index in range(count)}


def rows(local: Path) -> dict[str, tuple[str, int]]:
    """The catalog's shards: key -> (state, size); none before the catalog has its tables."""
    with contextlib.closing(sqlite3.connect(local / "catalog.sqlite")) as connection:
        if not connection.execute("SELECT count(*) FROM sqlite_master WHERE name='shards'").fetchone()[0]:
            return {}
        return {key: (state, size) for key, state, size in connection.execute("SELECT key, state, size FROM shards")}


def files(local: Path) -> dict[str, bytes]:
    """The local tier's data files (no temporaries), by shard key."""
    data = local / "data"
    if not data.exists():
        return {}
    return {
        path.name: path.read_bytes()
        for path in data.rglob("*")
        if path.is_file() and not path.name.endswith(".partial")
    }


def assert_agree(local: Path, shards: dict[str, bytes]) -> None:
    """Catalog and files agree exactly, nothing half-done is left, and every byte is the origin's."""
    catalogued = rows(local)
    on_disk = files(local)
    assert all(state == ShardState.RESIDENT for state, _ in catalogued.values()), catalogued
    assert set(catalogued) == set(on_disk)
    for key, data in on_disk.items():
        assert data == shards[key], key
    assert partial_files(local) == []


def warm_command(origin: Path, *extra: str) -> list[str]:
    return [*DATACACHE, "warm", str(origin), "--no-daemon", "--json", *extra]


def test_totals_follow_every_change_and_an_older_catalog_gets_them(tmp_path: Path) -> None:
    path = tmp_path / "catalog.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as old:  # a catalog of the version before the totals
        old.executescript(SCHEMA)
        old.execute(
            "INSERT INTO shards (dataset, key, size, state, last_access) VALUES ('d', 'a', 10, 'resident', 0),"
            " ('d', 'b', 7, 'staging', 0)"
        )
        old.commit()
    room = Room("host:1", None, lambda: None, 0, lambda *_: [])

    async def body() -> None:
        catalog = Catalog(path)
        try:
            await catalog.reserve_many("d", [Claim("c", 5, None), Claim("a", 11, "v2")], room)
            await catalog.commit_many("d", [("c", 5, None, "x")])
            await catalog.abandon_many("d", ["b"], "host:0")  # not its owner: stays
            await catalog.remove_many([("d", "b")])
            await catalog.mark_evicting("d", ["c"], "host:1")
        finally:
            await catalog.close()

    asyncio.run(body())
    with contextlib.closing(sqlite3.connect(path)) as connection:
        totals = {state: (size, count) for state, size, count in connection.execute("SELECT * FROM totals")}
        summed = dict.fromkeys(totals, (0, 0)) | {
            state: (size, count)
            for state, size, count in connection.execute("SELECT state, sum(size), count(*) FROM shards GROUP BY state")
        }
    assert totals == summed
    assert totals["staging"] == (11, 1) and totals["evicting"] == (5, 1)


def test_a_warm_killed_mid_batch_recovers_to_a_catalog_that_agrees_with_its_files(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    shards = tiny_shards(3_000)
    origin = fill_dir(tmp_path / "origin", shards)
    local = tmp_path / "local"
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(local)}
    in_flight = 0
    for threshold in (300, 1_200, 2_100):
        # Paced, so that the kill lands while batches are reserved and being written.
        process = subprocess.Popen(
            warm_command(origin, "--bandwidth", "600kB/s"),
            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            wait_for(
                lambda threshold=threshold: (local / "catalog.sqlite").exists()
                and sum(state == "resident" for state, _ in rows(local).values()) >= threshold,
                timeout=120,
                what=f"{threshold} shards resident",
            )
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait()
        left = rows(local)
        in_flight += any(state == ShardState.STAGING for state, _ in left.values())
        # Right after the kill: every row called resident has its whole file; every file is whole.
        on_disk = files(local)
        for key, (state, _) in left.items():
            if state == ShardState.RESIDENT:
                assert on_disk.get(key) == shards[key], key
        for key, data in on_disk.items():
            assert data == shards[key], key
        # Recovery: a dead warm's batch is adopted (whole files) or removed, rows and files agree.
        settings = load_settings(env)
        with_stager(settings, lambda stager: stager.reconcile(), reconcile=False)
        assert_agree(local, shards)
    assert in_flight, "no kill found a batch in flight: the test did not test a batch"
    done = subprocess.run(
        warm_command(origin), env=env, cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["complete"] is True and report["shards_resident"] == len(shards)
    assert_agree(local, shards)
    assert len(files(local)) == len(shards)


def test_a_batch_warm_honours_a_local_tier_smaller_than_the_dataset(tmp_path: Path, cache_env: dict[str, str]) -> None:
    shards = tiny_shards(600)
    origin = fill_dir(tmp_path / "origin", shards)
    capacity = 150 * TINY
    small = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "small"), "local_capacity": f"{capacity}B"})

    async def body(stager: Stager) -> tuple[int, int]:
        handle = await stager.open(str(origin))
        report = await stager.warm(handle)
        return report.shards_resident, report.bytes_resident

    resident, held = with_stager(small, body)
    assert 0 < resident < len(shards)
    assert held <= capacity
    catalogued = rows(small.local_dir)
    assert sum(size for _, size in catalogued.values()) <= capacity
    assert sum(len(data) for data in files(small.local_dir).values()) <= capacity
    assert_agree(small.local_dir, shards)


def test_two_processes_of_one_node_warm_the_same_dataset_once(tmp_path: Path, cache_env: dict[str, str]) -> None:
    shards = tiny_shards(2_000)
    origin = fill_dir(tmp_path / "origin", shards)
    local = tmp_path / "local"
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(local)}
    processes = [
        subprocess.Popen(
            warm_command(origin), env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    reports = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
    assert all(report["complete"] for report in reports)
    # One transfer per shard for the node, whichever process made it.
    assert sum(report["bytes_transferred"] for report in reports) == len(shards) * TINY
    assert_agree(local, shards)
    assert len(files(local)) == len(shards)


def test_two_nodes_warm_through_one_shared_directory_at_once(tmp_path: Path, cache_env: dict[str, str]) -> None:
    shards = tiny_shards(1_000)
    origin = fill_dir(tmp_path / "origin", shards)
    shared = tmp_path / "shared"
    nodes = [tmp_path / "node-a", tmp_path / "node-b"]
    processes = [
        subprocess.Popen(
            warm_command(origin),
            env={**cache_env, "DATACACHE_LOCAL_DIR": str(node), "DATACACHE_SHARED_DIR": str(shared)},
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in nodes
    ]
    for process in processes:
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr
        assert json.loads(stdout.strip().splitlines()[-1])["complete"] is True
    for node in nodes:
        assert_agree(node, shards)
        assert len(files(node)) == len(shards)
    dataset = resolve_dataset(str(origin), load_settings(cache_env)).id
    on_shared = {path.name: path.read_bytes() for path in (shared / "data" / dataset).iterdir()}
    assert on_shared == shards
    assert partial_files(shared) == []
    assert os.listdir(shared / "data") == [dataset]


def test_put_many_writes_each_file_whole_and_names_the_bad_key(tmp_path: Path) -> None:
    tier = LocalTier(tmp_path / "tier")
    items = [("ds/a.bin", b"a" * 10, {"size": "10"}), ("../escape", b"x", {}), ("ds/sub/b.bin", b"b" * 3, {})]
    landed = asyncio.run(tier.put_many(items))
    assert landed[0] == tier.path("ds/a.bin") and landed[2] == tier.path("ds/sub/b.bin")
    assert isinstance(landed[1], InvalidKeyError)
    assert tier.path("ds/a.bin").read_bytes() == b"a" * 10
    assert json.loads((tmp_path / "tier" / "meta" / "ds" / "a.bin.json").read_text()) == {"size": "10"}
    assert partial_files(tmp_path) == []


def test_a_warm_bigger_than_the_tier_keeps_the_shards_it_was_asked_for_first(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """Batches run three at once; which reached the catalog first was thread scheduling's choice, so on a busy
    machine a warm bigger than the tier kept an arbitrary subset (issue 34's order-dependent tests). Here the
    first batch is held until the later ones have finished or stand waiting for their turn: they must wait."""
    shards = tiny_shards(3)
    origin = fill_dir(tmp_path / "origin", shards)
    one = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "local"), "local_capacity": f"{TINY}B"})

    async def body(stager: Stager) -> list[str]:
        handle = await stager.open(str(origin))
        local = (await stager._ready()).local  # the batches' own stager, as `Stager.warm` hands it
        later_ready = [asyncio.Event(), asyncio.Event()]

        class Watched(Turn):
            def __init__(self, inner: Turn, ready: asyncio.Event | None) -> None:
                super().__init__()
                self.inner, self.ready = inner, ready

            async def wait(self) -> None:
                if self.ready is not None:
                    self.ready.set()  # a later batch stands at its turn
                await self.inner.wait()

            def release(self) -> None:
                self.inner.release()

        calls = 0

        async def stage(batch: Sequence[Shard], turn: Turn) -> list[Outcome]:
            nonlocal calls
            index, calls = calls, calls + 1
            ready = later_ready[index - 1] if index else None
            if index == 0:
                await asyncio.gather(*(event.wait() for event in later_ready))
            try:
                return await stage_batch(local, handle, batch, Watched(turn, ready))
            finally:
                if ready is not None:
                    ready.set()  # finished without waiting (the order bug): let the first go on

        async with WarmBatches(stage) as batches:
            got = await asyncio.gather(
                *(batches.submit(shard, 0.0) for shard in handle.manifest.shards), return_exceptions=True
            )
        return [shard.key for shard, where in zip(handle.manifest.shards, got, strict=True)
                if isinstance(where, Location) and where.tier == LOCAL]

    assert with_stager(one, body) == ["000000.bin"]
    assert set(rows(one.local_dir)) == {"000000.bin"}


# A warm killed by SIGKILL at the start of its first commit of a batch of at least N shards (the first
# batches hold one shard each): that batch's files are written and in place, its rows not yet committed.
_KILLED_AT_COMMIT = """
import asyncio, os, signal, sys
from datacache.config import load_settings
from datacache.staging import Stager

async def main() -> None:
    async with Stager(load_settings()) as stager:
        handle = await stager.open(sys.argv[1])
        commit = stager.catalog.commit_many

        async def commit_or_die(dataset, staged):
            if len(staged) >= int(sys.argv[2]):
                os.kill(os.getpid(), signal.SIGKILL)
            return await commit(dataset, staged)

        stager.catalog.commit_many = commit_or_die
        await stager.warm(handle)

asyncio.run(main())
"""


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


class _Range(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_uint64), ("length", ctypes.c_uint64)]


def unwritten_pages(path: Path) -> int:
    """Pages of ``path`` the page cache holds and the device does not have yet: dirty or being written.

    cachestat(2) (Linux 6.5): what a power cut would lose of a file a SIGKILL leaves whole in memory.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    stat, whole = _CacheStat(), _Range(0, 0)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(451, fd, ctypes.byref(whole), ctypes.byref(stat), 0) != 0:  # 451: cachestat
            raise OSError(ctypes.get_errno(), f"cachestat({path})")
    finally:
        os.close(fd)
    return int(stat.dirty + stat.writeback)


def test_a_warm_killed_between_a_batch_write_and_its_commit_left_every_file_in_place_durable(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """A batch's files are made durable once for the batch (syncfs), not one by one: every name in place
    must still name bytes the device has (no page of it dirty) before any row calls it resident, and
    recovery leaves the catalog and the files agreeing. Fails with the batch's syncs left out."""
    shards = tiny_shards(1_000)
    origin = fill_dir(tmp_path / "origin", shards)
    local = tmp_path / "local"
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(local), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_AT_COMMIT, str(origin), "100"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    left, on_disk = rows(local), files(local)
    staging = {key for key, (state, _) in left.items() if state == ShardState.STAGING}
    cut = staging & set(on_disk)  # later batches may be reserved and not written yet
    assert len(cut) >= 100, "no batch's commit was cut with its files in place"
    for key, (state, _) in left.items():
        if state == ShardState.RESIDENT:
            assert on_disk.get(key) == shards[key], key
    for key, data in on_disk.items():
        assert data == shards[key], key
        assert unwritten_pages(local / "data" / origin_id(env, origin) / key) == 0, f"{key} in place, not durable"
    with_stager(load_settings(env), lambda stager: stager.reconcile(), reconcile=False)
    assert_agree(local, shards)


def origin_id(env: dict[str, str], origin: Path) -> str:
    return resolve_dataset(str(origin), load_settings(env)).id
