"""The epoch plan at any scale: a keyed bijection per window, dealing in closed form, resume by windows.

Pure arithmetic, so Hypothesis checks the properties over many layouts; memory is measured with
tracemalloc (allocations, not time) for datasets of up to 1e10 samples.
"""

from __future__ import annotations

import tracemalloc
from collections import Counter

import numpy as np
import pytest
from datacache.loaders.order.layout import Cursor, Dealing, Layout
from datacache.loaders.order.permute import mix_key, permute, permute_windows, unpermute
from datacache.loaders.order.windows import WindowedOrder, exclusive_sum
from datacache.loaders.plans.positions import node_unit_sequences, plan_epoch
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 5000), key=st.integers(0, 2**64 - 1))
def test_the_window_permutation_is_a_bijection_that_inverts_exactly(n: int, key: int) -> None:
    positions = np.arange(n, dtype=np.int64)
    moved = permute(positions, n, key)
    assert sorted(moved.tolist()) == list(range(n))
    assert unpermute(moved, n, key).tolist() == positions.tolist()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 13, 251, 65521, 65537])
def test_the_permutation_holds_for_primes_and_one(n: int) -> None:
    positions = np.arange(n, dtype=np.int64)
    for key in (0, 1, 2**63 + 5):
        moved = permute(positions, n, key)
        assert np.array_equal(np.sort(moved), positions)
        assert np.array_equal(unpermute(moved, n, key), positions)


def test_the_permutation_depends_on_its_key_and_shuffles() -> None:
    positions = np.arange(1000, dtype=np.int64)
    one, two = permute(positions, 1000, 1), permute(positions, 1000, 2)
    assert not np.array_equal(one, two)
    assert not np.array_equal(one, positions)
    # each window of a whole order gets its own key: one call spans windows
    windows = permute(positions % 100, 100, positions // 100)
    assert not np.array_equal(windows[:100], windows[100:200])


@settings(max_examples=200, deadline=None)
@given(
    window=st.integers(1, 700),
    total=st.integers(1, 5000),
    start=st.integers(0, 5000),
    length=st.integers(0, 3000),
    seed=st.integers(0, 2**64 - 1),
)
def test_a_window_at_a_time_permutes_as_one_key_per_position(
    window: int, total: int, start: int, length: int, seed: int
) -> None:
    # The epoch's order asks for runs of positions of one window; computed run by run with scalar
    # keys, each position must land where the elementwise permutation (one key each) puts it.
    positions = np.arange(min(start, total - 1), min(start + length, total), dtype=np.int64)
    number = positions // window
    size = np.minimum(window, total - number * window)
    expected = permute(positions - number * window, size, mix_key(seed, 1, number))
    got = permute_windows(positions - number * window, number, size, lambda w: mix_key(seed, 1, w))
    assert got.tolist() == expected.tolist()
    shuffled = np.random.default_rng(seed % 2**32).permutation(len(positions))  # runs of one position
    offsets, numbers = (positions - number * window)[shuffled], number[shuffled]
    got = permute_windows(offsets, numbers, size[shuffled], lambda w: mix_key(seed, 1, w))
    assert got.tolist() == expected[shuffled].tolist()


def _ids(plan: object, counts: np.ndarray, upto: int | None = None) -> list[int]:
    bounds = exclusive_sum(counts)
    length = len(plan)  # type: ignore[arg-type]
    stop = length if upto is None else min(upto, length)
    units = [plan.unit_of[i] for i in range(stop)]  # type: ignore[attr-defined]
    local = [plan.local[i] for i in range(stop)]  # type: ignore[attr-defined]
    return [int(bounds[u]) + int(v) for u, v in zip(units, local)]


counts_strategy = st.lists(st.integers(0, 40), min_size=1, max_size=12).map(lambda c: np.asarray(c, dtype=np.int64))


@settings(max_examples=150, deadline=None)
@given(
    counts=counts_strategy,
    world=st.integers(1, 8),
    workers=st.integers(0, 3),
    chunk=st.integers(1, 5),
    window=st.integers(1, 9),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**40),
)
def test_every_sample_once_and_equal_lengths_for_any_layout(
    counts: np.ndarray, world: int, workers: int, chunk: int, window: int, drop_last: bool, seed: int
) -> None:
    total = int(counts.sum())
    readers = max(1, workers)
    seen: list[int] = []
    padded = 0
    per_rank = []
    for rank in range(world):
        rank_total = 0
        for worker in range(readers):
            layout = Layout(world, rank, readers, worker, chunk)
            plan = plan_epoch(
                counts, dealing=Dealing(seed, True, drop_last), epoch=3, window=window, cursors=(), layout=layout
            )
            ids = _ids(plan, counts)
            padded += plan.padded
            seen.extend(ids[: len(ids) - plan.padded] if plan.padded else ids)
            rank_total += len(ids)
            released: list[int] = []
            for position in range(len(plan)):
                unit = plan.unit_of[position]
                assert plan.first_use[unit] <= position <= plan.last_use[unit]
                for closed in plan.releases_after(position):
                    assert plan.last_use[closed] == position, "a unit is closed after its last use, not before"
                    released.append(closed)
            assert len(released) == len(set(released)), "a unit is closed once"
            assert {int(u) for u in plan.unit_of} <= set(released), "every unit read is closed"
        per_rank.append(rank_total)
    assert len(set(per_rank)) == 1, "every rank reads as many samples"
    if drop_last:
        assert per_rank[0] == total // world
        assert len(seen) == len(set(seen)) and len(seen) >= total - world + 1
    else:
        assert sorted(set(seen)) == list(range(total)) and len(seen) == total
        assert padded < world


