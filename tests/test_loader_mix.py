"""Several sources in one `CachedIterableDataset`: patterns, lists, weights, epoch size, resume (real files, moto)."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import webdataset as wds
from datacache.loaders import CachedIterableDataset, Source
from datacache.loaders.order.layout import Layout, reader_name
from datacache.loaders.plans.mixsources import mix_futures, mix_plan
from datacache.loaders.reading.mixed import SourcePlan
from torch.utils.data import DataLoader

from datacache.config import Settings
from datacache.errors import ConfigError, ShardNotFoundError, UnsupportedURLError

if TYPE_CHECKING:
    from conftest import S3Bucket

BATCH = 4


def write_source(directory: Path, name: str, samples: int, per_shard: int) -> list[str]:
    """Tar shards whose keys start with ``name`` (so sources are told apart); returns the keys."""
    directory.mkdir(parents=True, exist_ok=True)
    keys = []
    with wds.ShardWriter(str(directory / "shard-%04d.tar"), maxcount=per_shard, verbose=0) as writer:
        for i in range(samples):
            key = f"{name}{i:05d}"
            writer.write({"__key__": key, "bin": f"{key}:".encode() * (5 + i % 7), "cls": str(i % 3).encode()})
            keys.append(key)
    return keys


@pytest.fixture
def three(tmp_path: Path) -> dict[str, list[str]]:
    """Sources a and b of 200 samples and c of 20 (ten times smaller), under tmp_path."""
    return {
        "a": write_source(tmp_path / "a", "a", 200, 20),
        "b": write_source(tmp_path / "b", "b", 200, 25),
        "c": write_source(tmp_path / "c", "c", 20, 10),
    }


def mix(tmp_path: Path, settings: Settings, **options: Any) -> CachedIterableDataset:
    sources = [f"{tmp_path / name}/" for name in "abc"]
    options.setdefault("weights", [0.5, 0.3, 0.2])
    options.setdefault("epoch_size", 240)
    return CachedIterableDataset(sources, config=settings, seed=11, shuffle_buffer=16, **options)


def keys_of(loader: Any) -> list[str]:
    return [key for batch in loader for key in batch["__key__"]]


def source_counts(keys: list[str]) -> Counter[str]:
    return Counter(key[0] for key in keys)


def use_world(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))


def test_weights_set_each_sources_share_and_stats_report_it(
    three: dict[str, list[str]], tmp_path: Path, settings: Settings
) -> None:
    dataset = mix(tmp_path, settings)
    assert len(dataset) == 240
    keys = [sample["__key__"] for sample in dataset]
    assert source_counts(keys) == {"a": 120, "b": 72, "c": 48}
    # Without replacement: a and b give distinct samples; c (20 samples) cycles, each sample 2 or 3 times,
    # and no sample of it repeats before all 20 came.
    assert len(set(k for k in keys if k[0] != "c")) == 192
    c_stream = [k for k in keys if k[0] == "c"]
    assert len(set(c_stream[:20])) == 20 and len(set(c_stream[20:40])) == 20
    stats = dataset.stats()
    assert [(s.source, s.samples, round(s.share, 3)) for s in stats.sources] == [
        (f"{tmp_path / 'a'}/", 120, 0.5),
        (f"{tmp_path / 'b'}/", 72, 0.3),
        (f"{tmp_path / 'c'}/", 48, 0.2),
    ]
    assert sum(s.bytes for s in stats.sources) == stats.bytes > 0


def test_sources_and_repeat_choose_in_an_epoch(three: dict[str, list[str]], tmp_path: Path, settings: Settings) -> None:
    sources = [
        Source(f"{tmp_path / 'a'}/", repeat=0.5),
        Source(f"{tmp_path / 'b'}/"),
        Source(f"{tmp_path / 'c'}/", choose=50),
    ]
    dataset = CachedIterableDataset(sources, config=settings, seed=2, batch_size=8)
    keys = keys_of(DataLoader(dataset, batch_size=None, num_workers=2))
    found = Counter(keys)
    assert source_counts(keys) == {"a": 100, "b": 200, "c": 50}
    assert all(found[k] == 1 for k in three["a"] + three["b"] if k in found), "repeat<=1: each sample at most once"
    assert set(three["b"]) <= set(found)
    assert all(found[k] in (2, 3) for k in three["c"]), "choose=50 of 20 samples: every one 2 or 3 times"
    stats = dataset.stats()
    assert [s.samples for s in stats.sources] == [100, 200, 50]


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (2, 2), (3, 1)])
def test_the_mix_is_the_same_for_any_world_size_and_workers(
    three: dict[str, list[str]],
    tmp_path: Path,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    world: int,
    workers: int,
) -> None:
    use_world(monkeypatch, 0, 1)
    expected = Counter(sample["__key__"] for sample in mix(tmp_path, settings, drop_last=True))
    delivered: Counter[str] = Counter()
    for rank in range(world):
        use_world(monkeypatch, rank, world)
        dataset = mix(tmp_path, settings, drop_last=True)
        delivered.update(keys_of(DataLoader(dataset, batch_size=BATCH, num_workers=workers)))
    assert delivered == expected


def test_resume_a_mix_mid_epoch_on_1_then_2_then_3_ranks(
    three: dict[str, list[str]], tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_world(monkeypatch, 0, 1)
    expected = Counter(sample["__key__"] for sample in mix(tmp_path, settings))
    consumed: list[str] = []
    state: dict[str, Any] = {}
    for world, steps in ((1, 10), (2, 8)):
        saved = state
        for rank in range(world):
            use_world(monkeypatch, rank, world)
            dataset = mix(tmp_path, settings)
            if saved:
                dataset.load_state_dict(saved)
            loader = iter(DataLoader(dataset, batch_size=BATCH, num_workers=2))
            for _ in range(steps):
                consumed.extend(next(loader)["__key__"])
            state = dataset.state_dict(samples_consumed=steps * BATCH, batch_size=BATCH)
            del loader
    assert len(consumed) == 10 * BATCH + 2 * 8 * BATCH
    resumed: list[str] = []
    for rank in range(3):
        use_world(monkeypatch, rank, 3)
        dataset = mix(tmp_path, settings)
        dataset.load_state_dict(state)
        resumed.extend(keys_of(DataLoader(dataset, batch_size=BATCH, num_workers=2)))
    delivered = Counter(consumed + resumed)
    assert not expected - delivered, "a sample of the epoch was skipped"
    remaining = 240 - len(consumed)
    padding = 3 * -(-remaining // 3) - remaining  # drop_last=False evens out the last ranks
    assert sum((delivered - expected).values()) == padding


def test_a_saved_mix_refuses_other_weights(three: dict[str, list[str]], tmp_path: Path, settings: Settings) -> None:
    dataset = mix(tmp_path, settings)
    iterator = iter(dataset)
    next(iterator)
    state = dataset.state_dict()
    other = mix(tmp_path, settings, weights=[0.4, 0.4, 0.2])
    with pytest.raises(ConfigError, match="the saved state used mix="):
        other.load_state_dict(state)


def test_epoch_size_walks_one_permutation_across_epochs(
    three: dict[str, list[str]], tmp_path: Path, settings: Settings
) -> None:
    dataset = CachedIterableDataset(f"{tmp_path / 'a'}/", config=settings, seed=4, epoch_size=60)
    assert len(dataset) == 60
    epochs = []
    for epoch in range(5):
        dataset.set_epoch(epoch)
        epochs.append([sample["__key__"] for sample in dataset])
    assert all(len(keys) == 60 for keys in epochs)
    assert len(set(itertools.chain(*epochs[:3]))) == 180, "no sample repeats in the first 180"
    assert set(itertools.chain(*epochs[:4])) == set(three["a"]), "four epochs of 60 cover all 200"
    stream = list(itertools.chain(*epochs))
    assert sorted(stream[:200]) == sorted(three["a"]) and sorted(stream[200:300]) != sorted(stream[:100])


def test_the_reported_weighted_mix_repeats_no_sample_within_any_epoch(tmp_path: Path, settings: Settings) -> None:
    """Issue 34 item 4: weights 0.7/0.3, epoch_size=1000, sources of 1,200 and 300: epoch 1 had 59 repeats."""
    big = write_source(tmp_path / "big", "a", 1200, 100)
    small = write_source(tmp_path / "small", "b", 300, 100)
    sources = [f"{tmp_path / 'big'}/", f"{tmp_path / 'small'}/"]
    dataset = CachedIterableDataset(sources, weights=[0.7, 0.3], epoch_size=1000, config=settings, seed=5)
    epochs = []
    for epoch in range(4):
        dataset.set_epoch(epoch)
        keys = keys_of(DataLoader(dataset, batch_size=BATCH, num_workers=2 if epoch == 1 else 0))
        assert len(keys) == 1000 and len(set(keys)) == 1000, f"epoch {epoch}: {1000 - len(set(keys))} repeats"
        assert source_counts(keys) == {"a": 700, "b": 300} and set(small) <= set(keys)
        epochs.append(keys)
    for first in (0, 2):  # two epochs of 700 read all 1,200 of the big source, then a fresh pass begins
        assert {k for k in epochs[first] + epochs[first + 1] if k[0] == "a"} == set(big)


def test_replacement_draws_with_repeats(three: dict[str, list[str]], tmp_path: Path, settings: Settings) -> None:
    dataset = CachedIterableDataset(f"{tmp_path / 'a'}/", config=settings, seed=4, epoch_size=200, replacement=True)
    keys = [sample["__key__"] for sample in dataset]
    assert len(keys) == 200 and set(keys) <= set(three["a"])
    assert len(set(keys)) < 160, "200 draws of 200 with replacement leave about 37% out"


def test_resample_is_endless_and_has_no_len(three: dict[str, list[str]], tmp_path: Path, settings: Settings) -> None:
    dataset = CachedIterableDataset(f"{tmp_path / 'c'}/", config=settings, seed=4, resample=True)
    with pytest.raises(TypeError, match="resample=True is endless"):
        len(dataset)
    keys = [sample["__key__"] for sample in itertools.islice(dataset, 70)]
    assert len(keys) == 70
    for start in (0, 20, 40):
        assert sorted(keys[start : start + 20]) == sorted(three["c"]), "each pass covers the source once"


def test_a_brace_pattern_and_a_list_read_the_prefix_dataset_filtered(
    three: dict[str, list[str]], tmp_path: Path, settings: Settings
) -> None:
    prefix = CachedIterableDataset(f"{tmp_path / 'a'}/", config=settings)
    pattern = CachedIterableDataset(f"{tmp_path / 'a'}/shard-{{0001..0003}}.tar", config=settings)
    listed = CachedIterableDataset(
        [f"{tmp_path / 'a'}/shard-0001.tar", f"{tmp_path / 'a'}/shard-0003.tar"], config=settings
    )
    wanted = set(three["a"][20:80])
    assert set(sample["__key__"] for sample in pattern) == wanted and len(pattern) == 60
    assert set(sample["__key__"] for sample in listed) == set(three["a"][20:40] + three["a"][60:80])
    ids = {d._prepare().handle.id for d in (prefix, pattern, listed)}
    assert len(ids) == 1 and "{" not in ids.pop()


def test_a_pattern_naming_nothing_is_refused_by_name_when_the_dataset_is_made(
    three: dict[str, list[str]], tmp_path: Path, settings: Settings
) -> None:
    # At construction, not at the first iter(): in a DataLoader worker that error would come
    # wrapped in the worker's traceback, after the workers started.
    with pytest.raises(ShardNotFoundError, match=r"part-\{0\.\.3\}\.tar matches no shard of .*/a \(dataset") as caught:
        CachedIterableDataset(f"{tmp_path / 'a'}/part-{{0..3}}.tar", config=settings)
    assert "\n" not in str(caught.value)
    with pytest.raises(ShardNotFoundError, match=r"shard-\{0\.\.3\}\.tar matches no shard"):
        CachedIterableDataset(f"{tmp_path / 'none'}/shard-{{0..3}}.tar", config=settings)
    with pytest.raises(ShardNotFoundError, match="3 of its 5 shards are not in"):
        CachedIterableDataset(f"{tmp_path / 'a'}/shard-{{0008..0012}}.tar", config=settings)
    with pytest.raises(ShardNotFoundError, match=r"a glob \('\*', '\?', '\['\) is not a pattern here"):
        CachedIterableDataset(f"{tmp_path / 'a'}/part-*.tar", config=settings)
    with pytest.raises(ShardNotFoundError, match="matches no shard"):
        CachedIterableDataset([f"{tmp_path / 'a'}/shard-0001.tar", f"{tmp_path / 'b'}/part-9.tar"], config=settings)


def test_a_missing_path_or_an_uppercase_scheme_is_refused_when_the_dataset_is_made(
    three: dict[str, list[str]], tmp_path: Path, settings: Settings, s3: S3Bucket
) -> None:
    """A wrong path or `S3://` failed only at the first sample; cheap checks, no listing, at construction."""
    missing = tmp_path / "no-such-dir"
    with pytest.raises(ShardNotFoundError, match=f"^{missing}: no such file or directory") as caught:
        CachedIterableDataset(str(missing), config=settings)
    assert "\n" not in str(caught.value)
    with pytest.raises(ShardNotFoundError, match="no such file or directory"):
        CachedIterableDataset(f"file://{missing}/", config=settings)
    with pytest.raises(ShardNotFoundError, match="no such file or directory"):
        CachedIterableDataset([str(tmp_path / "a"), Source(str(missing), repeat=1)], config=settings)
    # The CLI's rule, the same words (tiers.check_scheme_case): `datacache warm S3://...` says this too.
    with pytest.raises(UnsupportedURLError, match=r"write the scheme in lower case \(s3://\)") as upper:
        CachedIterableDataset(s3.url("ds").replace("s3://", "S3://"), config=settings)
    assert "\n" not in str(upper.value)
    # A bucket prefix is not listed to be made (that waits for len() or iter()): no request at all.
    s3.server.reset_counts()
    CachedIterableDataset(s3.url("ds"), config=settings)
    assert s3.server.request_counts() == {}
    CachedIterableDataset(str(tmp_path / "a"), config=settings)  # an existing directory is fine


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"epoch_size": 0}, "epoch_size must be a positive integer"),
        ({"epoch_size": 2.5}, "epoch_size must be a positive integer"),
        ({"weights": [0.5, -0.5, 1.0]}, "weight must be a finite number >= 0"),
        ({"weights": [0.5, 0.5]}, "weights= has 2 values for 3 sources"),
    ],
)
def test_bad_mix_options_are_refused(tmp_path: Path, settings: Settings, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        mix(tmp_path, settings, **options)


def test_a_brace_pattern_on_s3_shares_the_prefix_cached_copy(s3: Any, settings: Settings, tmp_path: Path) -> None:
    keys = write_source(tmp_path / "upload", "s", 80, 20)
    for path in sorted((tmp_path / "upload").glob("*.tar")):
        s3.put(f"wds/{path.name}", path.read_bytes())
    pattern = CachedIterableDataset(s3.url("wds/shard-{0000..0001}.tar"), config=settings, seed=1)
    assert sorted(sample["__key__"] for sample in pattern) == keys[:40]
    pattern.close()  # finishes the copies still being made durable: both are on disk after it
    prefix = CachedIterableDataset(s3.url("wds") + "/", config=settings, seed=1)
    dataset_id = prefix._prepare().handle.id
    assert pattern._prepare().handle.id == dataset_id and "{" not in dataset_id
    staged = sorted(path.name for path in (settings.local_dir / "data" / dataset_id).iterdir())
    assert staged == ["shard-0000.tar", "shard-0001.tar"], "the pattern staged its two shards, under the prefix's id"
    s3.server.reset_counts()
    assert sorted(sample["__key__"] for sample in prefix) == keys
    assert prefix.stats().hit_ratio["local"] >= 0.5, "the prefix found the pattern's two shards cached"
    counts = s3.server.request_counts()
    gets = [counts.get(f"GET /{s3.name}/wds/shard-{i:04d}.tar", 0) for i in range(4)]
    assert gets[0] < gets[2] and gets[1] < gets[3], "a cached shard is not transferred again"


def test_a_mix_resumes_through_torchdata_stateful_dataloader(
    three: dict[str, list[str]], tmp_path: Path, settings: Settings
) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    expected = Counter(sample["__key__"] for sample in mix(tmp_path, settings))  # c's samples repeat
    loader = StatefulDataLoader(mix(tmp_path, settings), batch_size=5, num_workers=2)
    iterator = iter(loader)
    head = [key for _ in range(9) for key in next(iterator)["__key__"]]
    state = loader.state_dict()
    del iterator
    restored = StatefulDataLoader(mix(tmp_path, settings), batch_size=5, num_workers=2)
    restored.load_state_dict(state)
    assert Counter(head + keys_of(restored)) == expected
    elastic = mix(tmp_path, settings)  # the same checkpoint, resumed elastically in one process
    elastic.load_state_dict(state)
    assert Counter(head + [sample["__key__"] for sample in elastic]) == expected


def test_a_cold_mix_reads_each_shard_from_the_origin_once(s3: Any, settings: Settings, tmp_path: Path) -> None:
    for name, samples in (("x", 60), ("y", 20)):
        write_source(tmp_path / name, name, samples, 20)
        for path in sorted((tmp_path / name).glob("*.tar")):
            s3.put(f"{name}/{path.name}", path.read_bytes())
    dataset = CachedIterableDataset([s3.url("x") + "/", s3.url("y") + "/"], weights=[0.5, 0.5], config=settings)
    keys = keys_of(DataLoader(dataset, batch_size=BATCH, num_workers=2))
    assert source_counts(keys) == {"x": 40, "y": 40}
    counts = s3.server.request_counts()
    gets = {key: n for key, n in counts.items() if key.startswith(f"GET /{s3.name}/") and key.endswith(".tar")}
    assert len(gets) == 4 and set(gets.values()) == {1}, f"counting and reading share one GET per shard: {gets}"


def test_sources_of_two_formats_are_refused_by_name(
    three: dict[str, list[str]], tmp_path: Path, settings: Settings
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "table").mkdir()
    pq.write_table(pa.Table.from_pylist([{"i": i} for i in range(10)]), tmp_path / "table" / "part-0.parquet")
    dataset = CachedIterableDataset([f"{tmp_path / 'a'}/", f"{tmp_path / 'table'}/"], config=settings)
    with pytest.raises(ConfigError, match=r"must have one format; found .*a/: tar, .*table/: parquet"):
        next(iter(dataset))


def test_an_endless_stream_resumes_in_process_and_refuses_with_workers(
    three: dict[str, list[str]], tmp_path: Path, settings: Settings
) -> None:
    def stream() -> CachedIterableDataset:
        return CachedIterableDataset(f"{tmp_path / 'c'}/", config=settings, seed=6, resample=True)

    whole = [sample["__key__"] for sample in itertools.islice(stream(), 90)]
    first = stream()
    head = [sample["__key__"] for sample in itertools.islice(first, 50)]  # into the third pass (epoch 2)
    state = first.state_dict()
    assert state["epoch"] == 2
    again = stream()
    again.load_state_dict(state)
    assert head + [sample["__key__"] for sample in itertools.islice(again, 40)] == whole
    with_workers = stream()
    loader = iter(DataLoader(with_workers, batch_size=BATCH, num_workers=2))
    next(loader)
    with pytest.raises(ConfigError, match="resumed only when read without DataLoader worker processes"):
        with_workers.state_dict(samples_consumed=BATCH, batch_size=BATCH)


def test_a_pattern_and_a_mix_read_through_the_daemon(
    three: dict[str, list[str]], tmp_path: Path, cache_env: dict[str, str]
) -> None:
    from _daemon import start_daemon

    from datacache.config import load_settings

    daemon = start_daemon(cache_env, tmp_path / "local")
    try:
        settings = load_settings(daemon.env)
        pattern = CachedIterableDataset(f"{tmp_path / 'a'}/shard-{{0001..0002}}.tar", config=settings)
        assert sorted(sample["__key__"] for sample in pattern) == three["a"][20:60]
        assert pattern.stats().mode == "daemon"
        mixed = CachedIterableDataset(
            [f"{tmp_path / 'b'}/", f"{tmp_path / 'c'}/shard-0000.tar"], weights=[0.5, 0.5], config=settings
        )
        assert source_counts([sample["__key__"] for sample in mixed]) == {"b": 105, "c": 105}
        assert mixed.stats().mode == "daemon"
    finally:
        daemon.kill()


def test_a_url_naming_one_shard_is_still_that_object(
    three: dict[str, list[str]], tmp_path: Path, settings: Settings
) -> None:
    one = CachedIterableDataset(f"{tmp_path / 'a'}/shard-0001.tar", config=settings)
    prefix = CachedIterableDataset(f"{tmp_path / 'a'}/", config=settings)
    assert sorted(sample["__key__"] for sample in one) == three["a"][20:40]
    assert one._prepare().handle.id != prefix._prepare().handle.id  # a dataset of one object, as before


def test_each_sources_node_future_is_every_readers_units_of_it(
    three: dict[str, list[str]], tmp_path: Path, settings: Settings
) -> None:
    """Eviction and prefetch see, per source, every reader's shards of it: this epoch's rest, then the next's."""
    runtime = mix(tmp_path, settings).with_all_counts()
    common: dict[str, Any] = {"seed": 11, "epoch": 1, "shuffle": True, "drop_last": False, "cursors": ()}
    layouts = [Layout(2, rank, 2, worker, 4) for rank in range(2) for worker in range(2)]
    futures = {layout: mix_futures(runtime, layout, **common) for layout in layouts}

    def listed(found: tuple[Any, ...]) -> list[dict[str, list[int]]]:
        return [{name: units.tolist() for name, units in f.units.items()} for f in found]

    assert all(listed(found) == listed(futures[layouts[0]]) for found in futures.values())
    for layout, found in futures.items():
        now, following = mix_plan(runtime, layout, **common), mix_plan(runtime, layout, **{**common, "epoch": 2})
        assert len(found) == 3
        for source, future in enumerate(found):
            offset, units = int(runtime.mix.unit_offsets[source]), len(runtime.mix.parts[source].units.units)
            sequence = future.units[reader_name(layout.rank, layout.worker)]
            assert set(SourcePlan(now, offset, units).unit_sequence) <= set(sequence[: future.split])
            assert set(SourcePlan(following, offset, units).unit_sequence) <= set(sequence[future.split :])
            assert all(0 <= unit < units for unit in sequence)


