"""The cluster's sample-count index lives on the shared tier: other users' files there are never trusted blindly.

A FIFO, a link to /dev/zero or a huge file planted where a count file goes must not
hang or exhaust a reader (it is ignored and the shard counted again); a directory of
the index swapped for a symlink must never have a write go through it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from test_cold_index import build_counts, counts_on_disk
from test_loader import write_wds

from datacache.config import Settings
from datacache.counting.cluster import decide_cold, index_dir
from datacache.counting.indexfiles import IndexFiles
from datacache.errors import DatacacheError
from datacache.manifest import Manifest
from datacache.staging import Stager


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


_LINK_ONCE = IndexFiles.link_once


def _decide_unpatched(settings: Settings, manifest: Manifest, cold: bool) -> bool:
    IndexFiles.link_once = _LINK_ONCE  # type: ignore[method-assign]  # (forked: the test's patch came along)
    return decide_cold(settings, manifest, seed=1, epoch=0, cold=cold)


def _decide_in_another_process(settings: Settings, manifest: Manifest, cold: bool) -> bool:
    """`decide_cold` for epoch 0 of seed 1 in a process of its own (another rank, another node)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        return pool.submit(_decide_unpatched, settings, manifest, cold).result()


def test_the_process_that_loses_the_cold_decision_takes_the_recorded_answer(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24 item 16: two processes look for the epoch's record at once, find none, and both write.

    The one whose `link_once` loses must read epoch 0 as the winner recorded it, not as it
    would have decided itself: otherwise one epoch is dealt two ways.
    """
    origin = tmp_path / "origin"
    write_wds(origin, samples=30, per_shard=10)
    build_counts(settings, str(origin))  # the cluster index exists: a warm answer is recorded too

    async def open_manifest() -> Manifest:
        async with Stager(settings) as stager:
            return (await stager.open(str(origin))).manifest

    manifest = asyncio.run(open_manifest())
    competitors: list[bool] = []

    def another_process_decides_first(self: IndexFiles, name: str, data: bytes) -> None:
        # Between this process's look for a record and its own write, another process (its
        # counts were incomplete: cold) looks, finds none either, and writes first.
        competitors.append(_decide_in_another_process(settings, manifest, cold=True))
        _LINK_ONCE(self, name, data)

    monkeypatch.setattr(IndexFiles, "link_once", another_process_decides_first)
    assert decide_cold(settings, manifest, seed=1, epoch=0, cold=False) is True, "the recorded answer"
    assert competitors == [True]
    monkeypatch.undo()
    assert decide_cold(settings, manifest, seed=1, epoch=0, cold=False) is True, "and it stays recorded"
