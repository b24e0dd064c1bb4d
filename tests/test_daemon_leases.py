"""Leases through the daemon belong to the process that made them (issue 23 item 5).

The daemon runs as root (a real subprocess) with a small local tier; alice, an allowed client
of another uid, reports reader progress from real processes (`tests/_users.py`). A lease
names the calling process as the kernel reports it (``SO_PEERCRED``), ends when it exits,
holds only the dataset's shards, stays within the uid's share of the tier while another uid
uses it (bob, from a process that stays), is cut back to that share when another uid arrives,
and does not outlive a restart.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import _users
import pytest
from _daemon import DaemonProcess, make_shards
from _daemon_users import calls_as, serve_for
from _users import User, user_env

from datacache.config import dataset_id_for

users = _users.users  # the fixtures, by name
world_dir = _users.world_dir

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture
def base_env(cache_env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in cache_env.items() if not k.startswith("AWS_")}
    return env


_STAY = r"""
import json, sys
from _daemon import unix_request
socket, calls = sys.argv[1], json.loads(sys.argv[2])
print(json.dumps([list(unix_request(socket, m, t, b, timeout=60)) for m, t, b in calls]), flush=True)
sys.stdin.readline()  # alive (its leases and its presence with it) until the test closes its stdin
"""


@contextmanager
def staying_as(user: User, daemon: DaemonProcess, *calls: tuple[str, str, Any]) -> Iterator[list[Any]]:
    """Send ``calls`` as ``user`` from a process that lives until the block ends; their (status, reply)."""
    process = subprocess.Popen(
        [sys.executable, "-c", _STAY, str(daemon.socket), json.dumps(calls)],
        user=user.uid, group=user.gid, extra_groups=list(user.groups), env=user_env(user), cwd=user.home,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdin is not None and process.stdout is not None
    try:
        line = process.stdout.readline()
        assert line, f"{user.name}'s process ended (exit {process.wait()})"
        yield json.loads(line)
    finally:
        process.stdin.close()
        process.wait(timeout=60)
        process.stdout.close()


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
        # bob uses the tier too (a live process of his asked for room): alice is held to her share.
        with staying_as(users["bob"], daemon, opened, progress("rb")) as bobs:
            assert [status for status, _ in bobs] == [200, 200], bobs
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


def test_a_uid_alone_leases_past_its_share_and_gives_it_back_when_another_uid_arrives(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    data = world_dir / "data"
    make_shards(data / "wds", 6, 10_000)
    url = f"file://{data}/wds"
    dataset = dataset_id_for(url)
    small = ("--local-capacity", "40000B", "--allow-dataset", f"file://{data}/", "--allow-uid", str(users["bob"].uid))
    keys = [f"shard-{i:04d}.tar" for i in range(3)]
    opened = ("POST", "/v1/open", {"dataset": {"name": dataset, "url": url, "policy": "lru"}})
    ensures = [("POST", "/v1/ensure", {"dataset": dataset, "key": key}) for key in keys]
    body = {"reader": "r1", "epoch": 0, "position": 0, "holding": keys, "owner": f"{socket.gethostname()}:1"}
    progress = ("POST", "/v1/progress", {"dataset": dataset, "progress": body})
    daemon = serve_for(users, world_dir, base_env, *small)
    try:
        with staying_as(users["alice"], daemon, opened, *ensures, progress) as alices:
            assert [status for status, _ in alices] == [200] * 5, alices
            assert alices[-1][1]["holding"] == 3, alices  # alone on the tier: all her reader reads next
            assert len(_leases(daemon.local_dir)) == 3
            # bob asks for room: alice keeps her share (the nearest two), and bob's shard finds room.
            room = ("POST", "/v1/ensure", {"dataset": dataset, "key": "shard-0004.tar"})
            bobs = calls_as(users["bob"], daemon, opened, room)
            assert [status for status, _ in bobs] == [200, 200], bobs
            assert [key for key, _, _ in _leases(daemon.local_dir)] == keys[:2]
            assert bobs[1][1]["tier"] == "local", bobs
    finally:
        daemon.kill()
