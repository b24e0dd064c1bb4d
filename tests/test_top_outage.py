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
from typing import Any

import _users
from _outage import SAY, Node, Scripted, job_env, node
from _users import User, cli_as

users = _users.users  # the fixtures, by name
world_dir = _users.world_dir
__all__ = ["node"]

_READER = SAY + """
import asyncio, json
from datacache.access import FailoverAccess
from datacache.client import DaemonClient
from datacache.config import load_settings

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
    tmp, env = job_env(bob, node)
    daemon = None
    reader = Scripted(bob, _READER, env, node.world / "reader.err")
    try:
        staged = int(reader.said())  # the daemon never started: every shard staged in bob's own directory
        frame, text = _top(bob, env)
        assert frame["source"] == "embedded" and not frame["daemon"]["answers"], frame["daemon"]
        (row,) = [c for c in frame["clients"] if c.get("pid") == reader.pid]
        assert row["mode"] == "embedded (daemon unavailable)" and row["own_bytes_in"] == staged, row
        assert frame["totals"]["bytes_in"]["local"] == staged, "the fallback's counters, as an embedded reader's"
        assert "STAGED BY THE READER'S OWN PROCESS" in text and "embedded (daemon unavailable)" in text, text

        daemon = node.serve()
        reader.go()
        assert reader.said() == "back"
        frame, text = _top(bob, env)
        assert frame["source"] == "daemon", frame["daemon"]
        (row,) = [c for c in frame["clients"] if c.get("pid") == reader.pid]
        assert row["mode"] == "daemon" and row["own_bytes_in"] == staged, row
        assert "STAGED BY THE READER'S OWN PROCESS" in text, text
        assert not list(tmp.rglob("clients/*/*.json")), "the outage's report file goes once the daemon shows the reader"
        reader.go()
        reader.finish(timeout=120)
    finally:
        reader.end()
        if daemon is not None:
            daemon.kill()
