"""The local tier's room arithmetic, and a full disk seen before a shard lands (issue 34 item 10).

Three code changes the suite did not catch: the bytes of shards still staging left out of a
tier's excess (`catalog.room.trim_in`); a shard's own size no longer taken off the used bytes
when it is reserved again (`catalog.room._need`); and `posix_fallocate` replaced by
`ftruncate` in `tiers._landing` (a full disk then shows up as SIGBUS while a shard lands).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from _daemon import REPO

from datacache.catalog import Catalog, Claim, Room, process_owner
from datacache.eviction import Candidate

OWNER = process_owner()


def _lru(incoming: Candidate, candidates: list[Candidate], need: int) -> list[Candidate] | None:
    """Least recently used first, as few as free ``need`` bytes (None: they cannot)."""
    chosen, freed = [], 0
    for candidate in sorted(candidates, key=lambda c: c.last_access):
        if freed >= need:
            break
        chosen.append(candidate)
        freed += candidate.size
    return chosen if freed >= need else None


def _room(capacity: int) -> Room:
    return Room(OWNER, capacity, lambda: None, 0, _lru)


async def _resident(catalog: Catalog, dataset: str, keys: list[str], size: int) -> None:
    """Stage ``keys`` (``size`` bytes each) into the catalog, oldest first, as a stager would."""
    for key in keys:
        (granted,) = await catalog.reserve_many(dataset, [Claim(key, size, "v1")], _room(1 << 40))
        assert granted.granted
        await catalog.commit(dataset, key, size=size, version="v1", checksum=f"xxh3_64:{key}")


def test_a_tiers_excess_counts_the_bytes_of_shards_still_staging(tmp_path: Path) -> None:
    async def body() -> list[str]:
        catalog = Catalog(tmp_path / "catalog.sqlite")
        try:
            await _resident(catalog, "d", ["a", "b", "c"], 100)  # 300 bytes resident
            (staging,) = await catalog.reserve_many("d", [Claim("e", 200, "v1")], _room(1 << 40))
            assert staging.granted  # 200 bytes coming in: held, though not yet written
            victims = await catalog.trim(400, OWNER)
            return [victim.key for victim in victims]
        finally:
            await catalog.close()

    # 300 resident + 200 staging on a tier of 400: 100 over, so the oldest resident shard goes.
    # Leaving the staging bytes out, the tier looked 100 under and kept all three.
    assert asyncio.run(body()) == ["a"]


def test_a_shard_reserved_again_does_not_count_its_own_bytes_twice(tmp_path: Path) -> None:
    async def body() -> tuple[bool, list[str]]:
        catalog = Catalog(tmp_path / "catalog.sqlite")
        try:
            await _resident(catalog, "d", ["a", "b"], 100)  # a full tier of 200
            # Shard "a" staged again (a new version, or after a bad copy): it replaces its own row.
            (again,) = await catalog.reserve_many("d", [Claim("a", 100, "v2")], _room(200))
            return again.granted, [victim.key for victim in again.victims]
        finally:
            await catalog.close()

    # Its 100 bytes leave as its new copy's 100 come: it fits, and "b" stays.
    # Counting its old bytes too, the tier looked 100 short and "b" was evicted for nothing.
    assert asyncio.run(body()) == (True, [])


_LAND = """
import asyncio, errno, sys
from datacache.tiers import LocalTier

async def main(root):
    tier = LocalTier(root, durable=False)
    small = await tier.land("small.tar", 64 << 10)  # a control: the filesystem takes what fits
    small.buffer[:] = b"s" * len(small.buffer)
    await small.abandon()
    try:
        landing = await tier.land("big.tar", 8 << 20)  # larger than the filesystem
    except OSError as exc:
        print("refused", errno.errorcode.get(exc.errno), flush=True)
        return
    landing.buffer[:] = b"x" * len(landing.buffer)  # a page fault past what the disk holds: SIGBUS
    print("landed", flush=True)

asyncio.run(main(sys.argv[1]))
"""


@pytest.fixture
def small_filesystem(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A 1 MiB tmpfs (or the size the test's ``filesystem_size`` mark gives), mounted for the test (root only)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small filesystem")
    marked = request.node.get_closest_marker("filesystem_size")
    size = marked.args[0] if marked is not None else "1m"
    mountpoint = Path(tempfile.mkdtemp(prefix="datacache-full-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mountpoint)],
        capture_output=True, text=True, check=False,
    )
    if mounted.returncode != 0:
        mountpoint.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], capture_output=True, check=False)
        mountpoint.rmdir()


def test_a_full_disk_refuses_a_landing_before_its_first_byte_not_with_sigbus(small_filesystem: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_LAND), str(small_filesystem / "local")],
        capture_output=True, text=True, timeout=120, check=False, cwd=REPO,
    )
    assert done.returncode == 0, f"the landing process died with {done.returncode}: {done.stderr}"
    assert done.stdout.split() == ["refused", "ENOSPC"], done.stdout + done.stderr
    assert not [p for p in (small_filesystem / "local").rglob("*") if p.is_file()], "no temporary file is left"


_READ_EPOCH = r"""
import json, sys
from datacache.config import load_settings
from datacache.loaders import CachedIterableDataset

origin, local, epoch = sys.argv[1], sys.argv[2], int(sys.argv[3])
dataset = CachedIterableDataset(origin, config=load_settings(overrides={"local_dir": local}), shuffle=True, seed=1)
dataset.set_epoch(epoch)
print(json.dumps([s["__key__"] for s in dataset]))
"""


@pytest.mark.filesystem_size("16m")
def test_a_reader_reads_on_when_another_process_filled_its_disk(small_filesystem: Path, tmp_path: Path) -> None:
    """A trial's training died in the reader's progress note (TierFullError) once a `dd` filled the disk."""
    import errno
    import json

    from test_loader import write_wds

    expected = sorted(write_wds(tmp_path / "origin", samples=200, per_shard=20))

    def epoch(number: int) -> list[str]:
        done = subprocess.run(
            [sys.executable, "-c", _READ_EPOCH, str(tmp_path / "origin"), str(small_filesystem / "local"), str(number)],
            capture_output=True, text=True, timeout=300, check=False, cwd=REPO,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        keys: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
        return keys

    assert sorted(epoch(0)) == expected
    with open(small_filesystem / "fill", "wb") as out, pytest.raises(OSError) as full:
        while True:  # another process's file takes the rest of the disk
            out.write(bytes(1 << 16))
            out.flush()
    assert full.value.errno == errno.ENOSPC
    assert sorted(epoch(1)) == expected


@pytest.mark.filesystem_size("16m")
def test_a_warm_that_the_disk_stops_says_so_not_that_the_capacity_did(
    small_filesystem: Path, tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """A trial's 200 MB tier on a disk with 5.7 MB free was told "dataset 305 MB > local capacity 200 MB"."""
    from _helpers import fill_dir, make_shards, run_cli

    origin = fill_dir(tmp_path / "origin", make_shards(12, 1_000_000))
    with open(small_filesystem / "fill", "wb") as out:  # another process's file: 6 MB left
        out.write(bytes(10 << 20))
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(small_filesystem / "local")}
    result = run_cli(["warm", str(origin), "--local-capacity", "200MB"], env)
    assert result.returncode == 1, result.stderr
    first = result.stderr.splitlines()[0]
    assert re.fullmatch(
        r"datacache: dataset 12\.00 MB does not fit: the local device is nearly full \([^)]+ free; datacache leaves "
        r"[^)]+ free for the catalog and the system\): \d+ of 12 shards kept \(-v lists the others\)",
        first,
    ), result.stderr
