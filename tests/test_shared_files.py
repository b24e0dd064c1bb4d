"""Files others can plant in a shared tier: links, FIFOs, devices, huge files; and how writes reach the disk.

Each planted file must be refused (never followed, never read unbounded, never waited on),
and nothing may be written through a link, the tier's own ``data``, ``meta`` and ``locks``
included. Reads that would hang on today's code run in a child process with a deadline, so
that a hang fails the test instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from datacache.tiers import LocalTier, SharedTier
from datacache.tiers.files import UnsafeFileError, atomic_write, map_regular
from datacache.tiers.testing_map import MAP_DEADLINE

from datacache.errors import InvalidKeyError
from datacache.locks import LeaseLock
from datacache.manifest import ManifestStore

REPO = Path(__file__).resolve().parent.parent


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _put(tier: SharedTier | LocalTier, key: str, data: bytes, **kwargs: str) -> None:
    async def main() -> None:
        await tier.put(key, _one(data), metadata=kwargs or None)

    asyncio.run(main())


_PEAK = """
def peak_kb():  # this process's own peak RSS (ru_maxrss would carry over the forking parent's)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
"""


def _in_child(code: str, timeout: float = 60) -> str:
    """Run ``code`` in a fresh interpreter; a hang fails (the child is killed at ``timeout``)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PEAK + textwrap.dedent(code)],
            capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the read hung for {timeout}s")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


# -- the tier's own directories ------------------------------------------------------------


@pytest.mark.parametrize("area", ["data", "meta", "locks"])
def test_a_linked_top_level_directory_is_refused(area: str, tmp_path: Path) -> None:
    """``shared/data`` (or ``meta``, ``locks``) replaced by a link: nothing is written or read through it."""
    root = tmp_path / "shared"
    outside = tmp_path / "outside"
    outside.mkdir()
    root.mkdir()
    (root / area).symlink_to(outside, target_is_directory=True)
    tier = SharedTier(root)
    if area == "data":
        (outside / "ds").mkdir()
        (outside / "ds" / "k").write_bytes(b"someone else's")
    with pytest.raises(InvalidKeyError):
        if area == "locks":

            async def lock() -> None:
                async with LeaseLock(tier.lock_place("ds/k")).hold():
                    pass

            asyncio.run(lock())
        else:
            _put(tier, "ds/k", b"mine", checksum="x")
    if area == "data":
        assert (outside / "ds" / "k").read_bytes() == b"someone else's"
        assert sorted(p.name for p in (outside / "ds").iterdir()) == ["k"], "a partial leaked through the link"
    else:
        assert list(outside.iterdir()) == []