@pytest.mark.parametrize("shuffle", [False, True])
def test_each_samples_url_names_its_own_sources_shard(
    three: dict[str, list[str]], tmp_path: Path, settings: Settings, shuffle: bool
) -> None:
    """The three sources' shards have the same names (shard-0000.tar, ...): only the source tells them apart."""
    seen = Counter()
    for sample in mix(tmp_path, settings, shuffle=shuffle):
        source = sample["__key__"][0]
        assert sample["__url__"].startswith(f"{tmp_path / source}/shard-"), (sample["__key__"], sample["__url__"])
        seen[source] += 1
    assert set(seen) == set("abc")


def test_a_mix_of_parquet_sources_reads_each_sources_rows(tmp_path: Path, settings: Settings) -> None:
    """A Parquet plan is columnar (no lasting `Unit` objects): a mix once looked its units up by their ids."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = {}
    for name in "ab":
        (tmp_path / name).mkdir()
        for part in range(3):
            values = [f"{name}{part}-{i}" for i in range(50)]
            pq.write_table(pa.table({"x": values}), tmp_path / name / f"part-{part}.parquet")
            rows.update(dict.fromkeys(values, name))
    sources = [f"{tmp_path / name}/" for name in "ab"]
    got = [s["x"] for s in CachedIterableDataset(sources, config=settings, seed=5, shuffle=True, weights=[0.5, 0.5])]
    assert len(got) == len(set(got)) == len(rows)
    assert Counter(rows[x] for x in got) == {"a": 150, "b": 150}
