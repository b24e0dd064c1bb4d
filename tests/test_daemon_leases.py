"""Leases through the daemon belong to the process that made them (issue 23 item 5).

The daemon runs as root (a real subprocess) with a small local tier; alice, an allowed client
of another uid, reports reader progress from real processes (`tests/_users.py`). A lease
names the calling process as the kernel reports it (``SO_PEERCRED``), ends when it exits,
holds only the dataset's shards, stays within the uid's share of the tier, and does not
outlive a restart.
"""

from __future__ import annotations

import socket
import sqlite3
from pathlib import Path
from typing import Any

import _users
import pytest
from _daemon import make_shards
from _users import User
from test_daemon_multiuser import calls_as, serve_for

from datacache.config import dataset_id_for

users = _users.users  # the fixtures, by name
world_dir = _users.world_dir

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture
def base_env(cache_env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in cache_env.items() if not k.startswith("AWS_")}
    return env


def _leases(local_dir: Path) -> list[tuple[str, str, str]]:
    connection = sqlite3.connect(local_dir / "catalog.sqlite", timeout=30)
    try:
        return list(connection.execute("SELECT key, reader, owner FROM leases ORDER BY reader, key"))
    finally:
        connection.close()


def test_leases_belong_to_the_calling_process_and_end_with_it(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    data = world_dir / "data"
    make_shards(data / "wds", 6, 10_000)
    url = f"file://{data}/wds"
    dataset = dataset_id_for(url)
    # 4 shards; a uid may lease 2.
    small = ("--local-capacity", "40000B", "--allow-dataset", f"file://{data}/", "--allow-uid", str(users["bob"].uid))
    forged = f"{socket.gethostname()}:1"  # init: a process that never exits

    def shard(key: str) -> tuple[str, str, Any]:
        return ("POST", "/v1/ensure", {"dataset": dataset, "key": key})

    def progress(reader: str, *keys: str) -> tuple[str, str, Any]:
        body = {"reader": reader, "epoch": 0, "position": 0, "holding": list(keys), "owner": forged}
        return ("POST", "/v1/progress", {"dataset": dataset, "progress": body})

    opened = ("POST", "/v1/open", {"dataset": {"name": dataset, "url": url, "policy": "lru"}})
    daemon = serve_for(users, world_dir, base_env, *small)
    try:
        first = calls_as(
            users["alice"],
            daemon,
            opened,
            shard("shard-0000.tar"),
            shard("shard-0001.tar"),
            progress("r1", "shard-0000.tar", "no-such-shard.tar"),
            progress("r1", "shard-0000.tar", "shard-0001.tar"),
        )
        assert [status for status, _ in first] == [200, 200, 200, 400, 200], first
        assert "not a shard" in str(first[3][1])
        owners = {owner for _, _, owner in _leases(daemon.local_dir)}
        assert owners and forged not in owners, owners  # the calling process, not the one it named
        # A second process holds two more; the first's leases ended with it, so a fifth shard fits.
        second = calls_as(
            users["alice"],
            daemon,
            opened,
            shard("shard-0002.tar"),
            shard("shard-0003.tar"),
            progress("r2", "shard-0002.tar", "shard-0003.tar"),
            shard("shard-0004.tar"),
            progress("r3", "shard-0002.tar", "shard-0003.tar", "shard-0004.tar"),
            progress("r3", "shard-0002.tar", "shard-0003.tar", "shard-0004.tar"),
        )
        assert [status for status, _ in second] == [200] * 7, second
        assert second[4][1]["tier"] == "local", second[4][1]  # 0 or 1 evicted: their reader is gone
        # r2 already holds alice's share (half the tier): r3 gets none of its three.
        assert second[5][1]["holding"] == 0, second[5][1]
        assert second[6][1]["holding"] == 0, second[6][1]
        # Said once per dataset and uid, in a size a person reads (a new user's log had it on every note).
        said = [line for line in daemon.log_text().splitlines() if "more than one uid may lease" in line]
        assert len(said) == 1 and "(20.00 kB, half the local tier)" in said[0], said
        # bob, another allowed uid, reports progress under alice's reader name: her leases stay hers.
        before = [row for row in _leases(daemon.local_dir) if row[1] == "r2"]
        third = calls_as(users["bob"], daemon, opened, progress("r2"))
        assert [status for status, _ in third] == [200, 200], third
        assert [row for row in _leases(daemon.local_dir) if row[1] == "r2"] == before and before
    finally:
        daemon.kill()
    assert _leases(daemon.local_dir)  # left by processes now gone...
    restarted = serve_for(users, world_dir, base_env, *small)
    try:
        assert _leases(restarted.local_dir) == []  # ...and none survives the restart
    finally:
        restarted.kill()
