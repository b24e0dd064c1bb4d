"""A daemon outage is not a job outage, whoever the job's user is (issue 34 item 1).

As a new user's trial ran it: the daemon as its own account (``alice``, group ``team``, as
deploy/slurm's unit runs it), the job as ``bob``, a member of ``team`` by supplementary membership
only, who may read the daemon's shard files but write nothing of its cache. torch's DataLoader
with worker processes reads 4 epochs; the daemon is SIGKILLed mid-epoch (epoch 0) and again at
an epoch start, before ``iter(loader)`` makes the workers (epoch 2), and restarted after each.
Every epoch is exactly once with every byte right; the daemon's resident shards are read where
they are, the rest staged in bob's own directory; the epochs after each restart read through
the daemon again. Before: each worker failed with "the node cache ... is not writable by uid".
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import tempfile
from pathlib import Path

import _users
import pytest
from _outage import SAY, Node, Scripted, job_env, node, owned_only_by
from _users import User, cli_as, python_as, user_env
from datacache.tiers.local import GROUP_READABLE
from test_loader import write_wds

from datacache._outage import OutageAccess
from datacache.checksum import hash_file
from datacache.config import Settings
from datacache.staging import Stager

users = _users.users  # the fixtures, by name
world_dir = _users.world_dir
__all__ = ["node"]

_TRAIN = SAY + """
import hashlib, json
from torch.utils.data import DataLoader
from datacache.loaders import CachedIterableDataset

ds = CachedIterableDataset("train", shuffle=True, seed=3)
loader = DataLoader(ds, batch_size=None, num_workers=2)
epochs = []
for epoch in range(4):
    ds.set_epoch(epoch)
    if epoch == 2:
        say("kill")  # at the epoch's start: the workers are made with no daemon
    seen = []
    for sample in loader:
        seen.append([sample["__key__"], hashlib.sha256(sample["bin"]).hexdigest()])
        if epoch == 0 and len(seen) == 20:
            say("kill")  # mid-epoch: the workers are reading through the daemon
    epochs.append({"seen": seen, "mode": ds.stats().mode})
    if epoch in (0, 2):
        say("restart")
