"""The local tier is private however it is created: 0700 directories, 0600 files, under umask 022.

torchrun starts its processes at once, each creating the fresh cache (the root, the catalog and its
``-wal``/``-shm``, locks, data): a new user found the root 0755 and ``catalog.sqlite`` 0644 in 4 of 4
runs with 2 processes (issue 24 item 13). Everything there is made through one helper
(`datacache.tiers.local`: `make_local_dirs`, `make_local_file`, `LocalModes`).
"""

from __future__ import annotations

import stat
import subprocess
import sys
import textwrap
from pathlib import Path

from _helpers import REPO, fill_dir, tar_of

_READ = """
import sys
from datacache.loaders import CachedIterableDataset
ds = CachedIterableDataset(sys.argv[1], shuffle=True, seed=1)
print(sum(1 for _ in ds))
"""


def _loose(root: Path) -> list[str]:
    found = []
    for path in [root, *root.rglob("*")]:
        if "indexes" in path.relative_to(root).parts[:1]:
            continue  # the sample-count indexes' modes are issue 23 item 8's (another change)
        info = path.lstat()
        mode = stat.S_IMODE(info.st_mode)
        if stat.S_ISDIR(info.st_mode):
            wanted = 0o700
        elif stat.S_ISSOCK(info.st_mode):
            continue
        else:
            wanted = 0o600
        if mode & ~wanted:
            found.append(f"{path.relative_to(root.parent)} {oct(mode)}")
    return found


def test_two_processes_under_umask_022_make_a_private_local_tier(tmp_path: Path, cache_env: dict[str, str]) -> None:
    data = fill_dir(tmp_path / "data", {
        f"shard-{s}.tar": tar_of({f"s{s}_{i}.cls": b"1" for i in range(5)}) for s in range(4)
    })
    local = tmp_path / "node" / "cache"  # neither exists yet: the processes make both
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(local)}
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_READ), str(data)],
            env=env, cwd=REPO, umask=0o022, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for _ in range(2)
    ]
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err
        assert out.split() == ["20"]
    assert (local / "catalog.sqlite").exists()
    assert "\n".join(_loose(local)) == ""
