"""What `DataLoader` and `MapStyleDataset` ask of a `CachedIterableDataset` beyond its user API.

A user never calls these, so the dataset keeps them underscored; two modules of this package do.
They go through here, the one place outside ``dataset.py`` that names them, so that a change there
breaks one module (and tests/test_private_verbs.py, which checks the names), not the callers.
Once ``dataset.py`` names them publicly (its rework is under way), these become its methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datacache.loaders.dataset import CachedIterableDataset
    from datacache.loaders.iterator import EpochIterator
    from datacache.loaders.runtime import Runtime

__all__ = ["CALLED", "as_workers", "done_as_workers", "with_all_counts"]

CALLED = ("_as_workers", "_done_as_workers", "_complete")
"""The dataset's methods these verbs call."""


def as_workers(dataset: CachedIterableDataset, num_workers: int) -> list[EpochIterator]:
    """This epoch as ``num_workers`` DataLoader workers would each read it, read in this process."""
    return dataset._as_workers(num_workers)


def done_as_workers(dataset: CachedIterableDataset) -> None:
    """Close the shards `as_workers`'s readers kept open for each other."""
    dataset._done_as_workers()


def with_all_counts(dataset: CachedIterableDataset) -> Runtime:
    """The dataset's runtime once every shard's sample count is known (random access needs exact indexes)."""
    return dataset._complete()
