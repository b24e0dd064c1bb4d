"""The drop-in form, ``DataLoader(CachedIterableDataset(url), batch_size=B, num_workers=N)``.

Raw fields leave the workers through each worker's reused shared-memory ring
(`datacache.loaders.sharedbytes`) instead of being pickled through its pipe;
the training loop must still get exactly what a plain DataLoader gives: plain
``bytes`` of its own, in the same batches and order, with any ``collate_fn``.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import pickle
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import torch
import webdataset as wds
from _daemon import start_daemon
from datacache.loaders import CachedIterableDataset, sharedbytes
from datacache.loaders import DataLoader as DatacacheLoader
from datacache.loaders.dataloader import in_process_reason
from datacache.loaders.sharedbytes import RingBytes, SampleRing
from datacache.loaders.stats import Counter
from torch.utils.data import DataLoader, default_collate

from datacache.config import Settings, load_settings

Expected = dict[str, dict[str, bytes]]


def big_payload(index: int) -> bytes:
    """5-40 KB, distinct per sample: above `SMALL_FIELD`, so it travels through the ring."""
    seed = hashlib.sha256(str(index).encode()).digest()
    return (seed * 1300)[: 5000 + (index * 7919) % 35000]


@pytest.fixture
def big_dataset(tmp_path: Path) -> tuple[Path, Expected]:
    origin = tmp_path / "origin"
    origin.mkdir()
    expected: Expected = {}
    with wds.ShardWriter(str(origin / "train-%04d.tar"), maxcount=25, verbose=0) as writer:
        for i in range(150):
            fields = {"bin": big_payload(i), "cls": str(i % 10).encode()}
            writer.write({"__key__": f"s{i:05d}", **fields})
            expected[f"s{i:05d}"] = fields
    return origin, expected


def collect(loader: Any) -> list[Any]:
    return list(loader)


def check_batches(batches: list[dict[str, Any]], expected: Expected) -> None:
    seen: set[str] = set()
    for batch in batches:
        assert set(batch) == {"__key__", "__url__", "bin", "cls"}
        assert all(type(v) is list for v in batch.values())
        for index, key in enumerate(batch["__key__"]):
            assert key not in seen, f"{key} delivered twice"
            seen.add(key)
            for name in ("bin", "cls"):
                value = batch[name][index]
                assert type(value) is bytes, f"{name} of {key} is a {type(value).__name__}, not bytes"
                assert value == expected[key][name]
    assert seen == set(expected)


def test_dropin_batches_are_plain_dataloader_batches_through_shared_memory(
    big_dataset: tuple[Path, Expected], settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    origin, expected = big_dataset
    sharedbytes._HELD.clear()
    dataset = CachedIterableDataset(str(origin), config=settings, seed=7)
    through_ring = collect(DataLoader(dataset, batch_size=8, num_workers=2))
    check_batches(through_ring, expected)
    assert sharedbytes._HELD, "the workers' fields must arrive through their shared-memory rings"

    # The same loader with every field pickled through the pipe, as before the rings:
    # the same batches, in the same order.
    sharedbytes._HELD.clear()
    monkeypatch.setattr(sharedbytes, "SMALL_FIELD", 1 << 40)
    through_pipe = collect(DataLoader(dataset, batch_size=8, num_workers=2))
    assert not sharedbytes._HELD
    assert through_pipe == through_ring


def test_spawned_workers_send_fields_through_their_rings(
    big_dataset: tuple[Path, Expected], settings: Settings
) -> None:
    origin, expected = big_dataset
    sharedbytes._HELD.clear()
    dataset = CachedIterableDataset(str(origin), config=settings, seed=2)
    check_batches(collect(DataLoader(dataset, batch_size=8, num_workers=2, multiprocessing_context="spawn")), expected)
    assert sharedbytes._HELD, "spawned workers must send fields through their rings too"


def test_fields_stay_valid_while_rings_wrap_round_across_epochs(
    big_dataset: tuple[Path, Expected], settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A ring far smaller than an epoch, so it is rewritten many times while batches are held.
    monkeypatch.setattr(sharedbytes, "FIRST_RING_BYTES", 96 << 10)
    monkeypatch.setattr(sharedbytes, "MAX_RING_BYTES", 256 << 10)
    origin, expected = big_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, seed=3)
    loader = DataLoader(dataset, batch_size=4, num_workers=2, persistent_workers=True, pin_memory=False)
    held = []
    for epoch in range(2):
        dataset.set_epoch(epoch)
        batches = collect(loader)
        check_batches(batches, expected)
        held.append(batches)
    for batches in held:  # every batch of both epochs, after all the rewriting
        check_batches(batches, expected)


def test_custom_collate_fn_runs_in_the_worker_on_bytes(big_dataset: tuple[Path, Expected], settings: Settings) -> None:
    def collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
        for sample in samples:
            if not isinstance(sample["bin"], bytes):
                raise TypeError(f"bin is a {type(sample['bin']).__name__}")
        heads = torch.stack([torch.frombuffer(bytearray(s["bin"][:16]), dtype=torch.uint8) for s in samples])
        return {"keys": [s["__key__"] for s in samples], "heads": heads, "bin": [s["bin"] for s in samples]}

    origin, expected = big_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, seed=1)
    seen = set()
    for batch in DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=collate):
        assert batch["heads"].shape == (len(batch["keys"]), 16)
        for key, head, value in zip(batch["keys"], batch["heads"], batch["bin"]):
            assert type(value) is bytes and value == expected[key]["bin"]
            assert bytes(head.tolist()) == expected[key]["bin"][:16]
            seen.add(key)
    assert seen == set(expected)


def test_resume_with_workers_is_exact_through_the_rings(big_dataset: tuple[Path, Expected], settings: Settings) -> None:
    origin, expected = big_dataset
    batch_size, steps = 8, 5
    dataset = CachedIterableDataset(str(origin), config=settings, seed=17)
    iterator = iter(DataLoader(dataset, batch_size=batch_size, num_workers=2))
    head = [next(iterator) for _ in range(steps)]
    del iterator
    state = dataset.state_dict(samples_consumed=steps * batch_size, batch_size=batch_size)
    resumed = CachedIterableDataset(str(origin), config=settings, seed=17)
    resumed.load_state_dict(state)
    tail = collect(DataLoader(resumed, batch_size=batch_size, num_workers=2))
    check_batches(head + tail, expected)


# -- datacache.loaders.DataLoader: torch's, reading raw samples in the training process ----------

MORE_WORKERS = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@MORE_WORKERS
@pytest.mark.parametrize(("batch_size", "num_workers", "drop_last"), [(8, 2, False), (7, 3, True), (64, 2, False)])
def test_datacache_dataloader_yields_exactly_what_torchs_yields(
    big_dataset: tuple[Path, Expected], settings: Settings, batch_size: int, num_workers: int, drop_last: bool
) -> None:
    origin, expected = big_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, seed=5)
    ours = DatacacheLoader(dataset, batch_size=batch_size, num_workers=num_workers, drop_last=drop_last)
    assert in_process_reason(ours) is None
    plain = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, drop_last=drop_last)
    for epoch in (0, 1):
        dataset.set_epoch(epoch)
        got = []
        for batch in ours:
            assert not multiprocessing.active_children(), "read in the training process: no worker started"
            got.append(batch)
        want = collect(plain)
        # The same batches: samples, grouping per worker, the workers' turns, types.
        assert got == want
        assert [{k: [type(v) for v in vs] for k, vs in b.items()} for b in got] == [
            {k: [type(v) for v in vs] for k, vs in b.items()} for b in want
        ]
        if not drop_last:
            check_batches(got, expected)


def test_datacache_dataloader_falls_back_to_workers_where_they_may_be_needed(
    big_dataset: tuple[Path, Expected], settings: Settings
) -> None:
    origin, _ = big_dataset

    def collate(samples: list[dict[str, Any]]) -> list[str]:
        return [s["__key__"] for s in samples]

    dataset = CachedIterableDataset(str(origin), config=settings, seed=5)
    custom = DatacacheLoader(dataset, batch_size=8, num_workers=2, collate_fn=collate)
    assert in_process_reason(custom) == "a collate_fn"
    assert collect(custom) == collect(DataLoader(dataset, batch_size=8, num_workers=2, collate_fn=collate))
    decoded = CachedIterableDataset(str(origin), config=settings, seed=5, decode="basic")
    assert in_process_reason(DatacacheLoader(decoded, batch_size=8, num_workers=2)) == "a decoder or transform"
    batched = CachedIterableDataset(str(origin), config=settings, seed=5, batch_size=8)
    assert in_process_reason(DatacacheLoader(batched, batch_size=None, num_workers=2)) == "batch_size=None"


def test_datacache_dataloader_resumes_exactly_once(big_dataset: tuple[Path, Expected], settings: Settings) -> None:
    origin, expected = big_dataset
    batch_size, steps = 8, 5
    dataset = CachedIterableDataset(str(origin), config=settings, seed=17)
    iterator = iter(DatacacheLoader(dataset, batch_size=batch_size, num_workers=2))
    head = [next(iterator) for _ in range(steps)]
    del iterator
    state = dataset.state_dict(samples_consumed=steps * batch_size, batch_size=batch_size)
    resumed = CachedIterableDataset(str(origin), config=settings, seed=17)
    resumed.load_state_dict(state)
    tail = collect(DatacacheLoader(resumed, batch_size=batch_size, num_workers=2))
    check_batches(head + tail, expected)
    # And the same state resumes torch's DataLoader, with worker processes, on the same samples.
    again = CachedIterableDataset(str(origin), config=settings, seed=17)
    again.load_state_dict(state)
    assert collect(DataLoader(again, batch_size=batch_size, num_workers=2)) == tail


@MORE_WORKERS
def test_the_datacache_dataloader_opens_each_shard_once_however_many_workers_it_reads_as(
    big_dataset: tuple[Path, Expected], settings: Settings
) -> None:
    # In one process, N workers' readers share what is open: each shard is mapped,
    # verified and indexed once, not once per worker that reads from it. (Each reader counts
    # a shard it took open from another as its own hit, as a worker process would: TAKEN.)
    origin, expected = big_dataset
    shards = len(list(origin.glob("*.tar")))
    dataset = CachedIterableDataset(str(origin), config=settings, seed=6, shuffle_buffer=10)
    for epoch, workers in enumerate((1, 3)):
        dataset.set_epoch(epoch)
        check_batches(collect(DatacacheLoader(dataset, batch_size=4, num_workers=workers)), expected)
    rows = dataset._table.table.numpy()[:3]
    counted = rows[:, [Counter.UNITS_LOCAL, Counter.UNITS_SHARED, Counter.UNITS_ORIGIN]].sum()
    opened = counted - rows[:, Counter.TAKEN].sum()
    assert opened == shards, f"{opened} shard opens for {shards} shards read as 3 workers"


def test_the_datacache_dataloader_builds_batches_while_the_training_step_runs(
    big_dataset: tuple[Path, Expected], settings: Settings
) -> None:
    # Built in the training loop's thread, reading would add to every step; torch's workers
    # build the next batches while the step runs, and so must this.
    origin, expected = big_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, seed=4)
    loader = DatacacheLoader(dataset, batch_size=4, num_workers=2, prefetch_factor=2)
    iterator = iter(loader)
    batches = [next(iterator)]
    ahead = iterator._queue  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while ahead.qsize() < 4:  # prefetch_factor x num_workers batches, built while this "step" runs
        assert time.monotonic() < deadline, f"only {ahead.qsize()} batches built ahead of the step"
        time.sleep(0.01)  # sleep-ok: polling the read-ahead queue, with a deadline
    batches.extend(iterator)
    check_batches(batches, expected)


def test_batches_from_the_datacache_dataloader_stay_valid_while_held(
    big_dataset: tuple[Path, Expected], settings: Settings
) -> None:
    origin, expected = big_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, seed=9)
    loader = DatacacheLoader(dataset, batch_size=4, num_workers=2)
    held = []
    for epoch in range(3):  # each epoch's shards are unmapped when it ends
        dataset.set_epoch(epoch)
        held.append(collect(loader))
    for batches in held:
        check_batches(batches, expected)


# -- the ring itself ------------------------------------------------------------------------------


def fields(ring: SampleRing, sizes: list[int], start: int = 0) -> list[bytes]:
    values = []
    for i, size in enumerate(sizes):
        raw = bytes([(start + i) % 251]) * size
        values.append(ring.wrap(memoryview(raw)))
    return values


def test_a_collated_batch_pickles_as_places_not_bytes() -> None:
    ring = SampleRing()
    values = fields(ring, [50_000] * 64)
    assert all(isinstance(v, RingBytes) for v in values)
    batch = default_collate([{"bin": v, "__key__": str(i)} for i, v in enumerate(values)])
    message = ForkingPickler.dumps(batch)
    assert len(message) < 64 * 200, f"{len(message)} bytes pickled for 64 fields of 50 KB"
    back = pickle.loads(message)
    assert all(type(v) is bytes for v in back["bin"]) and back["bin"] == values


def test_ring_never_overwrites_what_its_reader_has_not_read() -> None:
    ring = SampleRing(first_bytes=64 << 10, max_bytes=1 << 20)
    sent = []
    values = fields(ring, [10_000] * 40)
    for value in values:  # none read yet: the ring grows instead of overwriting
        sent.append(ForkingPickler.dumps(value))
    assert [pickle.loads(m) for m in sent] == values
    for round_ in range(5):  # read as sent: the ring wraps round in place
        more = fields(ring, [9_000 + 1_000 * round_] * 30, start=round_)
        assert [pickle.loads(ForkingPickler.dumps(v)) for v in more] == more


def test_fields_that_do_not_fit_or_are_small_are_pickled_inline() -> None:
    ring = SampleRing(first_bytes=64 << 10, max_bytes=128 << 10)
    large, small = fields(ring, [100_000, 100])
    assert type(small) is bytes
    message = ForkingPickler.dumps(large)
    assert len(message) > 100_000 and pickle.loads(message) == large
    assert type(pickle.loads(pickle.dumps(large))) is bytes, "plain pickle gives plain bytes"


def test_a_weakly_ordered_cpu_pickles_every_field_through_the_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    # Python has no memory fence: on ARM the reader's "read up to here" store could be seen
    # before its copy finished, so there the ring must not be used at all.
    ring = SampleRing(first_bytes=1 << 20, max_bytes=4 << 20)
    (large,) = fields(ring, [100_000])
    assert len(ForkingPickler.dumps(large)) < 10_000, "on x86 the field goes through the ring"
    monkeypatch.setattr(sharedbytes, "STORE_ORDERED", False)
    message = ForkingPickler.dumps(large)
    assert len(message) > 100_000 and pickle.loads(message) == large


def test_datacache_dataloader_through_the_daemon(tmp_path: Path, cache_env: dict[str, str]) -> None:
    origin = tmp_path / "origin"
    origin.mkdir()
    with wds.ShardWriter(str(origin / "train-%04d.tar"), maxcount=10, verbose=0) as writer:
        for i in range(45):
            writer.write({"__key__": f"s{i:05d}", "bin": big_payload(i), "cls": str(i % 10).encode()})
    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        settings = load_settings(daemon.env)
        dataset = CachedIterableDataset(str(origin), config=settings, seed=8)
        ours = collect(DatacacheLoader(dataset, batch_size=4, num_workers=2))
        assert dataset.stats().mode == "daemon"
        assert ours == collect(DataLoader(dataset, batch_size=4, num_workers=2))
    finally:
        daemon.stop()
