"""Disk faults: a full disk or a file-size limit in the middle of a put, and bits flipped at rest.

Staging fails (or bypasses the full tier) cleanly, nothing partial is visible,
and service goes on once there is room again. A copy whose bytes changed on
disk is detected before any sample from it is served, and re-staged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _daemon import start_daemon, unix_request
from _faultdata import catalog, check_cache, check_exactly_once, make_dataset, partials, record, sample_pairs, xxh
from _helpers import DATACACHE, REPO, run_cli
from datacache.loaders import CachedIterableDataset
from torch.utils.data import DataLoader

from datacache.config import Settings, dataset_id_for, load_settings
from datacache.staging import Stager

if TYPE_CHECKING:
    from conftest import S3Bucket

KB = 1000


def disk_env(base: dict[str, str], s3: S3Bucket, tmp_path: Path, *, shared: bool = True) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith(("AWS_", "DATACACHE_"))}
    env.update(s3.server.env())
    env.update({"DATACACHE_LOCAL_DIR": str(tmp_path / "local"), "AWS_EC2_METADATA_DISABLED": "true"})
    if shared:
        env["DATACACHE_SHARED_DIR"] = str(tmp_path / "shared")
    return env


def upload_sized(s3: S3Bucket, sizes: dict[str, int]) -> dict[str, bytes]:
    files = {name: bytes([i % 251]) * size for i, (name, size) in enumerate(sorted(sizes.items()))}
    for name, data in files.items():
        s3.put(f"ds/{name}", data)
    return files


def limit_file_size(limit: int) -> Any:
    def apply() -> None:
        # Python ignores SIGXFSZ, so a write past the limit fails with EFBIG instead of killing.
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


# -- EFBIG: RLIMIT_FSIZE in the middle of a put ----------------------------------------------


@pytest.mark.parametrize("shared", [False, True], ids=["local", "local+shared"])
def test_efbig_mid_put_fails_cleanly_and_service_goes_on(
    shared: bool, s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path
) -> None:
    files = upload_sized(s3, {"a.tar": 120 * KB, "b.tar": 150 * KB, "big.tar": 700 * KB, "c.tar": 90 * KB})
    env = disk_env(cache_env, s3, tmp_path, shared=shared)
    settings = load_settings(env)
    url = s3.url("ds")
    limited = subprocess.run(
        [*DATACACHE, "warm", url, "-q"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_file_size(400 * KB),
        check=False,
    )
    assert limited.returncode == 1, limited.stderr
    assert "Traceback" not in limited.stderr
    # One line names the shard and the cause; the last says the warm-up is incomplete.
    lines = limited.stderr.strip().splitlines()
    assert [line for line in lines if "big.tar" in line and "File too large" in line], limited.stderr
    assert lines[-1] == "datacache: error: warm incomplete: 1 of 4 shards are not resident on the local tier"
    # Nothing partial is visible or left behind, and the catalog holds only whole, verified shards.
    assert partials(settings.local_dir, tmp_path / "shared") == []
    check_cache(settings.local_dir, settings.shared_dir, files)
    rows = {key: state for _, key, *_, state in catalog(settings.local_dir)}
    assert rows == dict.fromkeys(["a.tar", "b.tar", "c.tar"], "resident"), rows
    # Room again: the same warm-up completes, fetching only what was missing.
    done = run_cli(["warm", url, "--json"], env)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["complete"] is True and summary["bytes_transferred"] == 700 * KB
    check_cache(settings.local_dir, settings.shared_dir, files)
    assert sorted(key for _, key, *_ in catalog(settings.local_dir)) == sorted(files)
    record("efbig_cli", shared=shared, partial_visible=0)


def test_efbig_in_the_daemon_then_room_again_without_a_restart(
    s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path
) -> None:
    files = upload_sized(s3, {"a.tar": 100 * KB, "big.tar": 600 * KB, "b.tar": 80 * KB})
    env = disk_env(cache_env, s3, tmp_path, shared=False)
    local = tmp_path / "local"
    daemon = start_daemon(env, local)
    try:
        # A soft limit only, so that it can be lifted again without privileges.
        resource.prlimit(daemon.process.pid, resource.RLIMIT_FSIZE, (300 * KB, resource.RLIM_INFINITY))
        code, text = unix_request(daemon.socket, "POST", "/v1/warm", {"dataset": s3.url("ds")}, timeout=120)
        assert code == 200
        done = [json.loads(line) for line in str(text).splitlines() if line.strip()][-1]
        assert done["complete"] is False
        assert [failure["shard"] for failure in done["failures"]] == ["big.tar"], done
        assert "File too large" in done["failures"][0]["error"], done
        assert daemon.ready(), "the daemon goes on after a failed put"
        assert partials(local) == []
        check_cache(local, None, files)
        # Room again (the limit lifted on the live process): the next warm-up completes.
        resource.prlimit(daemon.process.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        code, text = unix_request(daemon.socket, "POST", "/v1/warm", {"dataset": s3.url("ds")}, timeout=120)
        done = [json.loads(line) for line in str(text).splitlines() if line.strip()][-1]
        assert done["complete"] is True, done
        check_cache(local, None, files)
        assert len(catalog(local)) == 3
        record("efbig_daemon", partial_visible=0)
    finally:
        daemon.kill()


# -- ENOSPC: a filesystem that really fills up (needs permission to mount a tmpfs) -------------


@contextlib.contextmanager
def tiny_filesystem(path: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes at ``path``; skips the test where mounting is not allowed."""
    path.mkdir(parents=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def test_enospc_on_the_shared_tier_bypasses_it_cleanly(s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path) -> None:
    files = upload_sized(s3, {f"s{i}.tar": 300 * KB for i in range(5)})
    with tiny_filesystem(tmp_path / "shared", 700 * 1024):
        env = disk_env(cache_env, s3, tmp_path)
        settings = load_settings(env)
        result = run_cli(["warm", s3.url("ds"), "--json"], env)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout.strip().splitlines()[-1])["complete"] is True
        assert partials(settings.local_dir, tmp_path / "shared") == []
        counts = check_cache(settings.local_dir, settings.shared_dir, files)
        assert counts["resident_rows"] == 5
        shared_copies = list((tmp_path / "shared" / "data").rglob("*.tar"))
        assert 0 < len(shared_copies) < 5, "the shared tier filled up and the rest bypassed it"
        record("enospc_shared", shared_copies=len(shared_copies), partial_visible=0)


