"""Cross-process single-flight locks: flock on the node, lease files on the shared tier."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import socket
import time
from pathlib import Path

import pytest

from datacache.errors import InvalidKeyError
from datacache.locks import LeaseLock, NodeLock, lock_name


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_lock_names_cannot_escape() -> None:
    assert lock_name("ds", "a/b.tar") == "ds/a/b.tar.lock"
    with pytest.raises(InvalidKeyError):
        lock_name("ds", "../../x")


async def _exclusive(make_lock: object, workers: int = 6) -> int:
    """Run ``workers`` tasks through the lock; return the most ever inside at once."""
    inside = 0
    most = 0

    async def one() -> None:
        nonlocal inside, most
        async with make_lock().hold():  # type: ignore[operator]
            inside += 1
            most = max(most, inside)
            # Real I/O inside the critical section gives the others every chance to enter.
            await asyncio.to_thread(os.urandom, 1 << 16)
            await asyncio.to_thread(os.urandom, 1 << 16)
            inside -= 1

    await asyncio.gather(*(one() for _ in range(workers)))
    return most


def test_lease_lock_is_exclusive(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "ds" / "a.tar.lock"
    assert asyncio.run(_exclusive(lambda: LeaseLock(path, lease_seconds=30))) == 1
    assert not path.exists(), "released"


def test_node_lock_is_exclusive(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "a.lock"
    with concurrent.futures.ThreadPoolExecutor(8) as waiters:
        assert asyncio.run(_exclusive(lambda: NodeLock(path, waiters))) == 1


def _write_holder(path: Path, host: str, pid: int, *, age: float = 0.0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps({"host": host, "pid": pid, "token": "old", "since": time.time() - age})
    )
    if age:
        past = time.time() - age
        os.utime(path, (past, past))


@pytest.mark.parametrize(
    "holder",
    ["expired lease on another node", "dead process on this node"],
)
def test_stale_lease_is_taken_over(tmp_path: Path, holder: str) -> None:
    path = tmp_path / "locks" / "a.lock"
    if holder.startswith("expired"):
        _write_holder(path, "some-other-node", 1, age=120)
    else:
        _write_holder(path, socket.gethostname(), _dead_pid())
    lock = LeaseLock(path, lease_seconds=30)

    async def body() -> dict[str, object]:
        async with lock.hold():
            return dict(json.loads(path.read_text()))

    record = asyncio.run(body())
    assert lock.took_over
    assert record["pid"] == os.getpid()
    assert not path.exists()
    assert list(path.parent.iterdir()) == [], "no '.stale' file left behind"


def test_live_lease_on_another_node_is_respected(tmp_path: Path) -> None:
    """A fresh lease held elsewhere is waited for; when its file goes, the waiter gets it."""
    path = tmp_path / "locks" / "a.lock"
    _write_holder(path, "some-other-node", 1)
    lock = LeaseLock(path, lease_seconds=30)
    checked = asyncio.Event

    async def body() -> bool:
        polled = checked()

        def release_once_seen_waiting() -> None:
            # The waiter is polling a lock that exists; "the other node" releases it.
            path.unlink()

        async def holder() -> None:
            await polled.wait()
            await asyncio.to_thread(release_once_seen_waiting)

        async def waiter() -> bool:
            assert path.exists()
            polled.set()
            async with lock.hold():
                return not lock.took_over

        results = await asyncio.gather(holder(), waiter())
        return bool(results[1])

    assert asyncio.run(body()) is True


def _take(lock: LeaseLock) -> None:
    """Take and release ``lock``; a waiter that hangs fails after 60 s instead of hanging the suite."""

    async def body() -> None:
        async with asyncio.timeout(60), lock.hold():
            pass

    asyncio.run(body())


def test_a_lock_dated_in_the_future_is_taken_over(tmp_path: Path) -> None:
    """A lock file dated 2100 is no live heartbeat: it must not hang every warm of its shard."""
    path = tmp_path / "locks" / "a.lock"
    _write_holder(path, "some-other-node", 1)
    year_2100 = 4_102_444_800.0
    os.utime(path, (year_2100, year_2100))
    lock = LeaseLock(path, lease_seconds=3600)

    _take(lock)
    assert lock.took_over


def test_a_skewed_clock_never_takes_over_a_live_lease(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This node's clock runs an hour ahead of the file server's: a live holder's lease is still live.

    The skew is the environment, set by replacing ``time.time``; the lease's age must come from
    the server's clock (the mtimes it sets), which the skew does not touch.
    """
    path = tmp_path / "locks" / "a.lock"

    async def body() -> bool:
        async with LeaseLock(path, lease_seconds=30).hold():
            real = time.time
            monkeypatch.setattr(time, "time", lambda: real() + 3600)
            waiter = LeaseLock(path, lease_seconds=30)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(2), waiter.hold():
                    pass
            return waiter.took_over

    assert asyncio.run(body()) is False


def test_a_lease_without_heartbeats_is_taken_over_after_one_lease_of_watching(tmp_path: Path) -> None:
    path = tmp_path / "locks" / "a.lock"
    _write_holder(path, "some-other-node", 1)  # fresh, but nobody renews it
    lock = LeaseLock(path, lease_seconds=0.5)

    _take(lock)
    assert lock.took_over


def test_a_lease_kept_alive_forever_is_bounded(tmp_path: Path) -> None:
    """A holder that heartbeats forever (hostile, or stuck) is taken over after ``max_hold`` of watching."""
    path = tmp_path / "locks" / "a.lock"

    async def body() -> bool:
        async with LeaseLock(path, lease_seconds=0.3).hold():
            waiter = LeaseLock(path, lease_seconds=0.3, max_hold=1.0)
            async with asyncio.timeout(60), waiter.hold():
                return waiter.took_over

    assert asyncio.run(body()) is True
