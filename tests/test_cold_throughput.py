"""What bounds a cold epoch's rate: the fixed costs before the first GET, and the work per byte staged."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from datacache.tiers import ByteRange, open_origin
from test_loader import write_wds

from datacache.config import load_settings
from datacache.staging.stager import Stager
from datacache.staging.types import LOCAL

if TYPE_CHECKING:
    from conftest import S3Bucket


def test_the_get_client_reuses_the_service_model_the_listing_loaded(
    s3: S3Bucket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """botocore's S3 service description is parsed once per origin: the GET threads' client
    shares the data loader of the session that listed (parsing it again cost 100-250 ms of
    the cold epoch, before its first byte)."""
    import botocore.loaders

    s3.put("ds/a.tar", b"x" * 1000)
    parsed: list[str] = []
    real = botocore.loaders.JSONFileLoader.load_file

    def counting(self: Any, file_path: str) -> Any:
        parsed.append(str(file_path))
        return real(self, file_path)

    monkeypatch.setattr(botocore.loaders.JSONFileLoader, "load_file", counting)

    async def body() -> None:
        origin = open_origin(s3.url("ds"))
        try:
            assert [info.key async for info in origin.list()] == ["a.tar"]
            assert await origin.get("a.tar", ByteRange(0, 10)) == b"x" * 10  # the GET threads' client
        finally:
            await origin.close()

    asyncio.run(body())
    models = [path for path in parsed if Path(path).parent.parent.name == "s3" and Path(path).name == "service-2"]
    assert len(models) == 1, f"the S3 service model was parsed {len(models)} times: {models}"


@contextlib.contextmanager
def _held_fsync(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, list[int]]]:
    """Hold every ``os.fsync`` until the event is set; each one that gave up waiting is counted."""
    real = os.fsync
    release = threading.Event()
    gave_up: list[int] = []

    def held(fd: int) -> None:
        if not release.wait(timeout=5):  # bounded: a stager that waits for the disk fails, never hangs
            gave_up.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", held)
    try:
        yield release, gave_up
    finally:
        release.set()


def test_the_next_transfers_start_while_earlier_copies_are_made_durable(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker hands its shard's verified bytes over and starts the next GET; the fsync goes on
    behind it. Before, each of the `concurrency` workers waited for its copy's fsync, rename and
    catalog commit, so the disk's durable rate gated when the next GET could start."""
    source = tmp_path / "upload"
    write_wds(source, samples=40, per_shard=10)
    shards = {path.name: path.read_bytes() for path in sorted(source.glob("*.tar"))}
    assert len(shards) == 4
    for name, data in shards.items():
        s3.put(f"ds/{name}", data)
    settings = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "local"), "concurrency": "2"})

    async def body(release: threading.Event) -> None:
        async with Stager(settings, reconcile=False) as stager:
            handle = await stager.open(s3.url("ds"))
            early = await asyncio.gather(*(stager.ensure(handle, key, early=True) for key in shards))
            assert [location.buffer for location in early] == list(shards.values())
            release.set()
            durable = await asyncio.gather(*(stager.ensure(handle, key) for key in shards))
            assert all(location.tier == LOCAL and location.path is not None for location in durable)
            assert [location.path.read_bytes() for location in durable if location.path] == list(shards.values())

    with _held_fsync(monkeypatch) as (release, gave_up):
        asyncio.run(body(release))
    assert not gave_up, f"{len(gave_up)} transfers waited for an earlier copy's fsync before starting"


_READ_ONE_EPOCH_AND_EXIT = """
import os, sys, time
real = os.fsync
def slow(fd):
    time.sleep(0.3)  # sleep-ok: a slow disk, so that copies are still being made durable at exit
    real(fd)
os.fsync = slow
from datacache.loaders import CachedIterableDataset
from datacache.config import load_settings
settings = load_settings(overrides={"local_dir": sys.argv[2]})
dataset = CachedIterableDataset(sys.argv[1], config=settings, batch_size=5, shuffle=False)
print(sum(len(batch["__key__"]) for batch in dataset))
"""


