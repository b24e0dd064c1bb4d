"""A cold shard is served from memory once verified, while its local copy is still being made durable."""

from __future__ import annotations

import asyncio
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from datacache.loaders import CachedIterableDataset
from test_loader import write_wds

from datacache.config import load_settings
from datacache.staging import LOCAL, Stager

if TYPE_CHECKING:
    from conftest import S3Bucket


@pytest.fixture
def fsync_gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], threading.Event]]:
    """Hold every fsync of the local tier until the returned event is set (the disk is slow to make a copy durable)."""
    real = os.fsync
    gate = threading.Event()
    held = threading.Event()

    def gated(fd: int) -> None:
        held.set()
        gate.wait(timeout=10)  # bounded: a stager that waits for the fsync fails the test, never hangs it
        real(fd)

    def close() -> threading.Event:
        monkeypatch.setattr(os, "fsync", gated)
        return gate

    yield close
    gate.set()


def upload(s3: S3Bucket, tmp_path: Path) -> dict[str, bytes]:
    source = tmp_path / "upload"
    write_wds(source, samples=40, per_shard=10)
    shards = {path.name: path.read_bytes() for path in sorted(source.glob("*.tar"))}
    for name, data in shards.items():
        s3.put(f"ds/{name}", data)
    return shards


def test_the_stager_hands_a_reader_the_verified_bytes_before_the_fsync(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str], fsync_gate: Callable[[], threading.Event]
) -> None:
    shards = upload(s3, tmp_path)
    key = sorted(shards)[0]
    settings = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "local")})

    async def body() -> None:
        async with Stager(settings, reconcile=False) as stager:
            handle = await stager.open(s3.url("ds"))
            gate = fsync_gate()
            location = await stager.ensure(handle, key, early=True)
            assert location.buffer == shards[key], "the reader has the shard's bytes"
            assert (await stager.locate(handle, key)).tier != LOCAL, "its local copy is not durable yet"
            gate.set()
            durable = await stager.ensure(handle, key)
            assert durable.tier == LOCAL and durable.path is not None and durable.buffer is None
            assert durable.path.read_bytes() == shards[key], "the durable copy follows"

    asyncio.run(body())


def test_a_cold_epoch_takes_its_first_batch_before_any_local_copy_is_durable(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str], fsync_gate: Callable[[], threading.Event]
) -> None:
    shards = upload(s3, tmp_path)
    settings = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "local")})
    dataset = CachedIterableDataset(s3.url("ds"), config=settings, seed=1, batch_size=5, shuffle=False)
    dataset._prepare()  # lists the origin and saves the manifest (durably) before the disk turns slow
    gate = fsync_gate()
    iterator = iter(dataset)
    first = next(iterator)
    assert not gate.is_set()
    assert len(first["__key__"]) == 5
    local = list((tmp_path / "local").rglob("*.tar"))
    assert not local, f"no shard was durable on the local tier yet: {local}"
    gate.set()
    rest = [key for batch in iterator for key in batch["__key__"]]
    assert len(first["__key__"]) + len(rest) == 40
    deadline = time.monotonic() + 60
    while len(list((tmp_path / "local").rglob("*.tar"))) < len(shards) and time.monotonic() < deadline:
        time.sleep(0.05)  # sleep-ok: polling, with a deadline, for the durable copies made behind the reader
    assert len(list((tmp_path / "local").rglob("*.tar"))) == len(shards), "every shard is durable in the end"


def test_a_whole_shard_buffer_is_taken_again_only_once_nothing_holds_a_view_of_it() -> None:
    from datacache.staging.transfer import _Buffers

    buffers = _Buffers(idle=1)
    first = buffers.take(100)
    held = memoryview(first)[:100].toreadonly()  # a reader served early still reads it
    second = buffers.take(100)
    assert second is not first
    del held
    assert buffers.take(50) is first  # free again, and big enough
    # Nothing holds either now: a larger shard gets a new map, and only one unused one is kept.
    third = buffers.take(200)
    assert third is not first and third is not second
    assert [b.closed for b in (first, second) if isinstance(b, mmap.mmap)].count(True) == 1
    assert isinstance(buffers.take(0), bytearray)
