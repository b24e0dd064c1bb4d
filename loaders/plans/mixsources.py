"""Opening the sources of a dataset, and the state a mixed epoch is planned from.

Every source is opened as a dataset of its own (its own handle in the stager,
so its own residency, eviction and sample counts); shard files named one by
one read their directory's dataset filtered to their keys (`only_keys`). The
units of all sources are numbered one after the other, source by source, so
that `plans.positions.plan_epoch` deals and resumes the mixed order (`order.mixed.MixedOrder`, computed per
position: O(shards + sources)) as it does one dataset's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from datacache.loaders.order.layout import Cursor, Dealing, Layout, reader_name
from datacache.loaders.order.mixcounts import source_counts
from datacache.loaders.order.mixed import MixedOrder
from datacache.loaders.order.windows import Deal, Order, exclusive_sum
from datacache.loaders.plans.cold import CountBook
from datacache.loaders.plans.counts import complete, load_or_build_plan
from datacache.loaders.plans.indexed import IndexedPositions, rank_unit_sequence
from datacache.loaders.plans.positions import auto_window, epoch_sequence, plan_epoch, settle_counts
from datacache.loaders.runtime import NodeFuture, Runtime, SpanCache
from datacache.loaders.shardfiles import UnitPlan
from datacache.loaders.sources import SourceSpec

from datacache._sync import LoopThread
from datacache.access import ShardAccess
from datacache.config import Settings
from datacache.errors import ConfigError, ShardNotFoundError
from datacache.staging import DatasetHandle

__all__ = ["Mix", "mix_futures", "mix_plan", "only_keys", "open_handle", "open_mix"]

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
        sizes = [len(part.units.units) for part in self.parts]
        return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)

    def order(self, *, seed: int, epoch: int, shuffle: bool) -> MixedOrder:
        """Epoch ``epoch``'s mixed order, computed per position."""
        return MixedOrder.of(
            [part.units.counts for part in self.parts],
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
        settle_counts(part, shuffle_buffer)  # a mix shares the epoch out by the sources' sizes
    formats = {part.handle.manifest.format for part in parts}
    if len(formats) > 1:
        found = ", ".join(
            f"{label}: {part.handle.manifest.format.value}"
            for label, part in zip((spec.label for spec in specs), parts, strict=True)
        )
        raise ConfigError(f"the sources of one dataset must have one format; found {found}")
    labels = tuple(spec.label for spec in specs)
    counts = source_counts([part.units.total for part in parts], [spec.mode for spec in specs], labels, epoch_size)
    sizes = [len(part.units.units) for part in parts]
    combined = UnitPlan(
        tuple(unit for part in parts for unit in part.units.units),
        {},
        {key: why for part in parts for key, why in part.units.unreadable.items()},
    )
    total = int(counts.sum())
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
) -> IndexedPositions:
    """The reader ``layout``'s share of mixed epoch ``epoch``, less what ``cursors`` consumed."""
    mix = runtime.mixed()
    return plan_epoch(
        runtime.units.counts,
        dealing=Dealing(seed, shuffle, drop_last),
        epoch=epoch,
        window=runtime.window,
        cursors=cursors,
        layout=layout,
        order=mix.order(seed=seed, epoch=epoch, shuffle=shuffle),
    )


def mix_futures(
    runtime: Runtime,
    layout: Layout,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    drop_last: bool,
    cursors: tuple[Cursor, ...],
) -> tuple[NodeFuture, ...]:
    """Each source's node future: every reader's units of it, what is left of this epoch, then the next.

    Per rank and per block of positions, as one dataset's (`plans.positions.node_unit_sequences`): a rank's
    workers share its sequence. Every reader computes the same value.
    """
    mix = runtime.mixed()
    this = mix.order(seed=seed, epoch=epoch, shuffle=shuffle)
    counts, window = runtime.units.counts, runtime.window
    now = epoch_sequence(counts, seed=seed, epoch=epoch, shuffle=shuffle, window=window, cursors=cursors, order=this)
    following = mix.order(seed=seed, epoch=epoch + 1, shuffle=shuffle)
    sources = len(mix.parts)
    found: list[dict[str, IntArray]] = [{} for _ in range(sources)]
    splits = [0] * sources
    for rank in range(layout.world_size):
        parts = [
            _by_source(mix, _rank_units(order, runtime.window, layout, rank, drop_last)) for order in (now, following)
        ]
        for source in range(sources):
            units = np.concatenate((parts[0][source], parts[1][source]))
            units.flags.writeable = False  # the rank's workers share it
            if rank == layout.rank:
                splits[source] = len(parts[0][source])
            for worker in range(layout.num_workers):
                name = reader_name(rank, worker)
                found[source][name] = units
    me = reader_name(layout.rank, layout.worker)
    return tuple(NodeFuture(me, epoch, found[s], split=splits[s]) for s in range(sources))


def _rank_units(order: Order, window: int, layout: Layout, rank: int, drop_last: bool) -> IntArray:
    deal = Deal(order.total, layout.world_size, window)
    return rank_unit_sequence(order, deal, rank, deal.length(drop_last=drop_last))


def _by_source(mix: Mix, units: IntArray) -> list[IntArray]:
    """``units`` (numbered across sources) split by source, in order, each numbered as in its source."""
    source = mix.source_of_unit[units]
    return [units[source == s] - mix.unit_offsets[s] for s in range(len(mix.parts))]