@settings(max_examples=150, deadline=None)
@given(
    counts=counts_strategy,
    before=st.tuples(st.integers(1, 8), st.integers(1, 3), st.integers(1, 4)),
    after=st.tuples(st.integers(1, 8), st.integers(1, 3), st.integers(1, 4)),
    fractions=st.lists(st.floats(0, 1), min_size=3, max_size=3),
    window=st.integers(1, 9),
    twice=st.booleans(),
)
def test_resume_on_another_layout_reads_the_rest_exactly(
    counts: np.ndarray,
    before: tuple[int, int, int],
    after: tuple[int, int, int],
    fractions: list[float],
    window: int,
    twice: bool,
) -> None:
    total = int(counts.sum())
    common = {"dealing": Dealing(5, True, False), "epoch": 1, "window": window}
    consumed: list[int] = []
    cursors: tuple[Cursor, ...] = ()
    layouts = [before, after] if not twice else [before, after, before]
    for world, workers, chunk in layouts[:-1]:
        lengths = [
            len(plan_epoch(counts, cursors=cursors, layout=Layout(world, 0, workers, w, chunk), **common))  # type: ignore[arg-type]
            for w in range(workers)
        ]
        produced = tuple(int(n * f) for n, f in zip(lengths, fractions))
        for rank in range(world):
            for worker in range(workers):
                layout = Layout(world, rank, workers, worker, chunk)
                plan = plan_epoch(counts, cursors=cursors, layout=layout, **common)  # type: ignore[arg-type]
                consumed.extend(_ids(plan, counts, produced[worker]))
        cursors = (*cursors, Cursor(world, workers, chunk, produced))
    world, workers, chunk = layouts[-1]
    resumed: list[int] = []
    for rank in range(world):
        for worker in range(workers):
            plan = plan_epoch(counts, cursors=cursors, layout=Layout(world, rank, workers, worker, chunk), **common)  # type: ignore[arg-type]
            resumed.extend(_ids(plan, counts))
    everything = Counter(consumed + resumed)
    assert set(everything) == set(range(total)), "a sample was skipped"
    assert sum(n - 1 for n in everything.values()) < 3 * 8, "only padding repeats"


