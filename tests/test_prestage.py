"""Prestage in the order a queued job will read: `datacache warm DATASET --order-for JOB`.

The job names its seed, world size, this node's rank and its ranks per node; the warm stages
first the shards those ranks open first in epoch 0, as the loader deals them (a dataset not yet
counted is read cold, whole shards dealt; a counted one by its sample counts), then the rest as
far as the tier holds. Each test checks the order against the real loader: the first shard each
of the node's ranks reads is resident before the job starts, on a tier smaller than the dataset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _daemon import REPO, catalog_rows, start_daemon
from _helpers import run_cli, tar_of
from datacache.loaders.prestage import JobLayout, node_first_units

from datacache.errors import ConfigError

SHARDS = 12
JOB = "seed=3,world_size=8,node_rank=1,ranks_per_node=2"


@pytest.fixture
def env(cache_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    clean = {k: v for k, v in cache_env.items() if not k.startswith(("AWS_", "FSSPEC_", "DATACACHE_"))}
    clean.update(DATACACHE_LOCAL_DIR=str(tmp_path / "local"), HOME=str(tmp_path / "home"))
    return clean


def _origin(directory: Path, *, counted: bool) -> Path:
    """12 tar shards of 3-8 samples (``sNN_III``), of about one size; ``counted``: open_clip's sizes.json too."""
    directory.mkdir()
    sizes = {}
    for s in range(SHARDS):
        count = 3 + (s * 5) % 6
        members = {}
        for i in range(count):
            members[f"s{s:02d}_{i:03d}.bin"] = os.urandom(24_000 // count)  # shards of one size
        (directory / f"shard-{s:04d}.tar").write_bytes(tar_of(members))
        sizes[f"shard-{s:04d}.tar"] = count
    if counted:
        (directory / "sizes.json").write_text(json.dumps(sizes))
    return directory


_FIRST = """
import itertools, sys
from datacache.loaders import CachedIterableDataset
buffer = int(sys.argv[2]) or None
ds = CachedIterableDataset(sys.argv[1], shuffle=True, seed=3, shuffle_buffer=buffer)
for sample in itertools.islice(ds, 4):
    print(sample["__key__"])
"""


def _first_batch_shards(origin: Path, env: dict[str, str], rank: int, local: Path, buffer: int = 0) -> set[str]:
    """The shards of the first 4 samples rank ``rank`` of 8 reads, as the loader deals them (its own cache)."""
    run_env = {**env, "RANK": str(rank), "WORLD_SIZE": "8", "DATACACHE_LOCAL_DIR": str(local)}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_FIRST), str(origin), str(buffer)], env=run_env,
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    keys = done.stdout.strip().splitlines()
    assert len(keys) == 4, done.stdout
    return {f"shard-{int(key[1:3]):04d}.tar" for key in keys}


def _resident(local: Path) -> set[str]:
    return {key for _, key, _, _, state in catalog_rows(local) if state == "resident"}


@pytest.mark.parametrize(
    ("counted", "room", "buffer"),
    # A cold first epoch reads a rank's shards two at a time: its first batch needs its first two.
    # A counted one deals windows of samples (8 here, as the job says): up to four shards each.
    [(False, 4, 0), (True, 8, 8)],
    ids=["cold-first-epoch", "counted"],
)
def test_the_nodes_ranks_find_their_first_batch_local_on_a_tier_smaller_than_the_dataset(
    tmp_path: Path, env: dict[str, str], counted: bool, room: int, buffer: int
) -> None:
    origin = _origin(tmp_path / "origin", counted=counted)
    shard = max(path.stat().st_size for path in origin.glob("*.tar"))
    env["DATACACHE_LOCAL_CAPACITY"] = f"{int(shard * (room + 0.5))}B"  # room for `room` of the 12 shards
    job = JOB + (f",shuffle_buffer={buffer}" if buffer else "")
    warmed = run_cli(["warm", str(origin), "--order-for", job], env, check=True)
    assert f"prestage for ranks 2-3 of 8 (seed 3): {room} shards of 12" in warmed.stderr, warmed.stderr
    resident = _resident(tmp_path / "local")
    assert len(resident) == room, resident
    # The loader, as ranks 2 and 3 of a world of 8 deal it, reads its first batch from these.
    for rank in (2, 3):
        first = _first_batch_shards(origin, env, rank, tmp_path / f"rank{rank}", buffer)
        assert first <= resident, (rank, first, resident)


