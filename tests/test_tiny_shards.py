"""Many tiny tar shards read like one stream: a window of units leased and located in one note.

A warm epoch of 2-sample shards paid a lease note (a catalog write) every few shards and a prefetch
(a catalog read and touch) at nearly every shard opened and released, ~10x a plain ``tarfile`` loop.
Leasing a window of them at once must still leave nothing leased for good when the reader dies.
"""

from __future__ import annotations

import asyncio
import io
import json
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

from datacache.loaders import CachedIterableDataset
from datacache.loaders.reading.units import HOLD_AHEAD

from datacache.catalog import Catalog
from datacache.config import load_settings
from datacache.staging import Stager

SHARDS = 200


def _write_tiny_tars(directory: Path, shards: int) -> set[str]:
    """``shards`` un-indexed tar files of two samples each (a ``.cls`` and a 100-byte ``.bin``); their keys."""
    directory.mkdir(parents=True)
    keys: set[str] = set()
    for index in range(shards):
        with tarfile.open(directory / f"tiny-{index:05d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for sample in range(2):
                key = f"{index:05d}-{sample}"
                keys.add(key)
                for extension, data in (("cls", str(sample).encode()), ("bin", bytes([index % 251]) * 100)):
                    member = tarfile.TarInfo(f"{key}.{extension}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
    return keys


def test_a_warm_epoch_of_tiny_shards_takes_a_catalog_write_per_window_not_per_few_shards(tmp_path: Path) -> None:
    origin = tmp_path / "origin"
    expected = _write_tiny_tars(origin, SHARDS)
    settings = load_settings({}, overrides={"local_dir": str(tmp_path / "local")})
    dataset = CachedIterableDataset(str(origin), config=settings, shuffle=True, seed=3)
    try:
        assert {sample["__key__"] for sample in dataset} == expected  # the first epoch stages every shard
        stager = dataset._runtime.access if dataset._runtime is not None else None
        assert isinstance(stager, Stager)
        before = stager.catalog.writes()
        dataset.set_epoch(1)
        keys = [sample["__key__"] for sample in dataset]
        after = stager.catalog.writes()
    finally:
        dataset.close()
    writes, touched = after.writes - before.writes, after.touches - before.touches
    assert sorted(keys) == sorted(expected)  # every sample once
    # One lease note (a write) for a window of shards: a note every few shards and a prefetch at
    # each open and release (their touches) wrote ~2 per shard.
    assert writes <= SHARDS // 10, f"{writes} catalog writes in a warm epoch of {SHARDS} tiny shards"
    # Each shard's read recorded about once (its note's locate), not again by every prefetch that
    # found it resident: those recorded ~40 reads a shard.
    assert touched <= 2 * SHARDS, f"{touched} reads recorded for {SHARDS} shards"


_READER = r"""
import json, sys
from datacache.config import load_settings
from datacache.loaders import CachedIterableDataset
settings = load_settings({}, overrides={"local_dir": sys.argv[2]})
dataset = CachedIterableDataset(sys.argv[1], config=settings, shuffle=True, seed=3)
dataset.set_epoch(int(sys.argv[3]))
for count, sample in enumerate(dataset):
    if count == 5:
        print(json.dumps({"read": count}), flush=True)
        sys.stdin.readline()  # mid-epoch, units open and a window leased, until killed
"""


def _leases(local: Path) -> set[tuple[str, str]]:
    async def body() -> set[tuple[str, str]]:
        catalog = Catalog(local / "catalog.sqlite")
        try:
            return await catalog.leased()
        finally:
            await catalog.close()

    return asyncio.run(body())


def test_a_reader_killed_mid_window_leaves_no_lease_for_good(tmp_path: Path) -> None:
    origin, local = tmp_path / "origin", tmp_path / "local"
    _write_tiny_tars(origin, 40)
    first = _READER.replace("count == 5", "False")  # the first epoch, read to its end: every shard local
    subprocess.run([sys.executable, "-c", first, str(origin), str(local), "0"], check=True, timeout=120)
    with subprocess.Popen(
        [sys.executable, "-c", _READER, str(origin), str(local), "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as reader:
        try:
            assert reader.stdout is not None
            assert json.loads(reader.stdout.readline()) == {"read": 5}
            held = _leases(local)
            # The warm reader leased a window ahead of the units it has open, not only `HOLD_AHEAD`.
            assert len(held) > HOLD_AHEAD + 5, held
            reader.send_signal(signal.SIGKILL)
            reader.wait(timeout=60)
        finally:
            reader.kill()
    assert _leases(local) == set()  # a dead process's leases hold nothing (`leased` counts live owners')

    # And eviction takes them: a tier cut to one byte keeps none of the dead reader's shards.
    async def trim() -> int:
        tight = load_settings({}, overrides={"local_dir": str(local), "local_capacity": 1})
        async with Stager(tight, reconcile=False) as stager:
            await stager.open(str(origin))
            return await (await stager._ready()).local.trim()

    assert asyncio.run(trim()) == 40
