"""CachedIterableDataset: exactly once, deterministic, resumable, every format, bad data."""

from __future__ import annotations

import hashlib
import json
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import webdataset as wds
from datacache.loaders import CachedIterableDataset, PackedBytes, basic_decoders
from datacache.loaders.order.windows import epoch_order
from torch.utils.data import DataLoader
from webdataset.tariterators import group_by_keys, tar_file_iterator

from datacache.config import Settings
from datacache.errors import ConfigError, DatacacheError, ShardReadError
from datacache.manifest import MANIFEST_NAME


def payload(index: int) -> bytes:
    """Deterministic, distinct bytes for sample ``index`` (sizes vary)."""
    seed = hashlib.sha256(str(index).encode()).digest()
    return (seed * (1 + index % 23))[: 200 + (index * 37) % 900]


def write_wds(
    directory: Path, samples: int, per_shard: int, *, with_counts: bool = False
) -> dict[str, dict[str, bytes]]:
    """Shards written by webdataset's own ShardWriter; returns key -> fields.

    With ``with_counts``, also the manifest `datacache shard` writes (sizes and
    sample counts), so readers start without a counting pass.
    """
    directory.mkdir(parents=True, exist_ok=True)
    expected: dict[str, dict[str, bytes]] = {}
    with wds.ShardWriter(str(directory / "train-%04d.tar"), maxcount=per_shard, verbose=0) as writer:
        for i in range(samples):
            key = f"sample{i:06d}"
            fields = {"bin": payload(i), "cls": str(i % 10).encode()}
            writer.write({"__key__": key, **fields})
            expected[key] = fields
    if with_counts:
        shards = sorted(directory.glob("*.tar"))
        entries = [
            {"key": p.name, "size": p.stat().st_size, "samples": min(per_shard, samples - i * per_shard)}
            for i, p in enumerate(shards)
        ]
        document = {"format_version": 1, "dataset": "t", "url": "", "format": "tar", "shards": entries}
        (directory / MANIFEST_NAME).write_text(json.dumps(document))
    return expected


@pytest.fixture
def wds_dataset(tmp_path: Path) -> tuple[Path, dict[str, dict[str, bytes]]]:
    origin = tmp_path / "origin"
    return origin, write_wds(origin, samples=157, per_shard=20)


def keys_of(items: Any) -> list[str]:
    found: list[str] = []
    for item in items:
        found.extend(item["__key__"] if isinstance(item["__key__"], list) else [item["__key__"]])
    return found


def run_rank(
    dataset: CachedIterableDataset, monkeypatch: pytest.MonkeyPatch, rank: int, world: int, workers: int
) -> list[str]:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    loader = DataLoader(dataset, batch_size=4, num_workers=workers)
    return keys_of(loader)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("workers", [0, 1, 3])
def test_every_sample_exactly_once_for_any_world_and_workers(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]],
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    world: int,
    workers: int,
) -> None:
    origin, expected = wds_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, seed=5, shuffle_buffer=16, drop_last=True)
    per_rank = [run_rank(dataset, monkeypatch, rank, world, workers) for rank in range(world)]
    assert len({len(keys) for keys in per_rank}) == 1, "ranks must get equal counts"
    everything = [key for keys in per_rank for key in keys]
    assert len(everything) == len(set(everything)), "a sample was delivered twice"
    assert len(everything) == len(expected) // world * world
    assert set(everything) <= set(expected)


