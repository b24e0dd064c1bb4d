"""A mixed epoch's plan at any scale (`loaders/order/mixed.py`): exact counts per source, exactly once
within each source's share, equal rank lengths, resume onto another layout, (seed, epoch) only.

Pure arithmetic, so Hypothesis checks the properties over many mixes and layouts; memory is measured
with tracemalloc (allocations, not time) for a mix of 1e10 samples.
"""

from __future__ import annotations

import tracemalloc
from collections import Counter

import numpy as np
import pytest
from datacache.loaders.order.layout import Cursor, Dealing, Layout
from datacache.loaders.order.mixcounts import apportion, source_counts, source_seed
from datacache.loaders.order.mixed import MixedOrder
from datacache.loaders.order.windows import Deal, WindowedOrder, exclusive_sum
from datacache.loaders.plans.indexed import IndexedPositions, rank_unit_sequence
from datacache.loaders.plans.positions import plan_epoch
from hypothesis import given, settings
from hypothesis import strategies as st

units_strategy = st.lists(
    st.lists(st.integers(0, 30), min_size=1, max_size=6).filter(lambda c: sum(c) > 0), min_size=1, max_size=4
)


@st.composite
def mixes(draw: st.DrawFn) -> tuple[list[np.ndarray], np.ndarray]:
    """Sources (unit counts each) and the samples each gives an epoch: from none to several times its size."""
    units = [np.asarray(u, dtype=np.int64) for u in draw(units_strategy)]
    counts = np.asarray([draw(st.integers(0, 3 * int(u.sum()))) for u in units], dtype=np.int64)
    return units, counts


def _order(units: list[np.ndarray], counts: np.ndarray, **options: object) -> MixedOrder:
    common: dict[str, object] = {"seed": 7, "epoch": 2, "shuffle": True, "windows": [5] * len(units)}
    common["replacement"] = False
    common.update(options)
    return MixedOrder.of(units, counts, **common)  # type: ignore[arg-type]


def _split(order: MixedOrder, ids: np.ndarray) -> list[list[int]]:
    """``ids`` (flat) as each source's own sample ids, source by source."""
    starts = exclusive_sum([draw.size for draw in order.draws])
    source = np.searchsorted(starts, ids, side="right") - 1
    return [(ids[source == s] - starts[s]).tolist() for s in range(len(order.draws))]


@settings(max_examples=200, deadline=None)
@given(mix=mixes(), seed=st.integers(0, 2**40), epoch=st.integers(0, 6), replacement=st.booleans())
def test_each_source_gives_exactly_its_count(
    mix: tuple[list[np.ndarray], np.ndarray], seed: int, epoch: int, replacement: bool
) -> None:
    units, counts = mix
    order = _order(units, counts, seed=seed, epoch=epoch, replacement=replacement)
    assert order.total == int(counts.sum())
    source, index = order.interleave.locate(np.arange(order.total, dtype=np.int64))
    for s, count in enumerate(counts.tolist()):
        assert sorted(index[source == s].tolist()) == list(range(count)), "each index of the share once"
    drawn = _split(order, order.ids(np.arange(order.total, dtype=np.int64)))
    assert [len(d) for d in drawn] == counts.tolist()
    assert all(0 <= i < int(u.sum()) for d, u in zip(drawn, units, strict=True) for i in d)