def test_a_linked_data_directory_is_never_read(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    outside = tmp_path / "outside"
    (outside / "ds").mkdir(parents=True)
    (outside / "ds" / "k").write_bytes(b"someone else's")
    root.mkdir()
    (root / "data").symlink_to(outside, target_is_directory=True)
    tier = SharedTier(root)

    async def reads() -> None:
        with pytest.raises(InvalidKeyError):
            await tier.get("ds/k")
        with pytest.raises(InvalidKeyError):
            await tier.stat("ds/k")
        assert [info.key async for info in tier.list()] == []

    asyncio.run(reads())


# -- planted files where a small file is expected --------------------------------------------


def _plant(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:  # a sparse file far larger than any real one
        with open(path, "wb") as handle:
            handle.truncate(4 << 30)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_planted_meta_files_are_not_read(kind: str, tmp_path: Path) -> None:
    root = tmp_path / "shared"
    _put(SharedTier(root), "ds/k", b"data", checksum="c")
    meta = root / "meta" / "ds" / "k.json"
    meta.unlink()
    _plant(meta, kind)
    out = _in_child(
        f"""
        import asyncio
        from datacache.tiers import SharedTier
        info = asyncio.run(SharedTier({str(root)!r}).stat("ds/k"))
        print(info.size, dict(info.metadata), peak_kb() < 1_000_000)
        """
    )
    assert out == "4 {} True"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_planted_shared_manifests_are_not_read(kind: str, tmp_path: Path) -> None:
    local, shared = tmp_path / "local", tmp_path / "shared"
    _plant(shared / "manifests" / "ds.json", kind)
    out = _in_child(
        f"""
        import asyncio
        from pathlib import Path
        from datacache.manifest import ManifestStore
        store = ManifestStore(Path({str(local / "manifests")!r}), Path({str(shared / "manifests")!r}))
        found = asyncio.run(store.load("ds"))
        print(found, peak_kb() < 1_000_000)
        """
    )
    assert out == "None True"


def test_a_linked_manifests_directory_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "ds.json").write_text("{}")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "manifests").symlink_to(outside, target_is_directory=True)
    store = ManifestStore(tmp_path / "local" / "manifests", shared / "manifests")
    assert asyncio.run(store.load("ds")) is None
    asyncio.run(store.delete("ds"))
    assert (outside / "ds.json").exists()


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge", "directory"])
def test_planted_lock_files_are_taken_over_not_waited_on(kind: str, tmp_path: Path) -> None:
    """A FIFO, a link to /dev/zero, a huge file or a directory where a lock file goes: a waiter takes the lock."""
    tier = SharedTier(tmp_path / "shared")
    lock = tier.lock_place("ds/k")
    if kind == "directory":
        lock.path.mkdir(parents=True)
    else:
        _plant(lock.path, kind)
    out = _in_child(
        f"""
        import asyncio
        from datacache.locks import LeaseLock
        from datacache.tiers import SharedTier
        lock = LeaseLock(SharedTier({str(tier.root)!r}).lock_place("ds/k"), lease_seconds=3600)
        async def main():
            async with lock.hold():
                pass
        asyncio.run(main())
        print(lock.took_over)
        """
    )
    assert out == "True"


# -- modes ----------------------------------------------------------------------------------


def _put_under_umask(mask: int, tier: SharedTier | LocalTier, key: str) -> None:
    old = os.umask(mask)
    try:
        _put(tier, key, b"x", checksum="c")
    finally:
        os.umask(old)