def test_padding_gives_equal_counts_and_is_reported(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    origin, expected = wds_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, seed=5, drop_last=False)
    per_rank = [run_rank(dataset, monkeypatch, rank, 4, 0) for rank in range(4)]
    assert {len(keys) for keys in per_rank} == {-(-len(expected) // 4)}
    everything = [key for keys in per_rank for key in keys]
    assert set(everything) == set(expected), "every sample at least once"
    repeats = sum(count - 1 for count in Counter(everything).values())
    assert repeats == 4 * -(-len(expected) // 4) - len(expected)
    padded = 0
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "4")
        list(iter(dataset))
        padded += dataset.stats().padded_samples
    assert padded == repeats


def test_global_order_depends_only_on_seed_and_epoch(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sample counts known up front (an un-indexed dataset's first epoch is dealt by whole shards,
    # per world size: tests/test_cold_epoch.py).
    origin = tmp_path / "indexed"
    write_wds(origin, samples=157, per_shard=20, with_counts=True)
    dataset = CachedIterableDataset(str(origin), config=settings, seed=11, shuffle_buffer=16, drop_last=True)
    single = run_rank(dataset, monkeypatch, 0, 1, 0)
    # Told the batch size, the dataset deals chunks to workers in the order the
    # DataLoader takes them back: the delivered order is the global order.
    batched = CachedIterableDataset(
        str(origin), config=settings, seed=11, shuffle_buffer=16, drop_last=True, batch_size=4
    )
    for workers in (0, 2, 3):
        again = keys_of(DataLoader(batched, batch_size=None, num_workers=workers))
        assert again == single, f"{workers} workers changed the order"
    position = {key: i for i, key in enumerate(single)}
    for world in (2, 3):
        for rank in range(world):
            stream = run_rank(dataset, monkeypatch, rank, world, 0)
            order = [position[key] for key in stream]
            assert order == sorted(order), "a rank's samples must follow the global order"
    dataset.set_epoch(1)
    assert run_rank(dataset, monkeypatch, 0, 1, 0) != single, "a new epoch must reshuffle"
    dataset.set_epoch(0)
    assert run_rank(dataset, monkeypatch, 0, 1, 0) == single
    other_seed = CachedIterableDataset(str(origin), config=settings, seed=12, shuffle_buffer=16, drop_last=True)
    assert run_rank(other_seed, monkeypatch, 0, 1, 0) != single


def test_samples_read_back_identically_to_webdataset(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings
) -> None:
    origin, _ = wds_dataset
    reference = {}
    for path in sorted(origin.glob("*.tar")):
        with path.open("rb") as stream:  # webdataset's own tar reader and grouping
            files = ({**f, "__url__": str(path)} for f in tar_file_iterator(stream))
            for sample in group_by_keys(files):
                reference[sample["__key__"]] = {k: v for k, v in sample.items() if not k.startswith("__")}
    dataset = CachedIterableDataset(str(origin), config=settings, shuffle=False)
    ours = {s["__key__"]: {k: v for k, v in s.items() if not k.startswith("__")} for s in dataset}
    assert ours == reference


def test_batch_mode_packs_fields_without_pickling_samples(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings
) -> None:
    origin, expected = wds_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, seed=3, batch_size=8)
    loader = DataLoader(dataset, batch_size=None, num_workers=2)
    seen: dict[str, bytes] = {}
    for batch in loader:
        assert isinstance(batch["bin"], PackedBytes)
        assert len(batch["bin"]) == len(batch["__key__"]) <= 8
        for key, value in zip(batch["__key__"], batch["bin"].tolist()):
            seen[key] = value
    assert seen == {key: fields["bin"] for key, fields in expected.items()}
    stats = dataset.stats()
    assert stats.samples == len(expected)
    assert stats.bytes == sum(len(f["bin"]) + len(f["cls"]) for f in expected.values())


def test_batches_from_reused_slots_and_persistent_workers_stay_exact(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings
) -> None:
    """Only a slot's first batch carries its shared memory; later ones name it (pid, ring, slot).

    Small batches make every slot of every worker's ring come round many times, and
    persistent workers start a new ring each epoch with the same slot numbers: a batch
    resolved against the wrong ring's memory would show up as wrong bytes.
    """
    from datacache.loaders import packing

    origin, expected = wds_dataset
    want = {key: fields["bin"] for key, fields in expected.items()}
    dataset = CachedIterableDataset(str(origin), config=settings, seed=5, batch_size=2)
    loader = DataLoader(dataset, batch_size=None, num_workers=2, persistent_workers=True)
    for _ in range(3):
        seen: dict[str, bytes] = {}
        batches = 0
        for batch in loader:
            batches += 1
            for key, value in zip(batch["__key__"], batch["bin"].tolist()):
                assert key not in seen
                seen[key] = value
        assert seen == want
        assert batches > 2 * 8, "every worker's ring slots must have come round"
    held_rings = {(pid, ring) for pid, ring, _ in packing._WORKER_SLOTS}
    assert 0 < len(held_rings) <= 2 * packing._RINGS_PER_WORKER, "old epochs' rings are let go"


def test_decoders_apply_per_field(wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings) -> None:
    origin, _ = wds_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, decode=basic_decoders(), shuffle=False)
    first = next(iter(dataset))
    assert first["__key__"] == "sample000000"
    assert first["cls"] == 0 and isinstance(first["bin"], bytes)
    whole = CachedIterableDataset(str(origin), config=settings, decode=lambda s: len(s["bin"]), shuffle=False)
    assert next(iter(whole)) == len(payload(0))


def test_resume_mid_epoch_without_workers_same_world(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    origin, _ = wds_dataset
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    reference = keys_of(CachedIterableDataset(str(origin), config=settings, seed=2, shuffle_buffer=16))
    first = CachedIterableDataset(str(origin), config=settings, seed=2, shuffle_buffer=16)
    iterator = iter(first)
    head = [next(iterator)["__key__"] for _ in range(50)]
    state = first.state_dict()
    assert set(state) >= {"epoch", "seed", "cursors"}
    assert len(pickle.dumps(state)) < 1000, "the resume state is a few integers"
    second = CachedIterableDataset(str(origin), config=settings, seed=2, shuffle_buffer=16)
    second.load_state_dict(state)
    tail = keys_of(second)
    assert head + tail == reference


@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 3), (4, 1), (3, 2)])
def test_resume_with_a_different_world_size_repeats_and_skips_nothing(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]],
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    before: int,
    after: int,
) -> None:
    origin, expected = wds_dataset
    batch, steps, workers = 4, 5, 2
    consumed: list[str] = []
    state: dict[str, Any] = {}
    for rank in range(before):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(before))
        dataset = CachedIterableDataset(str(origin), config=settings, seed=9, shuffle_buffer=16, batch_size=batch)
        loader = iter(DataLoader(dataset, batch_size=None, num_workers=workers))
        for _ in range(steps):
            consumed.extend(next(loader)["__key__"])
        state = dataset.state_dict(samples_consumed=steps * batch)
        del loader
    resumed: list[str] = []
    for rank in range(after):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(after))
        dataset = CachedIterableDataset(str(origin), config=settings, seed=9, shuffle_buffer=16, batch_size=batch)
        dataset.load_state_dict(state)
        resumed.extend(keys_of(DataLoader(dataset, batch_size=None, num_workers=1)))
    assert set(consumed + resumed) == set(expected), "a sample was skipped"
    assert not set(consumed) & set(resumed), "a sample consumed before the checkpoint came again"
    assert len(consumed) == len(set(consumed))
    # The final padding (drop_last=False) repeats exactly enough samples to even out the ranks.
    remaining = len(expected) - len(consumed)
    padding = after * -(-remaining // after) - remaining
    assert sum(count - 1 for count in Counter(resumed).values()) == padding


def test_resume_through_torchdata_stateful_dataloader(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings
) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    origin, expected = wds_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, seed=4, shuffle_buffer=16)
    loader = StatefulDataLoader(dataset, batch_size=5, num_workers=2)
    iterator = iter(loader)
    head = [key for _ in range(7) for key in next(iterator)["__key__"]]
    state = loader.state_dict()
    del iterator
    again = CachedIterableDataset(str(origin), config=settings, seed=4, shuffle_buffer=16)
    restored = StatefulDataLoader(again, batch_size=5, num_workers=2)
    restored.load_state_dict(state)
    tail = keys_of(restored)
    assert sorted(head + tail) == sorted(expected)

    # The same checkpoint resumes elastically through the dataset, on one process.
    elastic = CachedIterableDataset(str(origin), config=settings, seed=4, shuffle_buffer=16)
    elastic.load_state_dict(state)
    rest = keys_of(elastic)
    assert sorted(head + rest) == sorted(expected)


