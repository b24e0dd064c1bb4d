"""One listing per cluster: a node takes this user's listing another node saved on the shared tier.

A node that finds no manifest of its own takes the columnar manifest another node of the same user
saved on the shared tier, if it was listed at most ``shared_manifest_age`` seconds ago, and lists
the origin only otherwise. Another user's (or root's, or the daemon's) is never taken: whoever can
write the shared tier could name any shards and versions (docs/SECURITY.md).
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from _users import User, python_as, user_env, users, world_dir
from datacache.loaders import CachedIterableDataset
from test_loader import write_wds

from datacache.config import load_settings

if TYPE_CHECKING:
    from conftest import S3Bucket

__all__ = ["users", "world_dir"]  # fixtures, imported to be found


def _upload(s3: S3Bucket, tmp_path: Path) -> None:
    source = tmp_path / "upload"
    write_wds(source, samples=60, per_shard=5)
    for path in sorted(source.iterdir()):
        s3.put(f"ds/{path.name}", path.read_bytes())


def _first(s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str], node: str, **overrides: str) -> str:
    settings = load_settings(
        cache_env,
        overrides={"local_dir": str(tmp_path / node), "shared_dir": str(tmp_path / "shared"), **overrides},
    )
    sample = next(iter(CachedIterableDataset(s3.url("ds"), config=settings, seed=2, shuffle=True)))
    return str(sample["__key__"])


def _listings(s3: S3Bucket) -> int:
    listing = {f"GET /{s3.name}", f"GET /{s3.name}/"}  # ListObjectsV2: the bucket's path, the prefix a query
    return sum(n for request, n in s3.server.request_counts().items() if request in listing)


def test_a_second_node_reads_its_first_sample_without_listing_the_origin(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str]
) -> None:
    _upload(s3, tmp_path)
    s3.server.reset_counts()
    first = _first(s3, tmp_path, cache_env, "node-a")
    assert _listings(s3) == 1, "the first node lists the origin"
    s3.server.reset_counts()
    assert _first(s3, tmp_path, cache_env, "node-b") == first
    assert _listings(s3) == 0, s3.server.request_counts()
    # The second node kept the listing as its own: a third process there maps it, still no listing.
    s3.server.reset_counts()
    assert _first(s3, tmp_path, cache_env, "node-b") == first
    assert _listings(s3) == 0


@pytest.mark.parametrize("age", ["0", "1e-6"])
def test_a_shared_listing_older_than_shared_manifest_age_is_listed_again(
    s3: S3Bucket, tmp_path: Path, cache_env: dict[str, str], age: str
) -> None:
    """``0`` takes none; any other age bounds how old a listing another node made may be."""
    _upload(s3, tmp_path)
    first = _first(s3, tmp_path, cache_env, "node-a")
    s3.server.reset_counts()
    assert _first(s3, tmp_path, cache_env, "node-b", shared_manifest_age=age) == first
    assert _listings(s3) == 1, s3.server.request_counts()


_PLANT = """
import asyncio, sys
from pathlib import Path
from datacache.manifest import Manifest, ManifestStore, Shard, ShardFormat
local, shared, dataset_id, url = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
one = Shard("train-0000.tar", 10240, "planted", "xxh3_64:0123456789abcdef", 5)
manifest = Manifest(dataset_id, url, ShardFormat.TAR, (one,))
asyncio.run(ManifestStore(local / "manifests", shared / "manifests").save(manifest))
"""

_READ = """
import json
from datacache.loaders import CachedIterableDataset
keys = [s["__key__"] for s in CachedIterableDataset({url!r}, shuffle=False)]
print(json.dumps({{"keys": keys}}))
"""


def _as(user: User, code: str, env: dict[str, str], *args: str) -> dict[str, Any]:
    argv = f"import sys; sys.argv = ['-', *{list(args)!r}]\n" + textwrap.dedent(code)
    done = python_as(user, argv, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    found: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    found["stderr"] = done.stderr
    return found


def test_another_users_planted_shared_manifest_is_not_taken(
    users: dict[str, User], world_dir: Path, s3: S3Bucket, tmp_path: Path
) -> None:
    """bob, of alice's group, saves a one-shard columnar manifest for alice's dataset on their shared
    tier (2770, the group's; every check passes but its owner): alice lists the origin and reads every shard."""
    alice, bob = users["alice"], users["bob"]
    _upload(s3, tmp_path)
    shared = world_dir / "shared"
    shared.mkdir()
    os.chown(shared, 0, alice.groups[0])
    shared.chmod(0o2770)
    url = s3.url("ds") + "/"
    extra = {
        "AWS_ENDPOINT_URL": s3.server.endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "DATACACHE_SHARED_DIR": str(shared),
    }
    env = user_env(alice, extra)
    code = f"from datacache.config import load_settings as s, resolve_dataset as r; print(r({url!r}, s()).id)"
    done = python_as(alice, code, env=env)
    assert done.returncode == 0, done.stderr
    dataset_id = done.stdout.strip()
    _as(bob, _PLANT, user_env(bob), str(bob.home / "local"), str(shared), dataset_id, url)
    planted = shared / "manifests" / f"{dataset_id}.columns"
    assert planted.stat().st_uid == bob.uid and not planted.stat().st_mode & 0o022
    assert planted.stat().st_mode & 0o040, "alice's group may read it: only its owner tells it apart"

    s3.server.reset_counts()
    read = _as(alice, _READ.format(url=url), env)
    keys = read["keys"]
    assert len(keys) == 60, "alice read her own listing's 12 shards, not bob's one"
    # Another uid's listing on the shared tier is the usual case (the daemon's, a teammate's): passed over
    # quietly. A trial was warned "not a file of this user, root or the daemon" of the daemon's own.
    assert "ignoring manifest" not in read["stderr"], read["stderr"]
    assert _listings(s3) == 1, "alice listed the origin herself"
