"""The node's future as the stager holds it: index arrays into a key column, not per-key Python objects.

The array form must give Belady the very next uses the dict form gave (reader -> key -> positions,
kept here as the reference, with the waited-for rule as it was written over it); its memory is
measured with tracemalloc at rank 3 of 8; and its JSON form, which crosses the daemon's socket
from clients that are not trusted, is checked on parse.
"""

from __future__ import annotations

import bisect
import pickle
import tracemalloc
from collections.abc import Mapping, Sequence

import numpy as np
import pytest
from datacache.loaders.runtime import NodeFuture
from hypothesis import given, settings
from hypothesis import strategies as st

from datacache.formats._base import ShardUnits, UnitPlan
from datacache.manifest import Manifest, Shard, ShardFormat
from datacache.staging import FutureOrder
from datacache.staging.residency import Residency, _Uses, _waited_for, next_uses

_KEYS = [f"k{i}" for i in range(8)]


def _dict_form(order: Mapping[str, Sequence[str]]) -> dict[str, dict[str, list[int]]]:
    found: dict[str, dict[str, list[int]]] = {}
    for reader, keys in order.items():
        index: dict[str, list[int]] = {}
        for position, key in enumerate(keys):
            index.setdefault(key, []).append(position)
        found[reader] = index
    return found


def _waited_for_by_dicts(
    order: Mapping[str, Sequence[str]], where: Mapping[str, int], next_use: Mapping[str, int], key: str
) -> dict[str, int]:
    """`_waited_for` as it was over the dict form (before issue 35's arrays), for comparing."""
    positions = _dict_form(order)
    sequences: dict[tuple[str, ...], int] = {}
    sequence = {reader: sequences.setdefault(tuple(keys), len(sequences)) for reader, keys in order.items()}

    def reads_at(found: Sequence[int], position: int) -> bool:
        at = bisect.bisect_left(found, position)
        return at < len(found) and found[at] == position

    waiting = {r: p for r, p in where.items() if reads_at(positions[r].get(key, ()), p)}
    lead: dict[int, int] = {}
    for reader, position in waiting.items():
        lead[sequence[reader]] = max(position, lead.get(sequence[reader], position))
    later: int | None = None
    for reader, position in where.items():
        found = positions[reader].get(key, ())
        at = (bisect.bisect_right if reader in waiting else bisect.bisect_left)(found, position)
        if at < len(found):
            steps = max(0, found[at] - max(position, lead.get(sequence[reader], position)))
            later = steps if later is None else min(later, steps)
    result = dict(next_use)
    if later is None:
        return {k: v for k, v in result.items() if k != key}
    result[key] = later
    return result


_sequences = st.lists(st.sampled_from(_KEYS), max_size=24).map(tuple)


@st.composite
def _futures(draw: st.DrawFn) -> tuple[dict[str, tuple[str, ...]], dict[str, int]]:
    """Up to 3 ranks of up to 3 workers (a rank's workers share one sequence), and where some readers are."""
    order: dict[str, tuple[str, ...]] = {}
    for rank in range(draw(st.integers(1, 3))):
        keys = draw(_sequences)
        for worker in range(draw(st.integers(1, 3))):
            order[f"{rank}.{worker}"] = keys
    if draw(st.booleans()):  # two ranks that read the same sequence are rank-mates too
        order["9.0"] = tuple(order["0.0"])
    readers = draw(st.lists(st.sampled_from(sorted(order)), unique=True, max_size=len(order)))
    where = {reader: draw(st.integers(-2, 28)) for reader in readers}
    return order, where


@settings(max_examples=400, deadline=None)
@given(_futures(), st.booleans())
def test_the_array_form_gives_the_next_uses_and_waits_of_the_dict_form(
    future: tuple[dict[str, tuple[str, ...]], dict[str, int]], through_indices: bool
) -> None:
    order, where = future
    made = FutureOrder(0, order)
    if through_indices:  # the loader's form: a column of its own order, arrays handed over as they are
        column = FutureOrder(0, {"all": tuple(reversed(_KEYS))})
        at = {key: column.keys.position(key) for key in _KEYS}
        made = FutureOrder.of_indices(
            0, column.keys, {r: np.asarray([at[k] for k in keys]) for r, keys in order.items()}
        )
    uses = _Uses(made)
    asked = [*_KEYS, "not-in-the-order"]
    expected = next_uses(_dict_form(order), where)
    assert uses.next_uses(where, asked) == expected
    assert uses.next_uses(where, asked[:3]) == {k: v for k, v in expected.items() if k in asked[:3]}
    for key in _KEYS:
        if expected.get(key) == 0:
            assert _waited_for(uses, where, expected, key) == _waited_for_by_dicts(order, where, expected, key)


def test_the_forms_are_equal_and_one_that_grows_begins_with_the_other() -> None:
    by_keys = FutureOrder(1, {"0.0": ("a", "b", "c"), "0.1": ("a", "b", "c")})
    column = FutureOrder(1, {"x": ("c", "b", "a", "d")}).keys
    by_indices = FutureOrder.of_indices(1, column, {"0.0": np.asarray([2, 1, 0]), "0.1": np.asarray([2, 1, 0])})
    assert by_keys == by_indices and by_indices.readers == by_keys.readers
    longer = FutureOrder(1, {"0.0": ("a", "b", "c", "d"), "0.1": ("a", "b", "c", "a")})
    assert longer.begins(by_indices) and not by_indices.begins(longer) and longer != by_keys
    assert not FutureOrder(2, by_keys.readers).begins(by_keys)
    assert pickle.loads(pickle.dumps(by_indices)) == by_indices