def test_state_dict_with_workers_asks_for_the_consumed_count(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings
) -> None:
    origin, _ = wds_dataset
    dataset = CachedIterableDataset(str(origin), config=settings)
    next(iter(DataLoader(dataset, batch_size=4, num_workers=2)))
    with pytest.raises(ConfigError, match="samples_consumed"):
        dataset.state_dict()


def test_a_state_from_another_snapshot_or_seed_is_refused(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings
) -> None:
    origin, _ = wds_dataset
    state = CachedIterableDataset(str(origin), config=settings, seed=1).state_dict()
    with pytest.raises(ConfigError, match="seed"):
        CachedIterableDataset(str(origin), config=settings, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="snapshot"):
        CachedIterableDataset(str(origin), config=settings, seed=1).load_state_dict({**state, "snapshot": "0" * 16})


def test_a_state_from_another_dataset_with_the_same_files_is_refused(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings, tmp_path: Path
) -> None:
    """A copy of the same shards elsewhere has the same snapshot (keys, sizes, mtimes): only its origin differs."""
    import shutil

    origin, _ = wds_dataset
    copy = tmp_path / "copy-of-wds"
    shutil.copytree(origin, copy)  # copy2: the same mtimes, so the same versions
    state = CachedIterableDataset(str(origin), config=settings, seed=1).state_dict()
    other = CachedIterableDataset(str(copy), config=settings, seed=1)
    assert other.state_dict()["snapshot"] == state["snapshot"]
    with pytest.raises(ConfigError, match="the saved state is for dataset"):
        other.load_state_dict(state)


