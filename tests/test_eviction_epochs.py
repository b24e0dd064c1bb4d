"""Belady across an epoch's end: leases end at a shard's last use, and the next epoch is prefetched.

A reader of a dataset larger than its local tier opens each shard once per epoch.
Two things decide whether the next epoch starts from local copies (issue 13):
a shard's lease must end when its reader is done with it, not when the epoch
ends (else the tier stays full of finished shards), and prefetch must run past
the epoch's end into the next epoch's order, which every reader already knows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from datacache.loaders import CachedIterableDataset
from datacache.loaders.order.cold import rank_units
from datacache.loaders.order.layout import Dealing, Layout
from datacache.loaders.plans.positions import plan_epoch
from test_loader import write_wds

from datacache.catalog import Catalog, ReaderRow, ShardState
from datacache.config import Settings, load_settings
from datacache.eviction import Candidate
from datacache.staging import DatasetHandle, FutureOrder, Stager
from datacache.staging.residency import Residency

PER_SHARD, SHARDS, CAPACITY_SHARDS = 8, 12, 3


def _setup(tmp_path: Path) -> tuple[Path, Settings, list[str]]:
    origin = tmp_path / "origin"
    write_wds(origin, samples=PER_SHARD * SHARDS, per_shard=PER_SHARD, with_counts=True)
    keys = sorted(path.name for path in origin.glob("*.tar"))
    largest = max(path.stat().st_size for path in origin.glob("*.tar"))
    settings = load_settings(
        {},
        overrides={
            "local_dir": str(tmp_path / "local"),
            "shared_dir": str(tmp_path / "shared"),
            "local_capacity": CAPACITY_SHARDS * largest,
            "default_policy": "auto",
        },
    )
    return origin, settings, keys


def _units(seed: int, epoch: int) -> tuple[int, ...]:
    """The one reader's shards in order (a window of one shard: read one shard after another)."""
    plan = plan_epoch(
        [PER_SHARD] * SHARDS,
        dealing=Dealing(seed, True, False),
        epoch=epoch,
        window=PER_SHARD,
        cursors=(),
        layout=Layout(1, 0, 1, 0, 1),
    )
    return plan.unit_sequence


def _dataset(origin: Path, settings: Settings, seed: int) -> CachedIterableDataset:
    return CachedIterableDataset(str(origin), config=settings, seed=seed, shuffle_buffer=PER_SHARD)


def _shard_of(sample: dict[str, object]) -> int:
    return int(str(sample["__key__"]).removeprefix("sample")) // PER_SHARD


def _state(settings: Settings) -> tuple[set[str], set[str]]:
    """Keys resident on the local tier, and keys leased by a live reader."""

    async def look() -> tuple[set[str], set[str]]:
        catalog = Catalog(settings.local_dir / "catalog.sqlite")
        try:
            entries = await catalog.entries()
            leased = await catalog.leased()
        finally:
            await catalog.close()
        return {e.key for e in entries if e.state == ShardState.RESIDENT}, {key for _, key in leased}

    return asyncio.run(look())


def test_a_shards_lease_ends_at_its_last_use_not_at_the_epochs_end(tmp_path: Path) -> None:
    origin, settings, keys = _setup(tmp_path)
    units = _units(5, 0)
    dataset = _dataset(origin, settings, 5)
    samples: Iterator[dict[str, object]] = iter(dataset)
    # Read the first shard to its last sample: the reader closes it, and must say so.
    for _ in range(PER_SHARD):
        assert _shard_of(next(samples)) == units[0]
    # The note dropping its lease goes on a helper thread (the reader does not wait for it).
    deadline = time.monotonic() + 30
    while keys[units[0]] in (leased := _state(settings)[1]):
        assert time.monotonic() < deadline, f"{keys[units[0]]} still leased after its last use: {leased}"
        time.sleep(0.02)  # sleep-ok: polling the catalog for the helper thread's note, with a deadline
    # The next shard, opened on the next sample, is leased while read.
    assert _shard_of(next(samples)) == units[1]
    assert keys[units[1]] in _state(settings)[1]
    for _ in samples:
        pass