def test_modes_do_not_depend_on_the_umask(tmp_path: Path) -> None:
    """Local: private (0700/0600) under a lax umask. Shared: the group's (2770/0640) under a strict one."""
    local = LocalTier(tmp_path / "local")
    _put_under_umask(0o022, local, "ds/sub/k")
    for path in [local.root, local.root / "data", local.root / "data" / "ds", local.root / "meta" / "ds" / "sub"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE((local.root / "data" / "ds" / "sub" / "k").stat().st_mode) == 0o600
    assert stat.S_IMODE((local.root / "meta" / "ds" / "sub" / "k.json").stat().st_mode) == 0o600
    shared = SharedTier(tmp_path / "shared")
    shared.shared_datasets.add("ds")  # declared shared (readers): the group's copy
    _put_under_umask(0o077, shared, "ds/k")
    for path in [shared.root / "data", shared.root / "data" / "ds", shared.root / "meta" / "ds"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o2770, path
    assert stat.S_IMODE((shared.root / "data" / "ds" / "k").stat().st_mode) == 0o640
    # Any other dataset's copy is its writer's alone, whatever the umask (issue 33 item 1).
    _put_under_umask(0o022, shared, "private/k")
    assert stat.S_IMODE((shared.root / "data" / "private" / "k").stat().st_mode) == 0o600
    assert stat.S_IMODE((shared.root / "meta" / "private" / "k.json").stat().st_mode) == 0o600


# -- the order of an atomic write ----------------------------------------------------------------


def test_atomic_write_fsyncs_the_file_then_renames_then_fsyncs_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash at any point leaves the old file or the new one whole: data durable before the rename, the rename after.

    The calls are recorded and passed through to the real ones (a spy, not a stand-in).
    """
    calls: list[str] = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename
    # Only this test's files: another test's thread left in this process renamed one of its own
    # meanwhile (a CI run's extra "rename").
    mine = str(tmp_path)

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(mine):
            calls.append("fsync directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def ours(name: object, dir_fd: object) -> bool:
        where = os.readlink(f"/proc/self/fd/{dir_fd}") if isinstance(dir_fd, int) else ""
        return os.path.join(where, str(name)).startswith(mine)

    def replace(*args: object, **kwargs: object) -> None:
        if ours(args[1], kwargs.get("dst_dir_fd")):
            calls.append("rename")
        real_replace(*args, **kwargs)  # type: ignore[arg-type]

    def rename(*args: object, **kwargs: object) -> None:
        if ours(args[1], kwargs.get("dst_dir_fd")):
            calls.append("rename")
        real_rename(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    target = tmp_path / "dir" / "f"
    assert asyncio.run(atomic_write(target, _one(b"durable"))) == 7
    assert calls == ["fsync file", "rename", "fsync directory"]
    assert target.read_bytes() == b"durable"
    calls.clear()
    asyncio.run(atomic_write(target, _one(b"fast"), durable=False))
    assert calls == ["rename"]


def test_a_live_writers_partial_survives_a_lease_takeover(tmp_path: Path) -> None:
    """Whoever takes over a lease removes only partials no writer touched for ``min_age`` (server's clock)."""
    tier = SharedTier(tmp_path / "shared")
    _put(tier, "ds/other", b"x")
    partial = tier.root / "data" / "ds" / f".k.{'a' * 32}.partial"
    partial.write_bytes(b"being written on another node")
    assert asyncio.run(tier.remove_partials_of("ds/k", min_age=30)) == 0
    assert partial.exists()
    old = partial.stat().st_mtime - 60
    os.utime(partial, (old, old))
    assert asyncio.run(tier.remove_partials_of("ds/k", min_age=30)) == 1
    assert not partial.exists()


def test_eviction_never_lists_files_through_a_linked_data_directory(tmp_path: Path) -> None:
    from datacache.staging.shared import _shared_candidates

    outside = tmp_path / "outside"
    (outside / "ds").mkdir(parents=True)
    (outside / "ds" / "k").write_bytes(b"someone else's")
    root = tmp_path / "shared"
    root.mkdir()
    (root / "data").symlink_to(outside, target_is_directory=True)
    assert _shared_candidates(SharedTier(root)) == []
    (root / "data").unlink()
    _put(SharedTier(root), "ds/mine", b"12345")
    assert [(c.dataset, c.key, c.size) for c in _shared_candidates(SharedTier(root))] == [("ds", "mine", 5)]


@pytest.mark.parametrize("impostor", ["symlink", "fifo", "directory"])
def test_a_copy_mapped_by_its_path_is_refused_at_once_when_not_a_regular_file(tmp_path: Path, impostor: str) -> None:
    # `map_regular` is for a reader that has only a copy's path (the daemon handed it over).
    copy = tmp_path / "copy.tar"
    copy.write_bytes(b"the copy")
    mapped = map_regular(copy)
    assert bytes(mapped) == b"the copy"
    if hasattr(mapped, "close"):
        mapped.close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"not the copy")
    copy.unlink()
    plant = {"symlink": lambda: copy.symlink_to(elsewhere), "fifo": lambda: os.mkfifo(copy), "directory": copy.mkdir}
    plant[impostor]()
    outcome: list[object] = []

    def attempt() -> None:
        try:
            outcome.append(map_regular(copy))
        except Exception as exc:
            outcome.append(exc)

    reader = threading.Thread(target=attempt, daemon=True)  # a hung one must not block the suite's exit
    reader.start()
    reader.join(MAP_DEADLINE)
    assert not reader.is_alive(), f"mapping a {impostor} by its path still waiting after {MAP_DEADLINE} s"
    assert isinstance(outcome[0], UnsafeFileError), f"a {impostor} in the copy's place gave {outcome[0]!r}"
