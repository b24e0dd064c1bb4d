"""A node laid out as deploy/slurm runs it, and job-user scripts a test steps through word by word.

The outage tests (tests/test_outage_*.py, tests/test_top_outage.py) share it: the daemon as its own
account (``alice``, group ``team``), the job as ``bob``, a member of ``team`` by supplementary
membership only, who may read the daemon's shard files but write nothing of its cache.
"""

from __future__ import annotations

import grp
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import pytest
from _daemon import REPO, DaemonProcess, wait_until
from _users import User, user_env
from test_loader import write_wds

__all__ = ["SAY", "Node", "Scripted", "job_env", "node", "owned_only_by"]

# The first lines of a script a test steps through: it says a word, then waits for the test's answer.
SAY = """
import sys

def say(word):
    print(word, flush=True)
    sys.stdin.readline()  # the test answers once it has done what the word asks
"""


class Node:
    """A node's cache, socket and config, the daemon's (alice's, group team) as deploy/slurm lays them out."""

    def __init__(self, world: Path, daemon_user: User, team: int, capacity: int) -> None:
        self.world = world
        self.user = daemon_user
        self.team = team
        self.local = world / "cache"
        self.run = world / "run"
        for directory in (self.local, self.run):
            directory.mkdir(mode=0o750)
            os.chown(directory, daemon_user.uid, team)
            directory.chmod(0o750)
        self.socket = self.run / "daemon.sock"
        self.origin = world / "origin"
        self.config = world / "config.toml"
        self.config.write_text(
            textwrap.dedent(f"""
            [cache]
            local_dir = "{self.local}"
            local_capacity = "{capacity}B"
            [daemon]
            socket = "{self.socket}"
            daemon_uid = "{daemon_user.name}"
            [datasets]
            train = {{ url = "{self.origin}/", readers = ["@{grp.getgrgid(team).gr_name}"] }}
            """)
        )
        self.starts = 0
        self.capacity = capacity
        self.expected: dict[str, dict[str, bytes]] = {}

    def serve(self) -> DaemonProcess:
        """The daemon as systemd runs the unit: its account, the group, UMask=0027."""
        self.starts += 1
        log = self.world / f"daemon-{self.starts}.log"
        env = {"PATH": os.environ["PATH"], "HOME": str(self.user.home), "DATACACHE_CONFIG": str(self.config),
               "PYTHONPATH": str(REPO)}
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "datacache.cli", "serve", "--metrics-address", "127.0.0.1:0"],
                user=self.user.uid, group=self.team, extra_groups=list(self.user.groups), umask=0o027,
                env=env, cwd="/", stdout=out, stderr=subprocess.STDOUT,
            )
        daemon = DaemonProcess(process=process, local_dir=self.local, socket=self.socket, log=log, env=env)
        wait_until(daemon.ready, timeout=90, what="the daemon to become ready")
        return daemon

    def daemon_env(self) -> dict[str, str]:
        """The environment of a command run as the daemon's account, with the node's config."""
        return user_env(self.user, {"DATACACHE_CONFIG": str(self.config)})

    def resident(self) -> set[str]:
        """The shard files on the node's cache now."""
        return {path.name for path in (self.local / "data").rglob("*.tar")}


@pytest.fixture
def node(users: dict[str, User], world_dir: Path) -> Iterator[Node]:
    # 12 shards, room for 5 on the node: the daemon cannot have them all resident when it is killed.
    expected = write_wds(world_dir / "origin", samples=96, per_shard=8, with_counts=True)
    capacity = 5 * max(path.stat().st_size for path in (world_dir / "origin").glob("*.tar"))
    made = Node(world_dir, users["alice"], users["alice"].groups[0], capacity)
    made.expected = expected
    yield made


def job_env(user: User, node: Node) -> tuple[Path, dict[str, str]]:
    """``user``'s own 0700 ``~/tmp`` (where an outage's copies go) and an environment with the node's config."""
    tmp = user.home / "tmp"
    tmp.mkdir(mode=0o700, exist_ok=True)
    os.chown(tmp, user.uid, user.gid)
    return tmp, user_env(user, {"DATACACHE_CONFIG": str(node.config), "TMPDIR": str(tmp)})


def owned_only_by(root: Path, uid: int, *, private: bool = False) -> None:
    """Every path under ``root`` (and it) is ``uid``'s; with ``private``, none open to its group or others."""
    for path in [root, *root.rglob("*")]:
        info = path.lstat()
        assert info.st_uid == uid, f"{path} is uid {info.st_uid}'s, not {uid}'s"
        assert not private or info.st_mode & 0o077 == 0, (path, oct(info.st_mode))


class Scripted:
    """A script (of `SAY`'s shape) run as ``user``: `said` reads its next word, `go` answers it."""

    def __init__(self, user: User, script: str, env: dict[str, str], errors: Path) -> None:
        self.errors = errors
        with errors.open("w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(script)],
                user=user.uid, group=user.gid, extra_groups=list(user.groups), env=env, cwd=user.home,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
            )
        self.pid = self.process.pid

    def said(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        assert line, f"the script left:\n{self.errors.read_text()}"
        return line

    def expect(self, word: str) -> None:
        line = self.said()
        assert line == word, f"the script said {line!r}, not {word!r}:\n{self.errors.read_text()}"

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def finish(self, timeout: float) -> str:
        """Wait for the script's end; what it printed after its last word. It must succeed."""
        out, _ = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, self.errors.read_text()
        return out

    def end(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.communicate()

    def __enter__(self) -> Scripted:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.end()
