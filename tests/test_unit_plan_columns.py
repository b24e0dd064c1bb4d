"""A node's unit plan of one unit per shard held and saved as columns: its counts, a digest, mapped.

At 1e6 shards the plan was 1e6 `Unit` objects, built, saved and read back as JSON by every reader
(~200 bytes a shard in each process); these tests measure its allocations with tracemalloc.
"""

from __future__ import annotations

import asyncio
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from datacache.loaders.plans.counts import complete, encode_plan, read_plan

from datacache.config import Settings
from datacache.formats import get_format
from datacache.formats._base import PlanContext, Unit, UnitPlan
from datacache.manifest import Manifest, Shard, ShardFormat

SHARDS = 200_000


def _manifest(shards: int, *, samples: int | None = 1000, tag: str = "") -> Manifest:
    return Manifest(
        "synthetic",
        "s3://bucket/synthetic/",
        ShardFormat.PARQUET,
        tuple(Shard(f"part-{i:07d}{tag}.parquet", 4096, f"v{i}", None, samples) for i in range(shards)),
    )


def _plan(manifest: Manifest, settings: Settings) -> UnitPlan:
    async def unread(key: str, byte_range: object) -> bytes:
        raise AssertionError(f"{key}: the manifest knows every count")

    context = PlanContext(manifest, None, settings, unread)  # type: ignore[arg-type]
    return asyncio.run(get_format("parquet").plan(context, wait=True))


T = TypeVar("T")


def _traced(make: Callable[[], T]) -> tuple[T, int]:
    """What ``make`` returns, and the peak of memory traced while it ran."""
    tracemalloc.start()
    try:
        made = make()
        return made, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _write(path: Path, plan: UnitPlan) -> None:
    path.write_bytes(b"".join(encode_plan(plan)))


def test_a_plan_of_shards_with_known_counts_makes_no_unit_per_shard(settings: Settings) -> None:
    manifest = _manifest(SHARDS)
    manifest.table.samples  # noqa: B018 (the manifest's own columns, not the plan's)
    plan, peak = _traced(lambda: _plan(manifest, settings))
    assert complete(plan) and plan.total == SHARDS * 1000 and len(plan.units) == SHARDS
    assert plan.units[7] == Unit(("part-0000007.parquet",), 1000, "part-0000007.parquet")
    assert plan.units[-1].keys == ("part-0199999.parquet",)
    # its counts (8 bytes a shard) and a copy while made; 1e6 Units were ~200 bytes a shard
    assert peak <= 24 * SHARDS, f"{peak / SHARDS:.0f} bytes a shard"


def test_a_saved_plan_is_read_back_mapped_and_equal(tmp_path: Path, settings: Settings) -> None:
    manifest = _manifest(SHARDS)
    plan = _plan(manifest, settings)
    path = tmp_path / "plan.json"
    _write(path, plan)
    assert path.stat().st_size < 8 * SHARDS + 200, "the counts, a header and a digest: no keys"
    again, peak = _traced(lambda: read_plan(path, manifest))
    assert again is not None and peak < 2 * SHARDS, f"{peak / SHARDS:.1f} bytes a shard: mapped, not copied"
    assert np.array_equal(again.counts, plan.counts) and again.units[12345] == plan.units[12345]
    assert list(again.units[:3]) == list(plan.units[:3]) and again.unreadable == {}


def test_a_saved_plan_that_is_damaged_or_of_another_manifest_is_refused(tmp_path: Path, settings: Settings) -> None:
    manifest = _manifest(1000)
    path = tmp_path / "plan.json"
    _write(path, _plan(manifest, settings))
    data = bytearray(path.read_bytes())
    data[-3] ^= 1  # one count changed: the digest no longer matches
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="digest"):
        read_plan(path, manifest)
    _write(path, _plan(manifest, settings))
    with pytest.raises(ValueError, match="another manifest"):
        read_plan(path, _manifest(999))
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ValueError):
        read_plan(path, manifest)
    assert read_plan(tmp_path / "none.json", manifest) is None


def test_a_plan_saved_as_json_by_an_earlier_version_is_still_read(tmp_path: Path, settings: Settings) -> None:
    manifest = _manifest(50)
    plan = _plan(manifest, settings)
    path = tmp_path / "plan.json"
    path.write_bytes(__import__("json").dumps(plan.to_json()).encode())
    again = read_plan(path, manifest)
    assert again is not None and list(again.units) == list(plan.units) and again.total == plan.total


def test_the_node_future_in_keys_is_the_same_from_columns_as_from_units(settings: Settings) -> None:
    from datacache.loaders.runtime import NodeFuture

    manifest = _manifest(300)
    columns = _plan(manifest, settings)
    units = UnitPlan(tuple(columns.units), {})
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 300, 500).astype(np.int64)
    future = NodeFuture("1.0", 0, {"0.0": rng.integers(0, 300, 400).astype(np.int64), "1.0": shared, "1.1": shared})
    assert future.order(columns) == future.order(units)
    assert future.order(columns).readers["1.0"][:3] == tuple(f"part-{u:07d}.parquet" for u in shared[:3].tolist())
    assert future.key_positions(columns) == future.key_positions(units)
    picked = np.asarray([299, 0, 17, 17], dtype=np.int64)
    assert manifest.table.keys_at(picked) == [manifest.table.key(i) for i in picked.tolist()]
