"""The cache never grants what the origin would not, tested with real, different uids.

alice can read the bucket; bob (in alice's group) and mallory (outside it)
have no credentials at all. The shared tier is a directory everyone can write.
mallory plants, under the id of alice's ``s3://bucket/wds/``, a manifest, a tar
of the right size and a meta file binding it to the real ETag: alice never
serves it and ``warm`` is not fooled. bob, after alice cached the dataset,
gets the origin's refusal, not alice's bytes. docs/SECURITY.md, "Trust in
cached data".
"""

from __future__ import annotations

import grp
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import xxhash
from _helpers import tar_of
from _users import User, cli_as, python_as, run_as, user_env, users, world_dir

from datacache.manifest import Manifest, Shard, ShardFormat

if TYPE_CHECKING:
    from conftest import S3Bucket

__all__ = ["users", "world_dir"]  # fixtures, imported to be found

SHARDS = 4
SAMPLES = 5


def _tar(text: str, shard: int, pad_to: int | None = None) -> bytes:
    raw = tar_of({f"s{shard}{index:03d}.txt": f"{text} {shard}.{index}".encode() for index in range(SAMPLES)})
    if pad_to is not None:
        if len(raw) > pad_to:
            raise ValueError("the attacker's tar must fit the real shard's size")
        raw += b"\0" * (pad_to - len(raw))  # trailing zero blocks: still a valid tar
    return raw


@pytest.fixture
def dataset(s3: S3Bucket) -> dict[str, bytes]:
    shards = {f"shard-{i:04d}.tar": _tar("REAL SAMPLE", i) for i in range(SHARDS)}
    for key, data in shards.items():
        s3.put(f"wds/{key}", data)
    return shards


@pytest.fixture
def shared(world_dir: Path) -> Path:
    """A shared tier's directory every user can write: the threat model, not a recommendation."""
    path = world_dir / "shared"
    path.mkdir()
    path.chmod(0o777)
    return path


@pytest.fixture
def team_shared(world_dir: Path, users: dict[str, User]) -> Path:
    """A shared tier set up as docs/SECURITY.md says: ``install -d -m 2770 -g team``."""
    path = world_dir / "team-shared"
    path.mkdir()
    os.chown(path, 0, users["alice"].groups[0])
    path.chmod(0o2770)
    return path


@pytest.fixture
def url(s3: S3Bucket, dataset: dict[str, bytes]) -> str:
    """The dataset alice may read: ``s3://<bucket>/wds/``."""
    return s3.url("wds") + "/"


def _env(user: User, s3: S3Bucket, shared: Path, *, credentials: bool) -> dict[str, str]:
    extra = {
        "AWS_ENDPOINT_URL": s3.server.endpoint,  # the same origin for everyone
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
        "DATACACHE_SHARED_DIR": str(shared),
        "DATACACHE_MAX_ATTEMPTS": "1",
    }
    if credentials:
        extra.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"})
    return user_env(user, extra)


_READ = """
import json
from datacache.loaders import CachedIterableDataset
try:
    texts = [bytes(s["txt"]).decode() for s in CachedIterableDataset({url!r}, shuffle=False)]
    print(json.dumps({{"texts": texts}}))
except Exception as exc:
    import traceback
    trace = traceback.format_exc()
    print(json.dumps({{"error": f"{{type(exc).__name__}}: {{exc}}", "trace": trace}}))
"""


