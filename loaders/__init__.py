"""The PyTorch side of datacache: `CachedIterableDataset` and what it yields.

This is the only package of datacache that imports torch.
"""

from __future__ import annotations

from datacache.loaders.dataloader import DataLoader
from datacache.loaders.dataset import CachedIterableDataset
from datacache.loaders.decode import DECODERS, basic_decoders
from datacache.loaders.mapstyle import CachedMapDataset
from datacache.loaders.packing import PackedBytes
from datacache.loaders.remote import RayPool
from datacache.loaders.sources import Source
from datacache.loaders.stats import LoaderStats, RemoteStats, SourceStats

__all__ = [
    "DECODERS",
    "CachedIterableDataset",
    "CachedMapDataset",
    "DataLoader",
    "LoaderStats",
    "PackedBytes",
    "RayPool",
    "RemoteStats",
    "Source",
    "SourceStats",
    "basic_decoders",
]
