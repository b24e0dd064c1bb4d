"""`CachedMapDataset`: random access (``len(ds)``, ``ds[i]``) to a cached dataset, for samplers and frameworks.

Sample ``i`` is the ``i``-th sample of the dataset in manifest order (the order
`CachedIterableDataset` yields with ``shuffle=False`` on one rank): the dataset's
unit plan says which unit (tar shard, Parquet file, plain file, row of Zarr
chunks) holds it and where inside. Reading it opens that unit the way the
iterable dataset does (`reading.units.UnitReaders`): from the local tier, else the
shared tier (while the local copy is staged), else staged from the origin
now, verified against the manifest before any sample is served from it. A few
units stay open (mapped) per process, so that neighbouring indexes cost no
reopening. The sampler decides the order, so nothing is prefetched.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
from datacache.loaders.dataset import CachedIterableDataset
from datacache.loaders.decode import Decoder, SampleDecoding
from datacache.loaders.order.windows import exclusive_sum
from datacache.loaders.plans.interface import Opening
from datacache.loaders.plans.positions import PositionTable
from datacache.loaders.precheck import check_keywords
from datacache.loaders.reading.batching import name_sample
from datacache.loaders.reading.prefetch import PrefetchController
from datacache.loaders.reading.units import UnitReaders
from datacache.loaders.runtime import Runtime
from datacache.loaders.shardfiles import UnitReader
from datacache.loaders.sources import Given
from datacache.loaders.stats import Counter
from torch.utils.data import Dataset

from datacache.config import DatasetConfig, Settings
from datacache.errors import ConfigError, ShardReadError

__all__ = ["CachedMapDataset"]

logger = logging.getLogger(__name__)

_MAX_OPEN = 16
"""Units kept open (mapped and verified) per process by default."""
_EMPTY = np.zeros(0, dtype=np.int64)
_NO_ORDER = PositionTable(_EMPTY, _EMPTY, _EMPTY, padded=0, first_use={}, last_use={}, unit_sequence=())
"""Random access has no epoch order: the sampler's is unknown here, so nothing is prefetched."""


@dataclass
class _Opened:
    """What one process opened for random access; never pickled."""

    pid: int
    runtime: Runtime
    units: UnitReaders
    starts: npt.NDArray[np.int64]
    """Each unit's first sample index, and the total at the end."""
    decoding: SampleDecoding
    recent: OrderedDict[int, None] = field(default_factory=OrderedDict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class CachedMapDataset(Dataset[Any]):
    """Samples of a cached dataset by index: ``len(ds)`` and ``ds[i]``, over the same cache and stager.

    Parameters
    ----------
    dataset
        A URL or a configured dataset name, as for `CachedIterableDataset`.
    decode
        As for `CachedIterableDataset`: ``"auto"``/None (raw bytes), a built-in set by name, a callable,
        or a mapping of field name to callable.
    transform
        A callable applied to each decoded sample, in the process that reads it.
    config
        `Settings` to use instead of the config file and environment.
    max_open
        Units (shards) kept open per process; more keeps random access over many shards from
        reopening (and re-verifying) them.
    """

    @check_keywords("CachedMapDataset")
    def __init__(
        self,
        dataset: str | DatasetConfig,
        *,
        decode: Decoder | None = "auto",
        transform: Callable[[Any], Any] | None = None,
        config: Settings | None = None,
        max_open: int = _MAX_OPEN,
    ) -> None:
        super().__init__()
        if max_open < 1:
            raise ConfigError(f"max_open must be at least 1, got {max_open}")
        # Configuration, validated once; its runtime (loop, stager, plan) is what this dataset reads through.
        self._source = CachedIterableDataset(dataset, shuffle=False, decode=decode, transform=transform, config=config)
        if self._source._mixed:
            raise ConfigError(
                "CachedMapDataset reads one source (a URL, a name, a brace pattern or a list of shards of one "
                "directory); for several, wrap each in a CachedMapDataset and join them with "
                "torch.utils.data.ConcatDataset"
            )
        self.max_open = max_open
        self._opened: _Opened | None = None

    @property
    def dataset(self) -> Given:
        return self._source.dataset

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_opened"] = None
        return state

    def _open(self) -> _Opened:
        opened = self._opened
        if opened is not None and opened.pid == os.getpid():
            return opened
        source = self._source
        runtime = source.with_all_counts()  # every sample count known: indexes must be exact
        plan = runtime.units
        if plan.unreadable:
            key = min(plan.unreadable)
            raise ShardReadError(plan.unreadable[key])
        counts = plan.counts
        starts = exclusive_sum(counts)
        where = f"dataset {runtime.handle.id} (random access)"
        controller = PrefetchController(fixed=0, target=None, unit_bytes=1.0, where=where)
        row = np.zeros(Counter.WIDTH, dtype=np.float64)
        units = UnitReaders(runtime, _NO_ORDER, Opening(controller, row, threading.Lock(), False, True))
        decoding = SampleDecoding(source.decode, source.transform)
        opened = _Opened(os.getpid(), runtime, units, starts, decoding)
        self._opened = opened
        return opened

    def __len__(self) -> int:
        """Samples in the dataset (waits until every shard's count is known)."""
        return int(self._open().starts[-1])

    def __getitem__(self, index: int) -> Any:
        """Sample ``index`` (0 <= index < len), decoded and transformed; the first read of a shard stages it."""
        if isinstance(index, bool) or not isinstance(index, int | np.integer):
            raise TypeError(f"CachedMapDataset indexes are integers, got {type(index).__name__}")
        opened = self._open()
        total = int(opened.starts[-1])
        if not 0 <= index < total:
            raise IndexError(f"index {index} is out of range: the dataset holds samples 0 to {total - 1}")
        unit = int(np.searchsorted(opened.starts, index, side="right")) - 1
        reader, sample = self._read(opened, unit, int(index - opened.starts[unit]))
        name_sample(sample, reader, opened.runtime.url)
        if opened.decoding.raw:
            return sample
        return opened.decoding.apply(sample, reader.where)

    def _read(self, opened: _Opened, unit: int, local: int) -> tuple[UnitReader, dict[str, Any]]:
        """Sample ``local`` of ``unit`` (its bytes copied out), opening the unit if need be.

        Under the process's lock: a unit closed as least recently used beyond ``max_open``
        is never one another thread is reading from.
        """
        with opened.lock:
            reader = opened.units.reader_for(unit)
            if reader is None:  # only with skip_bad, which random access never sets
                raise ShardReadError(f"dataset {opened.runtime.handle.id}: unit {unit} could not be read")
            sample = reader.sample(local)
            opened.recent[unit] = None
            opened.recent.move_to_end(unit)
            while len(opened.recent) > self.max_open:
                old, _ = opened.recent.popitem(last=False)
                stale = opened.units.readers.pop(old, None)
                if stale is not None:
                    stale.close()
        return reader, sample

    def close(self) -> None:
        """Close this process's open shards, loop, stager and connections (also done at exit)."""
        opened, self._opened = self._opened, None
        if opened is not None and opened.pid == os.getpid():
            opened.units.close_all()
        self._source.close()
