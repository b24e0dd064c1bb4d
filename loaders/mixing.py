"""The order of a mixed epoch: pure arithmetic on sample ids (numpy, no I/O, no torch).

**How many samples each source gives an epoch** (`source_counts`): with weights,
the epoch holds ``epoch_size`` samples (default: every source's size added up)
split in proportion to the weights; otherwise each source gives ``repeat``
times its size (default 1) or ``choose`` samples, and ``epoch_size``, when
given, scales those counts to it. Counts are apportioned by largest remainder,
so they add up to the epoch exactly.

**Which samples** (`source_draw`): without replacement, each source walks an
endless stream of its own permutations (a fresh one, seeded by ``(seed,
source, cycle)``, each time the source is exhausted), and epoch ``e`` takes the
``e``-th run of its count from that stream. So consecutive epochs cover the
whole source before any sample repeats, and a source smaller than its share
cycles. With replacement, each epoch draws its count uniformly with
replacement. The permutations are `sequence.epoch_order` (shards shuffled, samples
shuffled within windows), so a source's reads stay local to a few shards.

**How they interleave** (`interleave`): source ``s``'s ``j``-th sample sits at
``(j + u_s) / c_s`` of the epoch (``u_s`` a per-epoch offset in [0, 1)), and the
epoch is these points in order: every window of ``L`` positions holds
``L * c_s / E`` samples of source ``s``, give or take one or two, not the
random drift of independent draws.

The mixed order is a sequence of flat ids (source ``s``'s sample ``i`` is
``offset[s] + i``) that `epoch.plan_epoch` deals and resumes as it does one
dataset's order: positions, not ids, so repeats are dealt and resumed exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from datacache.loaders.sequence import epoch_order

from datacache.errors import ConfigError

__all__ = ["apportion", "interleave", "mixed_order", "source_counts", "source_draw", "source_seed"]

IntArray = npt.NDArray[np.int64]
_MIX_MAGIC = 0x4D4958


def apportion(total: int, shares: Sequence[float]) -> IntArray:
    """``total`` split in proportion to ``shares`` (largest remainder; ties to the earlier source)."""
    weights = np.asarray(shares, dtype=np.float64)
    exact = weights / weights.sum() * total
    counts: IntArray = np.floor(exact).astype(np.int64)
    left = total - int(counts.sum())
    if left > 0:
        remainders = exact - counts
        order = np.lexsort((np.arange(len(weights)), -remainders))
        counts[order[:left]] += 1
    return counts


def source_counts(
    sizes: Sequence[int], modes: Sequence[tuple[str, float]], labels: Sequence[str], epoch_size: int | None
) -> IntArray:
    """Samples each source gives one epoch (see the module's docstring); ``labels`` name them in errors."""
    kinds = {kind for kind, _ in modes}
    if "weight" in kinds and kinds != {"weight"}:
        raise ConfigError(
            "give every source a weight, or give none (each then uses repeat= or choose=, default repeat=1): "
            "weights and repeat/choose do not mix"
        )
    if "weight" in kinds:
        shares = [value for _, value in modes]
        if sum(shares) <= 0:
            raise ConfigError("every weight is zero: at least one source needs a positive weight")
        total = int(sum(sizes)) if epoch_size is None else epoch_size
        counts = apportion(total, shares)
    else:
        natural = [
            int(value) if kind == "choose" else round(value * size)
            for (kind, value), size in zip(modes, sizes, strict=True)
        ]
        if epoch_size is None:
            counts = np.asarray(natural, dtype=np.int64)
        elif sum(natural) <= 0:
            raise ConfigError(f"epoch_size={epoch_size} cannot be split: every source gives 0 samples")
        else:
            counts = apportion(epoch_size, natural)
    for count, size, label in zip(counts.tolist(), sizes, labels, strict=True):
        if count > 0 and size == 0:
            raise ConfigError(f"source {label} has no samples, but its share of the epoch is {count}")
    return counts


def source_seed(seed: int, source: int) -> int:
    """The seed of source ``source``'s permutations: distinct per source, a function of ``seed``."""
    state = np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, source, _MIX_MAGIC])
    return int(state.generate_state(1, np.uint64)[0] >> 1)


def source_draw(
    unit_counts: Sequence[int] | IntArray,
    *,
    seed: int,
    epoch: int,
    count: int,
    shuffle: bool,
    window: int,
    replacement: bool,
) -> IntArray:
    """Epoch ``epoch``'s ``count`` sample ids of one source (ids number its samples unit by unit).

    ``seed`` is the source's own (`source_seed`).
    """
    size = int(np.sum(unit_counts))
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    if replacement:
        rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, epoch, _MIX_MAGIC])
        drawn = rng.integers(0, size, count, dtype=np.int64)
        # In the order of this epoch's permutation: the same draw, read shard by shard.
        rank = np.empty(size, dtype=np.int64)
        rank[_cycle(unit_counts, seed, epoch, shuffle, window)] = np.arange(size, dtype=np.int64)
        ordered: IntArray = drawn[np.argsort(rank[drawn], kind="stable")]
        return ordered
    begin = epoch * count
    end = begin + count
    parts = [
        _cycle(unit_counts, seed, cycle, shuffle, window)[max(begin - cycle * size, 0) : end - cycle * size]
        for cycle in range(begin // size, -(-end // size))
    ]
    return np.concatenate(parts).astype(np.int64)


def _cycle(unit_counts: Sequence[int] | IntArray, seed: int, cycle: int, shuffle: bool, window: int) -> IntArray:
    return epoch_order(unit_counts, seed=seed, epoch=cycle, shuffle=shuffle, window=window)


def interleave(counts: Sequence[int] | IntArray, *, seed: int, epoch: int) -> IntArray:
    """Source labels of an epoch's positions: source ``s`` ``counts[s]`` times, evenly spread."""
    sizes = np.asarray(counts, dtype=np.int64)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32 & 0xFFFFFFFF, epoch, _MIX_MAGIC, 1])
    offsets = rng.random(len(sizes))
    labels = np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    nth = np.arange(len(labels), dtype=np.int64) - starts[labels]
    keys = (nth + offsets[labels]) / np.maximum(sizes[labels], 1)
    ordered: IntArray = labels[np.lexsort((labels, keys))]
    return ordered


def mixed_order(
    unit_counts: Sequence[IntArray],
    counts: Sequence[int] | IntArray,
    *,
    seed: int,
    epoch: int,
    shuffle: bool,
    windows: Sequence[int],
    replacement: bool,
) -> IntArray:
    """Every flat id epoch ``epoch`` reads, in order (source ``s``'s ids are offset by the sizes before it)."""
    sizes = [int(np.sum(units)) for units in unit_counts]
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    labels = interleave(counts, seed=seed, epoch=epoch)
    order = np.empty(len(labels), dtype=np.int64)
    for source, units in enumerate(unit_counts):
        draw = source_draw(
            units,
            seed=source_seed(seed, source),
            epoch=epoch,
            count=int(counts[source]),
            shuffle=shuffle,
            window=windows[source],
            replacement=replacement,
        )
        order[labels == source] = draw + offsets[source]
    return order
