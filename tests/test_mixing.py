"""The arithmetic of mixed epochs and the parsing of sources: pure functions, no I/O."""

from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest
from datacache.loaders import Source
from datacache.loaders.order.mixcounts import apportion, source_counts
from datacache.loaders.order.mixed import Interleave, MixedOrder, SourceDraw
from datacache.loaders.sources import resolve_sources

from datacache.config import DatasetConfig
from datacache.errors import ConfigError

WINDOW = 10_000
TOLERANCE = 0.02
"""Every window of 10,000 samples holds each source within 2 points of its weight (issue 14's target)."""


def mixed_order(units: list[np.ndarray], counts: np.ndarray, **options: object) -> np.ndarray:
    """Every flat id of the epoch, in order (O(samples): small mixes only)."""
    order = MixedOrder.of(units, counts, **options)  # type: ignore[arg-type]
    return order.ids(np.arange(order.total, dtype=np.int64))


def source_draw(units: np.ndarray, *, seed: int, epoch: int, count: int, **options: object) -> np.ndarray:
    draw = SourceDraw(units, seed, epoch, count, **options)  # type: ignore[arg-type]
    return draw.ids(np.arange(count, dtype=np.int64))


def interleave(counts: list[int], *, seed: int, epoch: int) -> np.ndarray:
    sources: np.ndarray = Interleave(np.asarray(counts), seed, epoch).locate(np.arange(sum(counts)))[0]
    return sources


def _worst_window(labels: np.ndarray, shares: np.ndarray, window: int, step: int = 250) -> float:
    worst = 0.0
    for start in range(0, len(labels) - window + 1, step):
        found = np.bincount(labels[start : start + window], minlength=len(shares)) / window
        worst = max(worst, float(np.abs(found - shares).max()))
    return worst


def _source_of(order: np.ndarray, sizes: list[int]) -> np.ndarray:
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    return np.searchsorted(offsets, order, side="right") - 1


