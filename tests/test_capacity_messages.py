"""A dataset bigger than the local tier: what training and `datacache warm` say about it.

A cache smaller than the dataset is the expected case, so the reason a shard is
read from the next tier is said once per dataset per process, naming the tier
that is full; `warm --tier local` says the sizes first, in one line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from _helpers import REPO, fill_dir, make_shards, run_cli
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
    """The lines saying a shard bypassed the local tier, in one training run of two epochs of two datasets.

    Each dataset is 3x the tier's capacity; one is read through two objects. The run is a
    process group of its own, as torchrun starts each rank.
    """
    origins = [tmp_path / name for name in ("a", "b")]
    for origin in origins:
        if not origin.exists():
            write_wds(origin, samples=80, per_shard=10)  # 8 shards
    size = sum(p.stat().st_size for p in origins[0].glob("*.tar"))
    env = {
        **cache_env,
        "DATACACHE_LOCAL_DIR": str(tmp_path / "local"),
        "DATACACHE_LOCAL_CAPACITY": f"{size // 3}B",
        "PYTHONPATH": str(REPO),
    }
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    result = subprocess.run(
        # "a" twice: two dataset objects over one dataset in one process (a copy, a .map()) say it once too.
        [sys.executable, str(script), str(workers), *map(str, [origins[0], *origins])],
        env=env, capture_output=True, text=True, timeout=300, check=False, start_new_session=True,
    )
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if " is read from the " in line]
    assert said, f"no process said why shards were read from the next tier:\n{result.stderr}"
    # (A shard another worker is staging is read from the next tier too, saying so.)
    full = [line for line in said if "tier is full" in line]
    named = re.compile(r"the local tier is full \([\d.]+ \w?B of its [\d.]+ \w?B\)")
    assert full and all(named.search(line) for line in full), said
    return said


def _warned(said: list[str]) -> tuple[Counter[str], set[str]]:
    """Dataset -> WARNING lines about it (from any process of the run); every dataset that bypassed at all."""

    def dataset(line: str) -> str:
        return line.split("dataset ", 1)[1].split(":", maxsplit=1)[0]

    return Counter(dataset(line) for line in said if " WARNING " in line), {dataset(line) for line in said}


@pytest.mark.parametrize("workers", [0, 2])
def test_training_says_once_per_dataset_per_run_that_the_local_tier_is_full(
    tmp_path: Path, cache_env: dict[str, str], workers: int
) -> None:
    """Said several times per epoch per process (each epoch's new workers), as "the tier is full" (which?)."""
    for run in (1, 2):  # a later run is told again
        warned, bypassed = _warned(_train(tmp_path, cache_env, workers))
        assert set(warned) == bypassed, f"run {run}: each dataset is named"
        assert len(bypassed) == 2 and set(warned.values()) == {1}, f"run {run}: once per dataset: {warned}"


def test_warm_bigger_than_the_local_tier_says_the_sizes_in_one_line(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """It printed 10 per-shard 'not kept ... the tier is full' lines and '... and 17 more' first."""
    origin = fill_dir(tmp_path / "origin", make_shards(40, 30_000))  # 1.2 MB, 3x the tier
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(tmp_path / "local")}
    args = ["warm", str(origin), "--tier", "local", "--local-capacity", "400kB"]
    result = run_cli(args, env)
    assert result.returncode == 1, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("datacache:")]
    sizes = "datacache: dataset 1.20 MB > local capacity 400.00 kB: 13 of 40 shards kept (-v lists the others)"
    assert said[0] == sizes, said
    incomplete = "datacache: error: warm incomplete: 27 of 40 shards are not resident on the local tier"
    assert said[1:] == [incomplete], said
    # The details stay one flag away: every shard not kept, and why.
    verbose = run_cli([*args, "-v"], env)
    reasons = [line for line in verbose.stderr.splitlines() if line.startswith("datacache: shard ")]
    assert len(reasons) == 27 and all("not kept on the local tier: the local tier is full" in r for r in reasons)
    document = json.loads(run_cli([*args, "--json"], env).stdout.splitlines()[-1])
    assert len(document["failures"]) == 27, document


def test_warm_over_capacity_says_only_its_summary(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """A WARNING "shard ... is read from the origin tier" came first: a warm reads nothing, it stages."""
    origin = fill_dir(tmp_path / "origin", make_shards(5, 300_000))
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(tmp_path / "local")}
    result = run_cli(["warm", str(origin), "--local-capacity", "700kB"], env)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [
        "datacache: dataset 1.50 MB > local capacity 700.00 kB: 2 of 5 shards kept (-v lists the others)",
        "datacache: error: warm incomplete: 3 of 5 shards are not resident on the local tier",
    ], result.stderr


def test_warm_still_shows_a_shard_that_failed_for_another_reason(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """Only "not kept: no room" goes under -v; a shard that failed is an error the user sees."""
    shards = make_shards(4, 30_000)
    # The shard that goes away is small enough to find room whichever shard's room is reserved
    # first: 40 kB are free beside shard-0000, and after one 30 kB shard there are still 10 kB.
    # (A shard given no room is never read, so nothing could say it was missing.)
    shards["shard-0001.tar"] = shards["shard-0001.tar"][:10_000]
    origin = fill_dir(tmp_path / "origin", shards)
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(tmp_path / "local")}
    args = ["warm", str(origin), "--local-capacity", "70kB"]
    run_cli([*args, "--shards", "0:1"], env, check=True)  # the manifest is taken; then a shard goes away
    (origin / "shard-0001.tar").unlink()
    result = run_cli(args, env)
    assert result.returncode == 1, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("datacache:")]
    assert re.fullmatch(r"datacache: dataset 100.00 kB > local capacity 70.00 kB: 2 of 4 shards kept .*", said[0])
    assert len(said) == 3 and said[1].startswith("datacache: shard shard-0001.tar: "), said
    assert said[2].startswith("datacache: error: warm incomplete: "), said


