"""The manifest held as columns: every field round-trips, one file mapped by every process, a bad file refused."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _helpers import REPO
from _users import User, python_as, users, world_dir  # noqa: F401 (the fixtures)
from hypothesis import given
from hypothesis import strategies as st

from datacache.manifest import Manifest, ManifestStore, Shard, ShardFormat
from datacache.manifest.columns import ShardTable

SHARDS = (
    Shard("a.tar", 10, "etag-1", "xxh3_64:00ff00ff00ff00ff", 3),
    Shard("b/c.tar", 0),
    Shard("é/日本.tar", 5, "", None, 0),
    Shard("d.tar", 1 << 40, None, "xxh3_64:1", None),
    Shard("0.tar", 7, "v", None, 1 << 40),
)


def _manifest(shards: tuple[Shard, ...] = SHARDS) -> Manifest:
    return Manifest(
        "ds", "s3://bucket/prefix/", ShardFormat.TAR, shards, created=1234.5, extra={"sidecar_candidates": [["i", 3]]}
    )


def _saved(tmp_path: Path, manifest: Manifest) -> tuple[ManifestStore, Path]:
    store = ManifestStore(tmp_path / "manifests")
    asyncio.run(store.save(manifest))
    return store, tmp_path / "manifests" / f"{manifest.dataset}.columns"


def test_every_field_round_trips_through_the_mapped_file(tmp_path: Path) -> None:
    manifest = _manifest()
    store, path = _saved(tmp_path, manifest)
    assert path.is_file() and oct(path.stat().st_mode & 0o777) == "0o600"
    (tmp_path / "manifests" / "ds.json").unlink()  # what is loaded can only be the columns
    loaded = asyncio.run(store.load("ds"))
    assert loaded is not None and isinstance(loaded.shards, ShardTable)
    assert list(loaded.shards) == list(SHARDS) and loaded.shards == SHARDS
    for got, want in zip(loaded.shards, SHARDS, strict=True):
        assert (got.key, got.size, got.version, got.checksum, got.samples) == (
            want.key,
            want.size,
            want.version,
            want.checksum,
            want.samples,
        )
    assert (loaded.dataset, loaded.url, loaded.format, loaded.created) == ("ds", manifest.url, ShardFormat.TAR, 1234.5)
    assert loaded.extra == manifest.extra and loaded.snapshot == manifest.snapshot
    assert list(loaded.table.sizes) == [s.size for s in SHARDS]
    assert list(loaded.table.samples) == [-1 if s.samples is None else s.samples for s in SHARDS]
    assert list(loaded.table.keys()) == [s.key for s in SHARDS]
    assert all(loaded.shard(s.key) == s and s.key in loaded for s in SHARDS)
    assert "missing.tar" not in loaded and loaded.table.position("b") is None
    assert loaded.total_bytes == sum(s.size for s in SHARDS) and loaded.total_samples is None
    assert loaded.shards[-1] == SHARDS[-1] and loaded.shards[1:3] == SHARDS[1:3]
    assert pickle.loads(pickle.dumps(loaded)) == manifest


def test_an_empty_manifest_round_trips(tmp_path: Path) -> None:
    store, _ = _saved(tmp_path, _manifest(()))
    loaded = asyncio.run(store.load("ds"))
    assert loaded is not None and len(loaded.shards) == 0 and loaded.total_bytes == 0 and loaded.total_samples == 0


keys = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\\\0"), min_size=1, max_size=12)
shards_strategy = st.lists(
    st.builds(
        Shard,
        keys.map(lambda k: k + ".tar"),
        st.integers(0, 1 << 62),
        st.none() | st.text(max_size=8),
        st.none() | st.text(max_size=8).map("xxh3_64:".__add__),
        st.none() | st.integers(0, 1 << 62),
    ),
    max_size=20,
    unique_by=lambda s: s.key,
)


@given(shards=shards_strategy)
def test_a_table_holds_exactly_the_shards_it_was_made_of(shards: list[Shard]) -> None:
    table = ShardTable.from_shards(shards)
    assert list(table) == shards and len(table) == len(shards)
    assert all(table.position(s.key) == i for i, s in enumerate(shards))
    assert pickle.loads(pickle.dumps(table)) == table


_MAP_AND_WAIT = textwrap.dedent(
    """
    import asyncio, os, sys
    from pathlib import Path
    from datacache.manifest import ManifestStore
    manifest = asyncio.run(ManifestStore(Path(sys.argv[1])).load("ds"))
    assert manifest is not None and len(manifest.shards) == int(sys.argv[2])
    sum(manifest.table.samples), manifest.shards[len(manifest.shards) - 1]  # touch the columns
    lines, private = [], 0
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                inside = line.rstrip().endswith("ds.columns")
                if inside:
                    lines.append(fields[1] + " " + fields[4])
            elif inside and fields[0] == "Anonymous:":  # a private copy of a page; dirty ones are the page cache's
                private += int(fields[1])
    print(repr((lines, private)), flush=True)
    sys.stdin.readline()
    """
)


def test_two_processes_map_one_file_read_only_with_no_private_copy(tmp_path: Path) -> None:
    count = 20_000
    shards = tuple(Shard(f"part-{i:06d}.tar", 512 + i, f"v{i}", None, 2) for i in range(count))
    _, path = _saved(tmp_path, _manifest(shards))
    inode = path.stat().st_ino
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _MAP_AND_WAIT, str(tmp_path / "manifests"), str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for _ in range(2)
    ]
    try:
        seen = []
        for child in children:  # both hold their mapping open at once: each waits on its stdin
            assert child.stdout is not None
            line = child.stdout.readline()
            assert line, child.stderr.read() if child.stderr else ""
            seen.append(eval(line))  # a repr of (list of "perms inode", kB anonymous)
    finally:
        for child in children:
            child.communicate("\n", timeout=60)
    for mappings, private in seen:
        assert mappings, "the manifest's file is not mapped"
        assert {m.split()[1] for m in mappings} == {str(inode)}
        assert all(m.split()[0] == "r--s" for m in mappings), mappings  # read-only, shared
        assert private == 0


def _refused(tmp_path: Path, caplog: pytest.LogCaptureFixture, said: str) -> None:
    (tmp_path / "manifests" / "ds.json").unlink(missing_ok=True)  # else the JSON beside it is taken
    with caplog.at_level(logging.WARNING, logger="datacache.manifest"):
        assert asyncio.run(ManifestStore(tmp_path / "manifests").load("ds")) is None
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "ds.columns" in warned and said in warned, warned


def test_a_truncated_file_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, path = _saved(tmp_path, _manifest())
    os.truncate(path, path.stat().st_size - 9)
    _refused(tmp_path, caplog, "digest does not match")
    os.truncate(path, 10)
    _refused(tmp_path, caplog, "too short")


def test_an_altered_file_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, path = _saved(tmp_path, _manifest())
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1  # one bit of one column
    path.write_bytes(bytes(raw))
    _refused(tmp_path, caplog, "digest does not match")


def test_a_file_others_may_write_or_a_link_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, path = _saved(tmp_path, _manifest())
    path.chmod(0o620)
    _refused(tmp_path, caplog, "writable by others")
    path.chmod(0o600)
    path.rename(tmp_path / "elsewhere.columns")
    path.symlink_to(tmp_path / "elsewhere.columns")
    _refused(tmp_path, caplog, "symlink")


def test_a_file_planted_by_another_user_is_refused(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    users: dict[str, User],  # noqa: F811
    world_dir: Path,  # noqa: F811
) -> None:
    """Another uid that can write the directory makes a well-formed file: its owner is not trusted."""
    mallory = users["mallory"]
    directory = world_dir / "manifests"
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    made = python_as(
        mallory,
        f"""
        import asyncio
        from pathlib import Path
        from datacache.manifest import Manifest, ManifestStore, Shard, ShardFormat
        planted = Manifest("ds", "s3://bucket/prefix/", ShardFormat.TAR, (Shard("evil.tar", 1),))
        asyncio.run(ManifestStore(Path({str(directory)!r})).save(planted))
        """,
    )
    assert made.returncode == 0, made.stderr
    planted = directory / "ds.columns"
    assert planted.stat().st_uid == mallory.uid
    _refused(world_dir, caplog, "not a file of this user")
