"""`len()` of a dataset: exact where every sample count is known, at once `TypeError` where not.

torch's DataLoader, tqdm, Lightning and HF's Trainer call ``len()`` for progress and take a
`TypeError` for "no length": an un-indexed dataset's ``len()`` used to stage and count every
shard first (1e4 shards: no answer in 150 s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from datacache.loaders import CachedIterableDataset
from test_loader import write_wds
from torch.utils.data import DataLoader

from datacache.config import Settings


def _local_copies(settings: Settings) -> list[Path]:
    return list((settings.local_dir).rglob("train-*.tar"))


def test_len_of_an_unindexed_dataset_says_unknown_at_once_and_is_exact_after_an_epoch(
    tmp_path: Path, settings: Settings
) -> None:
    write_wds(tmp_path / "ds", samples=60, per_shard=3)  # 20 shards, no counts beside them
    dataset = CachedIterableDataset(f"{tmp_path / 'ds'}/", config=settings, shuffle=False)
    try:
        with pytest.raises(TypeError, match="no sample count yet"):
            len(dataset)
        with pytest.raises(TypeError):
            len(DataLoader(dataset, batch_size=None))  # what a progress bar asks
        assert not _local_copies(settings), "len() staged shards to count them"
        keys = [sample["__key__"] for sample in dataset]
        assert len(keys) == 60
        assert len(dataset) == 60, "the epoch counted every shard: len() is exact now"
    finally:
        dataset.close()


def test_len_of_a_dataset_with_its_counts_is_exact_before_any_read(tmp_path: Path, settings: Settings) -> None:
    write_wds(tmp_path / "ds", samples=50, per_shard=4, with_counts=True)
    dataset = CachedIterableDataset(f"{tmp_path / 'ds'}/", config=settings, shuffle=False, batch_size=8)
    try:
        assert len(dataset) == 7  # 50 samples in batches of 8
        assert not _local_copies(settings)
    finally:
        dataset.close()


def test_len_is_exact_after_an_epoch_read_by_worker_processes(tmp_path: Path, settings: Settings) -> None:
    """The counts a DataLoader's workers made reach the training process's `len()` (a new user's trial:
    it stayed `TypeError` for good after epochs with workers, so no progress bar ever had a total)."""
    write_wds(tmp_path / "ds", samples=60, per_shard=3)
    dataset = CachedIterableDataset(f"{tmp_path / 'ds'}/", config=settings, shuffle=False)
    try:
        with pytest.raises(TypeError, match="no sample count yet"):
            len(dataset)
        keys = [sample["__key__"] for sample in DataLoader(dataset, batch_size=None, num_workers=2)]
        assert len(keys) == 60
        assert len(dataset) == 60
    finally:
        dataset.close()


def test_an_unknown_len_stays_unknown_until_this_datasets_epoch_ends(tmp_path: Path, settings: Settings) -> None:
    """Lightning asks `len()` several times while it sets one epoch up, and starts the DataLoader's
    workers in between: they may count every shard before the next question. An answer that turned
    from TypeError to a number there made Lightning compute int(inf) (a CI run's OverflowError).
    Here another reader completes the counts; this dataset's answer holds until its own epoch ends."""
    write_wds(tmp_path / "ds", samples=60, per_shard=3)
    url = f"{tmp_path / 'ds'}/"
    dataset = CachedIterableDataset(url, config=settings, shuffle=False)
    other = CachedIterableDataset(url, config=settings, shuffle=False)
    try:
        with pytest.raises(TypeError, match="no sample count yet"):
            len(dataset)
        assert len([sample["__key__"] for sample in other]) == 60  # counts every shard, saved for the node
        assert len(other) == 60
        with pytest.raises(TypeError, match="no sample count yet"):
            len(dataset)
        dataset.set_epoch(1)
        assert len(dataset) == 60, "a new epoch takes the counts the node has"
    finally:
        dataset.close()
        other.close()


def test_an_unknown_len_turns_exact_once_this_datasets_workers_end_the_epoch(
    tmp_path: Path, settings: Settings
) -> None:
    write_wds(tmp_path / "ds", samples=60, per_shard=3)
    dataset = CachedIterableDataset(f"{tmp_path / 'ds'}/", config=settings, shuffle=False)
    try:
        with pytest.raises(TypeError, match="no sample count yet"):
            len(dataset)
        loader = iter(DataLoader(dataset, batch_size=None, num_workers=2))
        next(loader)
        with pytest.raises(TypeError, match="no sample count yet"):
            len(dataset)  # mid-epoch: the answer of the epoch's start holds
        assert len(list(loader)) == 59
        assert len(dataset) == 60
    finally:
        dataset.close()
