"""What a dataset can be refused for when it is made, at no cost: no listing, no connection.

A bucket prefix is listed at the first ``len()`` or ``iter()`` (listing a big prefix when a dataset
is made would cost every construction); shards named one by one are listed when it is made
(`CachedIterableDataset`). What needs no listing is checked here, so that it fails in one line
where the dataset is made, not inside a DataLoader worker at the first sample: a scheme not
written in lower case (the rule `open_origin` and so the CLI apply: `check_scheme_case`), a local
path that does not exist, a bare name that is neither a path nor a configured dataset
(`resolve_dataset`'s rule).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from datacache.loaders.sources import SourceSpec
from datacache.tiers import check_scheme_case

from datacache.config import DatasetConfig, Settings, load_settings, resolve_dataset
from datacache.manifest import missing_local_path

__all__ = ["check_sources"]


def check_sources(specs: Iterable[SourceSpec], config: Settings | None) -> None:
    """Refuse a source whose scheme is not lower case or whose local path does not exist.

    ``specs``: sources naming a whole dataset (not shards one by one). Settings are loaded
    only for a bare name that is no path here (to know whether the config names it).
    """
    for spec in specs:
        dataset = spec.dataset
        if isinstance(dataset, str) and "://" not in dataset and not _is_path(dataset):
            if os.path.exists(dataset):
                continue
            dataset = resolve_dataset(dataset, config if config is not None else load_settings())
        url = dataset.url if isinstance(dataset, DatasetConfig) else dataset
        check_scheme_case(url)
        missing = missing_local_path(url)  # the words `datacache warm` says it in
        if missing is not None:
            raise missing


def _is_path(text: str) -> bool:
    return text.startswith(("/", ".", "~"))

