"""The first epoch of an un-indexed tar dataset: the first batch after a few shards, still exactly once."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from datacache.loaders import CachedIterableDataset
from datacache.loaders.plans.cold import ColdPositions
from test_loader import keys_of, write_wds
from torch.utils.data import DataLoader

from datacache.catalog import ReaderRow
from datacache.config import Settings, load_settings
from datacache.staging import Stager

if TYPE_CHECKING:
    from conftest import S3Bucket


def upload(s3: S3Bucket, tmp_path: Path, *, samples: int, per_shard: int) -> dict[str, dict[str, bytes]]:
    source = tmp_path / "upload"
    expected = write_wds(source, samples=samples, per_shard=per_shard)
    for path in sorted(source.glob("*.tar")):
        s3.put(f"ds/{path.name}", path.read_bytes())
    return expected


def shards_read(s3: S3Bucket) -> int:
    head = f"GET /{s3.name}/ds/"
    return sum(1 for k in s3.server.request_counts() if k.startswith(head) and k.endswith(".tar"))


def test_the_first_batch_of_a_200_shard_unindexed_dataset_arrives_after_a_few_shards(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str]
) -> None:
    expected = upload(s3, tmp_path, samples=2000, per_shard=10)
    settings = load_settings(
        cache_env,
        overrides={"local_dir": str(tmp_path / "local"), "shared_dir": str(tmp_path / "shared"), "concurrency": 2},
    )
    s3.server.reset_counts()
    dataset = CachedIterableDataset(s3.url("ds"), config=settings, seed=4, batch_size=8)
    iterator = iter(dataset)
    first = next(iterator)
    assert len(first["__key__"]) == 8
    read = shards_read(s3)
    assert read <= 8, f"{read} of 200 shards were read before the first batch"
    seen = list(first["__key__"]) + [key for batch in iterator for key in batch["__key__"]]
    assert sorted(seen) == sorted(expected), "the cold epoch still delivers every sample exactly once"
    assert len(dataset) == 250


def run_rank(
    dataset: CachedIterableDataset, monkeypatch: pytest.MonkeyPatch, rank: int, world: int, workers: int
) -> list[str]:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return keys_of(DataLoader(dataset, batch_size=None, num_workers=workers))


@pytest.mark.parametrize(("world", "workers", "drop_last"), [(2, 0, False), (3, 2, False), (2, 2, True)])
def test_a_cold_epoch_is_exactly_once_with_equal_batches_on_every_rank(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch, world: int, workers: int, drop_last: bool
) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=203, per_shard=7)  # 29 shards: ranks' natural shares differ
    dataset = CachedIterableDataset(str(origin), config=settings, seed=11, batch_size=4, drop_last=drop_last)
    per_rank = [run_rank(dataset, monkeypatch, rank, world, workers) for rank in range(world)]
    markers = list((tmp_path / "shared" / "indexes").rglob("epoch-11-0.json"))
    assert [m.read_text() for m in markers] == ['{"cold": true}'], "the first epoch was read cold"
    assert len({len(keys) for keys in per_rank}) == 1, "every rank reads as many samples (no DDP hang)"
    counts = Counter(key for keys in per_rank for key in keys)
    if drop_last:
        assert max(counts.values()) == 1 and len(counts) == len(expected) // world * world
    else:
        assert set(counts) == set(expected)
        assert sum(n - 1 for n in counts.values()) < world
    second = CachedIterableDataset(str(origin), config=settings, seed=11, batch_size=4, drop_last=drop_last)
    again = [run_rank(second, monkeypatch, rank, world, workers) for rank in range(world)]
    assert again == per_rank, "the cold epoch's order depends only on (seed, epoch) and the world size"


def test_the_epoch_after_a_cold_one_is_decided_ahead_not_at_its_start(tmp_path: Path, settings: Settings) -> None:
    """Once a cold epoch's counts are all known, the cluster's record of the next epoch is read (here made)
    on a thread, not by the consumer as that epoch starts; the next epoch then reads as it records."""
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=60, per_shard=6)
    dataset = CachedIterableDataset(str(origin), config=settings, seed=12, batch_size=4)
    assert sorted(keys_of(dataset)) == sorted(expected)
    deadline = time.monotonic() + 30
    while not (markers := list((tmp_path / "shared" / "indexes").rglob("epoch-12-1.json"))):
        assert time.monotonic() < deadline, "the next epoch's record was not made ahead"
        time.sleep(0.05)  # sleep-ok: polls for a file a thread writes, with a deadline
    assert [m.read_text() for m in markers] == ['{"cold": false}'], "every count was known: indexed"
    dataset.set_epoch(1)
    assert sorted(keys_of(dataset)) == sorted(expected)
    assert dataset.state_dict()["cursors"][0].get("cold") is not True, "read as recorded: indexed"


def test_resume_mid_cold_epoch_on_another_world_size_reads_every_sample_once(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=180, per_shard=9)
    batch, steps, workers = 4, 4, 2
    consumed: list[str] = []
    state: dict[str, Any] = {}
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        dataset = CachedIterableDataset(str(origin), config=settings, seed=9, batch_size=batch)
        loader = iter(DataLoader(dataset, batch_size=None, num_workers=workers))
        for _ in range(steps):
            consumed.extend(next(loader)["__key__"])
        state = dataset.state_dict(samples_consumed=steps * batch)
        del loader
    assert state["cursors"][0]["cold"] is True
    resumed: list[str] = []
    for rank in range(3):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "3")
        dataset = CachedIterableDataset(str(origin), config=settings, seed=9, batch_size=batch)
        dataset.load_state_dict(state)
        resumed.extend(keys_of(DataLoader(dataset, batch_size=None, num_workers=1)))
    counts = Counter(consumed + resumed)
    assert set(counts) == set(expected), "a sample was skipped"
    assert sum(n - 1 for n in counts.values()) < 2 + 3, "only padding repeats"


_NODE_SCRIPT = """
import json, sys
from datacache.loaders import CachedIterableDataset
dataset = CachedIterableDataset(sys.argv[1], seed=5, batch_size=4)
print(json.dumps([key for batch in dataset for key in batch["__key__"]]))
"""


def test_a_cold_epoch_on_two_nodes_reads_each_shard_once_from_the_origin(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str]
) -> None:
    expected = upload(s3, tmp_path, samples=240, per_shard=6)  # 40 un-indexed shards
    s3.server.reset_counts()
    nodes = []
    for node in range(2):
        env = {
            **cache_env,
            **s3.server.env(),
            "DATACACHE_LOCAL_DIR": str(tmp_path / f"node-{node}"),
            "DATACACHE_SHARED_DIR": str(tmp_path / "shared"),
            "DATACACHE_CONCURRENCY": "2",
            "RANK": str(node),
            "WORLD_SIZE": "2",
        }
        command = [sys.executable, "-c", _NODE_SCRIPT, s3.url("ds")]
        nodes.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [node.communicate(timeout=240) for node in nodes]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr
    seen = [key for stdout, _ in outputs for key in json.loads(stdout)]
    assert sorted(seen) == sorted(expected), "each sample once across the two nodes"
    head = f"GET /{s3.name}/ds/"
    gets = {k: v for k, v in s3.server.request_counts().items() if k.startswith(head) and k.endswith(".tar")}
    assert len(gets) == 40
    twice = {k: v for k, v in gets.items() if v > 1}
    assert not twice, f"shards the origin served more than once in the cluster: {twice}"


def test_a_cold_epoch_tells_the_stager_where_its_readers_are_in_the_node_future(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    origin = tmp_path / "origin"
    write_wds(origin, samples=120, per_shard=6)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    dataset = CachedIterableDataset(str(origin), config=settings, seed=3, batch_size=4)
    iterator = iter(dataset)
    next(iterator)
    assert isinstance(iterator._plan, ColdPositions), "the first epoch is cold"

    async def readers() -> list[ReaderRow]:
        async with Stager(settings, reconcile=False) as stager:
            handle = await stager.open(str(origin))
            return await stager.catalog.readers(handle.id)

    rows = asyncio.run(readers())
    assert [(row.reader, row.epoch) for row in rows] == [("1.0", 0)], "progress in the node's future, by reader name"
    del iterator
    dataset.close()


def test_a_resumed_cold_epoch_hands_the_stager_the_whole_node_future(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    origin = tmp_path / "origin"
    write_wds(origin, samples=120, per_shard=6)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    first = CachedIterableDataset(str(origin), config=settings, seed=3, batch_size=4)
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    state = first.state_dict()
    assert state["cursors"][0]["cold"] is True
    del iterator
    first.close()

    # Resumed on another world size: every reader still computes the same node future (what the
    # cold epoch left, dealt to the new layout), so progress is noted by reader name, not dropped.
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    resumed = CachedIterableDataset(str(origin), config=settings, seed=3, batch_size=4)
    resumed.load_state_dict(state)
    iterator = iter(resumed)
    next(iterator)

    async def readers() -> list[ReaderRow]:
        async with Stager(settings, reconcile=False) as stager:
            handle = await stager.open(str(origin))
            return await stager.catalog.readers(handle.id)

    names = {row.reader for row in asyncio.run(readers())}
    assert "2.0" in names, f"the resumed reader's progress in the node future: {names}"
    del iterator
    resumed.close()
