"""The loader over gs:// and az:// origins (emulators): exactly once, one origin read per shard per node, resume."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from _emulators import AzureContainer, GcsBucket, azure, azurite_server, gcs, gcs_server
from datacache.loaders import CachedIterableDataset
from test_loader import keys_of, run_rank, write_wds
from test_origins_cloud import Origin, data_reads
from torch.utils.data import DataLoader

from datacache.config import Settings

__all__ = ["azure", "azurite_server", "gcs", "gcs_server"]  # fixtures, imported to be found


@pytest.fixture(params=["gcs", "azure"])
def origin(request: pytest.FixtureRequest) -> Origin:
    bucket: Origin = request.getfixturevalue(request.param)
    return bucket


@pytest.fixture
def uploaded(origin: Origin, tmp_path: Path) -> dict[str, dict[str, bytes]]:
    expected = write_wds(tmp_path / "upload", samples=90, per_shard=15, with_counts=True)
    for path in sorted((tmp_path / "upload").iterdir()):  # the shards, and the manifest with their counts
        origin.put(f"wds/{path.name}", path.read_bytes())
    origin.server.proxy.reset()
    return expected


def origin_settings(settings: Settings, origin: Origin) -> Settings:
    scheme = "gs" if isinstance(origin, GcsBucket) else "az"
    return dataclasses.replace(settings, storage_options={scheme: origin.storage_options})


def test_every_sample_once_and_each_shard_read_once_per_node(
    origin: Origin, uploaded: dict[str, Any], settings: Settings, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    config = origin_settings(settings, origin)
    dataset = CachedIterableDataset(origin.url("wds"), config=config, seed=4, shuffle_buffer=8)
    per_rank = [run_rank(dataset, monkeypatch, rank, 2, 2) for rank in range(2)]
    everything = [key for keys in per_rank for key in keys]
    assert sorted(everything) == sorted(uploaded), "every sample exactly once across ranks and workers"
    shards = sorted(p.name for p in (tmp_path / "upload").glob("*.tar"))
    assert {name: data_reads(origin, f"wds/{name}") for name in shards} == dict.fromkeys(shards, 1)


def test_resume_mid_epoch_repeats_and_skips_nothing(
    origin: Origin, uploaded: dict[str, Any], settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    config = origin_settings(settings, origin)
    url = origin.url("wds")
    reference = keys_of(CachedIterableDataset(url, config=config, seed=2, shuffle_buffer=8))
    first = CachedIterableDataset(url, config=config, seed=2, shuffle_buffer=8)
    iterator = iter(first)
    head = [next(iterator)["__key__"] for _ in range(40)]
    state = first.state_dict()
    second = CachedIterableDataset(url, config=config, seed=2, shuffle_buffer=8)
    second.load_state_dict(state)
    tail = keys_of(DataLoader(second, batch_size=None, num_workers=0))
    assert head + tail == reference and sorted(reference) == sorted(uploaded)


def test_the_types_used_here_are_the_fixtures() -> None:
    assert {GcsBucket, AzureContainer} == set(Origin.__args__)