def _read_as(user: User, url: str, env: dict[str, str]) -> dict[str, Any]:
    done = python_as(user, _READ.format(url=url), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _dataset_id(user: User, url: str, env: dict[str, str]) -> str:
    code = f"from datacache.config import load_settings as s, resolve_dataset as r; print(r({url!r}, s()).id)"
    done = python_as(user, code, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _plant(mallory: User, shared: Path, dataset_id: str, url: str, key: str, real: bytes, etag: str) -> bytes:
    """As mallory: a one-shard manifest, a tar of the real size, and meta binding it to the real version."""
    payload = _tar("ATTACKER PAYLOAD", 0, pad_to=len(real))
    checksum = f"xxh3_64:{xxhash.xxh3_64(payload).hexdigest()}"
    manifest = Manifest(dataset_id, url, ShardFormat.TAR, (Shard(key, len(real), etag, checksum, SAMPLES),))
    meta = {"version": etag, "size": str(len(real)), "checksum": checksum, "dataset": dataset_id, "key": key}
    files = {
        f"manifests/{dataset_id}.json": json.dumps(manifest.to_json()),
        f"data/{dataset_id}/{key}": payload.hex(),
        f"meta/{dataset_id}/{key}.json": json.dumps(meta),
    }
    code = textwrap.dedent(
        f"""
        import os
        os.umask(0)
        root = {str(shared)!r}
        for name, text in {files!r}.items():
            path = os.path.join(root, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            data = bytes.fromhex(text) if name.startswith("data/") else text.encode()
            temporary = path + ".planting"
            with open(temporary, "wb") as handle:
                handle.write(data)
            os.replace(temporary, path)
        """
    )
    done = python_as(mallory, code)
    assert done.returncode == 0, done.stderr
    assert os.stat(shared / "data" / dataset_id / key).st_uid == mallory.uid
    return payload


def test_planted_manifest_tar_and_meta_never_reach_alices_loader_or_warm(
    users: dict[str, User], shared: Path, url: str, s3: S3Bucket, dataset: dict[str, bytes]
) -> None:
    alice, mallory = users["alice"], users["mallory"]
    env = _env(alice, s3, shared, credentials=True)
    dataset_id = _dataset_id(alice, url, env)
    key = "shard-0000.tar"
    etag = s3.client.head_object(Bucket=s3.name, Key=f"wds/{key}")["ETag"].strip('"')
    _plant(mallory, shared, dataset_id, url, key, dataset[key], etag)

    result = _read_as(alice, url, env)
    assert "error" not in result, result
    texts = result["texts"]
    assert not [text for text in texts if "ATTACKER" in text], "alice was served mallory's payload"
    assert sorted(texts) == sorted(f"REAL SAMPLE {s}.{i}" for s in range(SHARDS) for i in range(SAMPLES))

    # mallory plants again over what alice staged; warm neither counts it nor keeps it.
    payload = _plant(mallory, shared, dataset_id, url, key, dataset[key], etag)
    done = cli_as(alice, "warm", url, "--tier", "shared", "--json", env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["shards_requested"], report["shards_resident"], report["complete"]) == (SHARDS, SHARDS, True)
    on_shared = (shared / "data" / dataset_id / key).read_bytes()
    assert on_shared == dataset[key] and on_shared != payload


def test_a_user_without_credentials_gets_the_origins_error_not_cached_bytes(
    users: dict[str, User], team_shared: Path, url: str, s3: S3Bucket, dataset: dict[str, bytes]
) -> None:
    alice, bob = users["alice"], users["bob"]
    shared = team_shared  # bob may read everything alice writes there: the origin still says no
    done = cli_as(alice, "warm", url, "--tier", "shared", env=_env(alice, s3, shared, credentials=True))
    assert done.returncode == 0, done.stderr
    assert any((shared / "data").rglob("*.tar")), "alice's copies are on the shared tier"

    bob_env = _env(bob, s3, shared, credentials=False)
    result = _read_as(bob, url, bob_env)
    assert "texts" not in result, f"bob read {len(result['texts'])} samples he may not read"
    assert "credentials" in result["error"], result.get("trace")
    refused = cli_as(bob, "warm", url, env=bob_env)
    assert refused.returncode != 0 and "credentials" in refused.stderr, refused.stderr
    assert "resident" not in refused.stdout


def _shard_gets(s3: S3Bucket) -> int:
    head = f"GET /{s3.name}/wds/"
    counts = s3.server.request_counts().items()
    return sum(count for name, count in counts if name.startswith(head) and name.endswith(".tar"))


def test_copies_the_configured_daemon_uid_wrote_are_used_and_nobody_elses(
    users: dict[str, User], team_shared: Path, url: str, s3: S3Bucket, dataset: dict[str, bytes]
) -> None:
    """The shared tier still saves origin reads: copies by a trusted uid (here bob, as the daemon's) count."""
    alice, bob = users["alice"], users["bob"]
    shared = team_shared
    # Sample counts beside the shards (a wids index), so that no reader scans the origin's tars for them.
    shardlist = [{"url": key, "nsamples": SAMPLES, "filesize": len(data)} for key, data in dataset.items()]
    index = {"__kind__": "wids-shard-index-v1", "wids_version": 1, "shardlist": shardlist}
    s3.put("wds/wids-index.json", json.dumps(index).encode())
    # Shared copies other uids can open exist only for a dataset declared shared with them (issue 33).
    config = shared.parent / "declared.toml"
    config.write_text(f'[datasets.wds]\nurl = "{url}"\nreaders = ["@{grp.getgrgid(alice.groups[0]).gr_name}"]\n')
    config.chmod(0o644)
    bob_env = {**_env(bob, s3, shared, credentials=True), "DATACACHE_CONFIG": str(config)}
    done = cli_as(bob, "warm", url, "--tier", "shared", env=bob_env)
    assert done.returncode == 0, done.stderr

    trusting = _env(alice, s3, shared, credentials=True)
    trusting.update({"DATACACHE_DAEMON_UID": bob.name, "DATACACHE_LOCAL_DIR": str(alice.home / "trusting")})
    trusting["DATACACHE_CONFIG"] = str(config)
    s3.server.reset_counts()
    assert len(_read_as(alice, url, trusting)["texts"]) == SHARDS * SAMPLES
    assert _shard_gets(s3) == 0, "every shard came from bob's copies on the shared tier"

    wary = _env(alice, s3, shared, credentials=True)
    wary["DATACACHE_LOCAL_DIR"] = str(alice.home / "wary")
    s3.server.reset_counts()
    assert len(_read_as(alice, url, wary)["texts"]) == SHARDS * SAMPLES
    assert _shard_gets(s3) == SHARDS, "bob is not trusted: every shard came from the origin"


# -- the cluster sample-count index is believed as copies are (issue 23 item 3) ------------------

_REWRITE_COUNTS = """
import json, os, sys
samples = int(sys.argv[1])
for path in sys.argv[2:]:
    document = json.load(open(path))
    document["counts"] = {key: samples for key in document["counts"]}
    with open(path + ".new", "w") as out:
        json.dump(document, out)
    os.replace(path + ".new", path)
"""

_READ_SKIP = _READ.replace("shuffle=False)", "shuffle=False, on_error='skip')")


def test_a_group_members_rewritten_cluster_index_never_reaches_another_users_loader(
    users: dict[str, User], team_shared: Path, url: str, s3: S3Bucket, dataset: dict[str, bytes]
) -> None:
    alice, bob = users["alice"], users["bob"]
    shared = team_shared
    bob_env = _env(bob, s3, shared, credentials=True)
    done = cli_as(bob, "index", url, env=bob_env)
    assert done.returncode == 0, done.stderr
    batches = sorted(shared.glob("indexes/*/*/batch-*.json"))
    assert batches and all(path.stat().st_uid == bob.uid for path in batches)
    # bob, a member of the tier's group, rewrites the counts: one sample short of each shard.
    run_rewrite(bob, bob_env, SAMPLES - 1, batches)
    expected = sorted(f"REAL SAMPLE {s}.{i}" for s in range(SHARDS) for i in range(SAMPLES))
    for script in (_READ, _READ_SKIP):  # neither fails, and on_error="skip" skips nothing
        env = _env(alice, s3, shared, credentials=True)
        env["DATACACHE_LOCAL_DIR"] = str(alice.home / f"local-{len(script)}")
        result = json.loads(python_as(alice, script.format(url=url), env=env).stdout.strip().splitlines()[-1])
        assert "error" not in result, result
        assert sorted(result["texts"]) == expected

    # Trusted (bob as the daemon's uid), a count its bytes cannot back is still not believed.
    run_rewrite(bob, bob_env, 1000, batches)
    trusting = _env(alice, s3, shared, credentials=True)
    trusting.update({"DATACACHE_DAEMON_UID": bob.name, "DATACACHE_LOCAL_DIR": str(alice.home / "trusting")})
    result = _read_as(alice, url, trusting)
    assert "error" not in result, result
    assert sorted(result["texts"]) == expected


def run_rewrite(user: User, env: dict[str, str], samples: int, paths: list[Path]) -> None:
    done = run_as(user, [sys.executable, "-c", _REWRITE_COUNTS, str(samples), *map(str, paths)], env=env)
    assert done.returncode == 0, done.stderr


# -- a shared copy counts only if every one of its writers is trusted (issue 23 item 14) ---------

_SWAP = """
import json, os, sys
shared, dataset_id, version, checksum = sys.argv[1:5]
data, meta = os.path.join(shared, "data", dataset_id), os.path.join(shared, "meta", dataset_id)
# alice's copy of shard 1 (still her file: a rename keeps the owner) now stands where shard 0 goes...
os.replace(os.path.join(data, "shard-0001.tar"), os.path.join(data, "shard-0000.tar"))
# ...and bob's own metadata binds it to shard 0's version, with its true checksum.
size = os.stat(os.path.join(data, "shard-0000.tar")).st_size
document = {"version": version, "size": str(size), "checksum": checksum, "dataset": dataset_id, "key": "shard-0000.tar"}
path = os.path.join(meta, "shard-0000.tar.json")
with open(path + ".new", "w") as out:
    json.dump(document, out)
os.replace(path + ".new", path)
"""


def test_a_copy_by_a_trusted_writer_with_metadata_by_another_is_not_used(
    users: dict[str, User], team_shared: Path, url: str, s3: S3Bucket, dataset: dict[str, bytes]
) -> None:
    alice, bob = users["alice"], users["bob"]
    shared = team_shared
    assert len(dataset["shard-0000.tar"]) == len(dataset["shard-0001.tar"])
    env = _env(alice, s3, shared, credentials=True)
    done = cli_as(alice, "warm", url, "--tier", "shared", env=env)
    assert done.returncode == 0, done.stderr
    dataset_id = _dataset_id(alice, url, env)
    etag = s3.client.head_object(Bucket=s3.name, Key="wds/shard-0000.tar")["ETag"].strip('"')
    checksum = f"xxh3_64:{xxhash.xxh3_64(dataset['shard-0001.tar']).hexdigest()}"
    swap = run_as(bob, [sys.executable, "-c", _SWAP, str(shared), dataset_id, etag, checksum])
    assert swap.returncode == 0, swap.stderr
    copy = shared / "data" / dataset_id / "shard-0000.tar"
    meta = shared / "meta" / dataset_id / "shard-0000.tar.json"
    assert (copy.stat().st_uid, meta.stat().st_uid) == (alice.uid, bob.uid)  # one trusted writer of two

    fresh = _env(alice, s3, shared, credentials=True)
    fresh["DATACACHE_LOCAL_DIR"] = str(alice.home / "fresh")  # no earlier confirmation of her own
    result = _read_as(alice, url, fresh)
    assert "error" not in result, result
    assert sorted(result["texts"]) == sorted(f"REAL SAMPLE {s}.{i}" for s in range(SHARDS) for i in range(SAMPLES))
