"""The cluster's sample-count index lives on the shared tier: other users' files there are never trusted blindly.

A FIFO, a link to /dev/zero or a huge file planted where a count file goes must not
hang or exhaust a reader (it is ignored and the shard counted again); a directory of
the index swapped for a symlink must never have a write go through it.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from test_cold_index import build_counts, counts_on_disk
from test_loader import write_wds

from datacache.config import Settings
from datacache.errors import DatacacheError
from datacache.indexing import index_dir
from datacache.stager import Stager


def _snapshot_dir(settings: Settings, url: str) -> Path:
    async def body() -> Path:
        async with Stager(settings) as stager:
            handle = await stager.open(url)
            assert settings.shared_dir is not None
            return index_dir(settings.shared_dir, handle.manifest)

    return asyncio.run(body())


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_planted_count_files_are_ignored_not_read(kind: str, tmp_path: Path, settings: Settings) -> None:
    origin = tmp_path / "origin"
    write_wds(origin, samples=30, per_shard=10)
    directory = _snapshot_dir(settings, str(origin))
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("batch-000000.json", "sidecars.json"):
        planted = directory / name
        if kind == "fifo":
            os.mkfifo(planted)
        elif kind == "dev-zero":
            planted.symlink_to("/dev/zero")
        else:
            with open(planted, "wb") as handle:
                handle.truncate(4 << 30)
    found, _ = build_counts(settings, str(origin))
    assert {key: count.samples for key, count in found.items()} == counts_on_disk(origin)


def test_a_swapped_index_directory_is_never_written_through(tmp_path: Path, settings: Settings) -> None:
    origin = tmp_path / "origin"
    write_wds(origin, samples=30, per_shard=10)
    directory = _snapshot_dir(settings, str(origin))
    elsewhere = tmp_path / "victim"
    elsewhere.mkdir()
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(DatacacheError, match="symlink"):
        build_counts(settings, str(origin))
    assert list(elsewhere.iterdir()) == [], "nothing was written through the link"