@pytest.mark.parametrize("weights", [(0.5, 0.3, 0.2), (0.37, 0.33, 0.3), (0.9, 0.07, 0.03)])
def test_weights_hold_in_every_window_of_10000(weights: tuple[float, ...]) -> None:
    sizes = [60_000, 60_000, 6_000]  # one source ten times smaller: it cycles
    units = [np.full(size // 500, 500, dtype=np.int64) for size in sizes]
    counts = source_counts(sizes, [("weight", w) for w in weights], ["a", "b", "c"], 100_000)
    assert counts.sum() == 100_000
    assert np.abs(counts / 100_000 - np.array(weights)).max() <= 1e-5
    for epoch in (0, 1):
        order = mixed_order(units, counts, seed=3, epoch=epoch, shuffle=True, windows=[1000] * 3, replacement=False)
        labels = _source_of(order, sizes)
        assert _worst_window(labels, np.array(weights), WINDOW) <= TOLERANCE
        # ... and per 1,000 too, far tighter than independent coin flips (about 1.5 points at 0.5)
        assert _worst_window(labels, np.array(weights), 1000, step=100) <= 0.005


def test_independent_draws_would_miss_the_target() -> None:
    # What the interleave is for: per-sample coin flips drift past 2 points in windows of 10,000.
    rng = np.random.default_rng(0)
    flips = rng.choice(3, size=1_000_000, p=[0.5, 0.3, 0.2])
    assert _worst_window(flips, np.array([0.5, 0.3, 0.2]), WINDOW, step=2000) > 0.01
    stratified = interleave([500_000, 300_000, 200_000], seed=0, epoch=0)
    assert _worst_window(stratified, np.array([0.5, 0.3, 0.2]), WINDOW, step=2000) <= 0.001


def test_every_source_once_by_default_and_each_sample_exactly_once() -> None:
    sizes = [1000, 300, 70]
    units = [np.full(size // 10, 10, dtype=np.int64) for size in sizes]
    counts = source_counts(sizes, [("repeat", 1.0)] * 3, ["a", "b", "c"], None)
    assert counts.tolist() == sizes
    order = mixed_order(units, counts, seed=1, epoch=4, shuffle=True, windows=[64] * 3, replacement=False)
    assert sorted(order.tolist()) == list(range(sum(sizes)))


def test_repeat_multiplies_and_choose_fixes_the_count() -> None:
    sizes = [100, 100, 100]
    units = [np.full(10, 10, dtype=np.int64)] * 3
    counts = source_counts(sizes, [("repeat", 2.0), ("repeat", 0.5), ("choose", 30.0)], ["a", "b", "c"], None)
    assert counts.tolist() == [200, 50, 30]
    order = mixed_order(units, counts, seed=2, epoch=0, shuffle=True, windows=[16] * 3, replacement=False)
    seen = Counter(order.tolist())
    assert all(seen[i] == 2 for i in range(100)), "repeat=2: every sample exactly twice"
    b = [i for i in seen if 100 <= i < 200]
    c = [i for i in seen if 200 <= i < 300]
    assert len(b) == 50 and all(seen[i] == 1 for i in b), "repeat=0.5: half the samples, once each"
    assert len(c) == 30 and all(seen[i] == 1 for i in c), "choose=30: 30 distinct samples"


def test_epoch_size_scales_repeat_and_choose_in_proportion() -> None:
    counts = source_counts([100, 100], [("repeat", 2.0), ("choose", 100.0)], ["a", "b"], 30)
    assert counts.tolist() == [20, 10]


def test_consecutive_epochs_cover_the_source_before_any_sample_repeats() -> None:
    units = np.full(25, 40, dtype=np.int64)  # 1,000 samples
    epochs = [
        source_draw(units, seed=9, epoch=e, count=300, shuffle=True, window=64, replacement=False) for e in range(7)
    ]
    first_three = np.concatenate(epochs[:3])
    assert len(set(first_three.tolist())) == 900, "no repeat within the first 900 samples"
    assert set(np.concatenate(epochs[:4]).tolist()) == set(range(1000)), "four epochs of 300 cover 1,000"
    assert all(len(set(epoch.tolist())) == 300 for epoch in epochs), "no repeat within an epoch"
    # A pass lasts four epochs: the fourth reads its last 100 and tops up with 200 of its first epoch's.
    assert sorted(np.concatenate([*epochs[:3], epochs[3][:100]]).tolist()) == list(range(1000))
    assert set(epochs[3][100:].tolist()) <= set(epochs[0].tolist())
    second = np.concatenate([*epochs[4:7]])  # the next pass: a fresh permutation
    assert len(set(second.tolist())) == 900 and not np.array_equal(second, first_three)


def test_a_small_source_cycles_through_fresh_permutations() -> None:
    units = np.full(5, 20, dtype=np.int64)  # 100 samples, asked for 250 an epoch
    drawn = source_draw(units, seed=4, epoch=0, count=250, shuffle=True, window=16, replacement=False)
    for start in (0, 100):
        assert sorted(drawn[start : start + 100].tolist()) == list(range(100))
    assert len(set(drawn[200:].tolist())) == 50


def test_with_replacement_draws_within_the_source_and_repeats() -> None:
    units = np.full(10, 100, dtype=np.int64)
    drawn = source_draw(units, seed=4, epoch=0, count=1000, shuffle=True, window=64, replacement=True)
    assert len(drawn) == 1000 and drawn.min() >= 0 and drawn.max() < 1000
    assert len(set(drawn.tolist())) < 700, "1,000 draws of 1,000 with replacement repeat about 37%"
    again = source_draw(units, seed=4, epoch=0, count=1000, shuffle=True, window=64, replacement=True)
    assert np.array_equal(drawn, again)
    other = source_draw(units, seed=4, epoch=1, count=1000, shuffle=True, window=64, replacement=True)
    assert not np.array_equal(np.sort(drawn), np.sort(other))


def test_the_mix_depends_only_on_seed_and_epoch() -> None:
    units = [np.full(20, 10, dtype=np.int64), np.full(3, 10, dtype=np.int64)]
    counts = np.array([150, 50])

    def order(seed: int, epoch: int) -> list[int]:
        found = mixed_order(units, counts, seed=seed, epoch=epoch, shuffle=True, windows=[32, 32], replacement=False)
        return list(found.tolist())

    assert order(5, 2) == order(5, 2)
    assert order(5, 2) != order(5, 3)
    assert order(5, 2) != order(6, 2)


def test_apportion_adds_up_exactly() -> None:
    for total in (0, 1, 7, 999, 100_003):
        assert apportion(total, [1 / 3, 1 / 3, 1 / 3]).sum() == total
    assert apportion(10, [0.0, 1.0]).tolist() == [0, 10]


# -- sources as the user writes them --------------------------------------------------------


def test_a_brace_pattern_is_its_directory_filtered_to_the_named_shards() -> None:
    (spec,) = resolve_sources("s3://bucket/ds/shard-{00000..00003}.tar")
    assert spec.dataset == "s3://bucket/ds/"
    assert spec.keys == ("shard-00000.tar", "shard-00001.tar", "shard-00002.tar", "shard-00003.tar")
    assert "{" not in DatasetConfig("x", str(spec.dataset)).id


def test_a_list_of_shard_urls_groups_by_directory() -> None:
    specs = resolve_sources(["s3://b/ds/a.tar", "s3://b/ds/b.tar", "s3://b/other/c.tar", "s3://b/ds2/"])
    assert [(s.dataset, s.keys) for s in specs] == [
        ("s3://b/ds/", ("a.tar", "b.tar")),
        ("s3://b/other/", ("c.tar",)),
        ("s3://b/ds2/", None),
    ]


def test_a_list_with_weights_is_one_source_each() -> None:
    specs = resolve_sources(["s3://b/x/", "s3://b/y/{0..1}.tar"], weights=[0.7, 0.3])
    assert [(s.dataset, s.keys, s.mode) for s in specs] == [
        ("s3://b/x/", None, ("weight", 0.7)),
        ("s3://b/y/", ("0.tar", "1.tar"), ("weight", 0.3)),
    ]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Source("s3://b/x/", weight=-1), "weight must be a finite number >= 0"),
        (lambda: Source("s3://b/x/", weight=0.5, choose=10), "give one of weight, repeat or choose"),
        (lambda: Source("s3://b/x/", choose=2.5), "choose must be an integer"),
        (lambda: Source("s3://b/x/", repeat=float("nan")), "repeat must be a finite number"),
        (lambda: resolve_sources(["s3://b/x/", "s3://b/y/"], weights=[1.0]), "weights= has 1 values for 2 sources"),
        (lambda: resolve_sources("s3://b/x/", weights=[1.0]), "weights= needs a list of sources"),
        (lambda: resolve_sources([]), "the list of sources is empty"),
        (lambda: resolve_sources("s3://b/x/shard-{0..3.tar"), "Unbalanced braces"),
        (lambda: resolve_sources("s3://b/x/shard-{0}.tar"), "leaves braces unexpanded"),
        (lambda: resolve_sources(["s3://b/x/a.tar", "s3://b/x/a.tar"]), "named twice"),
        (lambda: resolve_sources([Source("s3://b/x/")], weights=[1.0]), "give its weight as Source"),
        (lambda: resolve_sources([Source(["s3://b/x/a.tar", "s3://b/y/b.tar"], weight=1)]), "2 directories"),
        (lambda: resolve_sources(42), "expected a dataset"),  # type: ignore[arg-type]
        (lambda: source_counts([5, 5], [("weight", 1.0), ("repeat", 1.0)], ["a", "b"], None), "weights and"),
        (lambda: source_counts([5, 5], [("weight", 0.0), ("weight", 0.0)], ["a", "b"], None), "every weight is zero"),
        (lambda: source_counts([5, 0], [("weight", 1.0), ("weight", 1.0)], ["a", "b"], None), "source b has no"),
    ],
)
def test_bad_sources_are_refused_with_a_clear_error(make: object, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        make()  # type: ignore[operator]


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ([Source("/nowhere/x/", weight=1.0), Source("/nowhere/y/", repeat=2)], "weights and repeat/choose do not mix"),
        ([Source("/nowhere/x/", weight=1.0), "/nowhere/y/"], "weights and repeat/choose do not mix"),
        ([Source("/nowhere/x/", weight=0.0), Source("/nowhere/y/", weight=0.0)], "every weight is zero"),
    ],
)
def test_shares_that_cannot_mix_are_refused_when_the_dataset_is_made(sources: list[object], message: str) -> None:
    """Not at the first len() or iter(), after the sources were opened (issue 24 item 10)."""
    from datacache.loaders import CachedIterableDataset

    with pytest.raises(ConfigError, match=re.escape(message)):
        CachedIterableDataset(sources)  # type: ignore[arg-type]
