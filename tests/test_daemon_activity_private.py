"""What other users are doing stays theirs (issue 33 item 11).

The metrics port answers any local uid: it showed each client by name (``host:PID:r0w0``) with
its bytes/s and stall. Now its families carry one ``client="all"`` series (the node's total, the
dashboard's sum and max unchanged) unless the operator sets ``metrics_clients``. The manifests
the daemon writes for its clients sit in a folder its group may pass but not list, each under
a name only the daemon can make: a uid reads the manifest it was handed, and cannot find out
which datasets other uids opened.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _users
import pytest
from _daemon import make_shards, start_daemon
from _daemon_users import calls_as, serve_for
from _users import User, python_as, user_env

users = _users.users
world_dir = _users.world_dir

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

_SCRAPE = r"""
import sys, urllib.request
print(urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=30).read().decode())
"""


@pytest.fixture
def base_env(cache_env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in cache_env.items() if not k.startswith("AWS_")}


def _metrics_address(daemon_log: str) -> str:
    found = re.search(r"metrics on http://([0-9.]+:\d+)", daemon_log)
    assert found, daemon_log
    return found.group(1)


def _scrape_as(user: User, address: str) -> str:
    done = python_as(user, f"import sys; sys.argv = ['x', {address!r}]\n{_SCRAPE}")
    assert done.returncode == 0, done.stderr
    return done.stdout


# Sends its calls, prints the replies, and stays (a reporting reader is alive) until its stdin closes.
_STAYING_CLIENT = r"""
import json, sys
from _daemon import unix_request
socket, calls = sys.argv[1], json.loads(sys.argv[2])
print(json.dumps([list(unix_request(socket, m, t, b, timeout=60)) for m, t, b in calls]), flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _reporting(user: User, socket: Path, calls: list[Any]) -> Iterator[list[Any]]:
    client = subprocess.Popen(
        [sys.executable, "-c", _STAYING_CLIENT, str(socket), json.dumps(calls)],
        user=user.uid,
        group=user.gid,
        extra_groups=list(user.groups),
        env=user_env(user),
        cwd=user.home,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert client.stdin is not None and client.stdout is not None
    try:
        yield json.loads(client.stdout.readline())
    finally:
        client.stdin.close()
        client.stdout.close()
        client.wait(60)


def _report(name: str, dataset: str) -> tuple[str, str, dict[str, object]]:
    body = {"client": name, "delivered_bytes_per_s": 5e8, "stall_fraction": 0.25, "delivered_bytes": 10}
    body["dataset"] = dataset
    return ("POST", "/v1/report", body)


@pytest.mark.parametrize("opted_in", [False, True], ids=["default", "metrics_clients"])
def test_the_metrics_port_shows_no_client_of_another_uid_unless_the_operator_asks(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str], opted_in: bool
) -> None:
    data = world_dir / "data"
    make_shards(data / "alice-thesis", 1, 10_000, seed=1)
    args = ["--allow-dataset", f"file://{data}/"]
    if opted_in:
        config = world_dir / "datacache.toml"
        config.write_text("[daemon]\nmetrics_clients = true\n")
        args += ["--config", str(config)]
    daemon = serve_for(users, world_dir, base_env, *args)
    try:
        url = f"file://{data}/alice-thesis/"
        calls = [("POST", "/v1/open", {"dataset": url}), _report("node7:4242:r0w0", "alice-thesis")]
        with _reporting(users["alice"], daemon.socket, calls) as replies:
            assert [status for status, _ in replies] == [200, 200], replies
            text = _scrape_as(users["bob"], _metrics_address(daemon.log_text()))
        series = re.findall(r'^datacache_client_delivered_bytes_per_second\{client="([^"]*)"\} (\S+)$', text, re.M)
        if opted_in:
            assert ("node7_4242_r0w0", "5e+08") in series or ("node7:4242:r0w0", "5e+08") in series, series
        else:
            assert series == [("all", "5e+08")], series  # the node's total, nobody's name
            assert "4242" not in text and "node7" not in text and "alice-thesis" not in text
            assert re.search(r'^datacache_client_data_stall_fraction\{client="all"\} 0\.25$', text, re.M), text
    finally:
        daemon.kill()


def test_no_uid_can_list_which_datasets_the_daemon_serves(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    """The deploy/ shape: the daemon as its own account, whose primary group its job users share."""
    team = users["alice"].groups[0]
    account = users["mallory"]  # here: the daemon's own account, primary group the team's
    data = world_dir / "data"
    make_shards(data / "alice-thesis", 1, 10_000, seed=2)
    for folder in ("cache", "run"):
        (world_dir / folder).mkdir()
        os.chown(world_dir / folder, account.uid, team)

    def become_the_daemon() -> None:
        os.setgroups([team])
        os.setgid(team)
        os.setuid(account.uid)

    daemon = start_daemon(
        {**base_env, **user_env(account)},
        world_dir / "cache",
        "--allow-dataset",
        f"file://{data}/",
        socket_path=world_dir / "run" / "daemon.sock",
        log=world_dir / "daemon.log",
        preexec_fn=become_the_daemon,
    )
    try:
        opening = ("POST", "/v1/open", {"dataset": f"file://{data}/alice-thesis/"})
        ((status, opened),) = calls_as(users["alice"], daemon, opening)
        assert status == 200, opened
        manifests = Path(opened["manifest_path"]).parent
        assert stat.S_IMODE(manifests.stat().st_mode) == 0o710 and manifests.stat().st_gid == team
        # Alice reads the manifest she was handed...
        mine = python_as(users["alice"], f"print(open({opened['manifest_path']!r}).read()[:1])")
        assert mine.returncode == 0 and mine.stdout.strip() == "{", mine.stderr
        # ...bob, of the same group, can neither list the folder nor find her manifest by its id and snapshot.
        guess = manifests / f"{opened['dataset_id']}@{opened['snapshot']}.json"
        probe = python_as(
            users["bob"],
            f"""
            import os, json
            found = {{}}
            try:
                found["listed"] = os.listdir({str(manifests)!r})
            except PermissionError:
                found["listed"] = None
            found["guessed"] = os.path.exists({str(guess)!r})
            print(json.dumps(found))
            """,
        )
        assert probe.returncode == 0, probe.stderr
        assert json.loads(probe.stdout) == {"listed": None, "guessed": False}
        key = manifests / ".names.key"
        assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.stat().st_uid == account.uid
    finally:
        daemon.kill()