def test_dataset_pickles_with_configuration_only(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings
) -> None:
    origin, _ = wds_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, seed=7)
    list(iter(dataset))
    clone = pickle.loads(pickle.dumps(dataset))
    assert clone._runtime is None
    assert keys_of(clone) == keys_of(dataset)


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_spawned_workers_read_everything(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings, context: str
) -> None:
    origin, expected = wds_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, seed=1)
    loader = DataLoader(dataset, batch_size=8, num_workers=2, multiprocessing_context=context)
    assert sorted(keys_of(loader)) == sorted(expected)


def test_cold_cache_from_s3(s3: Any, settings: Settings, tmp_path: Path) -> None:
    expected = write_wds(tmp_path / "upload", samples=60, per_shard=16)
    for path in sorted((tmp_path / "upload").glob("*.tar")):
        s3.put(f"wds/{path.name}", path.read_bytes())
    dataset = CachedIterableDataset(s3.url("wds"), config=settings, seed=3, batch_size=6)
    seen: dict[str, bytes] = {}
    for batch in DataLoader(dataset, batch_size=None, num_workers=2):
        seen.update(zip(batch["__key__"], batch["bin"].tolist()))
    assert seen == {k: v["bin"] for k, v in expected.items()}
    counts = s3.server.request_counts()
    # One origin read per shard per node: the two workers share one cache, and a shard one of
    # them is staging is waited for by the other, not read again.
    shards = [path.name for path in (tmp_path / "upload").glob("*.tar")]
    reads = {name: counts.get(f"GET /{s3.name}/wds/{name}", 0) for name in shards}
    assert reads == dict.fromkeys(reads, 1), f"GETs per shard: {reads}"
    # The cold epoch filled the cache: the next one reads every shard locally, from S3 nothing.
    # (How many of the cold epoch's own reads found their shard local depends on timing: with
    # early serving, a reader that opens a shard before its prefetch lands takes it from memory.)
    before = dict(s3.server.request_counts())
    warm = CachedIterableDataset(s3.url("wds"), config=settings, seed=3, batch_size=6)
    warm.set_epoch(1)
    again: dict[str, bytes] = {}
    for batch in DataLoader(warm, batch_size=None, num_workers=2):
        again.update(zip(batch["__key__"], batch["bin"].tolist()))
    assert again == seen
    assert warm.stats().hit_ratio["local"] == 1.0
    assert {k: v for k, v in s3.server.request_counts().items() if k.endswith(".tar") and before.get(k) != v} == {}


