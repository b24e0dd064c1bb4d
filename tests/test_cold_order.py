"""The cold first epoch's arithmetic: whole shards dealt, settled to equal lengths, resumable anywhere."""

from __future__ import annotations

from collections import Counter

import numpy as np
from datacache.loaders.epochs.dataset import cold_plan
from datacache.loaders.order.cold import (
    WINDOW_UNITS,
    cold_remaining,
    final_stream,
    lower_bound_length,
    natural_stream,
    node_cold_sequences,
    rank_units,
)
from datacache.loaders.order.layout import Cursor, Layout, worker_positions
from datacache.loaders.order.windows import Deal
from datacache.loaders.plans.interface import Dealing
from datacache.loaders.testing import MemoryCounts, read_ids
from hypothesis import given, settings
from hypothesis import strategies as st

count_lists = st.lists(st.integers(0, 40), min_size=1, max_size=30)


@settings(max_examples=200, deadline=None)
@given(counts=count_lists, world=st.integers(1, 6), seed=st.integers(0, 2**40), drop_last=st.booleans())
def test_settled_streams_are_equal_and_read_each_sample_once(
    counts: list[int], world: int, seed: int, drop_last: bool
) -> None:
    sizes = np.asarray(counts, dtype=np.int64)
    total = int(sizes.sum())
    streams = [
        final_stream(sizes, seed=seed, epoch=3, shuffle=True, world_size=world, rank=r, drop_last=drop_last)
        for r in range(world)
    ]
    lengths = {len(s) for s, _ in streams}
    assert len(lengths) == 1, "every rank reads the same number of samples"
    seen = Counter(int(i) for s, repeats in streams for i in s[: len(s) - repeats])
    assert all(n == 1 for n in seen.values()), "no sample twice (repeats aside)"
    repeats = sum(r for _, r in streams)
    if drop_last:
        assert repeats == 0 and len(seen) == total // world * world
    else:
        assert len(seen) == total and repeats < world


@settings(max_examples=100, deadline=None)
@given(counts=count_lists, world=st.integers(1, 5), seed=st.integers(0, 2**40))
def test_a_rank_keeps_a_prefix_of_its_natural_stream_and_the_bound_never_overshoots(
    counts: list[int], world: int, seed: int
) -> None:
    """What a reader produces before the index is complete is never taken back by settling."""
    sizes = np.asarray(counts, dtype=np.int64)
    for rank in range(world):
        natural = natural_stream(sizes, seed=seed, epoch=0, shuffle=True, world_size=world, rank=rank)
        settled, _ = final_stream(sizes, seed=seed, epoch=0, shuffle=True, world_size=world, rank=rank, drop_last=True)
        bound = min(len(natural), lower_bound_length(int(sizes.sum()), world))
        assert np.array_equal(settled[:bound], natural[:bound])


