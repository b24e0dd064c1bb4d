"""Denial of service through the socket (issue 11 item 7): no client can hold the daemon for itself.

A real daemon subprocess, a low open-file limit where it matters, real uids for
the flood. Long variants (thousands of connections) run under the ``faults`` marker.
"""

from __future__ import annotations

import json
import resource
import select
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _users
import pytest
from _daemon import DaemonProcess, read_reply, start_daemon, unix_request, wait_until
from _users import User, run_as

users = _users.users  # the fixtures, by name
world_dir = _users.world_dir


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(60)
    sock.connect(str(path))
    return sock


def _closed_by_peer(sock: socket.socket) -> Callable[[], bool]:
    def closed() -> bool:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        try:
            return sock.recv(65536, socket.MSG_PEEK) == b""
        except ConnectionResetError:
            return True

    return closed


@pytest.fixture
def daemon(tmp_path: Path, cache_env: dict[str, str]) -> Any:
    named = tmp_path / "metrics-clients.toml"  # each client's name in the metrics: where their count needs a bound
    named.write_text("[daemon]\nmetrics_clients = true\n")
    limits = ("--request-timeout", "1", "--body-memory", "1MB", "--config", str(named))
    process = start_daemon(cache_env, tmp_path / "cache", *limits)
    try:
        yield process
    finally:
        process.kill()


def test_slowloris_headers_and_bodies_are_cut_off(daemon: DaemonProcess) -> None:
    slow_headers = _connect(daemon.socket)
    slow_headers.sendall(b"GET /v1/status HTTP/1.1\r\nHost: datacache\r\n")  # and never the blank line
    slow_body = _connect(daemon.socket)
    slow_body.sendall(b"POST /v1/report HTTP/1.1\r\nHost: datacache\r\nContent-Length: 100\r\n\r\n{\"client\"")
    try:
        wait_until(_closed_by_peer(slow_headers), timeout=60, what="the daemon to drop unfinished headers")
        reply = read_reply(slow_body)
        assert reply.startswith(b"HTTP/1.1 400"), reply
        assert b"did not arrive" in reply, reply
        assert daemon.request("GET", "/v1/status")[0] == 200  # and it serves everyone else
    finally:
        slow_headers.close()
        slow_body.close()


def test_request_bodies_share_one_memory_budget(daemon: DaemonProcess) -> None:
    size = 700_000  # two of these do not fit in --body-memory 1MB
    head = f"POST /v1/future_order HTTP/1.1\r\nHost: datacache\r\nContent-Length: {size}\r\n\r\n".encode()
    first, second = _connect(daemon.socket), _connect(daemon.socket)
    try:
        first.sendall(head)
        second.sendall(head)
        # One of them holds the budget while its body is awaited; the other is answered at once.
        wait_until(lambda: select.select([first, second], [], [], 0)[0], timeout=60, what="a reply")
        refused_socket = select.select([first, second], [], [], 0)[0][0]
        waiting = second if refused_socket is first else first
        refused = read_reply(refused_socket)
        assert refused.startswith(b"HTTP/1.1 503"), refused
        assert b"request bodies" in refused
        body = json.dumps({"dataset": "none", "keys": []}).encode()
        waiting.sendall(body + b" " * (size - len(body)))
        assert read_reply(waiting).startswith(b"HTTP/1.1 409")  # read and answered: no such dataset is open
    finally:
        first.close()
        second.close()


def test_report_names_are_bounded_in_the_metrics(daemon: DaemonProcess) -> None:
    for i in range(300):
        code, _ = daemon.request("POST", "/v1/report", {"client": f"name-{i}", "delivered_bytes_per_s": 1.0})
        assert code == 200
    code, text = daemon.request("GET", "/metrics")
    assert code == 200
    labels = {line.split('client="', 1)[1].split('"', 1)[0] for line in text.splitlines() if 'client="' in line}
    assert 0 < len(labels) <= 64, len(labels)
    assert "name-299" in labels  # the newest stay; the oldest of that uid made room
    assert len(daemon.status()["clients"]) <= 64


_FLOOD = r"""
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)  # a full backlog answers EAGAIN instead of blocking forever
    for attempt in range(300):  # the backlog is full for a moment: the attacker insists (up to ~3 s)
        try:
            s.connect(sys.argv[1])
            break
        except BlockingIOError:
            time.sleep(0.01)  # sleep-ok: the attacker's own pacing, not a synchronisation
    else:
        s.close()
        break
    held.append(s)
print(len(held), flush=True)
sys.stdin.read()
"""


def _low_fd_limit() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))