def test_the_order_depends_only_on_seed_and_epoch() -> None:
    counts = np.asarray([7, 3, 0, 11, 5], dtype=np.int64)
    one = WindowedOrder(counts, 9, 2, True, 4).ids(np.arange(26))
    assert np.array_equal(one, WindowedOrder(counts.copy(), 9, 2, True, 4).ids(np.arange(26)))
    assert not np.array_equal(one, WindowedOrder(counts, 9, 3, True, 4).ids(np.arange(26)))
    assert np.array_equal(WindowedOrder(counts, 9, 2, False, 4).ids(np.arange(26)), np.arange(26))


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 300), min_size=1, max_size=12),
    seed=st.integers(0, 2**32),
    shuffle=st.booleans(),
    window=st.integers(1, 700),
    run=st.integers(1, 400),
)
def test_a_positions_unit_and_row_come_from_the_order_as_its_id_says(
    counts: list[int], seed: int, shuffle: bool, window: int, run: int
) -> None:
    """`WindowedOrder.places` (what a reader's plan reads) is `ids` located among the units' starts."""
    order = WindowedOrder(np.asarray(counts, dtype=np.int64), seed, 1, shuffle, window)
    positions = np.arange(order.total, dtype=np.int64)
    ids = order.ids(positions)
    starts = exclusive_sum(np.asarray(counts, dtype=np.int64))
    unit, local = order.places(positions)
    assert np.array_equal(unit, np.searchsorted(starts, ids, side="right") - 1)
    assert np.array_equal(starts[unit] + local, ids)
    assert np.all((local >= 0) & (local < np.asarray(counts)[unit]))
    for begin in range(0, order.total, run):  # runs as a reader asks for them: many inside one unit
        some, rows = order.places(positions[begin : begin + run])
        assert np.array_equal(some, unit[begin : begin + run]) and np.array_equal(rows, local[begin : begin + run])


@pytest.mark.parametrize("world", [1, 8])
def test_a_plan_of_ten_billion_samples_costs_what_its_shards_cost(world: int) -> None:
    counts = np.full(10_000, 1_000_000, dtype=np.int64)  # 1e10 samples in 1e4 shards
    tracemalloc.start()
    try:
        layout = Layout(world, world - 1, 4, 3, 64)
        common = {"dealing": Dealing(1, True, False), "epoch": 0, "window": 16384}
        plan = plan_epoch(counts, cursors=(), layout=layout, **common)  # type: ignore[arg-type]
        first = [plan.unit_of[i] for i in range(100)]
        resumed = plan_epoch(
            counts, cursors=(Cursor(world, 4, 64, (10**6, 10**6 + 64, 10**6, 10**6)),), layout=layout, **common
        )  # type: ignore[arg-type]
        assert len(resumed) < len(plan) and resumed.unit_of[0] >= 0
        future = node_unit_sequences(counts, cursors=(), layout=layout, **common)  # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert abs(len(plan) - 10**10 / world / 4) <= 64, "a quarter of the rank's samples, give or take a chunk"
    assert all(0 <= unit < 10_000 for unit in first)
    assert len(future) == world * 4 and all(len(units) for units in future.values())
    # per sample this would be 80 GB; per shard and per window it is a few MB
    assert peak < 200 * 2**20, f"peak {peak / 2**20:.0f} MiB"


def test_planning_a_million_shards_at_rank_3_of_8_traces_at_most_70_bytes_a_shard() -> None:
    # The reader's plan, this epoch's order and the next epoch's (the node's future) need the counts'
    # running sum each: built once and shared, with the shard permutations held as int32, the plan's
    # peak is ~60 bytes a shard; a sum built per holder and int64 permutations made it ~84.
    from datacache.loaders.epochs.dataset import indexed_plan
    from datacache.loaders.plans.positions import auto_window

    shards = 1_000_000
    counts = np.full(shards, 1000, dtype=np.int64)
    tracemalloc.start()
    try:
        window = auto_window(int(counts.sum()), shards)
        plan = indexed_plan(counts, Layout(8, 3, 1, 0, 64), Dealing(3, True, False), epoch=0, cursors=(), window=window)
        future = plan.future()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert future is not None and plan.positions.unit_of[0] >= 0
    assert counts.flags.writeable, "the caller's counts are not frozen under it"
    assert peak <= 70 * shards, f"peak {peak / shards:.0f} bytes a shard"