def test_parquet_rows_and_record_batches(tmp_path: Path, settings: Settings) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    origin = tmp_path / "parquet"
    origin.mkdir()
    rows = [{"id": i, "text": f"row {i}", "score": i / 3} for i in range(230)]
    for part in range(3):
        chunk = rows[part * 80 : (part + 1) * 80]
        pq.write_table(pa.Table.from_pylist(chunk), origin / f"part-{part}.parquet", row_group_size=25)
    dataset = CachedIterableDataset(str(origin), config=settings, seed=0, shuffle_buffer=50)
    got = list(dataset)
    assert all(row.pop("__key__").startswith("part-") for row in got)
    assert sorted(got, key=lambda r: r["id"]) == rows
    batches = CachedIterableDataset(str(origin), config=settings, batch_size=64)
    collected = [b for b in DataLoader(batches, batch_size=None, num_workers=2)]
    assert all(isinstance(b, pa.RecordBatch) for b in collected)
    assert sorted(i for b in collected for i in b.column("id").to_pylist()) == list(range(230))


def test_zarr_rows_along_the_first_axis(tmp_path: Path, settings: Settings) -> None:
    import zarr

    path = tmp_path / "array.zarr"
    data = np.arange(97 * 6, dtype=np.int32).reshape(97, 6)
    array = zarr.open_array(str(path), mode="w", shape=data.shape, chunks=(10, 3), dtype="i4")
    array[:] = data
    dataset = CachedIterableDataset(str(path), config=settings, seed=2, shuffle_buffer=20)
    samples = list(dataset)
    assert len(samples) == 97
    for sample in samples:
        np.testing.assert_array_equal(sample["data"], data[int(sample["__key__"])])
    batched = CachedIterableDataset(str(path), config=settings, batch_size=16, shuffle=False)
    first = next(iter(batched))
    assert isinstance(first["data"], torch.Tensor)
    np.testing.assert_array_equal(first["data"].numpy(), data[:16])


def test_plain_files_one_sample_each(tmp_path: Path, settings: Settings) -> None:
    origin = tmp_path / "files"
    (origin / "cats").mkdir(parents=True)
    (origin / "dogs").mkdir()
    expected = {}
    for i in range(12):
        folder = "cats" if i % 2 else "dogs"
        (origin / folder / f"{i:03d}.jpg").write_bytes(payload(i))
        expected[f"{folder}/{i:03d}"] = payload(i)
    dataset = CachedIterableDataset(str(origin), config=settings)
    assert {s["__key__"]: s["jpg"] for s in dataset} == expected


def test_truncated_tar_names_dataset_and_shard(tmp_path: Path, settings: Settings) -> None:
    origin = tmp_path / "bad"
    write_wds(origin, samples=40, per_shard=10)
    victim = origin / "train-0002.tar"
    victim.write_bytes(victim.read_bytes()[:3000])
    dataset = CachedIterableDataset(str(origin), config=settings)
    with pytest.raises(ShardReadError, match=r"train-0002\.tar") as failure:
        list(dataset)
    assert "dataset" in str(failure.value)


def test_corrupt_parquet_is_skipped_on_request(tmp_path: Path, settings: Settings) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    origin = tmp_path / "pq"
    origin.mkdir()
    for part in range(3):
        pq.write_table(pa.Table.from_pylist([{"i": part * 10 + j} for j in range(10)]), origin / f"p{part}.parquet")
    raw = bytearray((origin / "p1.parquet").read_bytes())
    raw[4:40] = b"\xff" * 36  # damage the first column chunk, keep the footer
    (origin / "p1.parquet").write_bytes(bytes(raw))
    with pytest.raises(ShardReadError, match=r"p1\.parquet"):
        list(CachedIterableDataset(str(origin), config=settings))
    skipping = CachedIterableDataset(str(origin), config=settings, on_error="skip")
    got = sorted(row["i"] for row in skipping)
    assert got == [*range(10), *range(20, 30)]
    stats = skipping.stats()
    assert stats.skipped_shards == 1 and stats.skipped_samples == 10


def test_a_bit_flipped_in_the_cache_is_never_served(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings
) -> None:
    origin, expected = wds_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, shuffle=False)
    assert len(list(dataset)) == len(expected)
    cached = next((settings.local_dir / "data").rglob("train-0001.tar"))
    raw = bytearray(cached.read_bytes())
    raw[700] ^= 0x01
    cached.write_bytes(bytes(raw))
    fresh = CachedIterableDataset(str(origin), config=settings, shuffle=False)
    samples = {s["__key__"]: s["bin"] for s in fresh}
    assert samples == {k: v["bin"] for k, v in expected.items()}, "the corrupt copy was re-staged, not served"
    assert fresh.stats().corrupt_copies == 1