def test_enospc_on_the_local_tier_fails_cleanly_and_recovers(
    s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path
) -> None:
    files = upload_sized(s3, {f"s{i}.tar": 400 * KB for i in range(6)})
    with tiny_filesystem(tmp_path / "local", 1536 * 1024) as local:
        env = disk_env(cache_env, s3, tmp_path, shared=False)
        env["DATACACHE_CONCURRENCY"] = "6"  # six puts at once all find room, and then the disk fills
        first = run_cli(["warm", s3.url("ds"), "--json"], env)
        assert "Traceback" not in first.stderr, first.stderr
        assert partials(local) == []
        check_cache(local, None, files)
        resident = [key for _, key, *_, state in catalog(local) if state == "resident"]
        if first.returncode == 0:
            assert json.loads(first.stdout.strip().splitlines()[-1])["complete"] is False
        assert len(resident) < 6
        # Room again: evict what is there, and the shards that did not fit come in turn.
        dataset = dataset_id_for(s3.url("ds"))
        settings = load_settings(env)

        async def make_room() -> None:
            async with Stager(settings) as stager:
                await stager.evict(dataset)

        asyncio.run(make_room())
        second = run_cli(["warm", s3.url("ds"), "--shards", "s5.tar", "--json"], env)
        assert second.returncode == 0, second.stderr
        check_cache(local, None, files)
        assert "s5.tar" in [key for _, key, *_, state in catalog(local) if state == "resident"]
        record("enospc_local", resident_before=len(resident), partial_visible=0)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_full_local_disk_reads_from_the_next_tier(
    workers: int, s3: S3Bucket, cache_env: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 12 item 5: a 6 MB disk under a 15 MB dataset behaves like a full capacity, not a crash.

    Every sample once, read from S3 where the disk has no room; no partial file; every
    resident row has its file; the catalog's own writes never fail; the bypass is reported.
    """
    files, expected = make_dataset(15, 10, seed=5, size=(90_000, 110_000))
    for name, data in files.items():
        s3.put(f"ds/{name}", data)
    with tiny_filesystem(tmp_path / "local", 6 * 1024 * 1024) as local:
        env = disk_env(cache_env, s3, tmp_path, shared=False)
        settings = load_settings(env)
        dataset = CachedIterableDataset(
            s3.url("ds"), config=settings, shuffle=False
        )
        items = dataset if workers == 0 else DataLoader(dataset, batch_size=None, num_workers=workers)
        with caplog.at_level("WARNING", logger="datacache"):
            seen = sample_pairs(items)
        # Closing waits for the durable writes a cold epoch leaves running behind its readers
        # (early serving): a partial file found before that is one still being written.
        dataset.close()
        assert check_exactly_once(seen, expected) == (0, 0)
        assert partials(local) == []
        counts = check_cache(local, None, files)
        assert 0 < counts["resident_rows"] < 15, "some shards fit, the rest were read from S3"
        if workers == 0:  # worker processes log in their own process
            assert "the local device is nearly full" in caplog.text.lower(), caplog.text
        record("enospc_loader", workers=workers, resident=counts["resident_rows"], partial_visible=0)


# -- bits flipped at rest -------------------------------------------------------------------


def flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset % len(raw)] ^= 0x10
    path.write_bytes(bytes(raw))


def loader_epoch(
    url: str, settings: Settings, workers: int = 0, *, close: bool = False
) -> tuple[list[tuple[str, bytes]], Any]:
    """One epoch; with ``close``, its dataset is closed before returning.

    Closing stops what the epoch left running behind it (durable copies, the next epoch's
    prefetch, which checks each local copy's size): a bit flipped while that still runs can be
    met mid-rewrite, and the copy dropped and re-staged from the origin before the next epoch
    reads it, so that no reader ever meets the bad copy.
    """
    dataset = CachedIterableDataset(url, config=settings, shuffle=False)
    items = dataset if workers == 0 else DataLoader(dataset, batch_size=None, num_workers=workers)
    seen = sample_pairs(items)
    stats = dataset.stats()
    if close:
        dataset.close()
    return seen, stats


@pytest.mark.parametrize("where", ["local", "shared", "both"])
def test_a_flipped_bit_on_any_tier_is_never_served(where: str, tmp_path: Path, settings: Settings) -> None:
    files, expected = make_dataset(5, 12, seed=8)
    origin = tmp_path / "origin"
    origin.mkdir()
    for name, data in files.items():
        (origin / name).write_bytes(data)
    # Closed: nothing of the first epoch runs on while the bits are flipped.
    seen, _ = loader_epoch(str(origin), settings, close=True)
    assert check_exactly_once(seen, expected) == (0, 0)
    assert settings.shared_dir is not None
    victim = "shard-0002.tar"
    targets = {
        "local": [settings.local_dir],
        "shared": [settings.shared_dir],
        "both": [settings.local_dir, settings.shared_dir],
    }[where]
    for root in targets:
        flip(next((root / "data").rglob(victim)), 1500)
    if where == "shared":
        # The local copy is gone too: the next stage-in reads the (corrupt) shared copy.
        async def drop_local() -> None:
            async with Stager(settings) as stager:
                await stager.evict(dataset_id_for(str(origin)), [victim])

        asyncio.run(drop_local())
    # (Without worker processes for "both": one reader meets the bad local copy, then the bad shared one.)
    seen, stats = loader_epoch(str(origin), settings, workers=0 if where == "both" else 2)
    assert check_exactly_once(seen, expected) == (0, 0), "a sample from a corrupt copy was served"
    if where != "shared":
        assert stats.corrupt_copies >= 1
    if where != "local":
        # Detected on the shared tier too: by the reader that mapped it (it always checks a shared
        # copy) or by the stage-in that copied it (it checks what it copies), whichever met it
        # first; either drops that copy, so no other node is handed it. Its bytes say so, not its
        # inode: a copy written again may be given the freed inode's number.
        now = next((settings.shared_dir / "data").rglob(victim), None)
        good = (origin / victim).read_bytes()
        assert now is None or now.read_bytes() == good, "the corrupt shared copy was kept"
    check_cache(settings.local_dir, settings.shared_dir, files)
    lost, corrupt = check_exactly_once(seen, expected)
    record("bit_flip", where=where, lost=lost, corrupt=corrupt, samples=len(expected))


def test_a_flipped_bit_is_caught_through_the_daemon(tmp_path: Path, cache_env: dict[str, str]) -> None:
    files, expected = make_dataset(4, 10, seed=9)
    origin = tmp_path / "origin"
    origin.mkdir()
    for name, data in files.items():
        (origin / name).write_bytes(data)
    daemon = start_daemon(cache_env, tmp_path / "cache")
    try:
        settings = load_settings(daemon.env)
        seen, stats = loader_epoch(str(origin), settings)
        assert stats.mode == "daemon"
        assert check_exactly_once(seen, expected) == (0, 0)
        flip(next((tmp_path / "cache" / "data").rglob("shard-0001.tar")), 777)
        seen, stats = loader_epoch(str(origin), settings, workers=2)
        assert check_exactly_once(seen, expected) == (0, 0), "a sample from a corrupt copy was served"
        # Caught by a worker mapping the copy (its checksum; each worker that met it counts it), or
        # by the daemon before handing it out (the file changed since it was recorded): the order
        # of those two depends on the scheduler, and either way no sample of it was served.
        caught_by_daemon = "shard 'shard-0001.tar' vanished or changed" in daemon.log.read_text()
        assert stats.corrupt_copies >= 1 or caught_by_daemon
        rows = {key: (checksum, state) for _, key, _, _, checksum, state in catalog(tmp_path / "cache")}
        assert rows["shard-0001.tar"] == (xxh(files["shard-0001.tar"]), "resident"), "re-staged"
        lost, corrupt = check_exactly_once(seen, expected)
        record("bit_flip", where="daemon", lost=lost, corrupt=corrupt, samples=len(expected))
    finally:
        daemon.kill()
