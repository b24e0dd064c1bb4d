"""Calling the daemon as other real users: a root daemon their group can reach, and calls made as them.

Shared by the multi-user daemon tests (`test_daemon_multiuser.py` and the tests of each verb's
authority): the daemon runs as root (`tests/_daemon.py`), the callers as throwaway users
(`tests/_users.py`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from _daemon import DaemonProcess, start_daemon
from _users import User, run_as

__all__ = ["CALLS_SCRIPT", "calls_as", "error_code", "serve_for"]

CALLS_SCRIPT = r"""
import json, sys
from _daemon import unix_request
socket, calls = sys.argv[1], json.loads(sys.argv[2])
out = []
for method, target, body in calls:
    try:
        out.append(list(unix_request(socket, method, target, body, timeout=60)))
    except OSError as exc:
        out.append([0, {"os_error": exc.strerror}])
print(json.dumps(out))
"""


def calls_as(user: User, daemon: DaemonProcess, *calls: tuple[str, str, Any]) -> list[tuple[int, Any]]:
    """Send ``calls`` (method, path, body) over the daemon's socket as ``user``; their (status, reply)."""
    done = run_as(user, [sys.executable, "-c", CALLS_SCRIPT, str(daemon.socket), json.dumps(calls)], timeout=300)
    assert done.returncode == 0, done.stderr
    return [(status, reply) for status, reply in json.loads(done.stdout)]


def error_code(reply: Any) -> str | None:
    return reply.get("error", {}).get("code") if isinstance(reply, dict) else None


def serve_for(
    users: dict[str, User], world: Path, env: dict[str, str], *args: str, team_gid: bool = False
) -> DaemonProcess:
    """A root daemon whose socket the team group (alice, bob) can reach; alice is allowed in.

    ``team_gid``: the daemon runs with the team's gid (as deploy/slurm's does), so its clients read
    the manifests it writes; without it, only the socket is theirs."""
    team = users["alice"].groups[0]
    return start_daemon(
        env,
        world / "cache",
        "--socket-group",
        str(team),
        "--allow-uid",
        str(users["alice"].uid),
        *args,
        socket_path=world / "run" / "daemon.sock",
        log=world / "daemon.log",
        group=team if team_gid else None,
    )
