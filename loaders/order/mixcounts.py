"""How many samples each source of a mix gives an epoch, and each source's seed (pure arithmetic).

**How many** (`source_counts`): with weights, the epoch holds ``epoch_size`` samples (default:
every source's size added up) split in proportion to the weights; otherwise each source gives
``repeat`` times its size (default 1) or ``choose`` samples, and ``epoch_size``, when given,
scales those counts to it. Counts are apportioned by largest remainder, so they add up to the
epoch exactly.

Which samples, and in what order, is `order.mixed.MixedOrder`: computed per position, O(shards +
sources).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from datacache.errors import ConfigError

__all__ = ["apportion", "source_counts", "source_seed"]

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
