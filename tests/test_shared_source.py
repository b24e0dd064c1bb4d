"""The shared tier as a second source: what another node staged is read from there, and never unchecked."""

from __future__ import annotations

import asyncio
import os
import tarfile
from dataclasses import replace
from pathlib import Path

from datacache.loaders import CachedIterableDataset
from test_loader import write_wds

from datacache.config import Settings
from datacache.staging import Stager


def _stage_on_shared(settings: Settings, origin: Path) -> str:
    """As another node would: its own local tier, the shards put on the shared one."""

    async def main() -> str:
        async with Stager(replace(settings, local_dir=settings.local_dir.parent / "other-node")) as stager:
            handle = await stager.open(str(origin))
            assert (await stager.warm(handle, tier="shared")).complete
            return handle.id

    return asyncio.run(main())


def test_a_copy_changed_on_the_shared_tier_after_it_was_vouched_for_is_never_served(
    tmp_path: Path, settings: Settings
) -> None:
    """Even with ``verify_on_read`` off: others can write the shared tier's directories.

    The copy keeps its trusted owner and metadata (it is changed in place, as a swap
    between a reader's look and its open would show it); only its bytes tell.
    """
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=60, per_shard=20)
    dataset_id = _stage_on_shared(settings, origin)
    assert settings.shared_dir is not None
    copy = settings.shared_dir / "data" / dataset_id / "train-0000.tar"
    with tarfile.open(copy) as tar:
        payload = next(member for member in tar.getmembers() if member.name.endswith(".bin"))
    raw = bytearray(copy.read_bytes())
    raw[payload.offset_data + 5] ^= 0x01  # in a sample's payload: the tar still parses
    copy.write_bytes(bytes(raw))

    fresh = replace(settings, verify_on_read=False)
    dataset = CachedIterableDataset(str(origin), config=fresh, shuffle=False, prefetch=0)
    samples = {s["__key__"]: s["bin"] for s in dataset}
    assert samples == {k: v["bin"] for k, v in expected.items()}, "the changed shared copy was served"
    stats = dataset.stats()
    assert stats.corrupt_copies == 1


def test_shards_another_node_staged_are_read_from_the_shared_tier_not_the_origin(
    tmp_path: Path, settings: Settings
) -> None:
    origin = tmp_path / "origin"
    expected = write_wds(origin, samples=60, per_shard=20)
    _stage_on_shared(settings, origin)
    for shard in origin.glob("*.tar"):
        # Other bytes under the same version (size and mtime): a read of the origin would show.
        before = shard.stat()
        shard.write_bytes(bytes(before.st_size))
        os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))

    dataset = CachedIterableDataset(str(origin), config=settings, shuffle=False)
    samples = {s["__key__"]: s["bin"] for s in dataset}
    assert samples == {k: v["bin"] for k, v in expected.items()}
    assert dataset.stats().corrupt_copies == 0