print(json.dumps(epochs))
"""


@pytest.mark.timeout(600)  # 4 epochs of DataLoader workers and 3 daemon starts, on a machine others load
def test_a_job_user_of_the_group_reads_on_through_the_daemons_sigkill_and_back_to_it(
    node: Node, users: dict[str, User]
) -> None:
    want = sorted([key, hashlib.sha256(fields["bin"]).hexdigest()] for key, fields in node.expected.items())
    bob = users["bob"]
    assert node.team in bob.groups and bob.gid != node.team  # in the daemon's group by supplementary membership
    tmp, env = job_env(bob, node)

    daemon = node.serve()
    try:
        warmed = cli_as(node.user, "warm", "train", "--shards", "0:4", env=node.daemon_env())
        assert warmed.returncode == 0, warmed.stderr
        with Scripted(bob, _TRAIN, env, node.world / "trainer.err") as trainer:
            trainer.expect("kill")  # epoch 0, mid-epoch
            daemon.kill()
            resident_at_kill = node.resident()
            trainer.go()
            trainer.expect("restart")  # epoch 0 done without the daemon
            private = {path.name for path in tmp.rglob("*.tar")}
            assert private, "the shards not resident were staged in bob's own directory"
            assert not private & resident_at_kill, "the daemon's resident shards were read where they are"
            held = sum(path.stat().st_size for path in tmp.rglob("*.tar"))
            assert held <= node.capacity, "bob's own copies keep within the daemon's capacity"
            daemon = node.serve()
            trainer.go()
            trainer.expect("kill")  # epoch 2, before iter(loader)
            daemon.kill()
            trainer.go()
            trainer.expect("restart")
            daemon = node.serve()
            trainer.go()
            out = trainer.finish(timeout=600)
    finally:
        daemon.kill()
    epochs = json.loads(out.strip().splitlines()[-1])
    for epoch, read in enumerate(epochs):
        assert sorted(read["seen"]) == want, f"epoch {epoch}: every sample once, every byte right"
    assert [read["mode"] for read in epochs] == [
        "embedded (daemon unavailable)", "daemon", "embedded (daemon unavailable)", "daemon"
    ], "the epochs after each restart read through the daemon again"
    stderr = trainer.errors.read_text()
    assert "not writable by uid" not in stderr and "Traceback" not in stderr, stderr
    owned_only_by(node.local, node.user.uid)
    owned_only_by(tmp, bob.uid, private=True)


def test_ls_as_a_job_user_reads_the_daemon_that_status_says_answers(node: Node, users: dict[str, User]) -> None:
    """Issue 34 item 2: ``ls`` said "no daemon this process may use answers" where ``status`` said one answers."""
    bob = users["bob"]
    env = user_env(bob, {"DATACACHE_CONFIG": str(node.config)})
    daemon = node.serve()
    try:
        warmed = cli_as(node.user, "warm", "train", "--shards", "0:3", env=node.daemon_env())
        assert warmed.returncode == 0, warmed.stderr
        status = cli_as(bob, "status", "--json", env=env)
        assert status.returncode == 0 and json.loads(status.stdout)["daemon"]["answers"], status.stdout + status.stderr
        listed = cli_as(bob, "ls", "--json", env=env)
        assert listed.returncode == 0, listed.stderr
        (row,) = json.loads(listed.stdout)
        assert (row["names"], row["shards"], row["local_shards"]) == (["train"], 12, 3), row
        table = cli_as(bob, "ls", env=env)
        assert table.returncode == 0 and "train" in table.stdout, table.stdout + table.stderr
    finally:
        daemon.kill()
    # With the daemon gone, both say so, and ls says why it cannot go on without it.
    status = cli_as(bob, "status", "--json", env=env)
    assert not json.loads(status.stdout)["daemon"]["answers"], status.stdout + status.stderr
    listed = cli_as(bob, "ls", env=env)
    lines = [line for line in listed.stderr.splitlines() if line.strip()]
    assert listed.returncode != 0 and len(lines) == 1, listed.stderr
    assert "is the daemon's" in lines[0] and "refused" in lines[0].lower(), lines[0]


def test_a_mistyped_dataset_name_is_said_as_such_to_a_job_user_not_as_the_catalogs_permission(
    node: Node, users: dict[str, User]
) -> None:
    """A new user's trial: ``warm imagent`` as a job user printed ``[Errno 13] Permission denied: .../catalog.sqlite``
    (the fallback that takes a name as an id `ls` printed opened the daemon's own catalog)."""
    env = user_env(users["bob"], {"DATACACHE_CONFIG": str(node.config)})
    daemon = node.serve()
    try:
        warmed = cli_as(node.user, "warm", "train", "--shards", "0:1", env=node.daemon_env())
        assert warmed.returncode == 0, warmed.stderr
        mistyped = cli_as(users["bob"], "warm", "trian", env=env)
    finally:
        daemon.kill()
    lines = [line for line in mistyped.stderr.splitlines() if line.strip()]
    assert mistyped.returncode != 0 and len(lines) == 1, mistyped.stderr
    assert "Permission denied" not in lines[0] and "trian" in lines[0] and "train" in lines[0], lines[0]


def test_a_job_users_own_private_dataset_is_read_in_its_process_while_the_daemon_serves_the_node(
    node: Node, users: dict[str, User]
) -> None:
    """A new user's trial: bob's 0700 directory, read with the node's config while the daemon ran, failed with
    'neither configured in this daemon nor under a prefix'. The daemon holds no grant to it; bob does."""
    bob = users["bob"]
    private = bob.home / "private-wds"
    expected = write_wds(private, 24, 6)
    for path in (private, *private.iterdir()):
        os.chown(path, bob.uid, bob.gid)
        path.chmod(0o700 if path.is_dir() else 0o600)
    tmp, env = job_env(bob, node)
    daemon = node.serve()
    try:
        read = python_as(bob, f"""
            import hashlib, json
            from torch.utils.data import DataLoader
            from datacache.loaders import CachedIterableDataset
            ds = CachedIterableDataset({str(private)!r}, shuffle=True, seed=3)
            loader = DataLoader(ds, batch_size=None, num_workers=2)
            got = [[s["__key__"], hashlib.sha256(s["bin"]).hexdigest()] for s in loader]
            print(json.dumps([got, ds.stats().mode]))
        """, env=env, timeout=300)
    finally:
        daemon.kill()
    assert read.returncode == 0, read.stderr
    got, mode = json.loads(read.stdout.strip().splitlines()[-1])
    assert mode == "embedded", "a trial's stats said 'daemon' of a dataset read in the user's own process"
    assert sorted(got) == sorted([k, hashlib.sha256(v["bin"]).hexdigest()] for k, v in expected.items())
    assert "reading it in this process" in read.stderr, read.stderr
    # Nothing of it reached the daemon's cache, and bob's own copies are his alone.
    assert not [p for p in node.local.rglob("*") if p.name.startswith("train-")], "bob's data in the daemon's cache"
    copies = [p for p in tmp.rglob("train-*.tar") if p.is_file()]
    assert copies and all(p.stat().st_uid == bob.uid and p.stat().st_mode & 0o077 == 0 for p in copies), copies


def _stage_as_the_daemon(settings: Settings, origin: Path) -> list[str]:
    """Stage every shard of ``origin`` into ``settings.local_dir`` as the daemon does; their keys."""

    async def body() -> list[str]:
        async with Stager(settings, modes=GROUP_READABLE) as stager:
            handle = await stager.open(str(origin))
            for shard in handle.manifest.shards:
                await stager.ensure(handle, shard.key)
            return [shard.key for shard in handle.manifest.shards]

    return asyncio.run(body())


@pytest.mark.parametrize("verify_on_read", [True, False])
def test_the_daemons_copies_are_read_where_they_are_only_when_vouched_for_and_whole(
    tmp_path: Path, users: dict[str, User], monkeypatch: pytest.MonkeyPatch, verify_on_read: bool
) -> None:
    """A resident copy is read in place only if a trusted uid's metadata names this version, and its bytes match."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    origin = tmp_path / "origin"
    write_wds(origin, samples=32, per_shard=8)
    node_cache = tmp_path / "node"
    settings = Settings(local_dir=node_cache, verify_on_read=verify_on_read)
    keys = _stage_as_the_daemon(settings, origin)

    async def body() -> dict[str, tuple[str, bool, bytes]]:
        access = OutageAccess(settings)
        try:
            handle = await access.open(str(origin))
            data = {key: node_cache / "data" / handle.tier_key(key) for key in keys}
            _, tampered, planted, stale = keys
            body = bytearray(data[tampered].read_bytes())
            body[-1] ^= 0xFF  # the same size, other bytes
            data[tampered].write_bytes(bytes(body))
            for path in (data[planted], node_cache / "meta" / f"{handle.tier_key(planted)}.json"):
                os.chown(path, users["mallory"].uid, users["mallory"].gid)  # not a trusted uid's
            meta = node_cache / "meta" / f"{handle.tier_key(stale)}.json"
            meta.write_text(meta.read_text().replace('"version": "', '"version": "older-'))
            found = {}
            for key in keys:
                location = await access.ensure(handle, key)
                # The loader hashes what it maps (`verify_on_read`); a bad copy is reported, then read around.
                in_place = location.tier == "local" and location.path == data[key]
                if in_place and verify_on_read and hash_file(data[key]) != location.checksum:
                    await access.report_corrupt(handle, location)
                    location = await access.ensure(handle, key)
                assert location.path is not None
                in_place = location.path == data[key]
                found[key] = (location.tier, in_place, await access.read(handle, key))
            return found
        finally:
            await access.close()

    found = asyncio.run(body())
    good, tampered, planted, stale = keys
    origin_bytes = {key: (origin / key).read_bytes() for key in keys}
    assert {key: read for key, (_, _, read) in found.items()} == origin_bytes, "every byte right"
    assert found[good][1], "the daemon's good copy is read where it is"
    for key in (tampered, planted, stale):
        assert not found[key][1], f"{key}: staged in the reader's own directory, not read in place"
