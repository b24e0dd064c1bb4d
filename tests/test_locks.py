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
