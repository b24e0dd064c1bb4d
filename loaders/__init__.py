"""The PyTorch side of datacache: `CachedIterableDataset` and what it yields.

This is the only package of datacache that imports torch. Its names load on first use,
so that the plans beneath them (`datacache.loaders.prestage`, the epoch order) import
without torch: the daemon's image, which has none, computes a job's order to prestage.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_WHERE = {
    "DECODERS": "decode",
    "CachedIterableDataset": "dataset",
    "CachedMapDataset": "mapstyle",
    "DataLoader": "dataloader",
    "LoaderStats": "stats",
    "PackedBytes": "packing",
    "RayPool": "remote",
    "RemoteStats": "stats",
    "Source": "sources",
    "SourceStats": "stats",
    "basic_decoders": "decode",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
