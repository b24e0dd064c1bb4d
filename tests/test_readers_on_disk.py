"""A declared dataset's files admit exactly its readers, on the daemon's local tier and the shared tier (issue 33).

docs/SECURITY.md, "Who may read what". Before, `readers` was enforced by the daemon only: a declared
dataset's files were 0640 to the tier's group, so a member of that group who is not among the
readers (and whom the origin would refuse) read the shards with ``cat``. Now such files carry an
access ACL naming the readers, and a daemon whose tier refuses ACLs does not start. Real users
(tests/_users.py): ``alice`` and ``bob`` share the group ``team``; only ``alice`` is a reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from _daemon import start_daemon
from _users import User, run_as, users, world_dir
from datacache.tiers import LocalTier, SharedTier
from datacache.tiers.local import GROUP_READABLE
from datacache.tiers.testing import chunks_of
from test_loader import write_wds

from datacache.posix_acl import ACL_XATTR

__all__ = ["users", "world_dir"]


def _team_dir(path: Path, team: int, mode: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, 0, team)
    path.chmod(mode)
    return path


def _config(world: Path, shared: Path, readers: str) -> Path:
    config = world / "config.toml"
    config.write_text(
        textwrap.dedent(f"""
        [cache]
        shared_dir = "{shared}"
        [datasets]
        train = {{ url = "{world / "origin"}/", readers = [{readers}] }}
        """)
    )
    return config


def _reads(user: User, path: Path) -> bool:
    return run_as(user, ["dd", f"if={path}", "of=/dev/null", "bs=16", "count=1"]).returncode == 0


def test_a_declared_datasets_files_admit_its_readers_and_not_every_member_of_the_tiers_group(
    users: dict[str, User], world_dir: Path, cache_env: dict[str, str]
) -> None:
    alice, bob = users["alice"], users["bob"]
    team = alice.groups[0]
    assert team in bob.groups  # bob may traverse both tiers: only the files' ACL keeps him out
    write_wds(world_dir / "origin", samples=12, per_shard=4)
    local = _team_dir(world_dir / "cache", team, 0o2750)
    shared = _team_dir(world_dir / "shared", team, 0o2770)
    # As deploy/ runs it: the daemon's files take the group its users share.
    daemon = start_daemon(cache_env, local, config=_config(world_dir, shared, f'"{alice.name}"'), group=team)
    try:
        for tier in ("local", "shared"):
            warm = [sys.executable, "-m", "datacache.cli", "warm", "train", "--tier", tier]
            warmed = subprocess.run(warm, env=daemon.env, capture_output=True, text=True, timeout=300, check=False)
            assert warmed.returncode == 0, warmed.stderr
    finally:
        daemon.stop()
    for root in (local, shared):
        copies = sorted((root / "data").rglob("*.tar"))
        assert len(copies) == 3, copies
        for copy in copies:
            assert _reads(alice, copy), f"the reader alice cannot read {copy}"
            assert not _reads(bob, copy), f"bob, of the tier's group but not a reader, read {copy}"
            assert not _reads(users["mallory"], copy)
        metas = sorted((root / "meta").rglob("*.json"))
        assert metas and not any(_reads(bob, meta) for meta in metas), "the copies' metadata is the readers' too"
    # The dataset's manifests (its URL, shard names, sizes), the daemon's snapshots of them, and its
    # counts are the readers' as well: every file of the dataset on either tier, not only its bytes.
    described = [
        path
        for path in (*local.rglob("*.json"), *shared.rglob("*"))
        if path.is_file() and not path.is_symlink() and str(world_dir / "origin") in path.read_text(errors="replace")
    ]
    wheres = {path.relative_to(world_dir).parts[:2] for path in described}
    assert wheres >= {("cache", "manifests"), ("cache", "daemon"), ("shared", "manifests")}, wheres
    for path in described:
        own = path.parent == local / "manifests"  # the daemon's own record (0600): no client reads it
        assert own or _reads(alice, path), f"the reader alice cannot read {path}"
        assert not _reads(bob, path), f"bob, of the tier's group but not a reader, read {path}"


@contextlib.contextmanager
def _ramfs(team: int) -> Iterator[Path]:
    """A real filesystem that refuses POSIX ACLs (ramfs keeps no xattrs), mounted for the test."""
    where = Path(tempfile.mkdtemp(prefix="datacache-ramfs-"))
    mounted = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a ramfs here: {mounted.stderr.strip()}")
    try:
        yield _team_dir(where / "shared", team, 0o2770)
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)
        with contextlib.suppress(OSError):
            where.rmdir()


def test_a_daemon_whose_tier_refuses_acls_does_not_start_where_only_an_acl_keeps_the_readers(
    users: dict[str, User], world_dir: Path, cache_env: dict[str, str]
) -> None:
    alice, bob = users["alice"], users["bob"]
    team = alice.groups[0]
    write_wds(world_dir / "origin", samples=4, per_shard=4)
    local = _team_dir(world_dir / "cache", team, 0o2750)
    with _ramfs(team) as shared:
        readers = f'"{alice.name}", "{bob.name}"'
        refused = start_daemon(cache_env, local, wait=False, config=_config(world_dir, shared, readers))
        assert refused.process.wait(timeout=120) == 2  # a configuration that cannot be kept
        lines = [line for line in refused.log_text().splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("datacache: error: "), lines
        assert f"{shared} refuses POSIX ACLs" in lines[0] and "train" in lines[0] and "mount" in lines[0], lines[0]
        # A process of its own reads around such a shared tier, saying why, and writes nothing there.
        env = {**refused.env, "DATACACHE_SOCKET": str(world_dir / "none.sock")}
        warm = [sys.executable, "-m", "datacache.cli", "warm", "train", "--no-daemon"]
        warmed = subprocess.run(warm, env=env, capture_output=True, text=True, timeout=300, check=False)
        assert warmed.returncode == 0, warmed.stderr
        assert "not using the shared tier" in warmed.stderr and "refuses POSIX ACLs" in warmed.stderr, warmed.stderr
        written = [path for area in ("data", "meta") for path in (shared / area).rglob("*") if path.is_file()]
        assert not written, "a copy written where its readers cannot be kept"
        # Readers that are the tier's own group need no ACL: the mode says it, and the daemon starts.
        start_daemon(cache_env, local, config=_config(world_dir, shared, f'"@{team}"')).stop()


@pytest.mark.parametrize("kind", ["local", "shared"])
def test_every_way_a_tier_writes_a_declared_datasets_file_gives_it_its_readers_acl(
    users: dict[str, User], world_dir: Path, kind: str
) -> None:
    """One object (`put`), a batch of small ones (`put_many`, unnamed files linked into place), a mapped landing."""
    alice, bob = users["alice"], users["bob"]
    team = alice.groups[0]
    root = _team_dir(world_dir / kind, team, 0o2770)
    tier = LocalTier(root, modes=GROUP_READABLE) if kind == "local" else SharedTier(root)
    tier.shared_datasets.add("ds")
    tier.dataset_readers["ds"] = (frozenset({alice.uid}), frozenset())

    async def write() -> None:
        await tier.put("ds/one.tar", chunks_of(b"1" * 5000, 1000))
        landed = await tier.put_many([(f"ds/many-{i}.tar", b"m" * 100, {}) for i in range(5)])
        assert not [outcome for outcome in landed if isinstance(outcome, Exception)], landed
        if isinstance(tier, LocalTier):
            landing = await tier.land("ds/landed.tar", 4096)
            assert landing is not None
            landing.buffer[:] = b"l" * 4096
            await landing.publish()

    os.setegid(team)  # as deploy/ runs the daemon: its new directories take the group its users share
    try:
        asyncio.run(write())
    finally:
        os.setegid(0)
    files = sorted(path for area in ("data", "meta") for path in (root / area).rglob("*") if path.is_file())
    assert len(files) >= (7 if kind == "local" else 6) + 1, files
    for path in files:
        assert os.getxattr(path, ACL_XATTR), f"{path} has no ACL"
        assert _reads(alice, path) and not _reads(bob, path), path
