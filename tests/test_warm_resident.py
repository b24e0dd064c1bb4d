"""A warm of shards already resident: one catalog read for them all, and never trusted blindly.

`datacache warm` of a dataset the local tier already holds (the second run of a job's warm, or a
daemon's) looked its shards up a few thousand at a time, each look-up a catalog read; the issue
(35) asks for one read for the whole warm. Speed must not cost integrity: a resident file removed
or cut short behind the catalog's back is still found and staged again.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _helpers import fill_dir, with_stager

from datacache.config import load_settings, resolve_dataset
from datacache.staging import Stager, WarmReport

SHARDS = 10_001
"""More than one of the old look-ups' chunks (8,192 shards each)."""


def _origin(directory: Path, count: int) -> dict[str, bytes]:
    shards = {f"{index:06d}.bin": index.to_bytes(8, "big") for index in range(count)}
    fill_dir(directory, shards)
    return shards


def _warm_twice(tmp_path: Path, count: int, between: object = None) -> tuple[WarmReport, int]:
    """Warm ``count`` shards, run ``between`` (a callable of the local data dir), warm again: (report, reads)."""
    origin = tmp_path / "origin"
    _origin(origin, count)
    settings = load_settings({}, overrides={"local_dir": str(tmp_path / "local")})
    dataset = resolve_dataset(str(origin), settings)

    async def body(stager: Stager) -> tuple[WarmReport, int]:
        handle = await stager.open(dataset)
        first = await stager.warm(handle)
        assert first.shards_resident == count, first.failures[:3]
        if callable(between):
            between(tmp_path / "local" / "data" / handle.id)
        before = stager.catalog.writes()
        report = await stager.warm(handle)
        after = stager.catalog.writes()
        reads = (after.runs - after.writes) - (before.runs - before.writes)
        return report, reads

    return with_stager(settings, body)


def test_a_warm_of_resident_shards_makes_one_catalog_read(tmp_path: Path) -> None:
    report, reads = _warm_twice(tmp_path, SHARDS)
    assert report.shards_resident == SHARDS
    assert report.shards_transferred == 0
    # One read finds every resident row; the look-up in chunks made one a chunk (2 here).
    assert reads == 1, f"{reads} catalog reads to warm {SHARDS} resident shards"


def test_a_resident_file_removed_or_cut_short_behind_the_catalog_is_staged_again(tmp_path: Path) -> None:
    count = 50

    def damage(data: Path) -> None:
        (data / "000007.bin").unlink()
        (data / "000031.bin").write_bytes(b"x")  # a size the catalog does not have

    report, _ = _warm_twice(tmp_path, count, damage)
    assert report.shards_resident == count, report.failures
    assert report.shards_transferred == 2
    data = next((tmp_path / "local" / "data").iterdir())
    assert (data / "000007.bin").read_bytes() == (7).to_bytes(8, "big")
    assert (data / "000031.bin").read_bytes() == (31).to_bytes(8, "big")


_FOLDERS = r"""
import resource, sys
from pathlib import Path
from datacache.tiers import LocalTier
root = Path(sys.argv[1])
keys = [f"part-{index:04d}/shard.bin" for index in range(600)]
for index, key in enumerate(keys):
    (root / "data" / key).parent.mkdir(parents=True)
    (root / "data" / key).write_bytes(b"x" * (index + 1))
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
sizes = LocalTier(root).file_sizes([*keys, "part-0000/absent.bin"])
print(sizes == [*range(1, 601), -1])
"""


def test_resident_sizes_of_a_dataset_laid_out_a_folder_a_shard_stay_within_the_open_file_limit(tmp_path: Path) -> None:
    """The look-up kept each folder it walked open to its end: 600 folders under a limit of 256 failed (EMFILE)."""
    argv = [sys.executable, "-c", _FOLDERS, str(tmp_path / "tier")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"