@settings(max_examples=200, deadline=None)
@given(mix=mixes(), seed=st.integers(0, 2**40), epoch=st.integers(0, 6))
def test_each_source_share_is_its_stream_exactly_once(
    mix: tuple[list[np.ndarray], np.ndarray], seed: int, epoch: int
) -> None:
    """Without replacement, source s's share of epoch e: while c <= n, items [j*c, (j+1)*c) of pass e // m
    (j = e % m, m = ceil(n / c)), wrapping to the pass's start; for a smaller source, items [e*c, (e+1)*c) of
    its stream of passes."""
    units, counts = mix
    order = _order(units, counts, seed=seed, epoch=epoch)
    drawn = _split(order, order.ids(np.arange(order.total, dtype=np.int64)))
    for s, (u, count) in enumerate(zip(units, counts.tolist(), strict=True)):
        size = int(u.sum())
        if count <= size:
            epochs = -(-size // max(count, 1))
            permutation = WindowedOrder(u, source_seed(seed, s), epoch // epochs, True, 5).ids(np.arange(size))
            first = epoch % epochs * count
            expected = [int(permutation[i % size]) for i in range(first, first + count)]
            assert len(set(drawn[s])) == count, "within one epoch, no sample twice"
        else:
            cycles = range(epoch * count // size, -(-(epoch + 1) * count // size) + 1)
            stream = {c: WindowedOrder(u, source_seed(seed, s), c, True, 5).ids(np.arange(size)) for c in cycles}
            items = np.arange(epoch * count, (epoch + 1) * count, dtype=np.int64)
            expected = [int(stream[int(i // size)][i % size]) for i in items]
        assert sorted(drawn[s]) == sorted(expected)


def _ids(plan: object, counts: np.ndarray, upto: int | None = None) -> list[int]:
    bounds = exclusive_sum(counts)
    stop = len(plan) if upto is None else min(upto, len(plan))  # type: ignore[arg-type]
    units = plan.unit_of[0:stop]  # type: ignore[attr-defined]
    local = plan.local[0:stop]  # type: ignore[attr-defined]
    return (bounds[units] + local).tolist() if stop else []


@settings(max_examples=120, deadline=None)
@given(
    mix=mixes(),
    world=st.integers(1, 8),
    workers=st.integers(0, 3),
    chunk=st.integers(1, 5),
    window=st.integers(1, 9),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**40),
)
def test_every_position_once_and_equal_lengths_for_any_layout(
    mix: tuple[list[np.ndarray], np.ndarray],
    world: int,
    workers: int,
    chunk: int,
    window: int,
    drop_last: bool,
    seed: int,
) -> None:
    units, counts = mix
    flat = np.concatenate(units)
    order = _order(units, counts, seed=seed)
    everything = Counter(order.ids(np.arange(order.total, dtype=np.int64)).tolist())
    readers = max(1, workers)
    seen: Counter[int] = Counter()
    padded, per_rank = 0, []
    for rank in range(world):
        rank_total = 0
        for worker in range(readers):
            layout = Layout(world, rank, readers, worker, chunk)
            common = {"dealing": Dealing(seed, True, drop_last), "epoch": 2, "window": window}
            plan = plan_epoch(flat, cursors=(), layout=layout, order=order, **common)  # type: ignore[arg-type]
            ids = _ids(plan, flat)
            padded += plan.padded
            seen.update(ids[: len(ids) - plan.padded])
            rank_total += len(ids)
            for position in range(len(plan)):
                unit = plan.unit_of[position]
                assert plan.first_use[unit] <= position <= plan.last_use[unit]
        per_rank.append(rank_total)
    assert len(set(per_rank)) == 1, "every rank reads as many samples"
    if drop_last:
        assert per_rank[0] == order.total // world
        assert not seen - everything and sum((everything - seen).values()) < world
    else:
        assert seen == everything and padded < world


@settings(max_examples=120, deadline=None)
@given(
    mix=mixes(),
    before=st.tuples(st.integers(1, 8), st.integers(1, 3), st.integers(1, 4)),
    after=st.tuples(st.integers(1, 8), st.integers(1, 3), st.integers(1, 4)),
    fractions=st.lists(st.floats(0, 1), min_size=3, max_size=3),
    window=st.integers(1, 9),
    replacement=st.booleans(),
    twice=st.booleans(),
)
def test_resume_onto_another_layout_reads_the_rest_exactly(
    mix: tuple[list[np.ndarray], np.ndarray],
    before: tuple[int, int, int],
    after: tuple[int, int, int],
    fractions: list[float],
    window: int,
    replacement: bool,
    twice: bool,
) -> None:
    """Stopped part way on one layout (and, ``twice``, again on another), the rest read on a third."""
    units, counts = mix
    flat = np.concatenate(units)
    order = _order(units, counts, replacement=replacement)
    common = {"dealing": Dealing(7, True, False), "epoch": 2, "window": window, "order": order}
    consumed: list[int] = []
    cursors: tuple[Cursor, ...] = ()
    layouts = [before, after] if not twice else [before, after, before]
    for world, workers, chunk in layouts[:-1]:
        lengths = [len(_plan(flat, cursors, Layout(world, 0, workers, w, chunk), common)) for w in range(workers)]
        produced = tuple(int(n * f) for n, f in zip(lengths, fractions))
        for rank in range(world):
            for worker in range(workers):
                plan = _plan(flat, cursors, Layout(world, rank, workers, worker, chunk), common)
                consumed.extend(_ids(plan, flat, produced[worker]))
        cursors = (*cursors, Cursor(world, workers, chunk, produced))
    world, workers, chunk = layouts[-1]
    resumed: list[int] = []
    for rank in range(world):
        for worker in range(workers):
            resumed.extend(_ids(_plan(flat, cursors, Layout(world, rank, workers, worker, chunk), common), flat))
    expected = Counter(order.ids(np.arange(order.total, dtype=np.int64)).tolist())
    got = Counter(consumed + resumed)
    assert not expected - got, "a position of the epoch was skipped"
    assert sum((got - expected).values()) < 3 * 8, "only padding repeats"


def _plan(flat: np.ndarray, cursors: tuple[Cursor, ...], layout: Layout, common: dict[str, object]) -> IndexedPositions:
    return plan_epoch(flat, cursors=cursors, layout=layout, **common)  # type: ignore[arg-type]


def test_the_mix_depends_only_on_seed_and_epoch() -> None:
    units = [np.full(20, 10, dtype=np.int64), np.full(3, 10, dtype=np.int64), np.full(7, 3, dtype=np.int64)]
    counts = np.asarray([150, 50, 33])
    positions = np.arange(233, dtype=np.int64)

    def ids(seed: int, epoch: int, replacement: bool = False) -> list[int]:
        order = _order([u.copy() for u in units], counts.copy(), seed=seed, epoch=epoch, replacement=replacement)
        return list(order.ids(positions).tolist())

    for replacement in (False, True):
        assert ids(5, 2, replacement) == ids(5, 2, replacement)
        assert ids(5, 2, replacement) != ids(5, 3, replacement)
        assert ids(5, 2, replacement) != ids(6, 2, replacement)
    # any subset of positions, asked in any order, says the same samples
    order = _order(units, counts, seed=5, epoch=2)
    picked = np.random.default_rng(0).permutation(233)[:50]
    assert order.ids(picked).tolist() == [ids(5, 2)[p] for p in picked.tolist()]


def test_with_replacement_samples_repeat_and_stay_within_the_source() -> None:
    units = [np.full(10, 100, dtype=np.int64), np.full(4, 50, dtype=np.int64)]
    order = _order(units, np.asarray([1000, 200]), replacement=True, windows=[64, 64])
    drawn = _split(order, order.ids(np.arange(1200, dtype=np.int64)))
    assert len(drawn[0]) == 1000 and min(drawn[0]) >= 0 and max(drawn[0]) < 1000
    assert len(set(drawn[0])) < 700, "1,000 draws of 1,000 with replacement repeat"
    assert len(drawn[1]) == 200 and len(set(drawn[1])) < 160


@pytest.mark.parametrize("world", [1, 8])
def test_a_mix_of_ten_billion_samples_plans_in_what_its_shards_cost(world: int) -> None:
    shards = [5_000, 3_000, 2_000]  # 1e4 shards of 1e6 samples: 1e10 samples in 3 sources
    units = [np.full(n, 1_000_000, dtype=np.int64) for n in shards]
    flat = np.concatenate(units)
    counts = apportion(10**10, [0.5, 0.3, 0.2])
    tracemalloc.start()
    try:
        order = _order(units, counts, seed=1, epoch=0, windows=[16384] * 3)
        layout = Layout(world, world - 1 if world == 1 else 3, 4, 3, 64)
        common = {"dealing": Dealing(1, True, False), "epoch": 0, "window": 16384, "order": order}
        plan = plan_epoch(flat, cursors=(), layout=layout, **common)  # type: ignore[arg-type]
        first = [plan.unit_of[i] for i in range(100)]
        sequence = plan.unit_sequence
        cursor = Cursor(world, 4, 64, (10**6, 10**6 + 64, 10**6, 10**6))
        resumed = plan_epoch(flat, cursors=(cursor,), layout=layout, **common)  # type: ignore[arg-type]
        assert len(resumed) < len(plan) and resumed.unit_of[0] >= 0
        deal = Deal(order.total, world, 16384)
        future = [rank_unit_sequence(order, deal, rank, deal.length(drop_last=False)) for rank in range(world)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert abs(len(plan) - 10**10 / world / 4) <= 64
    assert all(0 <= unit < 10_000 for unit in first) and set(sequence) <= set(range(10_000))
    assert all(len(units) > 0 for units in future)
    # per sample this would be 720 GB (72 bytes a sample); per shard and per block it is a few MB
    assert peak < 200 * 2**20, f"peak {peak / 2**20:.0f} MiB"


@st.composite
def weighted_mixes(draw: st.DrawFn) -> tuple[list[np.ndarray], np.ndarray]:
    """Sources (unit counts each), weights and an epoch size, as the counts `source_counts` makes of them."""
    units = [np.asarray(u, dtype=np.int64) for u in draw(units_strategy)]
    weights = [draw(st.floats(0.01, 1.0)) for _ in units]
    epoch_size = draw(st.integers(0, 3 * sum(int(u.sum()) for u in units)))
    sizes, modes = [int(u.sum()) for u in units], [("weight", w) for w in weights]
    counts = source_counts(sizes, modes, [""] * len(units), epoch_size)
    return units, counts


@settings(max_examples=300, deadline=None)
@given(mix=weighted_mixes(), seed=st.integers(0, 2**40), epoch=st.integers(0, 12), window=st.integers(1, 9))
def test_no_sample_repeats_within_an_epoch_while_its_count_fits_the_source(
    mix: tuple[list[np.ndarray], np.ndarray], seed: int, epoch: int, window: int
) -> None:
    """README: "within an epoch no sample repeats while c_s <= n_s", in every epoch, not only in the first."""
    units, counts = mix
    order = _order(units, counts, seed=seed, epoch=epoch, windows=[window] * len(units))
    drawn = _split(order, order.ids(np.arange(order.total, dtype=np.int64)))
    for u, count, ids in zip(units, counts.tolist(), drawn, strict=True):
        if count <= int(u.sum()):
            assert len(set(ids)) == count, f"a sample repeats in epoch {epoch} ({count} of {int(u.sum())})"
    # What the readers open for a range of a source's draws holds every sample those draws read.
    bounds = exclusive_sum(np.concatenate(units))
    ids = order.ids(np.arange(order.total, dtype=np.int64))
    source, index = order.interleave.locate(np.arange(order.total, dtype=np.int64))
    for s, draw in enumerate(order.draws):
        starts = np.arange(0, draw.count, 3, dtype=np.int64)
        which, opened = draw.units_of_ranges(starts, np.minimum(starts + 4, draw.count))
        first_unit = sum(len(u) for u in units[:s])
        for r, begin in enumerate(starts.tolist()):
            mine = ids[(source == s) & (index >= begin) & (index < begin + 4)]
            needed = set((np.searchsorted(bounds, mine, side="right") - 1 - first_unit).tolist())
            assert needed <= set(opened[which == r].tolist()), "a range reads a unit it was not told of"


def test_the_reported_mix_repeats_no_sample_in_any_of_several_epochs() -> None:
    """Issue 34 item 4: weights 0.7/0.3, epoch_size=1000, sources of 1,200 and 300: epoch 1 had 59 repeats."""
    units = [np.full(12, 100, dtype=np.int64), np.full(3, 100, dtype=np.int64)]
    counts = source_counts([1200, 300], [("weight", 0.7), ("weight", 0.3)], ["a", "b"], 1000)
    assert counts.tolist() == [700, 300]
    read: list[list[int]] = []
    for epoch in range(8):
        order = _order(units, counts, seed=0, epoch=epoch, windows=[100, 100])
        big, small = _split(order, order.ids(np.arange(order.total, dtype=np.int64)))
        assert len(set(big)) == 700 and sorted(small) == list(range(300)), f"epoch {epoch}"
        read.append(big)
    # Two epochs of 700 read every one of the 1,200 before the next pass starts.
    assert set(read[0] + read[1]) == set(range(1200)) and set(read[2] + read[3]) == set(range(1200))
