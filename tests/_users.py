"""Real, different users for multi-user tests: throwaway accounts and a way to run as them.

The tests run as root here. `make_users` creates throwaway accounts (and a group they share)
with `useradd`/`groupadd`, removed again at the end of the session; `run_as` runs a command,
or `python_as` a snippet of Python, as one of them in a child process (``subprocess`` drops
to the uid, gid and supplementary groups before exec). Nothing here fakes a uid: the kernel
enforces every permission the tests rely on.

Where neither root nor `useradd` is available the fixtures skip with the reason.
"""

from __future__ import annotations

import fcntl
import grp
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class User:
    """A throwaway account: its name, uid, primary gid and supplementary gids."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...] = field(default=())

    @property
    def home(self) -> Path:
        return Path(pwd.getpwuid(self.uid).pw_dir)


def can_switch_users() -> str | None:
    """None where real users can be made and switched to, else the reason they cannot."""
    if os.geteuid() != 0:
        return "multi-user tests need root (to create throwaway users and drop to their uids)"
    for tool in ("useradd", "userdel", "groupadd", "groupdel"):
        if shutil.which(tool) is None:
            return f"multi-user tests need {tool} on PATH"
    return None


def _admin(argv: Sequence[str]) -> None:
    # useradd/groupadd take a lock on /etc/passwd; parallel test runs may hold it briefly.
    deadline = time.monotonic() + 30
    while True:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode == 0:
            return
        if "lock" not in done.stderr.lower() or time.monotonic() > deadline:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
        time.sleep(0.1)  # sleep-ok: backing off from another process's lock on /etc/passwd


def _open_traverse(paths: Sequence[Path]) -> list[tuple[Path, int]]:
    """Give others search (x) permission on each ancestor of ``paths`` that lacks it; return what to restore.

    The interpreter may live under root's 0700 home (pyenv): without this, no other uid can
    exec it. Only the search bit is added (nothing becomes listable or readable), and only
    for the session.
    """
    changed: list[tuple[Path, int]] = []
    for path in paths:
        for ancestor in [path, *path.parents]:
            if not ancestor.is_dir():
                continue
            mode = ancestor.stat().st_mode & 0o7777
            if not mode & 0o001:
                ancestor.chmod(mode | 0o001)
                changed.append((ancestor, mode))
    return changed


@pytest.fixture(scope="session")
def users() -> Iterator[dict[str, User]]:
    """Three throwaway users: ``alice`` and ``bob`` share the group ``team``; ``mallory`` does not.

    Also ``team_gid``: the gid of the shared group, as ``users["alice"].groups[0]``.
    """
    reason = can_switch_users()
    if reason is not None:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    group = f"dct{tag}"
    _admin(["groupadd", group])
    team = grp.getgrnam(group).gr_gid
    made: dict[str, User] = {}
    base = Path(tempfile.mkdtemp(prefix="datacache-homes-"))
    base.chmod(0o755)
    # Test sessions run side by side on one machine: each holds this lock shared while it needs the
    # search bits, and the last one out (the one that can take it exclusively) restores them.
    lock_path = os.path.join(tempfile.gettempdir(), "datacache-users-traverse.lock")
    in_use = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(in_use, fcntl.LOCK_SH)
    opened = _open_traverse([Path(os.path.realpath(sys.executable)).parent, Path(sys.prefix), REPO])
    try:
        for role in ("alice", "bob", "mallory"):
            name = f"dc{role[:3]}{tag}"
            extra = ["-G", group] if role != "mallory" else []
            _admin(["useradd", "-M", "-d", str(base / name), "-s", "/usr/sbin/nologin", "-U", *extra, name])
            entry = pwd.getpwnam(name)
            home = base / name
            home.mkdir(mode=0o700)
            os.chown(home, entry.pw_uid, entry.pw_gid)
            groups = (team,) if role != "mallory" else ()
            made[role] = User(name=name, uid=entry.pw_uid, gid=entry.pw_gid, groups=groups)
        yield made
    finally:
        for user in made.values():
            subprocess.run(["userdel", user.name], capture_output=True, check=False)
            with_group = subprocess.run(["getent", "group", user.name], capture_output=True, check=False)
            if with_group.returncode == 0:
                subprocess.run(["groupdel", user.name], capture_output=True, check=False)
        subprocess.run(["groupdel", group], capture_output=True, check=False)
        shutil.rmtree(base, ignore_errors=True)
        fcntl.flock(in_use, fcntl.LOCK_UN)
        try:
            fcntl.flock(in_use, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            opened = []  # another session still runs as these users: leave the search bits
        for path, mode in reversed(opened):
            path.chmod(mode)
        os.close(in_use)


@pytest.fixture
def world_dir() -> Iterator[Path]:
    """A fresh directory every user can reach (0755, root's), outside pytest's 0700 tmp root."""
    path = Path(tempfile.mkdtemp(prefix="datacache-multiuser-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def user_env(user: User, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A clean environment for ``user``: its own HOME and XDG dirs, no DATACACHE_* or AWS_* of root's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATACACHE_", "AWS_", "XDG_"))}
    env["HOME"] = str(user.home)
    env["USER"] = env["LOGNAME"] = user.name
    env["XDG_CACHE_HOME"] = str(user.home / ".cache")
    env["XDG_CONFIG_HOME"] = str(user.home / ".config")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tests"), env.get("PYTHONPATH", "")]))
    env.update(extra or {})
    return env


def run_as(
    user: User,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    cwd: str | os.PathLike[str] | None = None,
    input: bytes | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as ``user`` (uid, gid and supplementary groups dropped before exec)."""
    return subprocess.run(
        list(argv),
        user=user.uid,
        group=user.gid,
        extra_groups=list(user.groups),
        env=dict(env) if env is not None else user_env(user),
        cwd=cwd if cwd is not None else user.home,
        timeout=timeout,
        capture_output=True,
        text=input is None,
        input=input,
        check=False,
    )


def python_as(
    user: User, code: str, *, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a snippet of Python (dedented) as ``user`` with this interpreter."""
    return run_as(user, [sys.executable, "-c", textwrap.dedent(code)], env=env, timeout=timeout)


def cli_as(
    user: User, *args: str, env: Mapping[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``datacache ARGS`` as ``user``."""
    return run_as(user, [sys.executable, "-m", "datacache.cli", *args], env=env, timeout=timeout)
