"""Opening the sources of a dataset, and the state a mixed epoch is planned from.

Every source is opened as a dataset of its own (its own handle in the stager,
so its own residency, eviction and sample counts); shard files named one by
one read their directory's dataset filtered to their keys (`only_keys`). The
units of all sources are numbered one after the other, source by source, so
that `epoch.plan_epoch` deals and resumes the mixed order (`mixing.mixed_order`)
as it does one dataset's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import resource
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from datacache.loaders.coldplan import CountBook
from datacache.loaders.datasetplans import DatasetPlanner
from datacache.loaders.epoch import EpochPlan, auto_window, plan_epoch
from datacache.loaders.mixing import mixed_order, source_counts
from datacache.loaders.order import Cursor, Layout
from datacache.loaders.plan import complete, load_or_build_plan
from datacache.loaders.readers import SpanCache, UnitPlan
from datacache.loaders.runtime import Runtime
from datacache.loaders.sequence import exclusive_sum
from datacache.loaders.sources import SourceSpec

from datacache._sync import LoopThread
from datacache.access import ShardAccess
from datacache.config import Settings
from datacache.errors import ConfigError, DatasetTooLargeError, ShardNotFoundError
from datacache.stager import DatasetHandle
from datacache.units import format_bytes

__all__ = ["Mix", "mix_plan", "only_keys", "open_handle", "open_mix"]

IntArray = npt.NDArray[np.int64]


def only_keys(handle: DatasetHandle, keys: tuple[str, ...], label: str) -> DatasetHandle:
    """``handle`` reading only the shards ``keys`` (in that order): same dataset id, same cached copies.

    Its manifest (hence its snapshot, unit plan and index) holds those shards only.
    """
    manifest = handle.manifest
    shards = manifest.named(keys, label=label, url=handle.config.url)
    digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]
    subset = dataclasses.replace(manifest, shards=shards, dataset=f"{handle.id}-only-{digest}")
    # The whole dataset's snapshot: a daemon serving the dataset knows that one (it names the data; the
    # keys name the part read). The part's unit plan and counts are kept apart, under its own name.
    vars(subset)["snapshot"] = manifest.snapshot
    return dataclasses.replace(handle, manifest=subset)


async def open_handle(access: ShardAccess, spec: SourceSpec) -> DatasetHandle:
    """The handle of one source: its dataset, filtered to its keys when it names shards."""
    try:
        handle = await access.open(spec.dataset)
    except ShardNotFoundError as exc:
        if spec.keys is None:
            raise
        raise ShardNotFoundError(f"{spec.label} matches no shard: {exc}") from None
    return only_keys(handle, spec.keys, spec.label) if spec.keys is not None else handle


@dataclass
class Mix:
    """What a mixed epoch is planned from: every source's runtime and its samples per epoch."""

    parts: tuple[Runtime, ...]
    labels: tuple[str, ...]
    counts: IntArray
    """Samples each source gives one epoch."""
    windows: tuple[int, ...]
    """Each source's shuffle window."""
    replacement: bool
    unit_offsets: IntArray
    """The number of each source's first unit among all sources' units."""

    @property
    def total(self) -> int:
        """Samples in one epoch, across all ranks."""
        return int(self.counts.sum())

    @property
    def source_of_unit(self) -> IntArray:
        sizes = [len(part.plan.units) for part in self.parts]
        return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)

    def order(self, *, seed: int, epoch: int, shuffle: bool) -> IntArray:
        return mixed_order(
            [part.plan.counts for part in self.parts],
            self.counts,
            seed=seed,
            epoch=epoch,
            shuffle=shuffle,
            windows=self.windows,
            replacement=self.replacement,
        )

    def identity(self) -> tuple[str, str]:
        """``(dataset ids, snapshot)`` of the mix, for saved states: one string each."""
        ids = "+".join(part.handle.manifest.dataset for part in self.parts)
        joined = "+".join(part.handle.manifest.snapshot for part in self.parts)
        return ids, hashlib.sha256(joined.encode()).hexdigest()[:16]


