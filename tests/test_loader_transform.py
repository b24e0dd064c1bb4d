"""``transform=`` and ``ds.map(f)``: per-sample callables run where samples are read; their errors are named."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from datacache.loaders import CachedIterableDataset
from test_loader import keys_of, payload, write_wds
from torch.utils.data import DataLoader

from datacache.config import Settings
from datacache.errors import ConfigError, SampleDecodeError


@pytest.fixture
def origin(tmp_path: Path) -> Path:
    directory = tmp_path / "origin"
    write_wds(directory, samples=30, per_shard=10)
    return directory


def _label_and_pid(sample: dict[str, Any]) -> dict[str, Any]:
    return {"__key__": sample["__key__"], "label": int(sample["cls"]), "pid": os.getpid(), "size": len(sample["bin"])}


def _double_label(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "label": sample["label"] * 2}


def _index(sample: dict[str, Any]) -> int:
    return int(sample["__key__"].removeprefix("sample"))


def _reject_seven(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["__key__"].endswith("7"):
        raise RuntimeError("seven is rejected")
    return sample


def test_transform_runs_on_each_sample_in_the_worker_process(origin: Path, settings: Settings) -> None:
    dataset = CachedIterableDataset(str(origin), config=settings, shuffle=False, transform=_label_and_pid)
    got = list(DataLoader(dataset, batch_size=None, num_workers=2))
    assert sorted(s["__key__"] for s in got) == [f"sample{i:06d}" for i in range(30)]
    for sample in got:
        index = _index(sample)
        assert sample["label"] == index % 10 and sample["size"] == len(payload(index))
    assert {s["pid"] for s in got}.isdisjoint({os.getpid()})  # ran in the workers, not here


def test_transform_gets_decoded_samples(origin: Path, settings: Settings) -> None:
    dataset = CachedIterableDataset(
        str(origin), config=settings, shuffle=False, decode="basic", transform=lambda s: (s["cls"], s["__key__"])
    )
    assert list(dataset)[:3] == [(0, "sample000000"), (1, "sample000001"), (2, "sample000002")]


def test_map_composes_and_leaves_the_original_unchanged(origin: Path, settings: Settings) -> None:
    base = CachedIterableDataset(str(origin), config=settings, shuffle=False, transform=_label_and_pid)
    doubled = base.map(_double_label)
    indexed = CachedIterableDataset(str(origin), config=settings, shuffle=False).map(_index)
    assert [s["label"] for s in doubled][:12] == [2 * (i % 10) for i in range(12)]
    assert [s["label"] for s in base][:12] == [i % 10 for i in range(12)]
    assert list(indexed) == list(range(30))


def test_a_mapped_dataset_pickles_and_runs_in_spawned_workers(origin: Path, settings: Settings) -> None:
    mapped = CachedIterableDataset(str(origin), config=settings, shuffle=False, transform=_label_and_pid).map(
        _double_label
    )
    clone = pickle.loads(pickle.dumps(mapped))
    assert [s["label"] for s in clone][:3] == [0, 2, 4]
    loader = DataLoader(mapped, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    got = sorted((s["__key__"], s["label"]) for s in loader)
    assert got == [(f"sample{i:06d}", 2 * (i % 10)) for i in range(30)]


def test_in_batch_mode_the_transform_sees_each_sample_and_batches_are_collated(
    origin: Path, settings: Settings
) -> None:
    seen: list[Any] = []

    def label(sample: dict[str, Any]) -> dict[str, Any]:
        seen.append(sample)
        return {"label": int(sample["cls"]), "key": sample["__key__"]}

    dataset = CachedIterableDataset(str(origin), config=settings, shuffle=False, batch_size=8, transform=label)
    batches = list(dataset)
    assert all(isinstance(s, dict) and isinstance(s["bin"], bytes) for s in seen)  # one raw sample per call
    assert [len(b["key"]) for b in batches] == [8, 8, 8, 6]
    assert isinstance(batches[0]["label"], torch.Tensor)
    assert batches[0]["label"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [k for b in batches for k in b["key"]] == [f"sample{i:06d}" for i in range(30)]


@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_transform_error_names_dataset_shard_key_and_transform_and_is_skippable(
    origin: Path, settings: Settings, batch_size: int | None
) -> None:
    dataset = CachedIterableDataset(
        str(origin), config=settings, shuffle=False, batch_size=batch_size, transform=_reject_seven
    )
    with pytest.raises(SampleDecodeError) as failure:
        list(dataset)
    message = str(failure.value)
    assert "dataset" in message and "'train-0000.tar'" in message and "sample000007" in message
    assert "transform '_reject_seven'" in message and "seven is rejected" in message
    assert isinstance(failure.value.__cause__, RuntimeError)
    skipping = CachedIterableDataset(
        str(origin), config=settings, shuffle=False, batch_size=batch_size, transform=_reject_seven, on_error="skip"
    )
    assert sorted(keys_of(skipping)) == [f"sample{i:06d}" for i in range(30) if i % 10 != 7]
    assert skipping.stats().skipped_samples == 3


def test_a_failing_step_of_map_is_the_one_named(origin: Path, settings: Settings) -> None:
    dataset = CachedIterableDataset(str(origin), config=settings, shuffle=False).map(_label_and_pid).map(_reject_seven)
    with pytest.raises(SampleDecodeError, match=r"sample000007.*transform '_reject_seven'.*RuntimeError"):
        list(dataset)


def test_bad_transforms_are_refused(origin: Path, settings: Settings) -> None:
    with pytest.raises(ConfigError, match="transform must be a callable"):
        CachedIterableDataset(str(origin), config=settings, transform="upper")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="map"):
        CachedIterableDataset(str(origin), config=settings).map(3)  # type: ignore[arg-type]


def test_a_transform_applies_to_every_source_of_a_mix(tmp_path: Path, settings: Settings) -> None:
    write_wds(tmp_path / "a", samples=12, per_shard=6)
    write_wds(tmp_path / "b", samples=8, per_shard=4)
    mix = CachedIterableDataset([str(tmp_path / "a"), str(tmp_path / "b")], config=settings).map(_label_and_pid)
    got = list(DataLoader(mix, batch_size=None, num_workers=2))
    assert len(got) == 20 and all(set(s) == {"__key__", "label", "pid", "size"} for s in got)
    assert sorted(s["label"] for s in got) == sorted([i % 10 for i in range(12)] + [i % 10 for i in range(8)])