def test_the_first_window_needs_only_two_shards() -> None:
    counts = np.full(200, 50, dtype=np.int64)
    units = rank_units(200, seed=1, epoch=0, shuffle=True, world_size=4, rank=2)
    natural = natural_stream(counts, seed=1, epoch=0, shuffle=True, world_size=4, rank=2)
    first = set((natural[: 50 * WINDOW_UNITS] // 50).tolist())
    assert first == set(units[:WINDOW_UNITS].tolist())


@settings(max_examples=100, deadline=None)
@given(
    counts=count_lists,
    before=st.integers(1, 4),
    after=st.integers(1, 4),
    workers=st.integers(1, 3),
    chunk=st.integers(1, 5),
    fraction=st.floats(0, 1),
    seed=st.integers(0, 2**40),
)
def test_resume_of_a_cold_epoch_on_another_world_size_is_exactly_once(
    counts: list[int], before: int, after: int, workers: int, chunk: int, fraction: float, seed: int
) -> None:
    sizes = np.asarray(counts, dtype=np.int64)
    consumed: list[int] = []
    produced_by_rank = []
    for rank in range(before):
        stream, _ = final_stream(sizes, seed=seed, epoch=1, shuffle=True, world_size=before, rank=rank, drop_last=False)
        indexes = np.arange(len(stream))
        produced = []
        for worker in range(workers):
            mine = worker_positions(indexes, workers, worker, chunk)
            n = int(len(mine) * fraction)
            produced.append(n)
            consumed.extend(stream[mine[:n]].tolist())
        produced_by_rank.append(tuple(produced))
    assert len(set(produced_by_rank)) == 1, "equal streams: every rank's workers produce alike"
    cursor = Cursor(before, workers, chunk, produced_by_rank[0], cold=True)
    remaining = cold_remaining(sizes, cursor, seed=seed, epoch=1, shuffle=True, drop_last=False)
    resumed: list[int] = []
    for rank in range(after):
        deal = Deal(remaining.total, after, 4)
        spots = np.arange(deal.length(drop_last=False), dtype=np.int64)
        resumed.extend(remaining.ids(deal.positions(rank, spots)).tolist())
    everything = Counter(consumed + resumed)
    assert set(everything) == set(range(int(sizes.sum()))), "a sample was skipped"
    assert sum(n - 1 for n in everything.values()) < before + after, "only the final padding repeats"


def test_a_cursor_remembers_it_read_a_cold_epoch() -> None:
    cursor = Cursor(2, 1, 4, (8,), cold=True)
    assert Cursor.from_json(cursor.to_json()) == cursor
    assert "cold" not in Cursor(2, 1, 4, (8,)).to_json()


def test_the_cold_node_future_is_every_readers_shards_and_the_same_from_every_reader() -> None:
    futures = [
        {
            name: tuple(units.tolist())
            for name, units in node_cold_sequences(
                23, seed=7, epoch=0, shuffle=True, layout=Layout(3, rank, 2, worker, 4)
            ).items()
        }
        for rank in range(3)
        for worker in range(2)
    ]
    assert all(future == futures[0] for future in futures), "nothing for one reader to overwrite"
    future = futures[0]
    assert sorted(future) == [f"{rank}.{worker}" for rank in range(3) for worker in range(2)]
    for rank in range(3):
        mine = tuple(rank_units(23, seed=7, epoch=0, shuffle=True, world_size=3, rank=rank).tolist())
        assert future[f"{rank}.0"] == future[f"{rank}.1"] == mine, "each reader's shards in its rank's order"
    assert sorted(u for rank in range(3) for u in future[f"{rank}.0"]) == list(range(23))


@settings(max_examples=150, deadline=None)
@given(
    counts=count_lists,
    world=st.integers(1, 6),
    workers=st.integers(1, 3),
    chunk=st.integers(1, 4),
    seed=st.integers(0, 2**40),
    drop_last=st.booleans(),
    background=st.booleans(),
)
def test_the_growing_plan_deals_what_the_closed_form_says_position_by_position(
    counts: list[int], world: int, workers: int, chunk: int, seed: int, drop_last: bool, background: bool
) -> None:
    """`ColdPositions` (counts arriving as it reads) and `final_stream` (every count known) are one dealing.

    Resume (`cold_remaining`) computes what a cold epoch consumed from the closed form; readers
    produce it from the growing plan: they must agree at every position, for every worker.
    """
    sizes = np.asarray(counts, dtype=np.int64)
    dealing = Dealing(seed=seed, shuffle=True, drop_last=drop_last)
    for rank in range(world):
        stream, repeats = final_stream(
            sizes, seed=seed, epoch=4, shuffle=True, world_size=world, rank=rank, drop_last=drop_last
        )
        for worker in range(workers):
            layout = Layout(world, rank, workers, worker, chunk)
            plan = cold_plan(MemoryCounts(sizes, background=background), layout, dealing, epoch=4)
            grown = read_ids(plan, sizes)
            assert grown == stream[worker_positions(np.arange(len(stream)), workers, worker, chunk)].tolist()
            mine = worker_positions(np.arange(len(stream)), workers, worker, chunk)
            assert plan.positions.padded == int((mine >= len(stream) - repeats).sum())
