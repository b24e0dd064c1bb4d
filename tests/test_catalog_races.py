"""Races between the processes of one node on the catalog and the local tier (issue 12 items 19, 20).

Each test plays the other process's steps at the exact moment the race needs,
with the real catalog (SQLite), the real local tier and the real node locks,
so the interleaving is the one the reviewer found, every time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from _helpers import checksum
from datacache.tiers import LocalTier, ObjectInfo

from datacache.catalog import Catalog, ShardState, process_owner
from datacache.config import Settings
from datacache.locks import NodeLock, lock_name
from datacache.staging import recovery

# Another live process of this node: the test's parent (pytest's launcher) is alive throughout.
OTHER = f"{socket.gethostname()}:{os.getppid()}"
DATA = b"fresh bytes of a shard staged by another process" * 100


def no_choice(*_: object) -> list[object]:
    return []


async def reserve(catalog: Catalog, key: str, owner: str, *, capacity: int | None = None,
                  choose: Callable[..., object] = no_choice) -> bool:
    reservation = await catalog.reserve(
        "ds", key, size=len(DATA), version="v1", owner=owner, capacity=capacity,
        device_free=lambda: None, reserve_free=0, choose=choose,  # type: ignore[arg-type]
    )
    return reservation.granted


async def put_shard(tier: LocalTier, key: str) -> None:
    async def body() -> AsyncIterator[bytes]:
        yield DATA

    await tier.put(
        f"ds/{key}", body(), metadata={"checksum": checksum(DATA), "size": str(len(DATA)), "version": "v1"}
    )


class _ListHook(LocalTier):
    """The real local tier, running ``before_list`` once when reconcile starts walking its files."""

    def __init__(self, root: Path, before_list: Callable[[], Awaitable[None]]) -> None:
        super().__init__(root)
        self._before_list: Callable[[], Awaitable[None]] | None = before_list

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        hook, self._before_list = self._before_list, None
        if hook is not None:
            await hook()
        async for info in super().list(prefix):
            yield info


def test_reconcile_leaves_a_shard_renamed_into_place_before_its_commit(settings: Settings) -> None:
    """Item 19: reconcile snapshotted the rows, then another process reserved, renamed, and had
    not committed yet; the file looked orphaned, its adoption was refused, and it was deleted."""
    local_dir = settings.local_dir
    catalog = Catalog(local_dir / "catalog.sqlite")
    waiters = concurrent.futures.ThreadPoolExecutor(4)

    async def other_process_stages() -> None:
        # After reconcile read the catalog: reserve, then the verified file is renamed into place.
        assert await reserve(catalog, "shard-0.tar", OTHER)
        await put_shard(tier, "shard-0.tar")

    tier = _ListHook(local_dir, other_process_stages)

    def shard_lock(dataset: str, key: str) -> NodeLock:
        return NodeLock(local_dir / "locks" / lock_name(dataset, key), waiters)

    async def main() -> dict[str, int]:
        try:
            counts = await recovery.reconcile(
                settings, tier, None, catalog, owner=process_owner(), shard_lock=shard_lock
            )
            # The other process commits: its row must point at its file.
            await catalog.commit("ds", "shard-0.tar", size=len(DATA), version="v1", checksum=checksum(DATA))
            return counts
        finally:
            await catalog.close()
            waiters.shutdown()

    counts = asyncio.run(main())
    assert counts["orphans_removed"] == 0 and counts["orphans_adopted"] == 0, counts
    assert (local_dir / "data" / "ds" / "shard-0.tar").read_bytes() == DATA, "the fresh file was kept"


def test_an_evicting_row_is_not_reserved_again(settings: Settings) -> None:
    """Item 20: process A marks X evicting (to make room for Y); B reserved X anyway, renamed its
    copy in, and A's delete removed it: a RESIDENT row with no file."""
    catalog = Catalog(settings.local_dir / "catalog.sqlite")
    me = process_owner()

    async def main() -> list[tuple[str, ShardState]]:
        try:
            assert await reserve(catalog, "x.tar", me)
            await catalog.commit("ds", "x.tar", size=len(DATA), version="v1", checksum=checksum(DATA))

            def take_x(_incoming: object, residents: list[object], _need: int) -> list[object]:
                return residents

            # A (this process) makes room for y.tar: x.tar becomes its victim, EVICTING.
            assert await reserve(catalog, "y.tar", me, capacity=len(DATA), choose=take_x)
            assert (await catalog.get("ds", "x.tar")).state == ShardState.EVICTING  # type: ignore[union-attr]
            # B, and A itself, must not stage x.tar until A's eviction finished.
            assert not await reserve(catalog, "x.tar", OTHER)
            assert not await reserve(catalog, "x.tar", me)
            return [(e.key, e.state) for e in await catalog.entries()]
        finally:
            await catalog.close()

    assert asyncio.run(main()) == [("x.tar", ShardState.EVICTING), ("y.tar", ShardState.STAGING)]


def test_a_child_forked_while_its_parent_writes_can_write_the_catalog(tmp_path: Path) -> None:
    """SQLite keeps lock state per process: a child forked mid-transaction inherits locks nobody releases.

    A DataLoader worker forked while the parent's catalog thread was inside a write transaction
    waited for that phantom lock until the busy timeout ("database is locked" after 60 s, issue
    24's item 12). The fork now waits for the query in progress and no connection crosses it.
    """
    catalog = Catalog(tmp_path / "catalog.db")
    asyncio.run(catalog.record_dataset("d", url="file:///d", policy="auto", pinned=False))
    inside, release = threading.Event(), threading.Event()

    def hold(connection: sqlite3.Connection) -> None:
        with catalog._transaction(connection):
            connection.execute("UPDATE datasets SET policy='lru' WHERE id='d'")
            inside.set()
            # Bounded: with the fix the fork below waits for this transaction to end. A machine so
            # slow that the fork comes later than this would let the test pass without the fix,
            # never fail with it.
            release.wait(timeout=2.0)

    writer = threading.Thread(target=lambda: asyncio.run(catalog._write(hold)))
    writer.start()
    assert inside.wait(timeout=60)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            asyncio.run(catalog.record_dataset("e", url="file:///e", policy="auto", pinned=False))
            os.write(write, b"1")
        except BaseException as exc:
            os.write(write, repr(exc).encode()[:200])
        finally:
            os._exit(0)
    release.set()
    writer.join()
    os.close(write)
    answer = os.read(read, 256)
    os.waitpid(child, 0)
    assert answer == b"1", f"the child could not write the catalog: {answer!r}"
    assert {row.id for row in asyncio.run(catalog.datasets())} >= {"d", "e"}
