"""What a job user staged while the daemon was away goes once the daemon is back and nothing of it is read.

``bob`` (of the daemon's group, not its user) stages the shards the daemon does not hold into his own
``$TMPDIR/datacache-<uid>/outage-<hash>/`` while the daemon is away (tests/test_outage_multiuser.py).
Before, the copies stayed there for good after the daemon returned. Now each process that reads
through them holds the directory's lock shared; a process that finds the daemon answering (its
access opened, or closed after it reconnected) removes the directory once it can take the lock
exclusively: never under a reader that still has it, and after a reader killed mid-outage.
"""

from __future__ import annotations

import signal
from pathlib import Path

import _users
from _outage import SAY, Node, Scripted, job_env, node
from _users import User, python_as

users = _users.users  # the fixtures, by name
world_dir = _users.world_dir
__all__ = ["node"]

_READER = SAY + """
import asyncio
from datacache.access import FailoverAccess
from datacache.client import DaemonClient
from datacache.config import load_settings

async def main():
    settings = load_settings()
    # As open_access makes it where no daemon answers; retry_interval=0: every verb asks the daemon first.
    access = FailoverAccess(DaemonClient(settings), settings, down=True, retry_interval=0.0)
    handle = await access.open("train")
    for shard in handle.manifest.shards[:3]:
        await access.ensure(handle, shard.key)
    say("staged")
    await access.locate(handle, handle.manifest.shards[0].key)  # the daemon answers this one
    say("back" if access.mode == "daemon" else access.mode)
    await access.close()
    say("closed")

asyncio.run(main())
"""

_OPEN = """
import asyncio
from datacache.access import open_access
from datacache.config import load_settings

async def main():
    access = await open_access(load_settings())
    print(access.mode, flush=True)
    await access.close()

asyncio.run(main())
"""


def _outage_dirs(tmp: Path) -> list[Path]:
    """The outage directories (their lock files, beside them, stay: a lock is never removed under its holder)."""
    return [path for path in tmp.glob("datacache-*/outage-*") if path.is_dir()]


def _copies(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("datacache-*/outage-*/data/**/*.tar"))


def test_the_outage_copies_go_once_the_daemon_is_back_and_no_reader_uses_them(
    node: Node, users: dict[str, User]
) -> None:
    bob = users["bob"]
    tmp, env = job_env(bob, node)

    def open_once() -> None:
        opened = python_as(bob, _OPEN, env=env)
        assert opened.returncode == 0 and opened.stdout.strip() == "daemon", opened.stdout + opened.stderr

    daemon = None
    reader = Scripted(bob, _READER, env, node.world / "reader.err")
    try:
        assert reader.said() == "staged"
        staged = _copies(tmp)
        assert len(staged) == 3, staged
        daemon = node.serve()
        open_once()  # another process of bob's, the daemon answering: the reader still holds the copies
        assert _copies(tmp) == staged, "removed under a reader that still reads through them"
        reader.go()
        assert reader.said() == "back"
        assert _copies(tmp) == staged, "removed while the reader's access is open (its copies may be mapped)"
        reader.go()
        assert reader.said() == "closed"
        assert not _outage_dirs(tmp), "the copies stay after the daemon is back"
        reader.go()
        reader.finish(timeout=60)

        # A second outage; its reader is killed in it: the next process that finds the daemon removes them.
        daemon.kill()
        daemon = None
        reader = Scripted(bob, _READER, env, node.world / "reader2.err")
        assert reader.said() == "staged" and len(_copies(tmp)) == 3
        reader.process.send_signal(signal.SIGKILL)
        reader.end()
        assert len(_copies(tmp)) == 3, "the copies are reused by the next reader while the daemon is away"
        daemon = node.serve()
        open_once()
        assert not _outage_dirs(tmp), "a killed reader's outage copies stay"
    finally:
        reader.end()
        if daemon is not None:
            daemon.kill()