def test_the_next_epochs_first_shard_is_local_before_that_epoch_starts(tmp_path: Path) -> None:
    origin, settings, keys = _setup(tmp_path)
    # A seed whose next epoch starts with a shard read early in this one: only a prefetch
    # that looks past this epoch's end brings it back before the next epoch opens it.
    seed = next(s for s in range(100) if _units(s, 1)[0] in _units(s, 0)[: SHARDS // 2])
    dataset = _dataset(origin, settings, seed)
    dataset.set_epoch(0)
    read = [_shard_of(sample) for sample in dataset]
    assert read == [u for u in _units(seed, 0) for _ in range(PER_SHARD)]  # the plan the test reasons on
    first = keys[_units(seed, 1)[0]]
    deadline = time.monotonic() + 30
    while first not in _state(settings)[0]:
        assert time.monotonic() < deadline, f"{first} was not staged before epoch 1: {_state(settings)[0]}"
        time.sleep(0.05)  # sleep-ok: polling the catalog for a background transfer, with a deadline


def test_each_belady_choice_is_audited_with_every_shards_next_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    origin, settings, _ = _setup(tmp_path)

    async def opened() -> DatasetHandle:
        stager = Stager(settings, reconcile=False)
        try:
            return await stager.open(str(origin))
        finally:
            await stager.close()

    handle = asyncio.run(opened())
    residency = Residency()
    residency.set_future_order(handle.id, FutureOrder(0, {"0.0": ("a", "b", "c", "d")}))
    # The reader opens "a"; "b" comes in ahead of its read (a prefetch); "e" is never read.
    choose = residency.chooser(handle, [ReaderRow("0.0", 0, 0)])
    residents = [Candidate(handle.id, key, 10, 0.0) for key in ("e", "c", "d")]
    with caplog.at_level(logging.DEBUG, logger="datacache.staging.residency.audit"):
        victims = choose(Candidate(handle.id, "b", 10, 0.0), residents, 20)
        declined = choose(Candidate(handle.id, "d", 10, 0.0), [Candidate(handle.id, "c", 10, 0.0)], 10)
    assert [v.key for v in victims or []] == ["e", "d"]
    assert declined is None
    # This test's two choices: a stager another test left running in this process may audit its own meanwhile.
    audited = [json.loads(record.getMessage()) for record in caplog.records]
    made, refused = (line for line in audited if line["incoming"] in ("b", "d") and line["where"] == {"0.0": 0})
    assert made["incoming"] == "b" and made["incoming_next"] == 1
    assert made["victims"] == [["e", None], ["d", 3]]  # never read again first, then the farthest
    assert made["farthest"] is None and made["where"] == {"0.0": 0}
    assert refused["victims"] is None and refused["incoming_next"] == 3 and refused["farthest"] == 2


def test_a_cold_epoch_prefetches_the_next_epochs_first_shard_once_its_counts_are_known(tmp_path: Path) -> None:
    origin, settings, keys = _setup(tmp_path)
    for index in origin.glob("*.json"):
        index.unlink()  # no counts beside the shards: epoch 0 is dealt cold
    # A seed whose next epoch starts with a shard the cold epoch read early: evicted by its end,
    # it is back before epoch 1 only if the cold epoch's future grew by the next epoch's reads.
    seed = next(
        s
        for s in range(100)
        if _units(s, 1)[0]
        in rank_units(SHARDS, seed=s, epoch=0, shuffle=True, world_size=1, rank=0)[: SHARDS // 2].tolist()
    )
    dataset = _dataset(origin, settings, seed)
    dataset.set_epoch(0)
    read = [_shard_of(sample) for sample in dataset]
    assert sorted(read) == sorted(u for u in range(SHARDS) for _ in range(PER_SHARD)), "a cold epoch, exactly once"
    first = keys[_units(seed, 1)[0]]
    deadline = time.monotonic() + 30
    while first not in _state(settings)[0]:
        assert time.monotonic() < deadline, f"{first} was not staged before epoch 1: {_state(settings)[0]}"
        time.sleep(0.05)  # sleep-ok: polling the catalog for a background transfer, with a deadline


def test_a_warm_epoch_asks_the_stager_for_each_shard_about_once(tmp_path: Path) -> None:
    """Each ask for a local shard is a catalog read and write; a warm epoch must not repeat them.

    The next epoch's prefetch was asked again at every shard's release, for the same
    local shards: ~4x the catalog work of the epoch itself, ~20% of a warm batch-mode epoch.
    """
    origin, _, _ = _setup(tmp_path)
    roomy = load_settings({}, overrides={"local_dir": str(tmp_path / "roomy"), "default_policy": "auto"})
    # Batch mode in the training process: its reader threads open shards ahead, so the
    # next epoch's order is known (and prefetched) from early in the epoch.
    dataset = CachedIterableDataset(str(origin), config=roomy, seed=3, batch_size=4, shuffle_buffer=PER_SHARD)
    for epoch in (0, 1):  # the first stages every shard; after it all are local
        dataset.set_epoch(epoch)
        assert sum(len(batch["__key__"]) for batch in dataset) == PER_SHARD * SHARDS
    stager = dataset._runtime.access if dataset._runtime is not None else None
    assert isinstance(stager, Stager)
    before = stager.stats().hits["local"]
    dataset.set_epoch(2)
    assert sum(len(batch["__key__"]) for batch in dataset) == PER_SHARD * SHARDS
    asked = stager.stats().hits["local"] - before
    dataset.close()
    # Each shard opened once, and each asked for once more as the next epoch's prefetch.
    # The shards of the first shuffle window are asked for at its start too (a cold reader waits on
    # them: `UnitReaders` asks for those its first unit jumped over): at most once more each, so
    # under 3 per shard; asking again at each release, the bug this guards against, was ~5.
    assert asked <= 3 * SHARDS, f"{asked} local hits for {SHARDS} shards in one warm epoch"
