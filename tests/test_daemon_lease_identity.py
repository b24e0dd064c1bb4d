"""The daemon knows a reader's process by the kernel's word (SO_PEERCRED), whatever host:pid it claims (issue 36).

In the Kubernetes shapes a training container has a host name of its own (its pod's) and pids of its own
namespace: two readers may claim the same ``host:pid`` ("train-pod-0:1" is each pod's first process),
and the host they name is never the daemon's. The claim is a label only; a lease is the calling
process's as the kernel names it in the daemon's pid namespace, and ends when that process does.
Before, a progress naming another host was refused ("reader progress must name a process of this node").
"""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from _daemon import DaemonProcess, catalog_rows, make_shards, start_daemon
from _helpers import REPO

from datacache.config import dataset_id_for

_READER = r"""
import json, sys
from _daemon import unix_request
socket, calls = sys.argv[1], json.loads(sys.argv[2])
print(json.dumps([list(unix_request(socket, m, t, b, timeout=60)) for m, t, b in calls]), flush=True)
sys.stdin.readline()  # alive (its leases with it) until the test answers
"""

CLAIM = "train-pod-0:1"  # what each pod's first process would claim: another host, pid 1


def _leases(local_dir: Path) -> set[tuple[str, str, str]]:
    connection = sqlite3.connect(local_dir / "catalog.sqlite", timeout=30)
    try:
        return set(connection.execute("SELECT key, reader, owner FROM leases"))
    finally:
        connection.close()


def _reader(daemon: DaemonProcess, calls: list[tuple[str, str, Any]]) -> tuple[subprocess.Popen[str], list[Any]]:
    """A real process that sends ``calls`` and stays until its stdin is closed; with its (status, reply)s."""
    process = subprocess.Popen(
        [sys.executable, "-c", _READER, str(daemon.socket), json.dumps(calls)],
        env={**daemon.env, "PYTHONPATH": f"{REPO / 'tests'}:{REPO}"}, cwd=REPO,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"the reader ended (exit {process.wait()})"
    return process, json.loads(line)


def _end(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.close()
    process.wait(timeout=60)
    process.stdout.close()


def test_two_readers_claiming_one_host_pid_keep_their_own_leases_which_end_with_their_processes(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    make_shards(tmp_path / "wds", 6, 10_000)
    url = f"file://{tmp_path}/wds"
    dataset = dataset_id_for(url)
    keys = [f"shard-{i:04d}.tar" for i in range(6)]
    opened = ("POST", "/v1/open", {"dataset": {"name": dataset, "url": url, "policy": "lru"}})

    def ensure(key: str) -> tuple[str, str, Any]:
        return ("POST", "/v1/ensure", {"dataset": dataset, "key": key})

    def progress(*held: str) -> tuple[str, str, Any]:
        body = {"reader": "r0/w0", "epoch": 0, "position": 0, "holding": list(held), "owner": CLAIM}
        return ("POST", "/v1/progress", {"dataset": dataset, "progress": body})

    # Room for 4 shards; one uid alone on the tier: its leases are not bounded.
    daemon = start_daemon(cache_env, tmp_path / "local", "--local-capacity", "40000B",
                          "--allow-dataset", f"file://{tmp_path}/")  # fmt: skip
    first = second = None
    try:
        first, said = _reader(daemon, [opened, ensure(keys[0]), ensure(keys[1]), progress(keys[0], keys[1])])
        assert [status for status, _ in said] == [200] * 4, said
        second, said = _reader(daemon, [opened, ensure(keys[2]), ensure(keys[3]), progress(keys[2], keys[3])])
        assert [status for status, _ in said] == [200] * 4, said
        host = socket.gethostname()
        assert _leases(daemon.local_dir) == {
            (keys[0], "r0/w0", f"{host}:{first.pid}"),
            (keys[1], "r0/w0", f"{host}:{first.pid}"),
            (keys[2], "r0/w0", f"{host}:{second.pid}"),
            (keys[3], "r0/w0", f"{host}:{second.pid}"),
        }, "each reader's leases are its own process's, not the host:pid both claimed"
        _end(second)
        second = None
        # The tier is full: the shards of the reader that ended make the room, the live one's stay.
        third, said = _reader(daemon, [opened, ensure(keys[4]), ensure(keys[5])])
        _end(third)
        assert [reply.get("tier") for _, reply in said[1:]] == ["local", "local"], said
        local = {key for _, key, _, _, state in catalog_rows(daemon.local_dir) if state == "resident"}
        assert local == {keys[0], keys[1], keys[4], keys[5]}, local
    finally:
        for process in (first, second):
            if process is not None:
                _end(process)
        daemon.kill()
