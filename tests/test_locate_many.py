"""`Stager.locate_many` (what a reader's note locates its next shards with): a catalog read for the lot.

A cold window's note locates shards none of which is local yet; each one cost two single-row
catalog reads (its local row again, then the checksum this node learned), a thread hop each.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from _helpers import fill_dir, with_stager
from test_warm_batch import tiny_shards

from datacache.catalog import CatalogEntry
from datacache.config import Settings, load_settings
from datacache.staging import LOCAL, ORIGIN, Location, Stager


@pytest.fixture
def settings(tmp_path: Path, cache_env: dict[str, str]) -> Settings:
    return load_settings(cache_env, overrides={"local_dir": str(tmp_path / "local")})


def test_shards_not_local_are_located_without_a_catalog_read_each(tmp_path: Path, settings: Settings) -> None:
    shards = tiny_shards(24)
    origin = fill_dir(tmp_path / "origin", shards)
    keys = list(shards)

    async def body(stager: Stager) -> tuple[list[str], list[Location], list[Location]]:
        handle = await stager.open(str(origin))
        for key in keys[:4]:
            await stager.ensure(handle, key)
        catalog = stager.catalog
        single: list[str] = []
        get = catalog.get

        async def counted(dataset: str, key: str) -> CatalogEntry | None:
            single.append(key)
            return await get(dataset, key)

        catalog.get = counted  # type: ignore[method-assign]
        located = await stager.locate_many(handle, keys)
        one_by_one: list[Location] = []
        catalog.get = get  # type: ignore[method-assign]
        for key in keys:
            one_by_one.append(await stager.locate(handle, key))
        return single, located, one_by_one

    single, located, one_by_one = with_stager(settings, body)

    assert single == []  # two for each of the 20 not local before
    assert [location.tier for location in located] == [LOCAL] * 4 + [ORIGIN] * 20
    assert _same(located, one_by_one)


def _same(these: Sequence[Location], those: Sequence[Location]) -> bool:
    def seen(location: Location) -> tuple[Any, ...]:
        return location.tier, location.path, location.shard.key, location.checksum

    return [seen(location) for location in these] == [seen(location) for location in those]
