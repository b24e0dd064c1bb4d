"""A tier its last user left clean is not listed again at the next open; one a killed process used is.

Recovery lists every file of the local tier and reads every catalog row (seconds at 1e5 shards)
to repair what a killed process left. The last process to close the tier cleanly leaves a marker
that lets the next open skip that; a process killed (SIGKILL) while using the tier leaves its
session behind, and the next open recovers in full. What shows which ran: an orphan (a file in the
tier the catalog does not know, which only a killed transfer leaves) planted before the open.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from datacache.config import Settings, load_settings
from datacache.staging import Stager

_USER = r"""
import asyncio, json, sys
from datacache.config import load_settings
from datacache.staging import Stager

async def main():
    stager = Stager(load_settings({}, overrides={"local_dir": sys.argv[1]}))
    handle = await stager.open(sys.argv[2])
    location = await stager.ensure(handle, "shard-1.bin")
    print(json.dumps({"tier": location.tier}), flush=True)
    sys.stdin.readline()  # uses the tier until killed

asyncio.run(main())
"""


def _origin(tmp_path: Path) -> Path:
    origin = tmp_path / "origin"
    origin.mkdir()
    for i in range(3):
        (origin / f"shard-{i}.bin").write_bytes(bytes([i]) * 5_000)
    return origin


def _open_and_close(settings: Settings, origin: Path) -> dict[str, int]:
    """One process's use of the tier: its reconcile's counts, a shard staged, a clean close."""

    async def body() -> dict[str, int]:
        async with Stager(settings) as stager:
            counts = await stager.reconcile()
            handle = await stager.open(str(origin))
            await stager.ensure(handle, "shard-0.bin")
            return counts

    return asyncio.run(body())


def _plant_orphan(settings: Settings) -> Path:
    """A copy of a staged file under a name the catalog does not know (what a killed transfer leaves)."""
    staged = next(p for p in settings.local_dir.rglob("shard-0.bin") if p.is_file())
    orphan = staged.with_name("orphan.bin")
    shutil.copyfile(staged, orphan)
    return orphan


@contextmanager
def _user(settings: Settings, origin: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process using the tier (it has staged a shard) until killed."""
    with subprocess.Popen(
        [sys.executable, "-c", _USER, str(settings.local_dir), str(origin)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as user:
        try:
            assert user.stdout is not None
            assert json.loads(user.stdout.readline()) == {"tier": "local"}
            yield user
        finally:
            user.kill()


def test_after_a_clean_shutdown_the_next_open_does_not_list_the_tier(tmp_path: Path) -> None:
    origin, settings = _origin(tmp_path), load_settings({}, overrides={"local_dir": str(tmp_path / "local")})
    _open_and_close(settings, origin)
    orphan = _plant_orphan(settings)
    counts = _open_and_close(settings, origin)
    assert counts["orphans_removed"] == 0 and orphan.exists(), counts  # not listed: left alone


def test_after_a_sigkill_the_next_open_recovers_in_full(tmp_path: Path) -> None:
    origin, settings = _origin(tmp_path), load_settings({}, overrides={"local_dir": str(tmp_path / "local")})
    _open_and_close(settings, origin)  # clean: the marker is there
    with _user(settings, origin) as user:
        user.send_signal(signal.SIGKILL)
        user.wait(timeout=60)
    orphan = _plant_orphan(settings)
    counts = _open_and_close(settings, origin)
    assert counts["orphans_removed"] == 1 and not orphan.exists(), counts


def test_a_process_killed_while_another_closes_cleanly_leaves_the_next_open_a_full_recovery(tmp_path: Path) -> None:
    origin, settings = _origin(tmp_path), load_settings({}, overrides={"local_dir": str(tmp_path / "local")})
    _open_and_close(settings, origin)
    with _user(settings, origin) as user:
        # A second user opens and closes while the first still uses the tier: it is not the last.
        _open_and_close(settings, origin)
        orphan = _plant_orphan(settings)
        user.send_signal(signal.SIGKILL)
        user.wait(timeout=60)
    counts = _open_and_close(settings, origin)
    assert counts["orphans_removed"] == 1 and not orphan.exists(), counts
    # And killed before the other's clean close: that one was the last alive, but not all closed cleanly.
    with _user(settings, origin) as user:

        async def second_user() -> None:
            async with Stager(settings) as stager:
                handle = await stager.open(str(origin))
                await stager.ensure(handle, "shard-2.bin")
                user.send_signal(signal.SIGKILL)
                user.wait(timeout=60)

        asyncio.run(second_user())
    orphan = _plant_orphan(settings)
    counts = _open_and_close(settings, origin)
    assert counts["orphans_removed"] == 1 and not orphan.exists(), counts
    # That full recovery forgot the killed session: the tier is clean again after it.
    orphan = _plant_orphan(settings)
    counts = _open_and_close(settings, origin)
    assert counts["orphans_removed"] == 0 and orphan.exists(), counts