def test_the_json_form_names_each_key_once_and_round_trips() -> None:
    order = FutureOrder(3, {"0.0": ("a", "b", "a"), "0.1": ("c",), "1.0": ()})
    sent = order.to_json()
    assert sorted(sent["keys"]) == ["a", "b", "c"] and len(sent["reads"]["0.0"]) == 3
    assert FutureOrder.from_json(sent) == order
    assert FutureOrder.from_json(sent).begins(FutureOrder.from_json(sent))  # two clients' equal columns
    # The form of key lists (a client of an earlier version) is still read.
    assert FutureOrder.from_json({"epoch": 3, "readers": {k: list(v) for k, v in order.readers.items()}}) == order


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"epoch": 0, "keys": ["a"], "reads": {"r": [1]}}, "outside"),
        ({"epoch": 0, "keys": ["a"], "reads": {"r": [-1]}}, "outside"),
        ({"epoch": 0, "keys": ["a"], "reads": {"r": [2**70]}}, "outside"),
        ({"epoch": 0, "keys": ["a"], "reads": {"r": [True]}}, "key indices"),
        ({"epoch": 0, "keys": ["a"], "reads": {"r": [0.0]}}, "key indices"),
        ({"epoch": 0, "keys": ["a"], "reads": {"r": "0"}}, "key indices"),
        ({"epoch": 0, "keys": ["a", "a"], "reads": {"r": [0]}}, "twice"),
        ({"epoch": 0, "keys": ["a", 1], "reads": {"r": [0]}}, "list of shard keys"),
        ({"epoch": 0, "keys": ["a"], "reads": [[0]]}, "object of readers"),
        ({"epoch": -1, "keys": [], "reads": {}}, "epoch"),
        ({"epoch": 0, "readers": {"r": [1]}}, "list of shard keys"),
        ([], "must be an object"),
    ],
)
def test_a_future_order_from_a_client_is_checked(data: object, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        FutureOrder.from_json(data)


def _rank_3_of_8(shards: int) -> tuple[Manifest, UnitPlan, NodeFuture]:
    """A manifest of ``shards`` of 1,000 samples, its plan of one unit a shard, and rank 3 of 8's node future."""
    from datacache.loaders.epochs.dataset import indexed_plan
    from datacache.loaders.order.layout import Dealing, Layout
    from datacache.loaders.plans.positions import auto_window

    manifest = Manifest(
        "synthetic",
        "s3://bucket/synthetic/",
        ShardFormat.PARQUET,
        tuple(Shard(f"part-{i:07d}.parquet", 4096, f"v{i}", None, 1000) for i in range(shards)),
    )
    counts = np.full(shards, 1000, dtype=np.int64)
    window = auto_window(shards * 1000, shards)
    plan = indexed_plan(counts, Layout(8, 3, 1, 0, 64), Dealing(3, True, False), epoch=0, cursors=(), window=window)
    future = plan.future()
    assert future is not None and len(future.units) == 8
    return manifest, UnitPlan(ShardUnits(manifest.table, counts), {}), future


def test_the_node_future_at_rank_3_of_8_costs_the_stager_at_most_20_bytes_a_shard() -> None:
    # Handed over in process as the units arrays and the manifest's key column, indexed as one int64
    # a read (8 ranks' sequences of this epoch and the next: two reads a shard): 16 bytes a shard,
    # 18 at the peak. As key tuples and a dict of key -> positions per reader it held 387 (main, 294359f).
    shards = 200_000
    manifest, units, future = _rank_3_of_8(shards)
    residency = Residency()
    tracemalloc.start()
    try:
        residency.set_future_order("synthetic", future.order(units))
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held <= 20 * shards, f"{held / shards:.0f} bytes a shard held"
    assert peak <= 32 * shards, f"peak {peak / shards:.0f} bytes a shard"
    first = manifest.table.key(int(future.units[future.reader][0]))
    assert residency._orders["synthetic"].next_uses({future.reader: 0}, [first]) == {first: 0}


def test_a_readers_first_key_positions_at_rank_3_of_8_hold_at_most_6_bytes_a_shard() -> None:
    # Two sorted arrays of this reader's units (~47,000 of 200,000 shards, two epochs'): ~4 bytes a
    # shard. As a dict of Python ints it held 27 (main, 294359f).
    shards = 200_000
    _, units, future = _rank_3_of_8(shards)
    tracemalloc.start()
    try:
        positions = future.key_positions(units)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held <= 6 * shards, f"{held / shards:.1f} bytes a shard held"
    first: dict[int, int] = {}
    for position, unit in enumerate(future.units[future.reader].tolist()):
        first.setdefault(unit, position)
    assert dict(positions.items()) == first and positions.get(shards + 1, -1) == -1