_STATUS_AS_CLIENT = (
    "import sys, json; from _daemon import unix_request; "
    "codes = [unix_request(sys.argv[1], 'GET', '/v1/status', timeout=60)[0] for _ in range(int(sys.argv[2]))]; "
    "print(json.dumps(codes))"
)


def _flood_and_serve(
    users: dict[str, User], world_dir: Path, cache_env: dict[str, str], *, connections: int, requests: int
) -> None:
    """bob floods a daemon under ``ulimit -n 256`` with ``connections``; alice's ``requests`` must all succeed."""
    team = users["alice"].groups[0]
    allow = ("--allow-gid", str(team), "--allow-uid", str(users["alice"].uid), "--allow-uid", str(users["bob"].uid))
    daemon = start_daemon(
        cache_env,
        world_dir / "cache",
        "--socket-group",
        str(team),
        *allow,
        socket_path=world_dir / "run" / "daemon.sock",
        log=world_dir / "daemon.log",
        preexec_fn=_low_fd_limit,  # systemd's default LimitNOFILE is 1024; lower still here
    )
    flood = subprocess.Popen(
        [sys.executable, "-c", _FLOOD, str(daemon.socket), str(connections)],
        user=users["bob"].uid,
        group=users["bob"].gid,
        extra_groups=[team],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_users.user_env(users["bob"]),
    )
    try:
        assert flood.stdout is not None
        assert int(flood.stdout.readline()) > 256  # more connections than the daemon has fds
        done = run_as(
            users["alice"], [sys.executable, "-c", _STATUS_AS_CLIENT, str(daemon.socket), str(requests)], timeout=600
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == [200] * requests
        assert unix_request(daemon.socket, "GET", "/healthz")[0] == 200
        assert daemon.log.stat().st_size < 200_000, "the refusals are logged, not a traceback each"
    finally:
        flood.kill()
        flood.communicate()
        daemon.kill()


def test_one_uid_flooding_connections_does_not_starve_another(
    users: dict[str, User], world_dir: Path, cache_env: dict[str, str]
) -> None:
    _flood_and_serve(users, world_dir, cache_env, connections=600, requests=1)


@pytest.mark.faults
def test_a_long_flood_does_not_starve_another_uid(
    users: dict[str, User], world_dir: Path, cache_env: dict[str, str]
) -> None:
    _flood_and_serve(users, world_dir, cache_env, connections=5000, requests=200)


def test_a_uid_flooding_from_many_processes_is_capped_as_one(
    users: dict[str, User], world_dir: Path, cache_env: dict[str, str]
) -> None:
    """Issue 23 item 15: the cap is per uid, not per process: bob's 6 processes share one share.

    Under ``ulimit -n 256`` the daemon holds 128 connections, 32 per uid; 6 processes of 64
    would hold them all if each process had a share of its own.
    """
    team = users["alice"].groups[0]
    allow = ("--allow-uid", str(users["alice"].uid), "--allow-uid", str(users["bob"].uid))
    daemon = start_daemon(
        cache_env,
        world_dir / "cache",
        "--socket-group",
        str(team),
        *allow,
        socket_path=world_dir / "run" / "daemon.sock",
        log=world_dir / "daemon.log",
        preexec_fn=_low_fd_limit,
    )
    floods = [
        subprocess.Popen(
            [sys.executable, "-c", _FLOOD, str(daemon.socket), "64"],
            user=users["bob"].uid,
            group=users["bob"].gid,
            extra_groups=[team],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_users.user_env(users["bob"]),
        )
        for _ in range(6)
    ]
    try:
        for flood in floods:
            assert flood.stdout is not None
            assert int(flood.stdout.readline()) > 0
        done = run_as(users["alice"], [sys.executable, "-c", _STATUS_AS_CLIENT, str(daemon.socket), "3"], timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout) == [200] * 3
    finally:
        for flood in floods:
            flood.kill()
            flood.communicate()
        daemon.kill()


def test_a_capacity_larger_than_the_disk_is_said_at_the_daemons_start(
    tmp_path: Path, cache_env: dict[str, str]
) -> None:
    """Issue 34 item 5: a trial's ``local_capacity = "3TB"`` on a 67 GB disk started without a word."""
    local = tmp_path / "local"
    local.mkdir()
    disk = shutil.disk_usage(local).total
    daemon = start_daemon(cache_env, local, "--local-capacity", f"{2 * disk}B")
    try:
        assert "more than the filesystem" in daemon.log_text(), daemon.log_text()
    finally:
        daemon.stop()
    fits = start_daemon(cache_env, local, "--local-capacity", f"{disk // 2}B")
    try:
        assert "more than the filesystem" not in fits.log_text()
    finally:
        fits.stop()
