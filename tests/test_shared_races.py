"""Another user swaps the shared tier's directories for links while a victim writes: nothing lands outside.

Real users (tests/_users.py): mallory, who can write the shared directory, exchanges
(``renameat2(RENAME_EXCHANGE)``) ``shared/data/<dataset>`` and ``shared/data`` itself with
symlinks to a directory in alice's home, as fast as she can, while alice puts objects
through the tier API and runs ``datacache warm --tier shared``. Every write alice makes must
land in the tier or be refused: her directory must stay empty (no shard, no ``.partial``).
A short run is in ``make test``; a long one under the ``faults`` marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _daemon import make_shards
from _users import User, cli_as, python_as, user_env, users, world_dir

from datacache.config import dataset_id_for

__all__ = ["users", "world_dir"]

_SWAPPER = """
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
shared, dataset, target, stop, seconds = sys.argv[1:6]
data = os.path.join(shared, "data")
os.mkdir(os.path.join(data, dataset))
os.chmod(os.path.join(data, dataset), 0o777)
os.symlink(target, os.path.join(data, ".bait"))
os.symlink(target, os.path.join(shared, ".bait"))
pairs = [
    (os.path.join(data, dataset).encode(), os.path.join(data, ".bait").encode()),
    (data.encode(), os.path.join(shared, ".bait").encode()),
]
print("ready", flush=True)
swaps = 0
end = time.monotonic() + float(seconds)
while time.monotonic() < end and not os.path.exists(stop):
    for _ in range(100):
        for a, b in pairs:
            if libc.renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) == 0:
                swaps += 1
print(swaps, flush=True)
"""

_WRITER = """
import asyncio, json
from datacache.errors import DatacacheError
from datacache.tiers import SharedTier

async def chunks(i):
    yield b"alice's shard %d " % i * 64

async def main(puts):
    tier = SharedTier({shared!r})
    ok = refused = 0
    for i in range(puts):
        try:
            await tier.put({dataset!r} + "/k%d" % (i % 40), chunks(i), metadata={{"checksum": "c"}})
            ok += 1
        except (DatacacheError, OSError):
            refused += 1
    print(json.dumps({{"ok": ok, "refused": refused}}))

asyncio.run(main({puts}))
"""


def _start_swapper(
    mallory: User, shared: Path, dataset: str, target: Path, stop: Path, seconds: float
) -> subprocess.Popen[str]:
    swapper = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_SWAPPER), str(shared), dataset, str(target), str(stop), str(seconds)],
        user=mallory.uid,
        group=mallory.gid,
        extra_groups=list(mallory.groups),
        env=user_env(mallory),
        cwd="/",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert swapper.stdout is not None
    ready = swapper.stdout.readline().strip()
    assert ready == "ready", swapper.stderr.read() if swapper.stderr else ready
    return swapper


def _race(users: dict[str, User], world_dir: Path, *, puts: int, warms: int, seconds: float) -> None:
    alice, mallory = users["alice"], users["mallory"]
    shared = world_dir / "shared"
    (shared / "data").mkdir(parents=True)
    for directory in (shared, shared / "data"):
        directory.chmod(0o777)  # a shared directory anyone can write: the attacker's way in
    origin = world_dir / "origin"
    make_shards(origin, 4, 20_000)
    for path in [origin, *origin.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    url = str(origin)
    dataset = dataset_id_for(url)
    target = alice.home / f"target-{world_dir.name}"  # stands for ~/.ssh: only alice may write it
    target.mkdir(mode=0o700)
    os.chown(target, alice.uid, alice.gid)
    stop = world_dir / "stop"
    swapper = _start_swapper(mallory, shared, dataset, target, stop, seconds)
    try:
        wrote = python_as(alice, _WRITER.format(shared=str(shared), dataset=dataset, puts=puts), timeout=seconds + 60)
        assert wrote.returncode == 0, wrote.stderr
        counts = json.loads(wrote.stdout)
        env = user_env(alice, {"DATACACHE_SHARED_DIR": str(shared), "DATACACHE_LOCAL_DIR": str(alice.home / "cache")})
        for _ in range(warms):
            cli_as(alice, "warm", url, "--tier", "shared", env=env, timeout=seconds + 60)
    finally:
        stop.touch()
        out, err = swapper.communicate(timeout=60)
    swaps = int(out.split()[-1])
    landed = sorted(os.listdir(target))
    assert landed == [], f"{len(landed)} files landed in alice's directory through a link: {landed[:5]}"
    assert swaps > 100, f"the race barely ran ({swaps} swaps): {err}"
    assert counts["ok"] + counts["refused"] == puts and counts["ok"] > 0, counts


def test_swapped_directories_never_redirect_a_write(users: dict[str, User], world_dir: Path) -> None:
    _race(users, world_dir, puts=1500, warms=2, seconds=120)


@pytest.mark.faults
def test_swapped_directories_never_redirect_a_write_long(users: dict[str, User], world_dir: Path) -> None:
    _race(users, world_dir, puts=20_000, warms=10, seconds=900)