def test_a_process_leaving_right_after_a_cold_epoch_keeps_the_copies_it_had_received(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """The readers finish on the verified bytes while the copies are still being made durable;
    exit waits (bounded) for those copies instead of cancelling them, so the next process
    reads every shard locally rather than from the origin again."""
    source = tmp_path / "upload"
    write_wds(source, samples=40, per_shard=10)
    shards = sorted(path.name for path in source.glob("*.tar"))
    for name in shards:
        s3.put(f"ds/{name}", (source / name).read_bytes())
    local = tmp_path / "local"
    env = {**cache_env, **{k: v for k, v in os.environ.items() if k.startswith("AWS_")}}
    done = subprocess.run(
        [sys.executable, "-c", _READ_ONE_EPOCH_AND_EXIT, s3.url("ds"), str(local)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["40"]
    settings = load_settings(cache_env, overrides={"local_dir": str(local)})

    async def tiers() -> list[str]:
        async with Stager(settings, reconcile=True) as stager:
            handle = await stager.open(s3.url("ds"))
            return [(await stager.locate(handle, key)).tier for key in shards]

    assert asyncio.run(tiers()) == [LOCAL] * len(shards)


def test_a_shard_whose_checksum_is_known_is_not_also_crc_checked_on_the_way_in(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 sends a CRC32 of each body stored with one, and botocore checks it (~0.5 CPU s per GB,
    12% of a cold epoch's CPU here). A shard whose checksum the manifest holds is checked against
    that (xxh3, whole shard) instead; on first contact (no checksum yet) the CRC32 still is."""
    from botocore.httpchecksum import StreamingChecksumBody

    from datacache.checksum import checksum_of, new_hasher
    from datacache.errors import ChecksumMismatchError
    from datacache.manifest import MANIFEST_NAME

    data = os.urandom(300_000)
    hasher = new_hasher()
    hasher.update(data)
    entries = {"known": checksum_of(hasher), "unknown": None, "wrong": "xxh3_64:" + "0" * 16}
    for prefix, checksum in entries.items():
        s3.put(f"{prefix}/a.tar", data)
        entry: dict[str, Any] = {"key": "a.tar", "size": len(data), **({"checksum": checksum} if checksum else {})}
        document = {"format_version": 1, "dataset": prefix, "url": "", "format": "tar", "shards": [entry]}
        s3.put(f"{prefix}/{MANIFEST_NAME}", json.dumps(document).encode())
    checked: list[int] = []
    real = StreamingChecksumBody._validate_checksum

    def counting(self: Any) -> None:
        checked.append(1)
        real(self)

    monkeypatch.setattr(StreamingChecksumBody, "_validate_checksum", counting)
    settings = load_settings(cache_env, overrides={"local_dir": str(tmp_path / "local")})

    async def stage(prefix: str) -> bytes | memoryview | None:
        async with Stager(settings, reconcile=False) as stager:
            handle = await stager.open(s3.url(prefix))  # the manifest's own GET is checked
            checked.clear()
            return (await stager.ensure(handle, "a.tar", early=True)).buffer

    counts = {}
    for prefix in ("known", "unknown"):
        assert asyncio.run(stage(prefix)) == data
        counts[prefix] = len(checked)
    assert counts == {"known": 0, "unknown": 1}, counts
    with pytest.raises(ChecksumMismatchError):
        asyncio.run(stage("wrong"))


class _CountingPool(concurrent.futures.ThreadPoolExecutor):
    """The loop's default executor, counting the jobs handed to it (every `asyncio.to_thread`)."""

    jobs = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


def test_a_local_put_of_a_shard_in_one_chunk_takes_five_thread_jobs(tmp_path: Path) -> None:
    """Landing a shard into the local tier costs a few thread round trips, not one per system call.

    A 4 MB shard is one chunk: open the directory, create the temporary file, write it, then
    fsync + close + rename + fsync the directory in one job, and the metadata file + stat in
    one more (before: 13 jobs, each a wakeup of a pool thread and of the event loop, which on
    4 MB shards cost more CPU than the write itself). The file and its metadata are in place.
    """
    from datacache.tiers import LocalTier

    body = os.urandom(4_000_000)
    tier = LocalTier(tmp_path / "local", durable=True)
    pool = _CountingPool(4)

    async def one_chunk() -> Any:
        yield memoryview(body)

    async def put() -> None:
        asyncio.get_running_loop().set_default_executor(pool)
        await tier.put("ds/warmup", one_chunk(), metadata={"dataset": "ds"})  # the directories made
        pool.jobs = 0
        info = await tier.put("ds/shard", one_chunk(), metadata={"dataset": "ds", "size": str(len(body))})
        assert info.size == len(body)

    asyncio.run(put())
    assert pool.jobs == 5, f"{pool.jobs} thread jobs for one put of one chunk"
    assert (tmp_path / "local" / "data" / "ds" / "shard").read_bytes() == body
    meta = json.loads((tmp_path / "local" / "meta" / "ds" / "shard.json").read_text())
    assert meta == {"dataset": "ds", "size": str(len(body))}
    assert not [p for p in (tmp_path / "local").rglob("*.partial")]


def test_a_shard_within_the_keep_limit_lands_in_its_file_and_is_never_written_again(
    tmp_path: Path, cache_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transfer reads such a shard straight into its new file's pages (a shared map of the
    temporary file): no buffer of its own, no write(2) copying it into the page cache a second
    time. A shard above the keep limit still goes through `put`, in chunks."""
    from datacache.tiers import LocalTier

    origin = tmp_path / "origin"
    origin.mkdir()
    small, large = os.urandom(300_000), os.urandom(3_000_000)
    (origin / "small.tar").write_bytes(small)
    (origin / "large.tar").write_bytes(large)
    puts: list[str] = []
    real_put = LocalTier.put

    async def put(self: LocalTier, key: str, chunks: Any, **kwargs: Any) -> Any:
        puts.append(key.rsplit("/", 1)[-1])
        return await real_put(self, key, chunks, **kwargs)

    monkeypatch.setattr(LocalTier, "put", put)
    overrides = {"local_dir": str(tmp_path / "local"), "memory_budget": "8MB", "concurrency": "4"}
    settings = load_settings(cache_env, overrides=overrides)  # keep limit: 2 MB

    async def stage() -> list[bytes]:
        async with Stager(settings, reconcile=False) as stager:
            handle = await stager.open(str(origin))
            found = [await stager.ensure(handle, key) for key in ("small.tar", "large.tar")]
            return [Path(str(location.path)).read_bytes() for location in found]

    assert asyncio.run(stage()) == [small, large]
    assert puts == ["large.tar"], "only the shard above the keep limit was put"
    assert not list((tmp_path / "local").rglob("*.partial"))
