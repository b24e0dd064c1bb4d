"""A dataset bigger than the local tier: what training and `datacache warm` say about it.

A cache smaller than the dataset is the expected case, so the reason a shard is
read from the next tier is said once per dataset per process, naming the tier
that is full; `warm --tier local` says the sizes first, in one line.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from _helpers import REPO
from test_loader import write_wds

TRAIN = textwrap.dedent(
    """\
    import logging, sys
    from torch.utils.data import DataLoader
    from datacache.loaders import CachedIterableDataset

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(process)d %(levelname)s %(message)s")
    logging.getLogger("datacache.staging.local").setLevel(logging.DEBUG)  # the repeats too, to count them
    datasets = [CachedIterableDataset(url, seed=1) for url in sys.argv[2:]]
    for epoch in range(2):
        for ds in datasets:
            ds.set_epoch(epoch)
            for batch in DataLoader(ds, batch_size=4, num_workers=int(sys.argv[1])):
                pass
    """
)


def _train(tmp_path: Path, cache_env: dict[str, str], workers: int) -> list[str]:
    """The lines saying a shard bypassed the local tier, over two epochs of two datasets.

    Each dataset is 3x the tier's capacity; one is read through two objects.
    """
    origins = [tmp_path / name for name in ("a", "b")]
    for origin in origins:
        write_wds(origin, samples=80, per_shard=10)  # 8 shards
    size = sum(p.stat().st_size for p in origins[0].glob("*.tar"))
    env = {
        **cache_env,
        "DATACACHE_LOCAL_DIR": str(tmp_path / "local"),
        "DATACACHE_LOCAL_CAPACITY": str(size // 3),
        "PYTHONPATH": str(REPO),
    }
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    result = subprocess.run(
        # "a" twice: two dataset objects over one dataset in one process (a copy, a .map()) say it once too.
        [sys.executable, str(script), str(workers), *map(str, [origins[0], *origins])],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if " is read from the " in line]
    assert said, f"no process said why shards were read from the next tier:\n{result.stderr}"
    # (A shard another worker is staging is read from the next tier too, saying so.)
    full = [line for line in said if "tier is full" in line]
    named = re.compile(r"the local tier is full \([\d.]+ \w?B of its [\d.]+ \w?B\)")
    assert full and all(named.search(line) for line in full), said
    return said


def _warned(said: list[str]) -> tuple[Counter[tuple[str, str]], set[tuple[str, str]]]:
    """(process, dataset) -> WARNING lines; and every (process, dataset) that bypassed at all."""

    def who(line: str) -> tuple[str, str]:
        return line.split(maxsplit=1)[0], line.split("dataset ", 1)[1].split(":", maxsplit=1)[0]

    return Counter(who(line) for line in said if " WARNING " in line), {who(line) for line in said}


@pytest.mark.parametrize("workers", [0, 2])
def test_training_says_once_per_dataset_per_process_that_the_local_tier_is_full(
    tmp_path: Path, cache_env: dict[str, str], workers: int
) -> None:
    """Said several times per epoch per process, as "the tier is full" (which tier?)."""
    warned, bypassed = _warned(_train(tmp_path, cache_env, workers))
    assert set(warned) == bypassed, "each process says it for each dataset it bypasses for"
    assert max(warned.values()) == 1, f"said more than once at WARNING: {warned}"
