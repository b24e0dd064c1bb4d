"""The loader and bad data: truncated or random shards, failing decoders, and what is left mapped."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _helpers import wait_for
from datacache.loaders import CachedIterableDataset
from test_loader import keys_of, write_wds

from datacache.config import Settings
from datacache.errors import ShardReadError
from datacache.manifest import MANIFEST_NAME


def _mapped_paths() -> set[str]:
    """Files this process has mapped now (the last field of /proc/self/maps)."""
    found = set()
    for line in Path(f"/proc/{os.getpid()}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6:
            found.add(parts[5])
    return found


def _write_counts(directory: Path, counts: dict[str, int]) -> None:
    """The manifest `datacache shard` writes (sizes and sample counts), for the shards as they are now."""
    entries = [
        {"key": name, "size": (directory / name).stat().st_size, "samples": samples}
        for name, samples in sorted(counts.items())
    ]
    document = {"format_version": 1, "dataset": "t", "url": "", "format": "tar", "shards": entries}
    (directory / MANIFEST_NAME).write_text(json.dumps(document))


@pytest.mark.parametrize("damage", ["truncated", "random"])
def test_skip_covers_a_bad_tar_found_while_counting_samples(tmp_path: Path, settings: Settings, damage: str) -> None:
    origin = tmp_path / "bad"
    expected = write_wds(origin, samples=40, per_shard=10)
    victim = origin / "train-0002.tar"
    raw = victim.read_bytes()
    victim.write_bytes(raw[:3000] if damage == "truncated" else os.urandom(len(raw)))
    # No sample index: the plan counts samples by scanning every shard, and meets the bad one there.
    with pytest.raises(ShardReadError, match=r"train-0002\.tar"):
        list(CachedIterableDataset(str(origin), config=settings))
    skipping = CachedIterableDataset(str(origin), config=settings, on_error="skip")
    got = keys_of(skipping)
    assert sorted(got) == sorted(k for k in expected if not "sample000020" <= k < "sample000030")
    assert skipping.stats().skipped_shards == 1
    assert len(skipping) == 30, "the plan's sample count leaves the skipped shard out"
    # A later dataset that does not skip still fails on it, by name (the plan is kept per node).
    with pytest.raises(ShardReadError, match=r"train-0002\.tar"):
        list(CachedIterableDataset(str(origin), config=settings))


def test_a_shard_that_fails_to_open_is_unmapped_at_once(tmp_path: Path, settings: Settings) -> None:
    origin = tmp_path / "bad"
    write_wds(origin, samples=30, per_shard=10)
    victim = origin / "train-0001.tar"
    victim.write_bytes(victim.read_bytes()[:3000])
    _write_counts(origin, {p.name: 10 for p in origin.glob("*.tar")})
    # A first reader takes the shard's bytes from memory while it is staged (a cold shard is
    # served before its local copy is durable): nothing mapped yet. Its local copy follows.
    with pytest.raises(ShardReadError, match=r"train-0001\.tar"):
        list(CachedIterableDataset(str(origin), config=settings, shuffle=False))
    wait_for(lambda: any(settings.local_dir.rglob("train-0001.tar")), what="the bad shard's local copy")
    dataset = CachedIterableDataset(str(origin), config=settings, shuffle=False)
    with pytest.raises(ShardReadError, match=r"train-0001\.tar") as failure:
        list(dataset)  # this reader maps the local copy
    # The exception (and its traceback) is still held here, as a training loop that logs it would.
    cached = {str(p) for p in settings.local_dir.rglob("train-0001.tar")}
    assert cached, "the bad shard was staged before it was opened"
    assert not cached & _mapped_paths(), "the failed shard's mapping outlives the failure"
    assert failure.value is not None