MIX_BYTES_PER_SAMPLE = 72
"""What a mixed epoch holds per sample while it is planned (the order, each source's draw, a reader's
arrays and their temporaries; measured ~65). One dataset's epoch holds nothing per sample."""


def memory_limit() -> int:
    """The memory this process may use: its address-space limit, its cgroup's, or the machine's."""
    limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(soft)
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limits.append(int(text))
    return min(limits)


def _check_fits(epoch: int, sources: int, labels: tuple[str, ...]) -> None:
    """Refuse, before any epoch allocates for it, a mix this process's memory cannot plan."""
    need, limit = (epoch + sources) * MIX_BYTES_PER_SAMPLE, memory_limit()
    if need > limit // 2:
        raise DatasetTooLargeError(
            f"the mix of {', '.join(labels)} ({sources} samples, {epoch} an epoch) needs "
            f"{format_bytes(need)} to plan an epoch, over half this process's memory limit "
            f"({format_bytes(limit)}): a mix still plans per sample; read the largest source on its own"
        )


def open_mix(
    loop: LoopThread,
    access: ShardAccess,
    settings: Settings,
    specs: tuple[SourceSpec, ...],
    *,
    epoch_size: int | None,
    replacement: bool,
    shuffle_buffer: int | None,
) -> Runtime:
    """One runtime over every source (its plan all sources' units, one after the other) with its `Mix`."""
    parts: list[Runtime] = []
    for spec in specs:
        handle = loop.run(open_handle(access, spec))
        plan = loop.run(load_or_build_plan(access, handle, settings, wait=False))
        spans = SpanCache(directory=settings.local_dir / "indexes" / "spans" / handle.id)
        # Counted through the stager, so that the origin serves each shard once, for counting and
        # reading alike; every source's count starts now, and they run together.
        book = None if complete(plan) else CountBook(plan, handle, settings, loop, access)
        part = Runtime(os.getpid(), loop, settings, access, handle, plan, shuffle_buffer or 0, spans=spans, book=book)
        if book is not None:
            book.start()
        parts.append(part)
    for part in parts:
        DatasetPlanner(part, shuffle_buffer).complete()  # a mix shares the epoch out by the sources' sizes
    formats = {part.handle.manifest.format for part in parts}
    if len(formats) > 1:
        found = ", ".join(
            f"{label}: {part.handle.manifest.format.value}"
            for label, part in zip((spec.label for spec in specs), parts, strict=True)
        )
        raise ConfigError(f"the sources of one dataset must have one format; found {found}")
    labels = tuple(spec.label for spec in specs)
    counts = source_counts([part.plan.total for part in parts], [spec.mode for spec in specs], labels, epoch_size)
    sizes = [len(part.plan.units) for part in parts]
    combined = UnitPlan(
        tuple(unit for part in parts for unit in part.plan.units),
        {},
        {key: why for part in parts for key, why in part.plan.unreadable.items()},
    )
    total = int(counts.sum())
    _check_fits(total, sum(part.plan.total for part in parts), labels)
    window = shuffle_buffer or auto_window(total, len(combined.units))
    first = parts[0]
    mix = Mix(
        parts=tuple(parts),
        labels=labels,
        counts=counts,
        windows=tuple(part.window for part in parts),
        replacement=replacement,
        unit_offsets=exclusive_sum(sizes)[:-1],
    )
    return Runtime(first.pid, loop, settings, access, first.handle, combined, window, spans=first.spans, mix=mix)


def mix_plan(
    runtime: Runtime,
    layout: Layout,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    drop_last: bool,
    cursors: tuple[Cursor, ...],
) -> EpochPlan:
    """The reader ``layout``'s share of mixed epoch ``epoch``, less what ``cursors`` consumed."""
    mix = runtime.mixed()
    plan = plan_epoch(
        runtime.plan.counts,
        seed=seed,
        epoch=epoch,
        shuffle=shuffle,
        window=runtime.window,
        cursors=cursors,
        layout=layout,
        drop_last=drop_last,
        order=mix.order(seed=seed, epoch=epoch, shuffle=shuffle),
    )
    # Whole arrays: a mix's readers split positions by source (`mixunits`), and its order is one array.
    return EpochPlan.of(plan)