def _resident(local: Path) -> dict[str, set[str]]:
    """The shard files of each dataset on the local tier (its directory: the dataset id)."""
    found: dict[str, set[str]] = {}
    for path in sorted((local / "data").glob("*/*.tar")):
        found.setdefault(path.parent.name.rsplit("-", 1)[0], set()).add(path.name)
    return found


def test_warm_of_some_shards_makes_room_among_the_datasets_shards_not_asked_for(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """`warm URL --shards 7:10` was refused when the dataset's other shards filled the tier (no-thrash keeps a
    dataset's shards rather than evict them for more of it): the shards asked for fitted, and were never staged."""
    a = fill_dir(tmp_path / "a", make_shards(10, 30_000))
    b = fill_dir(tmp_path / "b", make_shards(2, 30_000, seed=1))
    local = tmp_path / "local"
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(local), "DATACACHE_LOCAL_CAPACITY": "210kB"}  # 7 shards
    assert run_cli(["warm", str(a), "-q"], env).returncode == 1  # 7 of its 10 kept
    run_cli(["warm", str(b), "--shards", "0:1", "-q"], env, check=True)  # in place of one of a's
    assert {name: len(keys) for name, keys in _resident(local).items()} == {"a": 6, "b": 1}
    result = run_cli(["warm", str(a), "--shards", "7:10"], env)
    assert result.returncode == 0, result.stderr
    # 90 kB asked for, none free: b's shard is what eviction takes first anyway; two of a's not asked for make
    # up the rest (the least recently used), and no more.
    assert result.stdout.endswith("; made room by evicting 2 other shards of the dataset (60.00 kB)\n"), result.stdout
    held = _resident(local)
    assert set(held) == {"a"} and len(held["a"]) == 7
    assert {"shard-0007.tar", "shard-0008.tar", "shard-0009.tar"} <= held["a"]
    again = run_cli(["warm", str(a), "--shards", "7:10", "--json"], env, check=True)
    assert json.loads(again.stdout.splitlines()[-1])["shards_displaced"] == 0  # resident already: nothing to move


def test_a_pinned_datasets_shards_are_not_displaced_and_the_error_says_what_frees_room(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """Pinned shards are never evicted, a warm's neither: the refusal says how to free room, and that works."""
    origin = fill_dir(tmp_path / "c", make_shards(4, 30_000))
    config = tmp_path / "config.toml"
    config.write_text(f'[datasets.c]\nurl = "{origin}"\npin = true\n')
    env = {
        **cache_env,
        "DATACACHE_CONFIG": str(config),
        "DATACACHE_LOCAL_DIR": str(tmp_path / "local"),
        "DATACACHE_LOCAL_CAPACITY": "90kB",
    }
    assert run_cli(["warm", "c", "-q"], env).returncode == 1  # 3 of 4 kept
    result = run_cli(["warm", "c", "--shards", "3", "-q"], env)
    assert result.returncode == 1
    assert result.stderr.splitlines()[0] == (
        "datacache: the requested shards 30.00 kB do not fit in the room left on the local tier (`datacache ls` "
        "shows what holds it, `datacache evict DATASET` frees it): 0 of 1 shards kept (-v lists the others)"
    ), result.stderr
    run_cli(["evict", "c", "--shards", "shard-0000.tar"], env, check=True)
    assert "3/3 shards resident" in run_cli(["warm", "c", "--shards", "1:4", "-q"], env, check=True).stdout


def test_only_what_makes_the_shards_asked_for_fit_is_displaced() -> None:
    """None when the room and other datasets' shards suffice, or when even all of them would not; never a
    pinned dataset's, nor a shard a reader holds; else the least recently used, as few as it takes."""
    from datacache.catalog import CatalogEntry, ShardState
    from datacache.manifest import Shard
    from datacache.staging.warm import displaced_for

    def row(dataset: str, key: str, when: float, state: ShardState = ShardState.RESIDENT) -> CatalogEntry:
        return CatalogEntry(dataset, key, 10, None, "x", state, None, when)

    rows = [row("a", f"{i}", when=float(10 - i)) for i in range(6)] + [row("b", "0", when=0.0)]
    asked = [Shard("6", 10), Shard("7", 10), Shard("0", 10)]  # "0" is resident already
    free = {"pinned": set[str](), "leased": set[tuple[str, str]]()}
    assert displaced_for(asked, "a", rows, free=10, **free) == []  # 10 free and b's 10 make the 20 missing
    assert [e.key for e in displaced_for(asked, "a", rows, free=0, **free)] == ["5"]  # the oldest of a's
    assert [e.key for e in displaced_for(asked, "a", rows, free=-5, **free)] == ["5", "4"]
    assert displaced_for(asked, "a", rows, free=0, pinned={"a"}, leased=set()) == []
    assert [e.key for e in displaced_for(asked, "a", rows, free=0, pinned=set(), leased={("a", "5")})] == ["4"]
    assert [e.key for e in displaced_for(asked, "a", rows, free=0, pinned={"b"}, leased=set())] == ["5", "4"]
    assert displaced_for(asked, "a", rows, free=-50, **free) == []  # all five not asked for would not do
    staging = [*rows[:-1], row("b", "0", 0.0, ShardState.STAGING)]  # not resident: nothing eviction may take
    assert [e.key for e in displaced_for(asked, "a", staging, free=0, **free)] == ["5", "4"]
