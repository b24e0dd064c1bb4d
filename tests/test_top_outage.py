"""`datacache top` shows what a reader staged in its own process while its daemon was away (issue 34).

A job user (``bob``, of the daemon's group, not its user) reads while the daemon (``alice``'s) is
down: its fallback stages the shards the daemon does not hold into bob's own directory. Run by
bob without the daemon, ``top`` shows that reader, its mode, and what its own process staged
(the reader's report file lives in bob's own directory, as the daemon's cache is not his to
write). Once the daemon answers again the reader reports to it, and ``top`` through the daemon
still says what the reader staged itself. Before: the reports of a reader whose daemon was away
were dropped (no client on screen), and the daemon's view had no word of the reader's own staging.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import _users
from _users import User, cli_as, user_env
from test_outage_multiuser import Node, node

users = _users.users  # the fixtures, by name
world_dir = _users.world_dir
__all__ = ["node"]

_READER = """
import asyncio, json, sys
from datacache.access import FailoverAccess
from datacache.client import DaemonClient
from datacache.config import load_settings

def say(word):
    print(word, flush=True)
    sys.stdin.readline()  # the test answers once it has looked

async def main():
    settings = load_settings()
    # As open_access makes it where no daemon answers; retry_interval=0: every verb asks the daemon first.
    access = FailoverAccess(DaemonClient(settings), settings, down=True, retry_interval=0.0)
    handle = await access.open("train")
    keys = [shard.key for shard in handle.manifest.shards][:3]
    for key in keys:
        await access.ensure(handle, key)
    figures = dict(rank=0, world_size=1, worker=0, num_workers=1, epoch=0, samples=24)
    async def report():
        await access.report(delivered_bytes_per_s=1e6, stall_fraction=0.25, delivered_bytes=10**6,
                            dataset=handle.id, mode=access.mode, **figures)
    await report()
    say(json.dumps(sum(handle.manifest.shard(key).size for key in keys)))
    await access.locate(handle, keys[0])  # the daemon answers this one
    await report()
    say("back")
    await access.close()

asyncio.run(main())
"""


def _say(reader: subprocess.Popen[str], errors: Path) -> str:
    assert reader.stdout is not None
    line = reader.stdout.readline().strip()
    assert line, f"the reader left:\n{errors.read_text()}"
    return line


def _go(reader: subprocess.Popen[str]) -> None:
    assert reader.stdin is not None
    reader.stdin.write("go\n")
    reader.stdin.flush()


def _top(bob: User, env: dict[str, str]) -> tuple[dict[str, Any], str]:
    shown = cli_as(bob, "top", "--once", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    text = cli_as(bob, "top", "--once", env=env)
    assert text.returncode == 0, text.stderr
    return json.loads(shown.stdout.splitlines()[-1]), text.stdout


def test_top_shows_what_a_reader_staged_itself_while_the_daemon_was_away_and_after_it_is_back(
    node: Node, users: dict[str, User]
) -> None:
    bob = users["bob"]
    tmp = bob.home / "tmp"
    tmp.mkdir(mode=0o700)
    os.chown(tmp, bob.uid, bob.gid)
    env = user_env(bob, {"DATACACHE_CONFIG": str(node.config), "TMPDIR": str(tmp)})
    errors = node.world / "reader.err"
    daemon = None
    with errors.open("w") as err:
        reader = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_READER)],
            user=bob.uid, group=bob.gid, extra_groups=list(bob.groups), env=env, cwd=bob.home,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
        )
    try:
        staged = int(_say(reader, errors))  # the daemon never started: every shard staged in bob's own directory
        frame, text = _top(bob, env)
        assert frame["source"] == "embedded" and not frame["daemon"]["answers"], frame["daemon"]
        (row,) = [c for c in frame["clients"] if c.get("pid") == reader.pid]
        assert row["mode"] == "embedded (daemon unavailable)" and row["own_bytes_in"] == staged, row
        assert frame["totals"]["bytes_in"]["local"] == staged, "the fallback's counters, as an embedded reader's"
        assert "STAGED BY THE READER'S OWN PROCESS" in text and "embedded (daemon unavailable)" in text, text

        daemon = node.serve()
        _go(reader)
        assert _say(reader, errors) == "back"
        frame, text = _top(bob, env)
        assert frame["source"] == "daemon", frame["daemon"]
        (row,) = [c for c in frame["clients"] if c.get("pid") == reader.pid]
        assert row["mode"] == "daemon" and row["own_bytes_in"] == staged, row
        assert "STAGED BY THE READER'S OWN PROCESS" in text, text
        assert not list(tmp.rglob("clients/*/*.json")), "the outage's report file goes once the daemon shows the reader"
        _go(reader)
        reader.communicate(timeout=120)
        assert reader.returncode == 0, errors.read_text()
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.communicate()
        if daemon is not None:
            daemon.kill()