def test_a_shard_that_cannot_be_restaged_fails_with_its_name(tmp_path: Path, settings: Settings) -> None:
    origin = tmp_path / "o"
    write_wds(origin, samples=30, per_shard=10)
    list(CachedIterableDataset(str(origin), config=settings, shuffle=False))
    # Corrupt every cached copy, and change the origin under the manifest snapshot.
    for root in (settings.local_dir, settings.shared_dir):
        assert root is not None
        for copy in (root / "data").rglob("train-0000.tar"):
            raw = bytearray(copy.read_bytes())
            raw[600] ^= 0xFF
            copy.write_bytes(bytes(raw))
    (origin / "train-0000.tar").write_bytes(b"x" * 10)
    with pytest.raises(DatacacheError, match=r"train-0000\.tar"):
        list(CachedIterableDataset(str(origin), config=settings, shuffle=False))


def test_epoch_order_is_a_permutation() -> None:
    counts = [5, 0, 17, 3]
    order = epoch_order(counts, seed=1, epoch=0, shuffle=True, window=4)
    assert sorted(order.tolist()) == list(range(25))
    assert epoch_order(counts, seed=1, epoch=0, shuffle=True, window=4).tolist() == order.tolist()


def test_an_unreachable_target_widens_prefetch_and_names_the_origin(
    tmp_path: Path, cache_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from datacache.loaders.reading import prefetch

    from datacache.config import load_settings

    monkeypatch.setattr(prefetch, "_INTERVAL", 0.1)
    origin = tmp_path / "slow"
    write_wds(origin, samples=60, per_shard=4, with_counts=True)
    throttled = load_settings(
        cache_env,
        overrides={"local_dir": str(tmp_path / "local"), "bandwidth_limit": "60kB/s", "concurrency": 1},
    )
    dataset = CachedIterableDataset(
        str(origin), config=throttled, target_bandwidth="1GB/s", shuffle=False, shuffle_buffer=8
    )
    with caplog.at_level("WARNING", logger="datacache.loaders.reading.prefetch"):
        count = sum(1 for _ in dataset)
    assert count == 60
    stats = dataset.stats()
    assert stats.meets_target is False
    assert stats.target_bandwidth == 1e9
    assert stats.limiting_stage == "origin"
    assert stats.hit_ratio["origin"] > 0.5
    assert stats.prefetch_depth > 4, "prefetch must widen when the target is missed"
    warnings = [r for r in caplog.records if "limiting stage is origin" in r.getMessage()]
    assert len(warnings) == 1, "one warning, not a flood"


def test_a_target_missed_because_the_training_loop_is_slow_names_the_loop_not_the_reader(
    tmp_path: Path, cache_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A trial's loop slept 0.1 s a batch, and the warning sent it after "the reader's own per-sample work (CPU)"."""
    import time

    from datacache.loaders.reading import prefetch

    from datacache.config import load_settings

    monkeypatch.setattr(prefetch, "_INTERVAL", 0.1)
    origin = tmp_path / "ds"
    write_wds(origin, samples=60, per_shard=4, with_counts=True)
    settings = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "local")})
    dataset = CachedIterableDataset(str(origin), config=settings, target_bandwidth="1GB/s", shuffle=False)
    assert sum(1 for _ in dataset) == 60  # staged: the epoch below reads local copies
    with caplog.at_level("WARNING", logger="datacache.loaders.reading.prefetch"):
        for _ in dataset:
            time.sleep(0.02)  # sleep-ok: the training step's own work, not a wait for anything
    said = [r.getMessage() for r in caplog.records if "limiting stage" in r.getMessage()]
    assert said and all("the training loop" in line for line in said), said
    assert dataset.stats().limiting_stage == prefetch.TRAINING_LOOP