def test_the_order_interleaves_the_nodes_ranks_and_names_each_shard_once() -> None:
    job = JobLayout.parse("seed=9,world_size=4,node_rank=0,ranks_per_node=2")
    counts = [5] * 10
    cold = node_first_units(counts, job, cold=True)
    assert len(cold) == len(set(cold)) == 6  # ranks 0 and 1 each deal 10 / 4 rounded up, whole shards
    indexed = node_first_units(counts, job, cold=False)
    assert len(indexed) == len(set(indexed))
    other = node_first_units(counts, JobLayout.parse("seed=9,world_size=4,node_rank=1,ranks_per_node=2"), cold=True)
    assert not set(cold) & set(other) and sorted({*cold, *other}) == list(range(10))


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("seed=1,world_size=8", "missing node_rank, ranks_per_node"),
        ("seed=1,world_size=8,node_rank=4,ranks_per_node=2", "node_rank 4 with 2 ranks per node holds no rank"),
        ("seed=x,world_size=8,node_rank=0,ranks_per_node=2", "seed must be an integer, got 'x'"),
        ("seed=1,world=8,node_rank=0,ranks_per_node=2", "'world=8' is not one of its fields; did you mean 'world_s"),
        ("seed=1,world_size=8,node_rank=0,ranks_per_node=2,shufle=false", "did you mean 'shuffle'?"),
        ("seed=1,world_size=8,node_rank=0,ranks_per_node=2,colour=red", "'colour=red' is not one of its fields (seed"),
        ("seed=1,world_size=8,node_rank=0,ranks_per_node=2,shuffle=maybe", "shuffle must be true or false"),
    ],
)
def test_a_bad_job_is_one_line_naming_what_is_wrong(text: str, said: str) -> None:
    with pytest.raises(ConfigError, match="--order-for") as raised:
        JobLayout.parse(text)
    assert said in str(raised.value) and "\n" not in str(raised.value)


def test_the_cli_refuses_a_bad_job_before_touching_the_dataset(tmp_path: Path, env: dict[str, str]) -> None:
    origin = _origin(tmp_path / "origin", counted=False)
    bad = run_cli(["warm", str(origin), "--order-for", "seed=1"], env)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "missing world_size, node_rank, ranks_per_node" in bad.stderr
    both = run_cli(["warm", str(origin), "--order-for", JOB, "--shards", "0:2"], env)
    assert both.returncode != 0 and "not both" in both.stderr
    assert not (tmp_path / "local" / "catalog.sqlite").exists()


def test_the_prestage_goes_through_the_nodes_daemon_when_one_answers(tmp_path: Path, env: dict[str, str]) -> None:
    origin = _origin(tmp_path / "origin", counted=False)
    shard = max(path.stat().st_size for path in origin.glob("*.tar"))
    local = tmp_path / "local"
    daemon = start_daemon(env, local, "--local-capacity", f"{int(shard * 4.5)}B")
    try:
        client_env = {**env, "DATACACHE_SOCKET": str(daemon.socket)}
        assert "DATACACHE_LOCAL_CAPACITY" not in client_env  # 4 shards: the daemon's capacity, asked of it
        warmed = run_cli(["warm", str(origin), "--order-for", JOB, "--json"], client_env, check=True)
        done = json.loads(warmed.stdout.strip().splitlines()[-1])
        assert done["shards_requested"] == 4 and done["complete"] is True, done
        resident = _resident(local)
    finally:
        daemon.stop()
    for rank in (2, 3):
        assert _first_batch_shards(origin, env, rank, tmp_path / f"rank{rank}") <= resident
