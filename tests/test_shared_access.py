"""The shared tier's permission model, with real users: a group resource, checked, bypassed when unusable.

alice and bob share a group (the tier's); mallory is outside it. The operator made the tier's
root ``chgrp team; chmod 2770`` (docs/SECURITY.md, "The shared tier"). Whatever a member creates
there stays usable by every member, whatever their umask; a user who cannot write it reads
around it with one warning, never a traceback; the node-local cache stays private.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from _daemon import make_shards
from _helpers import run_cli
from _users import User, cli_as, run_as, user_env, users, world_dir
from datacache.tiers import LocalTier, SharedTier

from datacache.checksum import checksum_of, new_hasher
from datacache.config import Settings, dataset_id_for
from datacache.staging import Stager

__all__ = ["users", "world_dir"]


def _origin(world_dir: Path, name: str, count: int = 3) -> str:
    origin = world_dir / name
    make_shards(origin, count, 4000, seed=len(name))
    for path in [origin, *origin.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return str(origin)


def _group_tier(world_dir: Path, users: dict[str, User]) -> Path:
    shared = world_dir / "shared"
    shared.mkdir()
    os.chown(shared, 0, users["alice"].groups[0])
    shared.chmod(0o2770)
    return shared


def _env(user: User, shared: Path) -> dict[str, str]:
    local = user.home / f"cache-{shared.parent.name}"
    return user_env(user, {"DATACACHE_SHARED_DIR": str(shared), "DATACACHE_LOCAL_DIR": str(local)})


def test_group_members_share_the_tier_whatever_their_umask(users: dict[str, User], world_dir: Path) -> None:
    shared = _group_tier(world_dir, users)
    team = users["alice"].groups[0]
    first, second = _origin(world_dir, "first"), _origin(world_dir, "second")
    alice = cli_as(users["alice"], "warm", first, "--tier", "shared", env=_env(users["alice"], shared))
    assert alice.returncode == 0, alice.stderr
    # bob creates his dataset's directories beside alice's, under data/, meta/ and locks/ that alice made.
    bob = cli_as(users["bob"], "warm", second, "--tier", "shared", env=_env(users["bob"], shared))
    assert bob.returncode == 0, bob.stderr
    assert "Traceback" not in bob.stderr
    second_id = dataset_id_for(second)
    assert sorted(p.name for p in (shared / "data" / second_id).iterdir()) == [
        "shard-0000.tar", "shard-0001.tar", "shard-0002.tar"
    ]
    for path in shared.rglob("*"):
        st = path.lstat()
        assert st.st_gid == team, f"{path} is not the group's"
        if stat.S_ISDIR(st.st_mode):
            assert stat.S_IMODE(st.st_mode) == 0o2770, f"{path}: {stat.S_IMODE(st.st_mode):o}"
        elif path.relative_to(shared).parts[0] in ("data", "meta", "manifests"):
            # Copies of datasets not declared shared are their reader's alone (issue 33 item 1), and so
            # are their manifests (their URL, every shard's name), unless the operator wrote them.
            assert stat.S_IMODE(st.st_mode) == 0o600, f"{path}: {stat.S_IMODE(st.st_mode):o}"
        else:
            assert stat.S_IMODE(st.st_mode) == 0o640, f"{path}: {stat.S_IMODE(st.st_mode):o}"


def test_a_user_outside_the_group_reads_around_the_tier(users: dict[str, User], world_dir: Path) -> None:
    shared = _group_tier(world_dir, users)
    url = _origin(world_dir, "origin")
    done = cli_as(users["mallory"], "warm", url, env=_env(users["mallory"], shared))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "not using the shared tier" in done.stderr and "cannot" in done.stderr
    assert "3/3 shards resident" in done.stdout + done.stderr
    assert list(shared.iterdir()) == []
    # Asked to place shards on the tier, mallory is told why not and what to do (a settings error, 2),
    # before anything is fetched, without a traceback.
    placed = cli_as(users["mallory"], "warm", url, "--tier", "shared", env=_env(users["mallory"], shared))
    assert placed.returncode == 2, placed.stderr
    assert "Traceback" not in placed.stderr
    assert "is not writable by this user" in placed.stderr and "datacache serve" in placed.stderr, placed.stderr
    assert list(shared.iterdir()) == []


def test_start_up_check_names_what_is_wrong(tmp_path: Path) -> None:
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o777)
    access = SharedTier(world).check_access()
    assert access.writable
    assert any("anyone can write it" in p for p in access.problems), access.problems
    assert any("not setgid" in p for p in access.problems), access.problems
    proper = tmp_path / "group"
    proper.mkdir()
    proper.chmod(0o2770)
    assert SharedTier(proper).check_access().problems == ()
    linked = tmp_path / "linked"
    linked.mkdir()
    linked.chmod(0o2770)
    (linked / "locks").symlink_to(tmp_path, target_is_directory=True)
    refused = SharedTier(linked).check_access()
    assert not refused.writable and any("symlink" in p for p in refused.problems), refused


def test_an_embedded_warm_keeps_the_local_cache_private(tmp_path: Path, cache_env: dict[str, str]) -> None:
    """Like the daemon's: 0700 directories, 0600 files, under a umask that would give 0755/0644."""
    url = _origin(tmp_path, "origin")
    local = tmp_path / "fresh-cache"
    env = {**cache_env, "DATACACHE_LOCAL_DIR": str(local)}
    old = os.umask(0o022)
    try:
        run_cli(["warm", url], env, check=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(local.stat().st_mode) == 0o700
    for path in (local / "data").rglob("*"):
        expected = 0o700 if path.is_dir() else 0o600
        assert stat.S_IMODE(path.stat().st_mode) == expected, path


def test_reconcile_lock_is_not_followed(tmp_path: Path, settings: Settings) -> None:
    """A link planted as ``locks/reconcile.lock`` must not create or open the file it names."""
    target = tmp_path / "elsewhere" / "created-through-the-link"
    target.parent.mkdir()
    (settings.local_dir / "locks").mkdir(parents=True)
    (settings.local_dir / "locks" / "reconcile.lock").symlink_to(target)

    async def main() -> dict[str, int]:
        async with Stager(settings) as stager:
            return await stager.reconcile()

    asyncio.run(main())
    assert not target.exists()


def test_an_orphan_is_adopted_only_if_its_bytes_hash_to_its_checksum(tmp_path: Path, settings: Settings) -> None:
    local = LocalTier(settings.local_dir)
    good, bad = b"g" * 1000, b"b" * 1000

    async def plant() -> str:
        await local.put("ds/good", _one(good), metadata={"checksum": _sum(good), "size": "1000", "version": "v"})
        # Same size, a checksum copied from another file: the metadata "proves" it whole.
        await local.put("ds/bad", _one(bad), metadata={"checksum": _sum(good), "size": "1000", "version": "v"})
        async with Stager(settings, reconcile=False) as stager:
            counts = await stager.reconcile()
        return f"{counts['orphans_adopted']} {counts['orphans_removed']}"

    assert asyncio.run(plant()) == "1 1"
    assert (settings.local_dir / "data" / "ds" / "good").exists()
    assert not (settings.local_dir / "data" / "ds" / "bad").exists()


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _sum(data: bytes) -> str:
    hasher = new_hasher()
    hasher.update(data)
    return checksum_of(hasher)


# -- a tier the first user made: its group, and reading around it (issue 23 item 4) --------------

_LOAD = """
import sys
from datacache.loaders import CachedIterableDataset
print("samples", len(list(CachedIterableDataset(sys.argv[1], shuffle=False))))
"""


def _tar_origin(world_dir: Path) -> str:
    from _helpers import tar_of

    origin = world_dir / "wds"
    origin.mkdir()
    for shard in range(3):
        # 4 KB a sample: a shard of 16 KiB or more keeps its tar index in a file (`SPAN_FILE_MIN_BYTES`).
        members = {f"s{shard}{i:03d}.txt": f"sample {shard}.{i}".encode().ljust(4096) for i in range(4)}
        (origin / f"shard-{shard:04d}.tar").write_bytes(tar_of(members))
    for path in [origin, *origin.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return str(origin)


def _load_as(user: User, url: str, env: dict[str, str]) -> tuple[str, str]:
    done = run_as(user, [sys.executable, "-c", _LOAD, url], env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr
    return done.stdout, done.stderr


def test_a_tier_the_first_user_made_is_read_around_by_others_and_shared_group_gives_it_the_team(
    users: dict[str, User], world_dir: Path
) -> None:
    alice, bob = users["alice"], users["bob"]
    team = alice.groups[0]
    url = _tar_origin(world_dir)
    for configured in (False, True):
        parent = world_dir / f"lustre-{configured}"
        parent.mkdir()
        os.chown(parent, alice.uid, alice.gid)  # alice's, not setgid: nothing gives a group below it
        shared = parent / "datacache"  # not there yet: alice's first run makes it
        extra = {"DATACACHE_SHARED_GROUP": str(team)} if configured else {}
        out, err = _load_as(alice, url, {**_env(alice, shared), **extra})
        assert "samples 12" in out
        assert shared.stat().st_gid == (team if configured else alice.gid)
        out, err = _load_as(bob, url, {**_env(bob, shared), **extra})
        assert "samples 12" in out, err  # never a PermissionError out of the loader
        if configured:
            assert "not using the shared tier" not in err, err
            assert any(p.stat().st_uid == bob.uid for p in shared.rglob("*")), "bob used the team's tier"
        else:  # read around, and the start-up check names the group that keeps bob out
            assert "not using the shared tier" in err and f"group {alice.name}" in err, err


def test_a_directory_a_member_made_the_others_cannot_use_is_moved_aside(
    users: dict[str, User], world_dir: Path
) -> None:
    """Issue 23 item 7: bob pre-creates data/<id>/ 0755; alice's warm --tier shared still places every shard."""
    shared = _group_tier(world_dir, users)
    url = _origin(world_dir, "origin")
    dataset = dataset_id_for(url)
    code = f"import os; os.umask(0o022); os.makedirs({str(shared / 'data' / dataset)!r})"
    made = run_as(users["bob"], [sys.executable, "-c", code])
    assert made.returncode == 0, made.stderr
    assert stat.S_IMODE((shared / "data" / dataset).stat().st_mode) & 0o070 != 0o070
    done = cli_as(users["alice"], "warm", url, "--tier", "shared", env=_env(users["alice"], shared))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3/3 shards resident" in done.stdout + done.stderr
    assert "moved aside" in done.stderr and "Traceback" not in done.stderr
    for path in (shared / "data", shared / "data" / dataset):
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o2770 and st.st_gid == users["alice"].groups[0], path
    assert sorted(p.name for p in (shared / "data" / dataset).iterdir()) == [f"shard-000{i}.tar" for i in range(3)]


_SIDE_FILES = """
import asyncio, os, sys
os.umask(0o022)
from datacache.catalog import Catalog

async def main():
    catalog = Catalog(sys.argv[1])
    await catalog.set_pinned("x", True)
    for side in ("", "-wal", "-shm"):
        print(oct(os.stat(sys.argv[1] + side).st_mode & 0o777).replace("0o", "0"))
    await catalog.close()

asyncio.run(main())
"""


def test_catalog_and_index_files_are_private_or_the_groups_under_umask_022(
    users: dict[str, User], world_dir: Path
) -> None:
    """Issue 23 item 8: catalog.sqlite and its -wal/-shm, indexes/*.json and indexes/spans/ are 0600/0700;
    the cluster index's files on the shared tier 0600 (a dataset not declared shared), whatever the umask."""
    alice, bob = users["alice"], users["bob"]
    shared = _group_tier(world_dir, users)
    url = _tar_origin(world_dir)
    env = _env(alice, shared)
    done = run_as(alice, [sys.executable, "-c", "import os; os.umask(0o022)\n" + _LOAD, url], env=env)
    assert done.returncode == 0 and "samples 12" in done.stdout, done.stderr[-3000:]
    local = Path(env["DATACACHE_LOCAL_DIR"])
    # The side files exist while a connection is open (a clean close removes them): look then.
    held = run_as(alice, [sys.executable, "-c", _SIDE_FILES, str(local / "catalog.sqlite")], env=env)
    assert held.returncode == 0 and held.stdout.split() == ["0600", "0600", "0600"], held.stdout + held.stderr
    plans = list((local / "indexes").glob("*.json"))
    spans = list((local / "indexes" / "spans").rglob("*"))
    assert plans and spans, (plans, spans)
    for path in [local / "catalog.sqlite", *plans, *spans, local / "indexes"]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path}: {mode:04o}"
    counts = [*shared.glob("indexes/*/*/batch-*.json"), *shared.glob("indexes/*/*/sidecars.json")]
    assert counts
    for path in counts:  # a dataset not declared shared, counted by a user, not the operator: hers alone
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, f"{path}: {stat.S_IMODE(path.stat().st_mode):04o}"
    # bob, who could list alice's cache directory were it 0755, cannot read her catalog.
    os.chmod(local, 0o755)
    peek = run_as(bob, [sys.executable, "-c", f"open({str(local / 'catalog.sqlite')!r}, 'rb').read()"])
    assert peek.returncode != 0 and "PermissionError" in peek.stderr