def test_tar_indexes_are_scanned_once_per_node(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings
) -> None:
    origin, expected = wds_dataset
    first = CachedIterableDataset(str(origin), config=settings, shuffle=False)
    assert len(list(first)) == len(expected)
    saved = sorted((settings.local_dir / "indexes" / "spans").rglob("*.spans"))
    assert len(saved) == len(list(origin.glob("*.tar"))), "one saved index per shard"
    # A new process (here: a fresh dataset) reads the saved indexes; a wrong one would be caught
    # by the sample-count check, so damage one and see it rejected, then rescanned.
    saved[0].write_bytes(saved[0].read_bytes()[:-8])
    second = CachedIterableDataset(str(origin), config=settings, shuffle=False)
    assert {s["__key__"]: s["bin"] for s in second} == {k: v["bin"] for k, v in expected.items()}


def test_readme_resume_recipe_with_worker_processes_is_exact(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings
) -> None:
    # The README's recipe: per-sample mode, the DataLoader batches, two workers. The DataLoader
    # takes whole batches from worker 0, 1, 0, ...: after 5 batches worker 0 made 3, worker 1 made 2.
    origin, expected = wds_dataset
    batch_size, steps = 8, 5
    dataset = CachedIterableDataset(str(origin), config=settings, seed=17)
    iterator = iter(DataLoader(dataset, batch_size=batch_size, num_workers=2))
    head = [key for _ in range(steps) for key in next(iterator)["__key__"]]
    del iterator
    with pytest.raises(ConfigError, match=r"batch_size="):
        dataset.state_dict(samples_consumed=steps * batch_size)
    state = dataset.state_dict(samples_consumed=steps * batch_size, batch_size=batch_size)
    resumed = CachedIterableDataset(str(origin), config=settings, seed=17)
    resumed.load_state_dict(state)
    tail = keys_of(DataLoader(resumed, batch_size=batch_size, num_workers=2))
    assert not set(head) & set(tail), "a sample consumed before the checkpoint came again"
    assert sorted(head + tail) == sorted(expected), "a sample was skipped or repeated"


@pytest.mark.parametrize("options", [{}, {"epoch_size": 120}], ids=["dataset", "mix"])
def test_state_dict_with_worker_processes_opens_nothing_in_the_training_process(
    wds_dataset: tuple[Path, dict[str, dict[str, bytes]]], settings: Settings, options: dict[str, Any]
) -> None:
    """It opened its own runtime there (the origin listed, or the daemon asked): 83-201 ms (issue 34 item 7).

    The workers publish what a state names of the dataset when they plan the epoch; the state made
    from it is the one the training process's own runtime gives, and it resumes exactly.
    """
    origin, expected = wds_dataset
    dataset = CachedIterableDataset(str(origin), config=settings, seed=17, **options)
    loader = DataLoader(dataset, batch_size=8, num_workers=2, persistent_workers=True)
    cold = [key for batch in loader for key in batch["__key__"]]  # epoch 0 counts the shards as it reads
    dataset.set_epoch(1)
    iterator = iter(loader)
    head = [key for _ in range(5) for key in next(iterator)["__key__"]]
    state = dataset.state_dict(samples_consumed=40, batch_size=8)
    assert dataset._runtime is None, "the training process opened the dataset to save a state"
    assert state["epoch"] == 1 and state["shuffle_buffer"] == 256 and "cold" not in state["cursors"][0]
    dataset.with_all_counts()  # now its own runtime answers
    assert dataset.state_dict(samples_consumed=40, batch_size=8) == state
    del iterator
    resumed = CachedIterableDataset(str(origin), config=settings, seed=17, **options)
    resumed.load_state_dict(state)
    tail = keys_of(DataLoader(resumed, batch_size=8, num_workers=2))
    assert len(head) + len(tail) == len(cold) and not set(head) & set(tail)
    if not options:
        assert sorted(head + tail) == sorted(expected)


def test_a_state_head_being_written_is_no_answer() -> None:
    from datacache.loaders.statehead import StateHeads

    heads = StateHeads()
    assert heads.read(0) is None
    heads.publish(1, {"epoch": 3, "dataset": "d"})
    assert heads.read(3) == {"epoch": 3, "dataset": "d"} and heads.read(2) is None
    heads.slots[1, 12] ^= 0xFF  # a byte changed under the reader, as a write under way would
    assert heads.read(3) is None
    heads.publish(1, {"epoch": 3, "x": "y" * 10_000})  # too large for a slot: none, not a truncated one
    assert heads.read(3) is None
